//! Property tests on random training DAGs:
//! - every registered strategy's plan validates in the simulator and, when the strategy
//!   reports success, its simulated peak is within the budget;
//! - the simulator agrees with a brute-force replay (peak, time, first broken step) on
//!   schedules lowered from random keep/swap/recompute decisions, and on broken ones.

mod common;

use std::collections::HashSet;

use proptest::prelude::*;
use remat_planner::attrs::tensor_attrs;
use remat_planner::lower::lower;
use remat_planner::{Decision, Graph, PlanError, Step, simulate, simulate_steps};
use remat_planner::{Problem, registry};

/// A random training graph: `n` forward ops, each reading 1-2 earlier forward outputs, a
/// loss, then one backward op per forward op in reverse, reading its forward op's inputs and
/// output and the previous gradient.
fn training_dag() -> impl Strategy<Value = Graph> {
    (3usize..9).prop_flat_map(|n| {
        (
            prop::collection::vec((1u64..64, 1u32..8, any::<u32>()), n),
            prop::collection::vec(0u64..16, 1),
        )
            .prop_map(move |(layers, statics)| build(&layers, statics[0]))
    })
}

fn build(layers: &[(u64, u32, u32)], static_bytes: u64) -> Graph {
    common::skip_chain(layers, static_bytes)
}

/// Random decisions: each activation kept, swapped (prompt somewhere in its window) or
/// recomputed.
fn random_decisions(graph: &Graph, picks: &[u8]) -> Vec<Decision> {
    let attrs = tensor_attrs(graph, 1.0);
    let mut decisions = vec![Decision::Keep; graph.len()];
    for (t, a) in attrs.iter().enumerate() {
        let Some((start, use_at)) = a.idle else {
            continue;
        };
        let pick = picks[t % picks.len()];
        decisions[t] = match pick % 3 {
            0 => Decision::Keep,
            1 => Decision::Swap {
                swap_out_after: start,
                prefetch_at: start + 1 + usize::from(pick / 3) % (use_at - start),
                use_at,
            },
            _ => Decision::Recompute {
                from: vec![],
                drop_after: start,
                use_at,
            },
        };
    }
    decisions
}

