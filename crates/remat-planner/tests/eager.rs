//! Property tests of the eager-order plan form (issue 30, item 4) on random training DAGs:
//! every plan the search or a single strategy returns for an eager request passes the
//! eager checks and the simulator under its budget and says its order; at a budget that
//! keeps everything the plan keeps everything; no plan goes under the eager floor; and
//! [`eager::conform`] puts any valid node-order schedule that evict makes into the form.

mod common;

use std::time::Duration;

use proptest::prelude::*;
use remat_planner::exact::evict::{Pass, evict_pass, weightings};
use remat_planner::request::{Outcome, RequestError, plan, plan_recompute_only, with_order};
use remat_planner::sim::Fate;
use remat_planner::{Graph, PlanOrder, Problem, Step, eager, registry, simulate};

/// `n` forward ops, each reading the previous one and sometimes an earlier one (a skip),
/// the loss and a mirrored backward (as `tests/prop_strategies.rs` builds them).
fn training_dag() -> impl Strategy<Value = Graph> {
    (3usize..9).prop_flat_map(|n| {
        (
            prop::collection::vec((1u64..64, 1u32..8, any::<u32>()), n),
            0u64..16,
        )
            .prop_map(|(layers, statics)| build(&layers, statics))
    })
}

fn build(layers: &[(u64, u32, u32)], static_bytes: u64) -> Graph {
    let graph = common::skip_chain(layers, static_bytes);
    with_order(graph, PlanOrder::Eager).expect("the graph has a backward")
}

/// A budget between the eager floor (0.0) and the store-all peak (1.0).
fn budget_at(graph: &Graph, share: f64) -> u64 {
    let floor = eager::floor(graph);
    let peak = graph.store_all_peak().max(floor);
    floor + ((peak - floor) as f64 * share) as u64
}

/// What every plan of an eager request must be.
fn assert_eager(graph: &Graph, budget: u64, outcome: Outcome) -> Result<(), TestCaseError> {
    let planned = match outcome.result {
        Ok(planned) => planned,
        // Nothing found under the budget is an answer; nothing under the floor is refused
        // before planning (checked apart).
        Err(RequestError::Infeasible { .. } | RequestError::SwapsNeeded { .. }) => return Ok(()),
        Err(other) => return Err(TestCaseError::fail(format!("{other}"))),
    };
    prop_assert_eq!(planned.plan.order, PlanOrder::Eager);
    if let Err(e) = eager::check(graph, &planned.plan.steps) {
        return Err(TestCaseError::fail(format!(
            "{e}: {:?}",
            planned.plan.steps
        )));
    }
    let report = simulate(graph, &planned.plan).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(report.peak_bytes <= budget);
    prop_assert!(report.peak_bytes >= eager::floor(graph));
    prop_assert_eq!(report, planned.report);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn every_searched_plan_is_eager_and_fits(graph in training_dag(), share in 0.0f64..1.0) {
        let budget = budget_at(&graph, share);
        let limit = Some(Duration::from_millis(40));
        for bandwidth in [1.0, 1e3] {
            let problem = Problem { graph: &graph, budget_bytes: budget, bandwidth };
            assert_eager(&graph, budget, plan(&problem, None, limit, |_| {}))?;
        }
        let problem = Problem { graph: &graph, budget_bytes: budget, bandwidth: 1e3 };
        assert_eager(&graph, budget, plan_recompute_only(&problem, None, limit, |_| {}))?;
    }

    #[test]
    fn every_strategy_plans_in_the_form(graph in training_dag(), share in 0.0f64..1.0) {
        let budget = budget_at(&graph, share);
        let problem = Problem { graph: &graph, budget_bytes: budget, bandwidth: 1e2 };
        for strategy in registry() {
            let name = strategy.name();
            let limit = Some(Duration::from_millis(30));
            let outcome = plan(&problem, Some(&name), limit, |_| {});
            // A strategy whose schedule has no eager form, or that does not apply, says so.
            if outcome.result.is_ok() {
                assert_eager(&graph, budget, outcome)?;
            }
        }
    }

    #[test]
    fn at_store_all_the_plan_keeps_everything(graph in training_dag()) {
        let budget = graph.store_all_peak().max(eager::floor(&graph));
        let problem = Problem { graph: &graph, budget_bytes: budget, bandwidth: 1.0 };
        let outcome = plan(&problem, None, Some(Duration::from_millis(40)), |_| {});
        let planned = outcome.result.map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(planned.report.overhead(), 0.0);
        prop_assert!(planned.report.fates.iter().all(|f| *f == Fate::Kept));
        let swaps = planned.plan.steps.iter().any(|s| matches!(s, Step::SwapOut { .. }));
        prop_assert!(!swaps);
        eager::check(&graph, &planned.plan.steps)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }

    #[test]
    fn under_the_eager_floor_nothing_is_tried(graph in training_dag()) {
        let floor = eager::floor(&graph);
        prop_assert!(floor >= graph.memory_floor());
        let problem = Problem { graph: &graph, budget_bytes: floor - 1, bandwidth: 1.0 };
        let refused = plan(&problem, None, None, |_| {}).result.unwrap_err();
        // The held values raise the floor of these graphs only sometimes: then the eager
        // floor is named, else the memory floor (the two are equal).
        let expected = if floor > graph.memory_floor() {
            RequestError::BelowEagerFloor { budget: floor - 1, floor }
        } else {
            RequestError::BelowFloor { budget: floor - 1, floor }
        };
        prop_assert_eq!(refused, expected);
    }

    /// Evict's passes on an eager graph keep held values, so the schedule is in the form
    /// as it comes; on the same graph unmarked, conform puts any fitting pass into it.
    #[test]
    fn conform_puts_node_order_schedules_into_the_form(
        graph in training_dag(),
        share in 0.0f64..1.0,
    ) {
        let budget = budget_at(&graph, share);
        let node_order = {
            let nodes = graph.nodes().to_vec();
            Graph::new("random", nodes, graph.static_bytes(), 1.0)
                .expect("valid")
                .with_fixed_order()
        };
        for weights in weightings().take(4) {
            if let Pass::Fits { steps, .. } = evict_pass(&graph, budget, weights) {
                eager::check(&graph, &steps).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            if let Pass::Fits { steps, .. } = evict_pass(&node_order, budget, weights) {
                let eager_steps = eager::conform(&graph, &steps)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                eager::check(&graph, &eager_steps)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let report = remat_planner::simulate_steps(&graph, &eager_steps, 1.0)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert!(report.peak_bytes >= eager::floor(&graph));
            }
        }
    }
}
