//! Issue 5, section 4: plans executed by the engine. For every plan (each registered
//! strategy, plus hand-made swap / recompute / mixed plans) the pool's peak equals the
//! simulator's prediction to the byte, and the gradients equal the engine's store-all
//! backward bit for bit.
//!
//! Why one file of ~780 lines: every integration-test file is a binary of its own linked
//! against the engine, so the plan-execution cases share one binary and its helpers.

use std::sync::Arc;

use remat_engine::core::swap::{CopyEngine, HostStore, Throttle};
use remat_engine::models::gpt::{Batch, Checkpointing, Gpt, GptConfig};
use remat_engine::models::mlp::{Mlp, MlpConfig};
use remat_engine::plan_exec::profile::{ProfileOptions, StepProfile, profile_step};
use remat_engine::plan_exec::{ItemKind, PlanExecError, StepReport, check_plan, run_plan};
use remat_engine::{Category, ExecContext, Graph, MemoryPool, NodeId, Policy, Tensor};
use remat_planner::attrs::tensor_attrs;
use remat_planner::problem::{plan_from_decisions, plan_from_steps};
use remat_planner::{Decision, PlanError, Planned, Problem, Step};

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

/// Store-all, except that every backward node that writes a parameter's gradient (and may
/// be dropped) is computed, freed and computed again. The second computation must not
/// rebuild the parameter's gradient: it was summed the first time, and a transient copy
/// would raise the peak above the simulator's. (Plans that recompute such nodes depend on
/// profiled times, so without this plan the case was only met now and then.)
fn backward_twice(p: &StepProfile, store_all: &[Step]) -> Vec<Step> {
    let items = p.layout.items();
    let writes_leaf_grad = |node: usize| {
        matches!(items[node].kind, ItemKind::Backward { .. })
            && p.graph.may_drop(node)
            && items[node]
                .inputs
                .iter()
                .any(|&i| matches!(items[i].kind, ItemKind::Grad { .. }))
    };
    let mut steps = Vec::with_capacity(store_all.len());
    for &step in store_all {
        steps.push(step);
        if let Step::Compute { node } = step
            && writes_leaf_grad(node)
        {
            steps.extend([Step::Free { tensor: node }, Step::Compute { node }]);
        }
    }
    steps
}

type Recorder = Box<dyn Fn(&ExecContext) -> (Graph, NodeId, Vec<NodeId>)>;

struct Setup {
    expected: Vec<Tensor>,
    /// The pool's peak over the engine's own store-all forward and backward, beyond what
    /// the pool held before.
    engine_peak: u64,
    /// Bytes of the outputs of ops whose output (reshape) or input gradients (reshape, add)
    /// share storage with another tensor in the engine: the executor gives every item's
    /// tensor its own bytes, so around them its peak may exceed the engine's.
    view_bytes: u64,
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
    pool.reset_peak();
    let before = pool.live();
    reference.forward().unwrap();
    reference.backward(loss).unwrap();
    let engine_peak = pool.peak() - before;
    let view_bytes = reference
        .node_ids()
        .filter(|&id| {
            reference
                .kind(id)
                .is_ok_and(|k| k == "reshape" || k == "add")
        })
        .map(|id| {
            let elems: usize = reference.shape(id).unwrap().iter().product();
            (elems * reference.dtype(id).unwrap().size_bytes()) as u64
        })
        .sum();
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
        engine_peak,
        view_bytes,
        graph,
        ids,
        profile,
    }
}

