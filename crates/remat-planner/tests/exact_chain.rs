//! The chain DP on training graphs: its schedules validate in the simulator, which agrees
//! with the DP on time and stays under the budget.

mod common;

use common::{Rng, node};

use remat_planner::exact::chain::solve_chain;
use remat_planner::exact::chain_graph::chain_of;
use remat_planner::exact::chain_strategy::ChainDp;
use remat_planner::{Graph, Node, Phase, PlanError, Problem, Strategy, simulate_steps};

const BANDWIDTH: f64 = 16e9;

/// A sequential network's training graph shaped like Checkmate's VGG graphs: `layer_k`
/// reads `layer_{k-1}`; `layer_k_backward` reads the layer's input and output and the
/// incoming gradient.
fn sequential_training_graph(rng: &mut Rng, layers: usize) -> Graph {
    let mut nodes = Vec::new();
    for k in 0..layers {
        let inputs = if k == 0 { vec![] } else { vec![k - 1] };
        nodes.push(node(
            format!("layer{k}"),
            Phase::Forward,
            1 + rng.below(50),
            1 + rng.below(1000),
            inputs,
        ));
    }
    let loss = layers;
    nodes.push(node("loss".into(), Phase::Backward, 5, 4, vec![layers - 1]));
    nodes.push(node(
        format!("layer{}_backward", layers - 1),
        Phase::Backward,
        9,
        10,
        vec![layers - 1, loss],
    ));
    for k in (0..layers - 1).rev() {
        let grad = nodes.len() - 1;
        let bytes = nodes[k].output_bytes;
        nodes.push(node(
            format!("layer{k}_backward"),
            Phase::Backward,
            1 + rng.below(90),
            bytes,
            vec![k, k + 1, grad],
        ));
    }
    Graph::new("sequential", nodes, 1000, 1e-3).unwrap()
}

#[test]
fn dp_schedules_validate_and_agree_with_the_simulator() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut solved = 0;
    for case in 0..8 {
        let graph = sequential_training_graph(&mut rng, 6 + case * 3);
        let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
        for step in 0..=10 {
            let budget = floor + (peak - floor) * step / 10;
            let mut mapped = chain_of(&graph).expect("a sequential graph is a chain");
            let avail = budget - graph.static_bytes();
            mapped.chain.unit_bytes = avail.div_ceil(300).max(1);
            let Ok(solution) = solve_chain(&mapped.chain, mapped.chain.budget_units(avail)) else {
                continue;
            };
            let steps = mapped.steps(&graph, &solution);
            let report = simulate_steps(&graph, &steps, BANDWIDTH).expect("dp schedule validates");
            assert!(
                report.peak_bytes <= budget,
                "case {case} step {step}: peak {} > {budget}",
                report.peak_bytes
            );
            let tolerance = 1e-9 * report.total_time;
            assert!(
                (report.total_time - solution.time).abs() <= tolerance,
                "case {case}: sim {} vs dp {}",
                report.total_time,
                solution.time
            );
            assert_eq!(report.stall_time, 0.0);
            solved += 1;
        }
    }
    assert!(solved > 40, "only {solved} budgets solved");
}

#[test]
fn strategy_keeps_everything_at_the_store_all_peak_and_recomputes_below() {
    let mut rng = Rng(99);
    let graph = sequential_training_graph(&mut rng, 20);
    let at = |budget: u64| {
        ChainDp.plan(&Problem {
            graph: &graph,
            budget_bytes: budget,
            bandwidth: BANDWIDTH,
        })
    };
    let full = at(graph.store_all_peak()).expect("store-all budget fits");
    assert_eq!(full.report.recompute_time, 0.0);
    let half = graph.memory_floor() + (graph.store_all_peak() - graph.memory_floor()) / 2;
    let tight = at(half).expect("half-way budget fits a chain");
    assert!(tight.report.peak_bytes <= half);
    assert!(tight.report.recompute_time > 0.0);
}

