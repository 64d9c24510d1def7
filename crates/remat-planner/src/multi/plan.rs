//! Planning K models together: a strategy runs on the combined graph renumbered in an
//! [`Order`], and its plan is mapped back onto the given graph's nodes.
//!
//! With [`MultiRequest::mutwo`] this is MuTWO (Algorithm B, Algorithm C for the swap
//! overhead) over the interleaved order: Algorithm C walks a prefetch's prompt back from the tensor's
//! first backward use over the nodes that run before it, which in the interleaved order are
//! the other models' forward and backward nodes as well as the model's own, and stops at
//! the peak interval; so a swap of one model is hidden behind another model's compute, as
//! in the paper's multi-model setting. Any registered strategy can be asked for by name, and
//! without one ([`MultiRequest::new`]) the anytime search (every strategy, MuTWO's included,
//! then the general solver) plans the combined graph like any other graph and keeps the
//! fastest plan. The renumbered graph keeps the given graph's order mark: when the order is
//! fixed, the general solver keeps the interleaved order too; otherwise it may choose its
//! own memory-aware order, still checked by the simulator on the given graph.

use std::time::Duration;

use super::report::{ModelStall, SwapHiding, explain};
use super::{Interleaving, MultiError, Multiplexed, Order};
use crate::ir::Graph;
use crate::plan::{PLAN_FORMAT_VERSION, Plan, PlanOrder};
use crate::problem::{Planned, Problem};
use crate::request;
use crate::search::SearchProgress;
use crate::sim::{SimReport, simulate_traced};
use crate::solve::bound::Bound;

/// What to plan the K models for.
#[derive(Clone, Debug, PartialEq)]
pub struct MultiRequest {
    /// Device bytes for the K models together, static memory included.
    pub budget_bytes: u64,
    /// Host-device bandwidth in bytes per second, each direction.
    pub bandwidth: f64,
    /// How the models' steps are merged (default [`Order::Interleaved`]).
    pub order: Order,
    /// A strategy by registry name (`mutwo` for MuTWO's Algorithms B and C alone), or
    /// `None` (the default) for the anytime search: every strategy, MuTWO's included, then
    /// the general solver improving on the best, as for one graph.
    pub strategy: Option<String>,
    /// The search's (and the `anytime` strategy's) time limit; default by graph size.
    pub time_limit: Option<Duration>,
}

impl MultiRequest {
    /// The anytime search over the interleaved order at `budget_bytes` and `bandwidth`.
    pub fn new(budget_bytes: u64, bandwidth: f64) -> MultiRequest {
        MultiRequest {
            budget_bytes,
            bandwidth,
            order: Order::Interleaved,
            strategy: None,
            time_limit: None,
        }
    }

    /// [`MultiRequest::new`] with MuTWO's Algorithms B and C alone (no search).
    pub fn mutwo(budget_bytes: u64, bandwidth: f64) -> MultiRequest {
        MultiRequest {
            strategy: Some("mutwo".into()),
            ..MultiRequest::new(budget_bytes, bandwidth)
        }
    }
}

/// A plan for K models together.
#[derive(Clone, Debug)]
pub struct MultiPlanned {
    /// An ordinary plan over the given graph's nodes ([`Multiplexed::graph`]).
    pub plan: Plan,
    /// The simulator's replay of `plan` on the given graph.
    pub report: SimReport,
    pub order: Order,
    /// Every swap: its tensor and model, which models' compute overlapped its copies, and
    /// what it stalled the step.
    pub swaps: Vec<SwapHiding>,
    /// Each model's compute, recompute and stall (one per model, then one for the shared
    /// nodes when there are any). The stalls sum to `report.stall_time`.
    pub models: Vec<ModelStall>,
    /// A lower bound on the overhead of any schedule of the renumbered graph at this budget.
    pub bound: Option<Bound>,
}

/// Plans the K models of `multi` together (see the module docs).
pub fn plan(multi: &Multiplexed, request: &MultiRequest) -> Result<MultiPlanned, MultiError> {
    plan_with_progress(multi, request, |_| {})
}

/// [`plan()`], calling `progress` as a search goes.
pub fn plan_with_progress(
    multi: &Multiplexed,
    request: &MultiRequest,
    progress: impl FnMut(&SearchProgress),
) -> Result<MultiPlanned, MultiError> {
    let floor = multi.floor();
    if request.budget_bytes < floor {
        return Err(MultiError::BelowFloor {
            budget: request.budget_bytes,
            floor,
            models: multi.models(),
        });
    }
    let order = multi.interleave(request.order)?;
    let problem = Problem {
        graph: order.graph(),
        budget_bytes: request.budget_bytes,
        bandwidth: request.bandwidth,
    };
    let outcome = request::plan(
        &problem,
        request.strategy.as_deref(),
        request.time_limit,
        progress,
    );
    let planned = outcome.result.map_err(|error| MultiError::Plan {
        models: multi.models(),
        error,
    })?;
    let plan = to_given(multi.graph(), &order, &planned);
    let (report, trace) = simulate_traced(multi.graph(), &plan.steps, plan.bandwidth_bytes_per_s)
        .map_err(|error| MultiError::Replay { error })?;
    let (swaps, models) = explain(multi, &plan.steps, &trace);
    Ok(MultiPlanned {
        plan,
        report,
        order: request.order,
        swaps,
        models,
        bound: outcome.bound,
    })
}