fn setup(layers: usize) -> Setup {
    let pool = MemoryPool::unbounded();
    // Enough rows that activations, not gradients, make the store-all peak.
    let m = model(&pool, layers, 64, 16);
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

    /// Hand-made swap and recompute plans, and every registered strategy at three budgets
    /// (with the names of the strategies whose plans were run, per budget).
    fn all_plans(&self) -> (Vec<(String, Planned)>, Vec<Vec<String>>) {
        let graph = &self.profile.graph;
        // From store-all's peak down to recompute-all's (the least a baseline needs).
        let peak = graph.store_all_peak();
        let least = remat_planner::lookup("recompute-all")
            .unwrap()
            .plan(&self.unlimited())
            .unwrap()
            .report
            .peak_bytes;
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
        let store_all = remat_planner::lookup("store-all")
            .unwrap()
            .plan(&self.unlimited())
            .unwrap();
        let twice = backward_twice(&self.profile, &store_all.plan.steps);
        assert!(
            twice.len() > store_all.plan.steps.len(),
            "no backward node writes a parameter gradient"
        );
        plans.push((
            "backward-twice".into(),
            plan_from_steps(&self.unlimited(), "backward-twice", twice, Vec::new()).unwrap(),
        ));
        let mut ran = Vec::new();
        for budget in [peak, least + (peak - least) / 2, least] {
            let problem = Problem {
                graph,
                budget_bytes: budget,
                bandwidth: BANDWIDTH,
            };
            let mut names = Vec::new();
            for strategy in remat_planner::registry() {
                match strategy.plan(&problem) {
                    Ok(planned) => {
                        // The profiled graph pins the gradient buffers, so no strategy may
                        // plan to recompute one: the simulator refuses it, and the
                        // executor's own check (the second guard) must agree. A pinned
                        // tensor's host copy is another matter: the planner's graph does
                        // not say which readers write a tensor in place, so a search may
                        // swap a buffer out, let a contribution into it, and free it. The
                        // executor refuses such a plan, and choosing skips it
                        // (plan_fits_executor); so does this test, naming it.
                        match check_plan(&self.profile.layout, &planned.plan.steps) {
                            Err(PlanExecError::GradientLost {
                                action: "freeing", ..
                            }) => {
                                names.push(format!("{} refused by the executor", strategy.name()));
                                continue;
                            }
                            Err(e) => panic!("{}@{budget}: {e}", strategy.name()),
                            Ok(()) => {}
                        }
                        names.push(strategy.name());
                        plans.push((format!("{}@{budget}", strategy.name()), planned));
                    }
                    // Over budget at the tighter budgets; chain-dp only plans chains.
                    Err(PlanError::OverBudget { .. } | PlanError::NotApplicable { .. }) => {}
                    Err(e) => names.push(format!("{} failed: {e}", strategy.name())),
                }
            }
            ran.push(names);
        }
        (plans, ran)
    }

    /// Runs every plan; returns the strategies that ran at each budget (store-all's peak,
    /// half way to recompute-all's, recompute-all's).
    fn check_all(&mut self) -> Vec<Vec<String>> {
        let (plans, ran) = self.all_plans();
        for names in &ran {
            assert!(
                names.iter().all(|n| !n.contains(" failed: ")),
                "strategies failed: {names:?}"
            );
        }
        let copy = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
        for (label, planned) in &plans {
            self.check(label, planned, &copy);
        }
        // Every swapped byte came back and was released.
        assert_eq!(copy.store().stats().live_bytes, 0);
        // Gradient buffers are allocated at their first write, as the engine's backward
        // does: the executed store-all plan peaks where the engine's own store-all does.
        let store_all = &plans
            .iter()
            .find(|(label, _)| label.starts_with("store-all@"))
            .expect("store-all always fits the store-all peak")
            .1;
        // Exactly, when the model has no views or pass-through gradients; those are the one
        // remaining difference (the executor copies them, the engine shares storage).
        let planned = store_all.report.peak_bytes - self.profile.static_bytes();
        if self.view_bytes == 0 {
            assert_eq!(
                planned, self.engine_peak,
                "store-all plan vs the engine's own store-all (beyond static memory)"
            );
        } else {
            assert!(
                planned >= self.engine_peak && planned - self.engine_peak <= self.view_bytes,
                "store-all plan {planned} vs the engine's own {} (views: {} bytes)",
                self.engine_peak,
                self.view_bytes
            );
        }
        ran
    }
}

/// The strategies every model must run at every budget tried (the general ones that
/// always reach the floor); the rest are checked by name at the store-all budget.
const ALWAYS: [&str; 3] = ["recompute-all", "threshold", "chen-greedy"];

fn assert_ran(ran: &[Vec<String>], at_store_all: &[&str]) {
    println!("strategies run per budget (store-all, middle, recompute-all): {ran:?}");
    for name in at_store_all {
        assert!(
            ran[0].iter().any(|n| n == name),
            "{name} did not run at the store-all budget: {ran:?}"
        );
    }
    for names in ran {
        for name in ALWAYS {
            assert!(names.iter().any(|n| n == name), "{name} missing: {ran:?}");
        }
    }
}

