//! The `evict` strategy on random DAGs: every plan it returns validates in the simulator and
//! fits the budget; with the store-all budget it recomputes nothing; when it gives up, the
//! peak it reports is one it really reached and is over the budget.

use proptest::prelude::*;
use remat_planner::Strategy as PlanStrategy;
use remat_planner::exact::evict::{
    Evict, Pass, evict_pass, evict_pass_until, evict_pass_with_swaps, weightings,
};
use remat_planner::{Graph, Node, Phase, PlanError, Problem, lookup, simulate_steps};

const BANDWIDTH: f64 = 16e9;

/// A random DAG in topological order: node v reads up to three earlier nodes.
fn dag() -> impl Strategy<Value = Graph> {
    (2usize..28).prop_flat_map(|n| {
        let nodes = (0..n)
            .map(|v| {
                let inputs = if v == 0 {
                    Just(vec![]).boxed()
                } else {
                    prop::collection::btree_set(0..v, 0..=v.min(3))
                        .prop_map(|s| s.into_iter().collect())
                        .boxed()
                };
                (1u64..50, 1u64..1000, inputs, any::<bool>())
            })
            .collect::<Vec<_>>();
        nodes.prop_map(move |specs| {
            let half = specs.len() / 2;
            let nodes = specs
                .into_iter()
                .enumerate()
                .map(|(v, (time, bytes, inputs, _))| Node {
                    name: format!("n{v}"),
                    phase: if v < half {
                        Phase::Forward
                    } else {
                        Phase::Backward
                    },
                    compute_time: time as f64,
                    output_bytes: bytes,
                    inputs,
                })
                .collect();
            Graph::new("random", nodes, 7, 1e-3).unwrap()
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn plans_validate_and_fit(graph in dag(), fraction in 0.0f64..1.0) {
        let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
        let budget = floor + ((peak - floor) as f64 * fraction) as u64;
        match Evict.plan(&Problem { graph: &graph, budget_bytes: budget, bandwidth: BANDWIDTH }) {
            Ok(planned) => {
                let report = simulate_steps(&graph, &planned.plan.steps, BANDWIDTH).unwrap();
                prop_assert!(report.peak_bytes <= budget);
                prop_assert_eq!(report.total_time, planned.report.total_time);
            }
            Err(PlanError::OverBudget { best_peak, .. }) => prop_assert!(best_peak > budget),
            Err(e) => prop_assert!(false, "{}", e),
        }
    }

    #[test]
    fn store_all_budget_recomputes_nothing(graph in dag()) {
        let planned = Evict.plan(&Problem { graph: &graph, budget_bytes: graph.store_all_peak(), bandwidth: BANDWIDTH }).unwrap();
        prop_assert_eq!(planned.report.recompute_time, 0.0);
    }

    #[test]
    fn every_weighting_schedule_replays(graph in dag(), fraction in 0.3f64..1.0) {
        let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
        let budget = floor + ((peak - floor) as f64 * fraction) as u64;
        for weights in weightings() {
            if let Pass::Fits { steps, time } = evict_pass(&graph, budget, weights) {
                let report = simulate_steps(&graph, &steps, BANDWIDTH).unwrap();
                prop_assert!(report.peak_bytes <= budget, "{:?}: {} > {}", weights, report.peak_bytes, budget);
                prop_assert!((report.total_time - time).abs() <= 1e-9 * time);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Passes that may swap (pinned tensors included, protected sets at random) give
    /// schedules the simulator accepts within the budget: every swap-in follows a swap-out
    /// and its tensor's free, and moving swap-ins earlier never passes the budget.
    #[test]
    fn passes_with_swaps_replay_within_the_budget(
        graph in dag(),
        fraction in 0.0f64..1.0,
        pin_every in 2usize..6,
        protect_every in 2usize..8,
        bandwidth in prop::sample::select(vec![1e3, 1e6, 16e9]),
    ) {
        let pinned: Vec<usize> = (0..graph.len()).filter(|v| v % pin_every == 1).collect();
        let graph = graph.with_pinned(pinned).unwrap();
        let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
        let budget = floor + ((peak - floor) as f64 * fraction) as u64;
        let protected: Vec<bool> = (0..graph.len()).map(|v| v % protect_every == 0).collect();
        for weights in weightings() {
            let pass = evict_pass_with_swaps(&graph, budget, weights, &protected, bandwidth, None);
            if let Pass::Fits { steps, .. } = pass {
                let report = simulate_steps(&graph, &steps, bandwidth);
                prop_assert!(report.is_ok(), "{:?}: {:?}", weights, report.err());
                let report = report.unwrap();
                prop_assert!(report.peak_bytes <= budget, "{:?}: {} > {}", weights, report.peak_bytes, budget);
            }
        }
    }
}

/// Below the recompute floor a pinned tensor must leave the device: a recompute-only pass is
/// stuck there, a pass with swaps copies it out and back. A chain a -> b -> c -> d whose
/// `a` (pinned, 100 bytes) is read again by the last node.
#[test]
fn a_pinned_tensor_is_swapped_where_nothing_can_be_rebuilt() {
    let node = |name: &str, bytes: u64, inputs: Vec<usize>| Node {
        name: name.into(),
        phase: Phase::Forward,
        compute_time: 10.0,
        output_bytes: bytes,
        inputs,
    };
    let nodes = vec![
        node("a", 100, vec![]),
        node("b", 50, vec![0]),
        node("c", 50, vec![1]),
        node("d", 50, vec![2]),
        node("e", 10, vec![3, 0]),
    ];
    let graph = Graph::new("pinned", nodes, 0, 1e-3)
        .unwrap()
        .with_pinned([0])
        .unwrap();
    // b -> c and c -> d need 100 bytes each; holding a across them needs 200.
    let budget = 160;
    let none = vec![false; graph.len()];
    let weights = weightings().next().unwrap();
    assert!(matches!(
        evict_pass_until(&graph, budget, weights, &none, None),
        Pass::Stuck { .. }
    ));
    let Pass::Fits { steps, .. } = evict_pass_with_swaps(&graph, budget, weights, &none, 1e6, None)
    else {
        panic!("a pass with swaps fits");
    };
    let report = simulate_steps(&graph, &steps, 1e6).unwrap();
    assert!(
        report.peak_bytes <= budget,
        "{steps:?}: {}",
        report.peak_bytes
    );
    assert_eq!(report.recompute_time, 0.0);
    assert!(steps.contains(&remat_planner::Step::SwapOut { tensor: 0 }));
    assert!(steps.contains(&remat_planner::Step::SwapIn { tensor: 0 }));
}

#[test]
fn registered_by_name() {
    assert_eq!(lookup("evict").unwrap().name(), "evict");
    assert!(lookup("chain-dp").unwrap().is_exact());
}

#[test]
fn plans_large_synthetic_graphs() {
    // ~350 and ~1,000 nodes with skip connections: plans validate and fit. The time is
    // printed for information; `remat bench plan` measures it properly.
    for layers in [175, 500] {
        let graph = remat_planner::synth::training_graph(layers, 11);
        let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
        for fraction in [0.25, 0.5] {
            let budget = floor + ((peak - floor) as f64 * fraction) as u64;
            let start = std::time::Instant::now();
            let planned = Evict
                .plan(&Problem {
                    graph: &graph,
                    budget_bytes: budget,
                    bandwidth: BANDWIDTH,
                })
                .unwrap();
            eprintln!(
                "{} nodes at {fraction}: overhead {:.4} in {:?}",
                graph.len(),
                planned.report.overhead(),
                start.elapsed()
            );
            assert!(planned.report.peak_bytes <= budget);
        }
    }
}
