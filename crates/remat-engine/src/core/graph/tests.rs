use crate::core::gradcheck::{CheckInput, Tolerance, check_op};
use crate::core::pool::Category;
use crate::{ExecContext, Graph, MemoryPool, Tensor};

fn check(
    build: impl Fn(&mut Graph, &[crate::NodeId]) -> crate::Result<crate::NodeId>,
    inputs: &[CheckInput],
) {
    let report = check_op(build, inputs, Tolerance::default()).unwrap();
    assert!(report.checked_elements > 0);
}

#[test]
fn gradcheck_matmul_shared_and_batched() {
    check(
        |g, x| g.matmul(x[0], x[1]),
        &[
            CheckInput::random("a", &[2, 3, 4], 1),
            CheckInput::random("b", &[4, 5], 2),
        ],
    );
    check(
        |g, x| g.matmul(x[0], x[1]),
        &[
            CheckInput::random("a", &[2, 3, 4], 3),
            CheckInput::random("b", &[2, 4, 2], 4),
        ],
    );
}

#[test]
fn gradcheck_elementwise_ops() {
    let a = CheckInput::random("a", &[3, 4], 5);
    let b = CheckInput::random("b", &[3, 4], 6);
    check(|g, x| g.add(x[0], x[1]), &[a.clone(), b.clone()]);
    check(|g, x| g.mul(x[0], x[1]), &[a.clone(), b.clone()]);
    check(|g, x| g.scale(x[0], -2.5), std::slice::from_ref(&a));
    check(
        |g, x| g.bias(x[0], x[1]),
        &[a.clone(), CheckInput::random("b", &[4], 7)],
    );
    check(|g, x| g.mse(x[0], x[1]), &[a.clone(), b.clone()]);
    // Keep inputs away from relu's kink, where finite differences are meaningless.
    let away: Vec<f64> = a
        .data
        .iter()
        .map(|v| if v.abs() < 0.05 { v + 0.1 } else { *v })
        .collect();
    check(|g, x| g.relu(x[0]), &[CheckInput::new("a", &[3, 4], away)]);
    check(|g, x| g.dropout(x[0], 0.3), std::slice::from_ref(&a));
    // x + x: two contributions to one gradient.
    check(|g, x| g.add(x[0], x[0]), &[a]);
}

#[test]
fn gradcheck_layout_ops() {
    let a = CheckInput::random("a", &[2, 3, 4], 8);
    check(|g, x| g.reshape(x[0], &[6, 4]), std::slice::from_ref(&a));
    check(|g, x| g.transpose(x[0], 0, 2), std::slice::from_ref(&a));
    check(|g, x| g.transpose(x[0], 1, 2), std::slice::from_ref(&a));
    check(|g, x| g.slice(x[0], 1, 1, 2), std::slice::from_ref(&a));
    check(
        |g, x| {
            let parts = g.split(x[0], 2, &[1, 3])?;
            let t = g.scale(parts[0], 3.0)?;
            g.concat(&[parts[1], t], 2)
        },
        std::slice::from_ref(&a),
    );
    check(
        |g, x| g.concat(&[x[0], x[1]], 0),
        &[a, CheckInput::random("b", &[1, 3, 4], 9)],
    );
}

#[test]
fn shape_errors_name_the_node() {
    let ctx = ExecContext::single_threaded().unwrap();
    let pool = ctx.pool().clone();
    let mut g = Graph::new(&ctx);
    let a = g.input(
        "a",
        Tensor::zeros(
            &pool,
            &[2, 3],
            crate::DType::F32,
            Category::Activations,
            None,
        )
        .unwrap(),
    );
    let b = g.input(
        "b",
        Tensor::zeros(
            &pool,
            &[4, 5],
            crate::DType::F32,
            Category::Activations,
            None,
        )
        .unwrap(),
    );
    let err = g.matmul(a, b).unwrap_err().to_string();
    assert!(
        err.contains("matmul#2") && err.contains("inner dimensions"),
        "{err}"
    );
}

#[test]
fn hundred_thousand_node_chain_runs_without_recursion() {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let mut g = Graph::new(&ctx);
    let x = Tensor::from_vec(
        &pool,
        "x",
        &[4],
        vec![1.0f32, 2.0, 3.0, 4.0],
        Category::Parameters,
    )
    .unwrap();
    let mut h = g.param("x", &x);
    for _ in 0..100_000 {
        h = g.scale(h, 1.0).unwrap();
    }
    let t = g.input(
        "t",
        Tensor::zeros(&pool, &[4], crate::DType::F32, Category::Activations, None).unwrap(),
    );
    let loss = g.mse(h, t).unwrap();
    // Recompute everything too: the rebuild of the whole chain must not recurse either.
    crate::Policy::RecomputeAll.apply(&mut g).unwrap();
    g.forward().unwrap();
    assert_eq!(g.scalar(loss).unwrap(), 7.5);
    g.backward(loss).unwrap();
    assert_eq!(
        g.grad(g.node_ids().next().unwrap())
            .unwrap()
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![0.5, 1.0, 1.5, 2.0]
    );
}

#[test]
fn a_spent_graph_refuses_a_second_backward() {
    let ctx = ExecContext::single_threaded().unwrap();
    let pool = ctx.pool().clone();
    let w = Tensor::from_vec(&pool, "w", &[2], vec![1.0f32, 2.0], Category::Parameters).unwrap();
    let mut g = Graph::new(&ctx);
    let wn = g.param("w", &w);
    let y = g.mul(wn, wn).unwrap();
    let t = g.input(
        "t",
        Tensor::zeros(&pool, &[2], crate::DType::F32, Category::Activations, None).unwrap(),
    );
    let loss = g.mse(y, t).unwrap();
    g.forward().unwrap();
    g.backward(loss).unwrap();
    let err = g.backward(loss).unwrap_err().to_string();
    assert!(err.contains("backward already ran"), "{err}");
    assert!(g.forward().is_err());
    assert_eq!(
        g.grad(wn).unwrap().unwrap().to_vec::<f32>().unwrap(),
        vec![2.0, 16.0]
    );
}

#[test]
fn large_dropout_and_transpose_are_identical_across_thread_counts() {
    let run = |threads: usize| {
        let pool = MemoryPool::unbounded();
        let ctx = ExecContext::new(pool.clone(), threads).unwrap();
        let n = 3 * 64 * 512;
        let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.01).sin()).collect();
        let x = Tensor::from_vec(&pool, "x", &[3, 64, 512], v, Category::Parameters).unwrap();
        let mut g = Graph::new(&ctx);
        g.set_seed(3);
        let xn = g.param("x", &x);
        let d = g.dropout(xn, 0.4).unwrap();
        let t = g.transpose(d, 0, 1).unwrap();
        let zeros = Tensor::zeros(
            &pool,
            &[64, 3, 512],
            crate::DType::F32,
            Category::Activations,
            None,
        )
        .unwrap();
        let z = g.input("z", zeros);
        let loss = g.mse(t, z).unwrap();
        g.forward().unwrap();
        let out = g.value(t).unwrap().to_vec::<f32>().unwrap();
        g.backward(loss).unwrap();
        (out, g.grad(xn).unwrap().unwrap().to_vec::<f32>().unwrap())
    };
    let (a, ga) = run(1);
    let (b, gb) = run(2);
    assert_eq!(
        a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(
        ga.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        gb.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    let kept = a.iter().filter(|v| **v != 0.0).count() as f64 / a.len() as f64;
    assert!((kept - 0.6).abs() < 0.01, "kept fraction {kept}");
}