/// `name` ran at each of the first `budgets` budgets (store-all, middle, recompute-all).
fn assert_ran_through(ran: &[Vec<String>], budgets: usize, name: &str) {
    for (k, names) in ran.iter().take(budgets).enumerate() {
        assert!(
            names.iter().any(|n| n == name),
            "{name} did not run at budget {k}: {ran:?}"
        );
    }
}

#[test]
fn every_plan_meets_its_predicted_peak_and_store_all_gradients() {
    let ran = setup(3).check_all();
    assert_ran(
        &ran,
        &["store-all", "every:2", "every:4", "sqrt", "mutwo", "evict"],
    );
    // With the gradient buffers pinned, evict no longer plans to recompute them and
    // reaches every budget here (it used to stop at the middle one).
    assert_ran_through(&ran, 3, "evict");
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
    let rows = 64;
    let x = Tensor::from_vec(
        &pool,
        "x",
        &[rows, 24],
        values(rows * 24, 5, 2.0),
        Category::Activations,
    )
    .unwrap();
    let y = Tensor::from_vec(
        &pool,
        "y",
        &[rows, 16],
        values(rows * 16, 6, 2.0),
        Category::Activations,
    )
    .unwrap();
    let ran = setup_with(Box::new(move |ctx| {
        let mut g = Graph::new(ctx);
        g.set_seed(7);
        let (xn, yn) = (g.input("x", x.clone()), g.input("y", y.clone()));
        let nodes = mlp.build(&mut g, xn, yn).unwrap();
        (g, nodes.loss, nodes.params)
    }))
    .check_all();
    assert_ran(
        &ran,
        &[
            "store-all",
            "every:2",
            "every:4",
            "sqrt",
            "mutwo",
            "evict",
            "chain-dp",
        ],
    );
    // Pinned gradient buffers: evict reaches every budget (it used to stop at store-all).
    assert_ran_through(&ran, 3, "evict");
    assert_ran_through(&ran, 3, "anytime");
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
    let (batch, seq) = (8, 16);
    let tokens: Vec<u32> = (0..batch * seq).map(|i| (i * 7 % 32) as u32).collect();
    let targets: Vec<u32> = (0..batch * seq).map(|i| (i * 5 % 32) as u32).collect();
    let data = Batch {
        tokens: tokens.into(),
        targets: targets.into(),
        batch,
        seq,
    };
    let ran = setup_with(Box::new(move |ctx| {
        let mut g = Graph::new(ctx);
        g.set_seed(7);
        let step = gpt
            .record(&mut g, &data, Checkpointing::Graph(Policy::StoreAll))
            .unwrap();
        (g, step.loss, step.params)
    }))
    .check_all();
    assert_ran(
        &ran,
        &["store-all", "every:2", "every:4", "sqrt", "mutwo", "evict"],
    );
    // Pinned gradient buffers: evict reaches the middle budget too (it used to stop at
    // store-all); at recompute-all's peak its greedy is over budget.
    assert_ran_through(&ran, 2, "evict");
    // The anytime solver (in the profiled order, which the engine's graph fixes) plans
    // wherever evict does, and its plans execute exactly (checked above for every plan the
    // executor takes). Under load its time-limited search may stop at a plan that frees a
    // gradient buffer after a contribution its host copy lacks (see all_plans): the
    // executor refuses that one, as choosing does.
    for (k, names) in ran.iter().take(2).enumerate() {
        assert!(
            names
                .iter()
                .any(|n| n == "anytime" || n == "anytime refused by the executor"),
            "anytime did not plan at budget {k}: {ran:?}"
        );
    }
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

/// Swaps every gradient buffer over its longest idle gap (after a write, back before the
/// next write or the end of the step).
fn grad_swap_decisions(p: &StepProfile) -> Vec<Decision> {
    let nodes = p.graph.nodes();
    tensor_attrs(&p.graph, BANDWIDTH)
        .iter()
        .enumerate()
        .map(|(t, a)| match a.idle {
            Some((after, use_at)) if nodes[t].name.starts_with("grad:") => Decision::Swap {
                swap_out_after: after,
                prefetch_at: (use_at - 1).max(after + 1),
                use_at,
            },
            _ => Decision::Keep,
        })
        .collect()
}

#[test]
fn gradient_buffers_are_planner_nodes_that_swap_exactly() {
    let mut s = setup(2);
    let layout = &s.profile.layout;
    // One buffer per parameter, allocated right before its first writer, read at the end.
    let grads: Vec<usize> = (0..layout.len())
        .filter(|&i| layout.items()[i].name.starts_with("grad:"))
        .collect();
    assert_eq!(grads.len(), s.ids.len());
    let end = layout.len() - 1;
    assert_eq!(layout.items()[end].name, "end:step");
    assert_eq!(layout.items()[end].inputs, grads);
    for &g in &grads {
        assert!(
            layout.items()[g + 1..]
                .iter()
                .any(|i| i.inputs.contains(&g))
        );
    }
    // Exactly the buffers are pinned in the planner's graph, and the mark survives the
    // JSON that `remat profile` writes and `remat plan` reads.
    let graph = &s.profile.graph;
    assert_eq!(graph.pinned().collect::<Vec<_>>(), grads);
    let json = remat_planner::import::remat_json::to_json(graph);
    let again = remat_planner::import::parse(
        "profile.json",
        &json,
        remat_planner::import::ImportOptions::default(),
    )
    .unwrap();
    assert_eq!(again.pinned().collect::<Vec<_>>(), grads);
    // (Times may differ in the last bit: serde_json parses floats fast, not exactly.)
    assert_eq!(again.len(), graph.len());
    for (a, b) in again.nodes().iter().zip(graph.nodes()) {
        assert_eq!(
            (&a.name, &a.inputs, a.output_bytes),
            (&b.name, &b.inputs, b.output_bytes)
        );
        assert!((a.compute_time - b.compute_time).abs() <= 1e-12 * b.compute_time.abs());
    }
    // Static memory no longer holds gradient buffers: the store-all plan's first allocation
    // of a gradient comes in backward.
    let decisions = grad_swap_decisions(&s.profile);
    let swapped = decisions
        .iter()
        .filter(|d| matches!(d, Decision::Swap { .. }))
        .count();
    assert!(swapped > 0, "some gradient buffer has an idle gap");
    let planned = plan_from_decisions(&s.unlimited(), "swap-grads", decisions).unwrap();
    let copy = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
    let report = s.check("swap gradient buffers", &planned, &copy);
    assert!(report.swapped_out_bytes > 0);
    assert_eq!(copy.store().stats().live_bytes, 0);
}

#[test]
fn a_plan_dropping_a_written_gradient_buffer_is_refused_before_it_runs() {
    let mut s = setup(2);
    let layout = s.profile.layout.clone();
    let grad = (0..layout.len())
        .find(|&i| layout.items()[i].name.starts_with("grad:"))
        .unwrap();
    let writer = (grad + 1..layout.len())
        .find(|&i| layout.items()[i].inputs.contains(&grad))
        .unwrap();
    // Free the buffer right after its first write and recompute it for the next reader.
    let mut steps = Vec::new();
    for step in layout.store_all_steps() {
        match step {
            remat_planner::Step::Free { tensor } if tensor == grad => {}
            remat_planner::Step::Compute { node } if node > writer => {
                if layout.items()[node].inputs.contains(&grad)
                    && !steps.contains(&remat_planner::Step::Compute { node: grad })
                {
                    steps.push(remat_planner::Step::Compute { node: grad });
                }
                steps.push(step);
            }
            remat_planner::Step::Compute { node } if node == writer => {
                steps.push(step);
                steps.push(remat_planner::Step::Free { tensor: grad });
            }
            other => steps.push(other),
        }
    }
    // The planner's simulator refuses it too, and refuses bringing the buffer back by
    // recomputing it (a zero-cost node, but pinned) right before the end of the step.
    let sim = remat_planner::simulate_steps(&s.profile.graph, &steps, BANDWIDTH).unwrap_err();
    assert!(
        sim.to_string().contains(&layout.items()[grad].name),
        "{sim}"
    );
    let end = layout.len() - 1;
    let mut recompute = steps.clone();
    let at = recompute
        .iter()
        .position(|s| *s == remat_planner::Step::Compute { node: end })
        .unwrap();
    recompute.insert(at, remat_planner::Step::Compute { node: grad });
    let sim = remat_planner::simulate_steps(&s.profile.graph, &recompute, BANDWIDTH).unwrap_err();
    assert!(
        matches!(sim, remat_planner::SimError::PinnedRecomputed { ref node, .. }
            if *node == layout.items()[grad].name),
        "{sim}"
    );
    let err = check_plan(&layout, &steps).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, PlanExecError::GradientLost { .. }) && text.contains("grad:"),
        "{text}"
    );
    s.graph.set_seed(7);
    let run = remat_engine::plan_exec::run_steps(
        &mut s.graph,
        &layout,
        &steps,
        None,
        remat_engine::plan_exec::RunOptions::default(),
    );
    assert!(matches!(run, Err(PlanExecError::GradientLost { .. })));
    // Nothing ran: no partial gradients.
    for id in &s.ids {
        assert!(s.graph.grad(*id).unwrap().is_none());
    }
}