/// The plan of the renumbered graph as a plan of the given graph.
fn to_given(given: &Graph, order: &Interleaving, planned: &Planned) -> Plan {
    let mut plan = Plan {
        version: PLAN_FORMAT_VERSION,
        graph: given.name().to_string(),
        node_count: given.len(),
        strategy: planned.plan.strategy.clone(),
        budget_bytes: planned.plan.budget_bytes,
        bandwidth_bytes_per_s: planned.plan.bandwidth_bytes_per_s,
        order: PlanOrder::Free,
        steps: order.to_given(&planned.plan.steps),
        decisions: order.decisions_to_given(&planned.plan.decisions),
    };
    // The merged order is the given graph's own only when it runs no node early.
    if !plan.reorders() {
        plan.order = PlanOrder::of(given);
    }
    plan
}

/// The baseline MuTWO's multiplexing is measured against: each graph planned alone at the
/// same budget (the K models trained one after another, each with the whole device), with
/// the request's strategy. The order in the request does not apply to one model.
pub fn plan_each_alone(
    graphs: &[Graph],
    request: &MultiRequest,
) -> Result<Vec<Planned>, MultiError> {
    graphs
        .iter()
        .enumerate()
        .map(|(model, graph)| {
            let problem = Problem {
                graph,
                budget_bytes: request.budget_bytes,
                bandwidth: request.bandwidth,
            };
            request::plan(
                &problem,
                request.strategy.as_deref(),
                request.time_limit,
                |_| {},
            )
            .result
            .map_err(|error| MultiError::Alone {
                model,
                name: graph.name().to_string(),
                error,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::graph::tests::tiny;
    use super::*;
    use crate::sim::simulate;

    #[test]
    fn a_plan_names_the_given_nodes_and_replays_within_the_budget() {
        let m = Multiplexed::union(&[tiny("a", 10, 5), tiny("b", 10, 5)]).unwrap();
        let interleaved = m.interleave(Order::Interleaved).unwrap();
        let peak = interleaved.graph().store_all_peak();
        for strategy in ["mutwo", "mutwo-refined", "recompute-all"] {
            let request = MultiRequest {
                strategy: Some(strategy.into()),
                ..MultiRequest::new(peak - 10, 1.0)
            };
            let planned = plan(&m, &request).unwrap();
            assert_eq!(planned.plan.graph, "a+b");
            assert_eq!(planned.plan.node_count, 10);
            let replay = simulate(m.graph(), &planned.plan).unwrap();
            assert!(replay.peak_bytes <= peak - 10, "{strategy}");
            assert_eq!(replay.peak_bytes, planned.report.peak_bytes);
            let stalls: f64 = planned.models.iter().map(|s| s.stall_time).sum();
            assert!((stalls - replay.stall_time).abs() < 1e-9, "{strategy}");
        }
    }

    #[test]
    fn a_budget_below_the_floor_of_the_models_together_names_it() {
        let m = Multiplexed::union(&[tiny("a", 10, 5), tiny("b", 10, 5)]).unwrap();
        // Floor: 10 static plus b1 with its two inputs (30 bytes).
        let err = plan(&m, &MultiRequest::mutwo(39, 1.0)).unwrap_err();
        assert_eq!(
            err,
            MultiError::BelowFloor {
                budget: 39,
                floor: 40,
                models: 2
            }
        );
        let text = err.to_string();
        assert!(
            text.contains("39 B is below the floor of the 2 models together, 40 B"),
            "{text}"
        );
        // At the floor itself the search finds a plan.
        let planned = plan(&m, &MultiRequest::new(40, 1.0)).unwrap();
        assert_eq!(planned.report.peak_bytes, 40);
    }

    #[test]
    fn unknown_strategies_and_impossible_budgets_are_plan_errors() {
        let m = Multiplexed::union(&[tiny("a", 10, 5), tiny("b", 10, 5)]).unwrap();
        let request = MultiRequest {
            strategy: Some("no-such".into()),
            ..MultiRequest::new(1000, 1.0)
        };
        let err = plan(&m, &request).unwrap_err();
        assert!(err.to_string().contains("no-such"), "{err}");
        assert!(matches!(err, MultiError::Plan { models: 2, .. }));
    }
}
