//! Graphs are `Send`: two steps on two threads sharing read-only parameters give the same
//! gradients as the same steps run one after the other.

use std::sync::Arc;

use remat_engine::models::mlp::{Mlp, MlpConfig};
use remat_engine::{Category, ExecContext, Graph, MemoryPool, Policy, RngState, Tensor};

fn assert_send<T: Send>() {}
fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn core_types_are_send() {
    assert_send::<Graph>();
    assert_send_sync::<Tensor>();
    assert_send_sync::<MemoryPool>();
    assert_send_sync::<ExecContext>();
}

fn batch(pool: &Arc<MemoryPool>, name: &str, shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let s = RngState { seed, offset: 0 };
    Tensor::from_vec(
        pool,
        name,
        shape,
        (0..n).map(|i| s.uniform(i as u64) - 0.5).collect(),
        Category::Activations,
    )
    .unwrap()
}

/// One step on its own graph; the batch and dropout seed depend on `step`.
fn step(mlp: &Mlp, ctx: &ExecContext, step: u64, policy: Policy) -> Vec<Tensor> {
    let pool = ctx.pool();
    let mut g = Graph::new(ctx);
    g.set_seed(100 + step);
    let x = g.input("x", batch(pool, "x", &[16, 24], 2 * step));
    let t = g.input("t", batch(pool, "t", &[16, 8], 2 * step + 1));
    let nodes = mlp.build(&mut g, x, t).unwrap();
    policy.apply(&mut g).unwrap();
    g.forward().unwrap();
    g.backward(nodes.loss).unwrap();
    nodes
        .params
        .iter()
        .map(|&p| g.take_grad(p).unwrap().unwrap())
        .collect()
}

#[test]
fn two_steps_on_two_threads_match_sequential() {
    let pool = MemoryPool::unbounded();
    let mlp = Mlp::new(
        &pool,
        MlpConfig {
            dims: vec![24, 48, 48, 48, 8],
            dropout: 0.1,
            seed: 9,
        },
    )
    .unwrap();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let sequential: Vec<Vec<Tensor>> = (0..2)
        .map(|s| step(&mlp, &ctx, s, Policy::StoreAll))
        .collect();
    let versions: Vec<u64> = mlp.params().iter().map(|(_, t)| t.version()).collect();

    let parallel: Vec<Vec<Tensor>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|s| {
                let (mlp, pool) = (&mlp, pool.clone());
                scope.spawn(move || {
                    // Each thread its own thread pool of the same size, one shared memory pool.
                    let ctx = ExecContext::new(pool, 1).unwrap();
                    step(
                        mlp,
                        &ctx,
                        s,
                        if s == 0 {
                            Policy::Sqrt
                        } else {
                            Policy::RecomputeAll
                        },
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, b) in sequential.iter().zip(&parallel) {
        for (x, y) in a.iter().zip(b) {
            assert!(x.bit_eq(y));
        }
    }
    // The parameters were only read.
    assert_eq!(
        versions,
        mlp.params()
            .iter()
            .map(|(_, t)| t.version())
            .collect::<Vec<_>>()
    );
}

#[test]
fn a_graph_moves_between_threads_mid_step() {
    let pool = MemoryPool::unbounded();
    let mlp = Mlp::new(
        &pool,
        MlpConfig {
            dims: vec![24, 32, 8],
            dropout: 0.0,
            seed: 4,
        },
    )
    .unwrap();
    let ctx = ExecContext::new(pool.clone(), 2).unwrap();
    let want = step(&mlp, &ctx, 0, Policy::StoreAll);
    let mut g = Graph::new(&ctx);
    g.set_seed(100);
    let x = g.input("x", batch(&pool, "x", &[16, 24], 0));
    let t = g.input("t", batch(&pool, "t", &[16, 8], 1));
    let nodes = mlp.build(&mut g, x, t).unwrap();
    Policy::RecomputeAll.apply(&mut g).unwrap();
    g.forward().unwrap();
    let g = std::thread::spawn(move || {
        g.backward(nodes.loss).unwrap();
        g
    })
    .join()
    .unwrap();
    for (p, w) in nodes.params.iter().zip(&want) {
        assert!(g.grad(*p).unwrap().unwrap().bit_eq(w));
    }
}