fn swap_traffic(graph: &remat_planner::Graph, planned: &Planned) -> u64 {
    remat_engine::plan_exec::swap_traffic(graph, &planned.plan)
}

#[test]
fn the_auto_choice_charges_swap_traffic_for_the_compute_it_takes() {
    use remat_engine::plan_exec::choose_plan;
    let s = setup(6);
    let graph = &s.profile.graph;
    let activations = graph.store_all_peak() - graph.static_bytes();
    let problem = Problem {
        budget_bytes: graph.static_bytes() + activations / 2,
        ..s.unlimited()
    };
    // Free copies: some fitting plan swaps (the budget is tight enough to need it, and
    // swaps hidden behind compute cost nothing).
    let free = choose_plan(&problem, &s.profile.layout, None, &[], 0.0).unwrap();
    let free_traffic = swap_traffic(graph, &free.planned);
    assert!(
        free_traffic > 0,
        "with free copies {} does not swap",
        free.planned.plan.strategy
    );
    // Everything swapped out comes back for backward: out and in both count.
    assert!(free_traffic >= 2 * free.planned.report.swapped_out_bytes);
    let simulated = remat_planner::simulate(graph, &free.planned.plan).unwrap();
    assert_eq!(free.planned.report.total_time, simulated.total_time);
    // A small charge: the predicted time is the simulator's plus the charge.
    let cost = 1e-12;
    let charged = choose_plan(&problem, &s.profile.layout, None, &[], cost).unwrap();
    let simulated = remat_planner::simulate(graph, &charged.planned.plan).unwrap();
    let traffic = swap_traffic(graph, &charged.planned);
    let want = simulated.total_time + cost * traffic as f64;
    assert!(
        (charged.planned.report.total_time - want).abs() <= 1e-12 * want.max(1.0),
        "{} vs {want}",
        charged.planned.report.total_time
    );
    // Copies that cost more than any recompute: the choice stops swapping.
    let dear = choose_plan(&problem, &s.profile.layout, None, &[], 1.0).unwrap();
    assert_eq!(
        swap_traffic(graph, &dear.planned),
        0,
        "chose {} (free copies: {} swapping {free_traffic} bytes)",
        dear.planned.plan.strategy,
        free.planned.plan.strategy
    );
}

