//! The `evict` strategy on random DAGs: every plan it returns validates in the simulator and
//! fits the budget; with the store-all budget it recomputes nothing; when it gives up, the
//! peak it reports is one it really reached and is over the budget.

use proptest::prelude::*;
use remat_planner::Strategy as PlanStrategy;
use remat_planner::exact::evict::{Evict, Pass, evict_pass, weightings};
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
