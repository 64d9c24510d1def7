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

#[test]
fn segment_keeps_only_its_inputs_and_output() {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let mlp = Mlp::new(
        &pool,
        MlpConfig {
            dims: vec![8, 16, 16, 16, 16, 4],
            dropout: 0.0,
            seed: 5,
        },
    )
    .unwrap();
    let mut g = Graph::new(&ctx);
    let x = g.input("x", data(&pool, "x", &[4, 8], 1));
    let t = g.input("t", data(&pool, "t", &[4, 4], 2));
    let nodes = mlp.build_segmented(&mut g, x, t, 2).unwrap();
    g.forward().unwrap();
    // Layers 1-2, 3-4 and 5 are segments: their outputs (layers 2, 4, 5) are held, the
    // rest of each segment was dropped after its last forward use.
    let held: Vec<bool> = nodes
        .layer_outputs
        .iter()
        .map(|&n| g.is_resident(n).unwrap())
        .collect();
    assert_eq!(held, [false, true, false, true, true]);
    assert_eq!(g.segment_of(nodes.layer_outputs[0]).unwrap(), Some(0));
    assert_eq!(g.segment_of(nodes.layer_outputs[2]).unwrap(), Some(1));
    g.backward(nodes.loss).unwrap();
    // Each segment is recomputed once: the three ops of each dropped hidden layer.
    assert_eq!(g.stats().recomputed_nodes, 2 * 3);
}

#[derive(Default)]
struct Counter(std::sync::Arc<std::sync::Mutex<Vec<(remat_engine::Phase, String, u64)>>>);

impl remat_engine::GraphObserver for Counter {
    fn after_node(&mut self, e: &remat_engine::NodeEvent<'_>) {
        self.0
            .lock()
            .unwrap()
            .push((e.phase, e.kind.to_string(), e.output_bytes));
    }
}

#[test]
fn observer_sees_every_node_execution() {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let mlp = Mlp::new(
        &pool,
        MlpConfig {
            dims: vec![8, 16, 4],
            dropout: 0.0,
            seed: 5,
        },
    )
    .unwrap();
    let mut g = Graph::new(&ctx);
    let x = g.input("x", data(&pool, "x", &[4, 8], 1));
    let t = g.input("t", data(&pool, "t", &[4, 4], 2));
    let nodes = mlp.build(&mut g, x, t).unwrap();
    Policy::RecomputeAll.apply(&mut g).unwrap();
    let log = Counter::default();
    let events = log.0.clone();
    g.set_observer(Some(Box::new(log)));
    g.forward().unwrap();
    g.backward(nodes.loss).unwrap();
    let events = events.lock().unwrap();
    let count = |p| events.iter().filter(|e| e.0 == p).count() as u64;
    let stats = g.stats();
    assert_eq!(count(remat_engine::Phase::Forward), stats.forward_nodes);
    assert_eq!(
        count(remat_engine::Phase::Recompute),
        stats.recomputed_nodes
    );
    assert_eq!(count(remat_engine::Phase::Backward), stats.backward_nodes);
    assert_eq!(stats.forward_nodes, 6);
    assert!(events.iter().any(|e| e.1 == "matmul" && e.2 == 4 * 16 * 4));
}
