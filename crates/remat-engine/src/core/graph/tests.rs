use crate::core::pool::Category;
use crate::{ExecContext, Graph, MemoryPool, Tensor};

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
