//! MLP chain: gradients under every policy (dropout included) equal store-all bit for bit.

use remat_engine::models::mlp::{Mlp, MlpConfig};
use remat_engine::{Category, ExecContext, Graph, MemoryPool, Policy, Tensor};

fn data(pool: &std::sync::Arc<MemoryPool>, name: &str, shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let s = remat_engine::RngState { seed, offset: 0 };
    let v: Vec<f32> = (0..n).map(|i| s.uniform(i as u64) * 2.0 - 1.0).collect();
    Tensor::from_vec(pool, name, shape, v, Category::Activations).unwrap()
}

enum Mode {
    Policy(Policy),
    Segments(usize),
}

fn step(mlp: &Mlp, ctx: &ExecContext, mode: &Mode) -> (f64, Vec<Tensor>, remat_engine::GraphStats) {
    let pool = ctx.pool();
    let batch = 8;
    let mut g = Graph::new(ctx);
    g.set_seed(42);
    let x = g.input("x", data(pool, "x", &[batch, mlp.config.dims[0]], 1));
    let t = g.input(
        "t",
        data(pool, "t", &[batch, *mlp.config.dims.last().unwrap()], 2),
    );
    let nodes = match mode {
        Mode::Policy(p) => {
            let nodes = mlp.build(&mut g, x, t).unwrap();
            p.apply(&mut g).unwrap();
            nodes
        }
        Mode::Segments(k) => mlp.build_segmented(&mut g, x, t, *k).unwrap(),
    };
    g.forward().unwrap();
    let loss = g.scalar(nodes.loss).unwrap();
    g.backward(nodes.loss).unwrap();
    let grads = nodes
        .params
        .iter()
        .map(|&p| g.grad(p).unwrap().unwrap())
        .collect();
    (loss, grads, g.stats())
}

#[test]
fn every_policy_matches_store_all_bit_for_bit() {
    for threads in [1, 2] {
        let pool = MemoryPool::unbounded();
        let ctx = ExecContext::new(pool.clone(), threads).unwrap();
        let cfg = MlpConfig {
            dims: vec![16, 32, 32, 32, 32, 32, 8],
            dropout: 0.2,
            seed: 3,
        };
        let mlp = Mlp::new(&pool, cfg).unwrap();
        let (loss0, ref_grads, ref_stats) = step(&mlp, &ctx, &Mode::Policy(Policy::StoreAll));
        assert_eq!(ref_stats.recomputed_nodes, 0);
        let modes = [
            Mode::Policy(Policy::RecomputeAll),
            Mode::Policy(Policy::EveryN(2)),
            Mode::Policy(Policy::EveryN(5)),
            Mode::Policy(Policy::ByDepth(3)),
            Mode::Policy(Policy::Sqrt),
            Mode::Segments(1),
            Mode::Segments(2),
        ];
        for mode in &modes {
            let (loss, grads, stats) = step(&mlp, &ctx, mode);
            assert!(stats.recomputed_nodes > 0);
            assert_eq!(loss.to_bits(), loss0.to_bits());
            for (a, b) in grads.iter().zip(&ref_grads) {
                assert!(a.bit_eq(b), "gradients differ from store-all");
            }
        }
    }
}
