use super::*;
use crate::ir::{Graph, Node, Phase};
use crate::sim::simulate_steps;

/// A sequential network's training graph: `f_k` reads `f_{k-1}`; `f_k_backward` reads the
/// layer's input and output and the incoming gradient. Sizes and times vary per layer.
fn sequential(layers: usize, seed: u64) -> Graph {
    let mut state = seed;
    let mut next = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        1 + state % n
    };
    let mut nodes = Vec::new();
    for k in 0..layers {
        nodes.push(Node {
            name: format!("f{k}"),
            phase: Phase::Forward,
            compute_time: next(50) as f64,
            output_bytes: 4096 * next(50),
            inputs: if k == 0 { vec![] } else { vec![k - 1] },
        });
    }
    nodes.push(Node {
        name: "loss".into(),
        phase: Phase::Backward,
        compute_time: 5.0,
        output_bytes: 4096,
        inputs: vec![layers - 1],
    });
    for k in (0..layers).rev() {
        let grad = nodes.len() - 1;
        let mut inputs = vec![k, grad];
        if k > 0 {
            inputs.insert(0, k - 1);
        }
        nodes.push(Node {
            name: format!("f{k}_backward"),
            phase: Phase::Backward,
            compute_time: next(90) as f64,
            output_bytes: nodes[k].output_bytes,
            inputs,
        });
    }
    Graph::new("sequential", nodes, 0, 1e-6).expect("a valid graph")
}

fn problems(graph: &Graph) -> Vec<u64> {
    let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
    (1..=5).map(|i| floor + (peak - floor) * i / 8).collect()
}

#[test]
fn never_slower_than_recompute_only_and_plans_validate() {
    let mut compared = 0;
    for seed in 1..6 {
        let graph = sequential(10 + 2 * seed as usize, seed * 7919);
        for budget in problems(&graph) {
            for bandwidth in [1e8, 1e9, 1e11] {
                let problem = Problem {
                    graph: &graph,
                    budget_bytes: budget,
                    bandwidth,
                };
                let Ok(dp) = ChainDp.plan(&problem) else {
                    continue;
                };
                let planned = ChainOffload
                    .plan(&problem)
                    .expect("chain-dp fits, so must this");
                let report = simulate_steps(&graph, &planned.plan.steps, bandwidth)
                    .expect("the schedule runs");
                assert!(report.peak_bytes <= budget);
                assert!(report.total_time <= dp.report.total_time + 1e-9);
                compared += 1;
            }
        }
    }
    assert!(compared > 30, "only {compared} comparisons");
}

#[test]
fn with_no_bandwidth_it_is_recompute_only() {
    let graph = sequential(14, 12345);
    let mut compared = 0;
    for budget in problems(&graph) {
        let problem = Problem {
            graph: &graph,
            budget_bytes: budget,
            bandwidth: 1e-3,
        };
        let (Ok(dp), Ok(off)) = (ChainDp.plan(&problem), ChainOffload.plan(&problem)) else {
            continue;
        };
        assert_eq!(off.report.total_time, dp.report.total_time);
        assert_eq!(off.plan.steps, dp.plan.steps);
        // And the search itself, which costs the copies, chooses no offloaded checkpoint.
        assert!(offload_plan(&problem).is_none(), "offloads at {budget}");
        compared += 1;
    }
    assert!(compared >= 4, "only {compared} budgets planned");
}

#[test]
fn fast_copies_under_a_tight_budget_beat_recompute_only() {
    // 100 GB/s against microsecond layers: copies of ~50 KB take ~0.5 us, well hidden, so
    // offloading checkpoints instead of recomputing saves time somewhere in these cases.
    let mut wins = 0;
    for seed in 1..6 {
        let graph = sequential(16, seed * 104729);
        for budget in problems(&graph) {
            let problem = Problem {
                graph: &graph,
                budget_bytes: budget,
                bandwidth: 1e11,
            };
            let (Ok(dp), Ok(off)) = (ChainDp.plan(&problem), ChainOffload.plan(&problem)) else {
                continue;
            };
            if off.report.total_time < dp.report.total_time {
                assert!(
                    off.plan
                        .steps
                        .iter()
                        .any(|s| matches!(s, Step::SwapIn { .. }))
                );
                wins += 1;
            }
        }
    }
    assert!(wins > 0, "offloading never helped");
}
