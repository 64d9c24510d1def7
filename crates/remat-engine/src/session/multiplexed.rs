//! `--policy auto:multiplexed[-search]` with K models: the K-model step planned as one
//! multiplexed graph (`remat_planner::multi`): the models' steps interleaved (model i's
//! backward beside model i+1's forward), then MuTWO's Algorithm C (`multiplexed`) or the
//! anytime search (`multiplexed-search`) on that order, so that one model's swap-in can
//! hide behind another model's compute. The plan's steps name the profiled graph's own
//! nodes, so the engine's plan executor runs it as any other plan.

use remat_planner::Planned;
use remat_planner::multi::{MultiPlanned, MultiRequest, Multiplexed};

use super::error::{During, Result};
use crate::core::graph::Graph;
use crate::plan_exec::profile::StepProfile;
use crate::plan_exec::{Considered, check_plan};

/// `--policy auto:NAME` names that take this route, with the planner strategy each runs on
/// the interleaved order (`None`: the anytime search).
pub const STRATEGIES: [(&str, Option<&str>); 2] =
    [("multiplexed", Some("mutwo")), ("multiplexed-search", None)];

/// The planner strategy of a multiplexed `--policy auto:NAME`, or `None` when `name` is
/// not one (an ordinary strategy).
pub fn inner_strategy(name: &str) -> Option<Option<&'static str>> {
    STRATEGIES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, inner)| inner)
}

/// Plans the profiled K-model step of `graph` as a multiplexed graph, labelling every
/// planner node with its model, and checks that the engine can execute the plan.
pub fn plan(
    graph: &Graph,
    profile: &StepProfile,
    budget: u64,
    bandwidth: f64,
    inner: Option<&str>,
) -> Result<(MultiPlanned, Planned, Vec<Considered>)> {
    let owners = profile.node_owners(graph);
    let multi = Multiplexed::from_labels(profile.graph.clone(), owners)
        .during("labelling the profiled step by model")?;
    let mut request = MultiRequest::new(budget, bandwidth);
    request.strategy = inner.map(String::from);
    let planned = remat_planner::multi::plan(&multi, &request)
        .during("planning the K models as one multiplexed step")?;
    check_plan(&profile.layout, &planned.plan.steps)
        .during("the multiplexed plan cannot run on the engine")?;
    let single = Planned {
        plan: planned.plan.clone(),
        report: planned.report.clone(),
    };
    let considered = vec![Considered {
        name: format!("multiplexed {}", inner.unwrap_or("search")),
        outcome: Ok((planned.report.total_time, planned.report.peak_bytes)),
    }];
    Ok((planned, single, considered))
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_the_multiplexed_names_take_this_route() {
        assert_eq!(super::inner_strategy("multiplexed"), Some(Some("mutwo")));
        assert_eq!(super::inner_strategy("multiplexed-search"), Some(None));
        assert_eq!(super::inner_strategy("mutwo"), None);
    }
}