#[test]
fn copies_under_compute_have_a_bandwidth_and_a_nonnegative_cost() {
    use remat_engine::plan_exec::profile::measure_copy_under_compute;
    let mut s = setup(3);
    let copy = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
    let m = measure_copy_under_compute(&mut s.graph, &s.profile, &copy, 2, 1 << 16).unwrap();
    assert!(m.bandwidth.is_finite() && m.bandwidth > 0.0, "{m:?}");
    assert!(
        m.compute_seconds_per_byte.is_finite() && m.compute_seconds_per_byte >= 0.0,
        "{m:?}"
    );
    // The probe leaves the step as it was: a plan still runs with store-all's gradients.
    let store_all = remat_planner::lookup("store-all")
        .unwrap()
        .plan(&s.unlimited())
        .unwrap();
    s.check("after the probe", &store_all, &copy);
}

#[test]
fn swap_cost_is_calibrated_on_a_swapping_plan() {
    use remat_engine::plan_exec::profile::calibrate_swap_cost;
    let mut s = setup(6);
    let copy = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
    let cost = calibrate_swap_cost(&mut s.graph, &s.profile, &copy, BANDWIDTH, 2)
        .unwrap()
        .expect("MuTWO swaps at one of the calibration budgets");
    assert!(cost.is_finite() && cost >= 0.0, "{cost}");
    // The calibration runs leave the step as it was.
    let store_all = remat_planner::lookup("store-all")
        .unwrap()
        .plan(&s.unlimited())
        .unwrap();
    s.check("after calibrating", &store_all, &copy);
}
