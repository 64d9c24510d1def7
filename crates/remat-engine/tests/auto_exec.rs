//! Issue 5, section 4: plans executed by the engine. For every plan (each registered
//! strategy, plus hand-made swap / recompute / mixed plans) the pool's peak equals the
//! simulator's prediction to the byte, and the gradients equal the engine's store-all
//! backward bit for bit.

use std::sync::Arc;

use remat_engine::models::gpt::{Batch, Checkpointing, Gpt, GptConfig};
use remat_engine::models::mlp::{Mlp, MlpConfig};
use remat_engine::plan_exec::{StepReport, run_plan};
use remat_engine::profile::{ProfileOptions, StepProfile, profile_step};
use remat_engine::swap::{CopyEngine, HostStore, Throttle};
use remat_engine::{Category, ExecContext, Graph, MemoryPool, NodeId, Policy, Tensor};
use remat_planner::attrs::tensor_attrs;
use remat_planner::strategy::plan_from_decisions;
use remat_planner::{Decision, Planned, Problem};

const BANDWIDTH: f64 = 8e9;

struct Model {
    params: Vec<(String, Tensor)>,
    x: Tensor,
    target: Tensor,
    layers: usize,
}

fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503));
            ((h >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

/// A residual MLP: x -> L blocks of (matmul, bias, relu, dropout, matmul, reshape there and
/// back, residual add) -> mse. Residual adds give nodes with two users, reshape gives views,
/// dropout gives random states to replay.
fn model(pool: &Arc<MemoryPool>, layers: usize, batch: usize, width: usize) -> Model {
    let mut params = Vec::new();
    for l in 0..layers {
        let t = |name: &str, shape: &[usize], seed: u32| {
            let data = values(shape.iter().product(), seed, 0.4);
            Tensor::from_vec(pool, name, shape, data, Category::Parameters).unwrap()
        };
        params.push((
            format!("w1.{l}"),
            t("w1", &[width, 2 * width], 10 + l as u32),
        ));
        params.push((format!("b1.{l}"), t("b1", &[2 * width], 20 + l as u32)));
        params.push((
            format!("w2.{l}"),
            t("w2", &[2 * width, width], 30 + l as u32),
        ));
    }
    let act = |seed| {
        Tensor::from_vec(
            pool,
            "x",
            &[batch, width],
            values(batch * width, seed, 2.0),
            Category::Activations,
        )
        .unwrap()
    };
    Model {
        params,
        x: act(1),
        target: act(2),
        layers,
    }
}

fn record(ctx: &ExecContext, m: &Model, seed: u64) -> (Graph, NodeId, Vec<NodeId>) {
    let mut g = Graph::new(ctx);
    g.set_seed(seed);
    let ids: Vec<NodeId> = m.params.iter().map(|(n, t)| g.param(n, t)).collect();
    let mut x = g.input("x", m.x.clone());
    let target = g.input("target", m.target.clone());
    let shape = m.x.shape().to_vec();
    for l in 0..m.layers {
        let h = g.matmul(x, ids[3 * l]).unwrap();
        let h = g.bias(h, ids[3 * l + 1]).unwrap();
        let h = g.relu(h).unwrap();
        let h = g.dropout(h, 0.1).unwrap();
        let h = g.matmul(h, ids[3 * l + 2]).unwrap();
        let h = g.reshape(h, &[shape[0] * shape[1]]).unwrap();
        let h = g.reshape(h, &shape).unwrap();
        x = g.add(x, h).unwrap();
    }
    let loss = g.mse(x, target).unwrap();
    (g, loss, ids)
}

fn swap_decisions(p: &StepProfile) -> Vec<Decision> {
    tensor_attrs(&p.graph, BANDWIDTH)
        .iter()
        .map(|a| match (a.idle, a.last_fw_access, a.first_bw_access) {
            (Some((after, use_at)), Some(_), Some(_)) if a.memory_size > 0 => Decision::Swap {
                swap_out_after: after,
                prefetch_at: (use_at - 1).max(after + 1),
                use_at,
            },
            _ => Decision::Keep,
        })
        .collect()
}

fn recompute_decisions(p: &StepProfile, every: usize) -> Vec<Decision> {
    let nodes = p.graph.nodes();
    tensor_attrs(&p.graph, BANDWIDTH)
        .iter()
        .enumerate()
        .map(|(t, a)| match (a.idle, a.first_bw_access) {
            (Some((drop_after, use_at)), Some(_))
                if t % every == 0 && nodes[t].phase == remat_planner::Phase::Forward =>
            {
                Decision::Recompute {
                    from: Vec::new(),
                    drop_after,
                    use_at,
                }
            }
            _ => Decision::Keep,
        })
        .collect()
}

type Recorder = Box<dyn Fn(&ExecContext) -> (Graph, NodeId, Vec<NodeId>)>;

struct Setup {
    expected: Vec<Tensor>,
    graph: Graph,
    ids: Vec<NodeId>,
    profile: StepProfile,
}

/// Profiles one recording of a step; the expected gradients come from another recording
/// run by the engine's own store-all forward and backward.
fn setup_with(record: Recorder) -> Setup {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let (mut reference, loss, ids) = record(&ctx);
    reference.forward().unwrap();
    reference.backward(loss).unwrap();
    let expected = ids
        .iter()
        .map(|&id| reference.grad(id).unwrap().unwrap())
        .collect();
    drop(reference);
    let (mut graph, loss, ids) = record(&ctx);
    let opts = ProfileOptions {
        runs: 1,
        name: "mlp".into(),
    };
    let profile = profile_step(&mut graph, loss, &opts).unwrap();
    Setup {
        expected,
        graph,
        ids,
        profile,
    }
}

fn setup(layers: usize) -> Setup {
    let pool = MemoryPool::unbounded();
    let m = model(&pool, layers, 8, 16);
    setup_with(Box::new(move |ctx| record(ctx, &m, 7)))
}

impl Setup {
    /// Runs a plan and checks the measured peak and every gradient.
    fn check(&mut self, label: &str, planned: &Planned, copy: &CopyEngine) -> StepReport {
        self.graph.set_seed(7);
        let report = run_plan(
            &mut self.graph,
            &self.profile.layout,
            "mlp",
            &planned.plan,
            Some(copy),
        )
        .unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(
            report.peak_bytes, planned.report.peak_bytes,
            "{label}: measured vs simulated peak"
        );
        for (k, (id, want)) in self.ids.iter().zip(&self.expected).enumerate() {
            let got = self.graph.grad(*id).unwrap().unwrap();
            assert!(
                got.bit_eq(want),
                "{label}: gradient of parameter {k} differs from store-all"
            );
        }
        report
    }

    fn unlimited(&self) -> Problem<'_> {
        Problem {
            graph: &self.profile.graph,
            budget_bytes: u64::MAX,
            bandwidth: BANDWIDTH,
        }
    }

    /// Hand-made swap and recompute plans, and every registered strategy at three budgets.
    fn all_plans(&self) -> Vec<(String, Planned)> {
        let graph = &self.profile.graph;
        let (peak, floor) = (graph.store_all_peak(), graph.memory_floor());
        let mut plans: Vec<(String, Planned)> = Vec::new();
        for (label, decisions) in [
            ("swap-all", swap_decisions(&self.profile)),
            ("recompute-all", recompute_decisions(&self.profile, 1)),
            ("recompute-every-3", recompute_decisions(&self.profile, 3)),
        ] {
            plans.push((
                label.into(),
                plan_from_decisions(&self.unlimited(), label, decisions).unwrap(),
            ));
        }
        for budget in [peak, floor + (peak - floor) / 2, floor + (peak - floor) / 4] {
            let problem = Problem {
                graph,
                budget_bytes: budget,
                bandwidth: BANDWIDTH,
            };
            for strategy in remat_planner::registry() {
                if let Ok(planned) = strategy.plan(&problem) {
                    plans.push((format!("{}@{budget}", strategy.name()), planned));
                }
            }
        }
        plans
    }

    fn check_all(&mut self) {
        let plans = self.all_plans();
        assert!(plans.len() >= 6, "{} plans", plans.len());
        let copy = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
        for (label, planned) in &plans {
            self.check(label, planned, &copy);
        }
        // Every swapped byte came back and was released.
        assert_eq!(copy.store().stats().live_bytes, 0);
    }
}

#[test]
fn every_plan_meets_its_predicted_peak_and_store_all_gradients() {
    setup(3).check_all();
}

#[test]
fn mlp_chain_with_dropout_under_every_plan() {
    let pool = MemoryPool::unbounded();
    let config = MlpConfig {
        dims: vec![24, 32, 32, 32, 16],
        dropout: 0.2,
        seed: 3,
    };
    let mlp = Mlp::new(&pool, config).unwrap();
    let x = Tensor::from_vec(
        &pool,
        "x",
        &[6, 24],
        values(6 * 24, 5, 2.0),
        Category::Activations,
    )
    .unwrap();
    let y = Tensor::from_vec(
        &pool,
        "y",
        &[6, 16],
        values(6 * 16, 6, 2.0),
        Category::Activations,
    )
    .unwrap();
    setup_with(Box::new(move |ctx| {
        let mut g = Graph::new(ctx);
        g.set_seed(7);
        let (xn, yn) = (g.input("x", x.clone()), g.input("y", y.clone()));
        let nodes = mlp.build(&mut g, xn, yn).unwrap();
        (g, nodes.loss, nodes.params)
    }))
    .check_all();
}

#[test]
fn gpt_with_dropout_under_every_plan() {
    let pool = MemoryPool::unbounded();
    let config = GptConfig {
        vocab: 32,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        ffn_hidden: 64,
        dropout: 0.1,
        ..GptConfig::bench()
    };
    let gpt = Gpt::new(&pool, config).unwrap();
    let (batch, seq) = (2, 8);
    let tokens: Vec<u32> = (0..batch * seq).map(|i| (i * 7 % 32) as u32).collect();
    let targets: Vec<u32> = (0..batch * seq).map(|i| (i * 5 % 32) as u32).collect();
    let data = Batch {
        tokens: tokens.into(),
        targets: targets.into(),
        batch,
        seq,
    };
    setup_with(Box::new(move |ctx| {
        let mut g = Graph::new(ctx);
        g.set_seed(7);
        let step = gpt
            .record(&mut g, &data, Checkpointing::Graph(Policy::StoreAll))
            .unwrap();
        (g, step.loss, step.params)
    }))
    .check_all();
}

#[test]
fn swaps_through_a_memory_mapped_file_are_exact() {
    let mut s = setup(2);
    let dir = std::env::temp_dir().join(format!("remat-auto-exec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = CopyEngine::new(
        Arc::new(HostStore::on_disk(&dir).unwrap()),
        Throttle::default(),
    );
    let planned =
        plan_from_decisions(&s.unlimited(), "swap-all", swap_decisions(&s.profile)).unwrap();
    assert!(planned.report.swapped_out_bytes > 0);
    let report = s.check("swap-all via file", &planned, &copy);
    assert_eq!(report.swapped_out_bytes, planned.report.swapped_out_bytes);
    assert!(
        report.swapped_in_bytes > 0,
        "the plan must bring tensors back"
    );
    assert!(copy.store().stats().peak_bytes > 0);
    drop(copy);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_slow_host_store_shows_up_as_stall_time() {
    let mut s = setup(2);
    let planned =
        plan_from_decisions(&s.unlimited(), "swap-all", swap_decisions(&s.profile)).unwrap();
    let fast = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
    let fast_report = s.check("fast", &planned, &fast);
    let slow = CopyEngine::new(
        Arc::new(HostStore::in_memory()),
        Throttle {
            bytes_per_sec: None,
            latency: std::time::Duration::from_millis(5),
        },
    );
    let slow_report = s.check("slow", &planned, &slow);
    // Each copy takes 5 ms while the ops between a prefetch and its use take microseconds:
    // the compute thread must wait, and the wait is counted.
    assert!(
        slow_report.stall >= std::time::Duration::from_millis(5),
        "{:?}",
        slow_report.stall
    );
    assert!(slow_report.stall > fast_report.stall);
    assert_eq!(slow.stats().stall, slow_report.stall);
}
