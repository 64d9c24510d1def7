//! `remat train --models K --policy auto:multiplexed[-search]`: the K-model step planned
//! as one multiplexed graph (`remat_planner::multi`): the models' steps interleaved (model
//! i's backward beside model i+1's forward), then MuTWO's Algorithm C (`multiplexed`) or
//! the anytime search (`multiplexed-search`) on that order, so that one model's swap-in
//! can hide behind another model's compute. The plan's steps name the profiled graph's own
//! nodes, so the engine's plan executor runs it as any other plan.

use anyhow::Context;
use remat_engine::graph::Graph;
use remat_engine::plan_exec::{Considered, check_plan};
use remat_engine::profile::StepProfile;
use remat_planner::Planned;
use remat_planner::multi::{MultiPlanned, MultiRequest, Multiplexed};

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
) -> anyhow::Result<(MultiPlanned, Planned, Vec<Considered>)> {
    let owners = profile.node_owners(graph);
    let multi = Multiplexed::from_labels(profile.graph.clone(), owners)
        .context("labelling the profiled step by model")?;
    let mut request = MultiRequest::new(budget, bandwidth);
    request.strategy = inner.map(String::from);
    let planned = remat_planner::multi::plan(&multi, &request)
        .context("planning the K models as one multiplexed step")?;
    check_plan(&profile.layout, &planned.plan.steps)
        .context("the multiplexed plan cannot run on the engine")?;
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

/// Which model's compute ran while each swap copied, and what stayed exposed (simulated,
/// in ms): the multiplexed plan's hiding, one line per swapped tensor (at most `max`).
pub fn hiding_lines(planned: &MultiPlanned, max: usize) -> Vec<String> {
    let model = |m: Option<usize>| m.map_or("shared".to_string(), |m| format!("model {m}"));
    let mut lines = vec![format!(
        "  multiplexed plan: {} swaps; simulated exposed stall per model: {}",
        planned.swaps.len(),
        planned
            .models
            .iter()
            .map(|s| format!("{} {:.2} ms", model(s.model), s.stall_time * 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    )];
    for s in planned.swaps.iter().take(max) {
        let by = s
            .in_hidden_by
            .iter()
            .map(|&(m, t)| format!("{} {:.2} ms", model(m), t * 1e3))
            .collect::<Vec<_>>();
        lines.push(format!(
            "    {} ({}, {} B): copy back hidden by {}; exposed {:.2} ms",
            s.name,
            model(s.model),
            s.bytes,
            if by.is_empty() {
                "nothing".to_string()
            } else {
                by.join(", ")
            },
            s.exposed * 1e3
        ));
    }
    if planned.swaps.len() > max {
        lines.push(format!("    ... {} more", planned.swaps.len() - max));
    }
    lines
}
