//! The annealing of copies (`solve::anneal_copies`) on a random layered graph at 0.9 of the
//! given order's peak: starting from the greedy's copies on the given order, the plan it
//! returns replays in the simulator within the budget, recomputes only, and costs no more
//! than the greedy's plan it started from (the phase only returns the cheapest fitting
//! sequence it saw, the start included).

use std::time::{Duration, Instant};

use remat_planner::Problem;
use remat_planner::solve::anneal_copies;
use remat_planner::solve::plan_with_copies;
use remat_planner::synth::{LayeredParams, random_layered};
use remat_planner::{NodeId, Step, simulate_steps};

#[test]
fn annealed_copies_on_a_500_node_layered_graph_replay_within_the_budget() {
    let graph = random_layered(&LayeredParams::moccasin(500), 2).expect("valid parameters");
    let budget = graph.store_all_peak() * 9 / 10;
    let problem = Problem {
        graph: &graph,
        budget_bytes: budget,
        bandwidth: 1.0,
    };
    let order: Vec<NodeId> = (0..graph.len()).collect();
    let far = Instant::now() + Duration::from_secs(120);
    let greedy = plan_with_copies(&problem, &order, far).expect("copies fit 0.9");
    let deadline = Instant::now() + Duration::from_millis(400);
    let annealed =
        anneal_copies::phase(&problem, Some(&greedy), &order, deadline).expect("a fitting plan");
    let replay = simulate_steps(&graph, &annealed.plan.steps, 1.0).expect("a valid schedule");
    assert!(
        replay.peak_bytes <= budget,
        "{} > {budget}",
        replay.peak_bytes
    );
    assert_eq!(replay.peak_bytes, annealed.report.peak_bytes);
    assert!(annealed.report.total_time <= greedy.report.total_time);
    assert!(
        annealed
            .plan
            .steps
            .iter()
            .all(|s| matches!(s, Step::Compute { .. } | Step::Free { .. }))
    );
}

/// With no plan to start from, the phase anneals the bare order: its own penalty has to
/// bring the sequence under the budget.
#[test]
fn annealing_from_the_bare_order_reaches_the_budget() {
    let graph = random_layered(&LayeredParams::moccasin(250), 3).expect("valid parameters");
    let budget = graph.store_all_peak() * 9 / 10;
    let problem = Problem {
        graph: &graph,
        budget_bytes: budget,
        bandwidth: 1.0,
    };
    let order: Vec<NodeId> = (0..graph.len()).collect();
    let deadline = Instant::now() + Duration::from_millis(500);
    let annealed = anneal_copies::phase(&problem, None, &order, deadline).expect("a fitting plan");
    let replay = simulate_steps(&graph, &annealed.plan.steps, 1.0).expect("a valid schedule");
    assert!(
        replay.peak_bytes <= budget,
        "{} > {budget}",
        replay.peak_bytes
    );
}
