//! Property: on random DAGs of ops, any mix of kept and checkpointed nodes (with any
//! `save_inputs` / `force`) gives gradients bit-identical to store-all, and every byte
//! returns to the pool when the graph is dropped.

use proptest::prelude::*;
use remat_engine::{
    Category, CheckpointOptions, ExecContext, Graph, MemoryPool, NodeId, Retention, RngState,
    Tensor,
};

#[derive(Clone, Debug)]
enum Step {
    Add(usize, usize),
    Mul(usize, usize),
    Scale(usize),
    Relu(usize),
    Dropout(usize),
    MatMul(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Step::Add(a, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Step::Mul(a, b)),
        any::<usize>().prop_map(Step::Scale),
        any::<usize>().prop_map(Step::Relu),
        any::<usize>().prop_map(Step::Dropout),
        any::<usize>().prop_map(Step::MatMul),
    ]
}

/// 0 = keep, 1 = checkpoint, 2 = checkpoint with save_inputs, 3 = forced checkpoint.
fn run(steps: &[Step], marks: &[u8], threads: usize) -> Vec<Option<Tensor>> {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), threads).unwrap();
    let mk = |name: &str, seed: u64| {
        let s = RngState { seed, offset: 0 };
        let v: Vec<f32> = (0..36).map(|i| s.uniform(i) - 0.5).collect();
        Tensor::from_vec(&pool, name, &[6, 6], v, Category::Parameters).unwrap()
    };
    let params = [mk("p0", 1), mk("p1", 2), mk("p2", 3)];
    let base = pool.live();
    let grads = {
        let mut g = Graph::new(&ctx);
        g.set_seed(5);
        let leaves: Vec<NodeId> = params
            .iter()
            .enumerate()
            .map(|(i, p)| g.param(&format!("p{i}"), p))
            .collect();
        let mut nodes = leaves.clone();
        for s in steps {
            let pick = |i: usize| nodes[i % nodes.len()];
            let n = match *s {
                Step::Add(a, b) => g.add(pick(a), pick(b)),
                Step::Mul(a, b) => g.mul(pick(a), pick(b)),
                Step::Scale(a) => g.scale(pick(a), 0.75),
                Step::Relu(a) => g.relu(pick(a)),
                Step::Dropout(a) => g.dropout(pick(a), 0.3),
                Step::MatMul(a) => g.matmul(pick(a), leaves[a % 3]),
            }
            .unwrap();
            nodes.push(n);
        }
        // Sum every op node into the loss so each contributes a gradient.
        let mut total = nodes[3..]
            .iter()
            .copied()
            .reduce(|a, b| g.add(a, b).unwrap())
            .unwrap();
        total = g.scale(total, 0.5).unwrap();
        let target = g.input(
            "t",
            Tensor::zeros(
                &pool,
                &[6, 6],
                remat_engine::DType::F32,
                Category::Activations,
                None,
            )
            .unwrap(),
        );
        let loss = g.mse(total, target).unwrap();
        for (k, &n) in nodes[3..].iter().enumerate() {
            let base_opts = CheckpointOptions {
                save_inputs: false,
                max_recompute_depth: usize::MAX,
                ..Default::default()
            };
            let r = match marks.get(k).copied().unwrap_or(0) {
                0 => Retention::Keep,
                1 => Retention::Recompute(base_opts),
                2 => Retention::Recompute(CheckpointOptions {
                    save_inputs: true,
                    ..base_opts
                }),
                _ => Retention::Recompute(CheckpointOptions {
                    force: true,
                    ..base_opts
                }),
            };
            g.set_retention(n, r).unwrap();
        }
        g.forward().unwrap();
        g.backward(loss).unwrap();
        leaves
            .iter()
            .map(|&l| g.take_grad(l).unwrap())
            .collect::<Vec<_>>()
    };
    let grad_bytes: u64 = grads.iter().flatten().map(Tensor::bytes).sum();
    assert_eq!(
        pool.live(),
        base + grad_bytes,
        "only the gradients outlive the graph"
    );
    grads
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn any_retention_matches_store_all(
        steps in prop::collection::vec(step(), 1..14),
        marks in prop::collection::vec(0u8..4, 14),
        threads in 1usize..3,
    ) {
        let want = run(&steps, &[], threads);
        let got = run(&steps, &marks, threads);
        for (a, b) in want.iter().zip(&got) {
            match (a, b) {
                (Some(a), Some(b)) => prop_assert!(a.bit_eq(b)),
                (None, None) => {}
                _ => prop_assert!(false, "a gradient exists under one retention only"),
            }
        }
    }
}