/// Brute force: the resident set replayed step by step, memory summed from scratch.
/// Returns (peak, total time, recompute time) or the index of the first broken step.
fn replay(graph: &Graph, steps: &[Step], bandwidth: f64) -> Result<(u64, f64, f64), usize> {
    let mut resident: HashSet<usize> = HashSet::new();
    let mut host: Vec<Option<f64>> = vec![None; graph.len()];
    let mut ready = vec![0.0f64; graph.len()];
    let mut computed = vec![0u32; graph.len()];
    let (mut now, mut d2h, mut h2d, mut recompute) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let mem = |r: &HashSet<usize>| {
        graph.static_bytes() + r.iter().map(|&t| graph.node(t).output_bytes).sum::<u64>()
    };
    let mut peak = mem(&resident);
    let copy = |t: usize| graph.node(t).output_bytes as f64 / bandwidth;
    for (i, &step) in steps.iter().enumerate() {
        match step {
            Step::Compute { node } => {
                let inputs = &graph.node(node).inputs;
                if inputs.iter().any(|u| !resident.contains(u)) || resident.contains(&node) {
                    return Err(i);
                }
                let start = inputs.iter().map(|&u| ready[u]).fold(now, f64::max);
                resident.insert(node);
                peak = peak.max(mem(&resident));
                computed[node] += 1;
                if computed[node] > 1 {
                    recompute += graph.node(node).compute_time;
                }
                ready[node] = start;
                now = start + graph.node(node).compute_time;
            }
            Step::Free { tensor } => {
                if !resident.remove(&tensor) {
                    return Err(i);
                }
                if let Some(done) = host[tensor] {
                    now = now.max(done);
                }
            }
            Step::SwapOut { tensor } => {
                if !resident.contains(&tensor) {
                    return Err(i);
                }
                let start = now.max(d2h).max(ready[tensor]);
                d2h = start + copy(tensor);
                host[tensor] = Some(d2h);
            }
            Step::SwapIn { tensor } => {
                let Some(done_out) = host[tensor] else {
                    return Err(i);
                };
                if resident.contains(&tensor) {
                    return Err(i);
                }
                let start = now.max(h2d).max(done_out);
                h2d = start + copy(tensor);
                ready[tensor] = h2d;
                resident.insert(tensor);
                peak = peak.max(mem(&resident));
            }
        }
    }
    if computed.contains(&0) {
        return Err(steps.len());
    }
    Ok((peak, now, recompute))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn every_strategy_validates_and_fits_when_it_succeeds(
        graph in training_dag(),
        fraction in 0.3f64..1.0,
        bandwidth in prop::sample::select(vec![0.5, 8.0, 1e3]),
    ) {
        let peak = graph.store_all_peak();
        let floor = graph.memory_floor();
        let budget = floor + ((peak - floor) as f64 * fraction) as u64;
        let problem = Problem { graph: &graph, budget_bytes: budget, bandwidth };
        for strategy in registry() {
            match strategy.plan(&problem) {
                Ok(planned) => {
                    let report = simulate(&graph, &planned.plan);
                    prop_assert!(report.is_ok(), "{}: {:?}", strategy.name(), report);
                    let report = report.unwrap();
                    prop_assert!(report.peak_bytes <= budget, "{}", strategy.name());
                    prop_assert_eq!(report.peak_bytes, planned.report.peak_bytes);
                    prop_assert!(report.peak_bytes >= floor, "{}", strategy.name());
                }
                Err(PlanError::OverBudget { best_peak, .. }) => {
                    prop_assert!(best_peak > budget, "{}", strategy.name());
                }
                Err(PlanError::NotApplicable { .. }) => {}
                Err(other) => prop_assert!(false, "{}: {other}", strategy.name()),
            }
        }
    }

    #[test]
    fn simulator_agrees_with_brute_force_replay(
        graph in training_dag(),
        picks in prop::collection::vec(any::<u8>(), 1..16),
        bandwidth in prop::sample::select(vec![0.25, 4.0, 100.0]),
        cut in any::<prop::sample::Index>(),
    ) {
        let decisions = random_decisions(&graph, &picks);
        let lowered = lower(&graph, &decisions, bandwidth).expect("random decisions lower");
        let sim = simulate_steps(&graph, &lowered.steps, bandwidth).expect("lowered plans run");
        let (peak, time, recompute) = replay(&graph, &lowered.steps, bandwidth).expect("replays");
        prop_assert_eq!(sim.peak_bytes, peak);
        prop_assert!(close(sim.total_time, time), "{} vs {}", sim.total_time, time);
        prop_assert!(close(sim.recompute_time, recompute));
        // Drop one step: both must agree on whether it breaks and where.
        let mut broken = lowered.steps.clone();
        let removed = cut.index(broken.len());
        broken.remove(removed);
        let brute = replay(&graph, &broken, bandwidth);
        match simulate_steps(&graph, &broken, bandwidth) {
            Ok(r) => {
                let (p, t, _) = brute.expect("brute force accepts what the simulator accepts");
                prop_assert_eq!(r.peak_bytes, p);
                prop_assert!(close(r.total_time, t));
            }
            Err(e) => {
                let at = brute.expect_err("brute force rejects what the simulator rejects");
                let step = match e {
                    remat_planner::SimError::NeverComputed { .. } => broken.len(),
                    ref other => step_of(other),
                };
                prop_assert_eq!(step, at, "{}", e);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Copies out reissued by their deadlines (`solve::copies_out`) only move `SwapOut`
    /// steps: the schedule still runs, with the same steps, peak and recomputation.
    #[test]
    fn copies_out_by_deadlines_keep_the_schedule_valid(
        graph in training_dag(),
        picks in prop::collection::vec(any::<u8>(), 1..16),
        bandwidth in prop::sample::select(vec![0.25, 4.0, 100.0]),
    ) {
        let decisions = random_decisions(&graph, &picks);
        let lowered = lower(&graph, &decisions, bandwidth).expect("random decisions lower");
        let before = simulate_steps(&graph, &lowered.steps, bandwidth).expect("lowered plans run");
        let per_byte = 1.0 / (bandwidth * graph.time_unit_s());
        let reissued = remat_planner::solve::copies_out::issue_by_deadlines(
            &graph,
            lowered.steps.clone(),
            per_byte,
        );
        let after = simulate_steps(&graph, &reissued, bandwidth);
        prop_assert!(after.is_ok(), "{:?}\n{:?}", after, reissued);
        let after = after.unwrap();
        prop_assert_eq!(after.peak_bytes, before.peak_bytes);
        prop_assert!(close(after.recompute_time, before.recompute_time));
        let sorted = |steps: &[Step]| {
            let mut keys: Vec<String> = steps.iter().map(|s| format!("{s:?}")).collect();
            keys.sort();
            keys
        };
        prop_assert_eq!(sorted(&reissued), sorted(&lowered.steps));
    }
}

fn step_of(e: &remat_planner::SimError) -> usize {
    use remat_planner::SimError::*;
    match *e {
        UnknownNode { step, .. }
        | InputMissing { step, .. }
        | AlreadyResident { step, .. }
        | FreeMissing { step, .. }
        | SwapOutMissing { step, .. }
        | SwapInWithoutSwapOut { step, .. }
        | SwapInResident { step, .. } => step,
        _ => usize::MAX,
    }
}