#[test]
fn below_the_floor_is_over_budget_with_the_smallest_peak() {
    let mut rng = Rng(5);
    let graph = sequential_training_graph(&mut rng, 10);
    let budget = graph.memory_floor() - 1;
    match ChainDp.plan(&Problem {
        graph: &graph,
        budget_bytes: budget,
        bandwidth: BANDWIDTH,
    }) {
        Err(PlanError::OverBudget { best_peak, .. }) => {
            assert!(
                best_peak > budget && best_peak <= graph.store_all_peak(),
                "{best_peak}"
            )
        }
        other => panic!("expected over budget, got {other:?}"),
    }
}

#[test]
fn a_graph_with_a_skip_connection_is_not_a_chain() {
    let nodes = vec![
        node("a".into(), Phase::Forward, 1, 1, vec![]),
        node("b".into(), Phase::Forward, 1, 1, vec![0]),
        node("c".into(), Phase::Forward, 1, 1, vec![0, 1]),
        node("loss".into(), Phase::Backward, 1, 1, vec![2]),
    ];
    let graph = Graph::new("skip", nodes, 0, 1.0).unwrap();
    let err = ChainDp
        .plan(&Problem {
            graph: &graph,
            budget_bytes: 100,
            bandwidth: BANDWIDTH,
        })
        .unwrap_err();
    assert!(matches!(err, PlanError::NotApplicable { .. }), "{err}");
    assert!(err.to_string().contains("`c`"), "{err}");
}

#[test]
fn chain_dp_is_exact_only_when_its_memory_units_are_lossless() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Sizes of up to 1000 bytes: one byte per unit fits the table, so nothing is rounded.
    let graph = sequential_training_graph(&mut rng, 12);
    let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
    let problem = Problem {
        graph: &graph,
        budget_bytes: floor + (peak - floor) / 3,
        bandwidth: BANDWIDTH,
    };
    assert!(ChainDp.is_exact_for(&problem));
    let planned = ChainDp.plan(&problem).unwrap();
    let mut mapped = chain_of(&graph).unwrap();
    mapped.chain.unit_bytes = 1;
    let avail = problem.budget_bytes - graph.static_bytes();
    let optimum = solve_chain(&mapped.chain, avail as usize).unwrap();
    assert!((planned.report.total_time - optimum.time).abs() < 1e-9);
    // Scaled to GiB-sized tensors of odd sizes the lossless table would need billions of
    // units: the plan is then an approximation and is not claimed exact.
    // (Scaling alone would keep a common divisor: offsets break it.)
    let scaled: Vec<Node> = graph
        .nodes()
        .iter()
        .enumerate()
        .map(|(i, n)| Node {
            output_bytes: n.output_bytes * 1_000_003 + i as u64 % 7,
            ..n.clone()
        })
        .collect();
    let big = Graph::new("scaled", scaled, 1000, 1e-3).unwrap();
    let big_problem = Problem {
        graph: &big,
        budget_bytes: big.memory_floor() + (big.store_all_peak() - big.memory_floor()) / 3,
        bandwidth: BANDWIDTH,
    };
    assert!(!ChainDp.is_exact_for(&big_problem));
    let approx = ChainDp.plan(&big_problem).unwrap();
    assert!(approx.report.peak_bytes <= big_problem.budget_bytes);
}

#[test]
fn a_thousand_node_chain_is_declined_not_solved_coarsely() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let graph = sequential_training_graph(&mut rng, 500);
    assert!(graph.len() > 1000);
    let problem = Problem {
        graph: &graph,
        budget_bytes: graph.memory_floor() + (graph.store_all_peak() - graph.memory_floor()) / 2,
        bandwidth: BANDWIDTH,
    };
    // Within the work limit 500 stages leave only a few memory units, which would waste
    // most of the budget: the DP declines and the combined planner uses the others.
    match ChainDp.plan(&problem) {
        Err(PlanError::NotApplicable { why, .. }) => assert!(why.contains("500 stages"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(!ChainDp.is_exact_for(&problem));
    let best = remat_planner::request::plan(&problem, None, None, |_| {})
        .result
        .unwrap();
    assert!(best.report.peak_bytes <= problem.budget_bytes);
}
