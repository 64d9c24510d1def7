//! Recomputations inserted into an order on a random layered graph where the store-all
//! profile is above the budget over most of the sequence (0.8 of the given order's peak),
//! the case the copies with the inputs they miss are for. The plan is replayed by the
//! simulator, independently of the solver's own check.

use std::time::{Duration, Instant};

use remat_planner::Problem;
use remat_planner::solve::plan_with_copies;
use remat_planner::synth::{LayeredParams, random_layered};
use remat_planner::{NodeId, Step, simulate_steps};

#[test]
fn copies_fit_a_2000_node_layered_graph_at_0_8_and_replay_within_the_budget() {
    let graph = random_layered(&LayeredParams::moccasin(2000), 1).expect("valid parameters");
    let budget = graph.store_all_peak() * 8 / 10;
    let problem = Problem {
        graph: &graph,
        budget_bytes: budget,
        bandwidth: 1.0,
    };
    let order: Vec<NodeId> = (0..graph.len()).collect();
    // A generous deadline: it only keeps a broken search from running forever.
    let deadline = Instant::now() + Duration::from_secs(120);
    let planned = plan_with_copies(&problem, &order, deadline).expect("copies fit 0.8");
    let replay = simulate_steps(&graph, &planned.plan.steps, 1.0).expect("a valid schedule");
    assert!(
        replay.peak_bytes <= budget,
        "{} > {budget}",
        replay.peak_bytes
    );
    assert_eq!(replay.peak_bytes, planned.report.peak_bytes);
    assert!(replay.recompute_time > 0.0);
    // Recompute only: nothing swapped.
    assert!(
        planned
            .plan
            .steps
            .iter()
            .all(|s| matches!(s, Step::Compute { .. } | Step::Free { .. }))
    );
}
