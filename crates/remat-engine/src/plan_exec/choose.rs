//! Choosing the plan to execute: the fastest predicted plan under the budget among the
//! planner's strategies and the engine's own fixed policies expressed as plans, skipping
//! plans the executor refuses (see [`super::check_plan`]).

use remat_planner::attrs::tensor_attrs;
use remat_planner::lower::Helpers;
use remat_planner::problem::plan_from_decisions_with;
use remat_planner::{Decision, Plan, PlanError, Planned, Problem, Step};

use super::layout::{ItemKind, Layout};
use super::plan_fits_executor;
use crate::core::graph::Graph;

/// The op nodes a recorded graph keeps between forward and backward (its retention is
/// `Keep`): the checkpoint set of the engine policy it was recorded or marked with.
pub fn kept_nodes(graph: &Graph) -> Vec<bool> {
    graph
        .node_ids()
        .map(|id| {
            graph
                .retention(id)
                .is_ok_and(|r: crate::core::checkpoint::Retention| !r.is_checkpoint())
        })
        .collect()
}

/// One of the engine's fixed policies as a plan for the profiled step: the forward items
/// of the nodes it keeps are kept, the others dropped after their last forward use and
/// recomputed for backward, a replayed segment serving the whole backward of its nodes as
/// the engine's checkpointing does ([`Helpers::KeepNeeded`]). `kept` is indexed by engine
/// node ([`kept_nodes`] of a recording of the same step under the policy).
pub fn policy_plan(
    problem: &Problem,
    layout: &Layout,
    name: &str,
    kept: &[bool],
) -> Result<Planned, PlanError> {
    let attrs = tensor_attrs(problem.graph, problem.bandwidth);
    let mut decisions = vec![Decision::Keep; layout.len()];
    for (i, item) in layout.items().iter().enumerate() {
        let ItemKind::Forward { node } = item.kind else {
            continue;
        };
        if kept.get(node).copied().unwrap_or(true)
            || item.phase != remat_planner::Phase::Forward
            || layout.is_loss(node)
        {
            continue;
        }
        if let Some((drop_after, use_at)) = attrs.get(i).and_then(|a| a.idle) {
            decisions[i] = Decision::Recompute {
                from: Vec::new(),
                drop_after,
                use_at,
            };
        }
    }
    plan_from_decisions_with(problem, name, decisions, Helpers::KeepNeeded)
}

/// What happened to one candidate.
#[derive(Clone, Debug)]
pub struct Considered {
    pub name: String,
    /// Predicted step time (seconds) and peak, when the plan fits and can be executed.
    pub outcome: Result<(f64, u64), String>,
}

/// The chosen plan and every candidate considered.
#[derive(Clone, Debug)]
pub struct Choice {
    pub planned: Planned,
    pub considered: Vec<Considered>,
}

/// The fastest predicted plan under the budget among `strategy` (one registered planner
/// strategy) or, when `None`, every registered strategy, every `every:N` for N up to 8 and
/// the given fixed policies (name, kept engine nodes). Plans the executor refuses are
/// skipped. When nothing fits, [`PlanError::Infeasible`] names the smallest budget at which
/// a plan the executor runs was found (the peaks the candidates reported, tried in
/// ascending order, then the store-all peak).
///
/// `copy_cost` is the compute time a byte of swap traffic takes from the step (seconds per
/// byte, [`super::profile::CopyUnderCompute::compute_seconds_per_byte`]): the simulator
/// hides a swap behind compute when the bandwidth allows, but on a CPU the copies run on
/// the cores that compute, so every candidate's predicted time (`report.total_time`) is
/// charged for its swap-out and swap-in bytes before the candidates are compared.
pub fn choose_plan(
    problem: &Problem,
    layout: &Layout,
    strategy: Option<&str>,
    fixed: &[(String, Vec<bool>)],
    copy_cost: f64,
) -> Result<Choice, PlanError> {
    let candidates = Candidates {
        layout,
        strategy,
        fixed,
        copy_cost,
    };
    let round = choose_once(problem, &candidates)?;
    if let Some(planned) = round.best {
        return Ok(Choice {
            planned,
            considered: round.considered,
        });
    }
    let mut peaks = round.peaks;
    peaks.sort_unstable();
    peaks.dedup_by_key(|p| p.0);
    let store_all = problem.graph.store_all_peak();
    for (peak, _) in peaks
        .into_iter()
        .filter(|&(p, _)| p > problem.budget_bytes && p < store_all)
        .take(MAX_RETRIES)
    {
        let retry = Problem {
            budget_bytes: peak,
            ..*problem
        };
        if let Some(planned) = choose_once(&retry, &candidates)?.best {
            return Err(PlanError::Infeasible {
                budget: problem.budget_bytes,
                best_peak: peak,
                strategy: planned.plan.strategy,
            });
        }
    }
    Err(PlanError::Infeasible {
        budget: problem.budget_bytes,
        best_peak: store_all,
        strategy: "store-all".into(),
    })
}

/// Budgets tried when looking for the smallest feasible one.
const MAX_RETRIES: usize = 8;

struct Round {
    best: Option<Planned>,
    considered: Vec<Considered>,
    /// The smallest peak each over-budget candidate reported, with its name.
    peaks: Vec<(u64, String)>,
}

/// What [`choose_plan`] weighs, besides the problem.
struct Candidates<'a> {
    layout: &'a Layout,
    strategy: Option<&'a str>,
    fixed: &'a [(String, Vec<bool>)],
    copy_cost: f64,
}

/// Bytes a plan copies to the host and back: every swap-out and swap-in step's tensor.
pub fn swap_traffic(graph: &remat_planner::Graph, plan: &Plan) -> u64 {
    let nodes = graph.nodes();
    plan.steps
        .iter()
        .filter_map(|step| match *step {
            Step::SwapOut { tensor } | Step::SwapIn { tensor } => nodes.get(tensor),
            _ => None,
        })
        .map(|n| n.output_bytes)
        .sum()
}

fn choose_once(problem: &Problem, c: &Candidates) -> Result<Round, PlanError> {
    let Candidates {
        layout,
        strategy,
        fixed,
        copy_cost,
    } = *c;
    let mut candidates: Vec<(String, Result<Planned, PlanError>)> = Vec::new();
    match strategy {
        Some(name) => {
            let s = remat_planner::lookup(name)?;
            match s.plan(problem) {
                // The one strategy asked for cannot plan this graph: say why.
                Err(e) if !matches!(e, PlanError::OverBudget { .. }) => return Err(e),
                result => candidates.push((s.name(), result)),
            }
        }
        None => {
            let mut names = Vec::new();
            for s in remat_planner::registry() {
                names.push(s.name());
                candidates.push((s.name(), s.plan(problem)));
            }
            for n in 2..=8 {
                let name = format!("every:{n}");
                if !names.contains(&name)
                    && let Ok(s) = remat_planner::lookup(&name)
                {
                    candidates.push((name, s.plan(problem)));
                }
            }
            for (name, kept) in fixed {
                candidates.push((
                    format!("policy:{name}"),
                    policy_plan(problem, layout, &format!("policy:{name}"), kept),
                ));
            }
        }
    }
    let mut round = Round {
        best: None,
        considered: Vec::with_capacity(candidates.len()),
        peaks: Vec::new(),
    };
    for (name, result) in candidates {
        let outcome = match result {
            Ok(planned) if !plan_fits_executor(layout, &planned.plan) => {
                Err("drops a written gradient buffer".to_string())
            }
            Ok(mut planned) => {
                let traffic = swap_traffic(problem.graph, &planned.plan);
                planned.report.total_time += copy_cost.max(0.0) * traffic as f64;
                let r = &planned.report;
                let out = Ok((r.total_time, r.peak_bytes));
                if round
                    .best
                    .as_ref()
                    .is_none_or(|b| r.total_time < b.report.total_time)
                {
                    round.best = Some(planned);
                }
                out
            }
            Err(PlanError::OverBudget {
                best_peak,
                strategy,
                ..
            }) => {
                round.peaks.push((best_peak, strategy));
                Err(format!(
                    "over budget (its smallest peak: {})",
                    remat_units::human_bytes(best_peak)
                ))
            }
            Err(e) => Err(e.to_string()),
        };
        round.considered.push(Considered { name, outcome });
    }
    Ok(round)
}

/// Whether a recording of the step under another policy has the same nodes as `graph`
/// (names and order), so its kept set indexes `graph`'s layout.
pub fn same_nodes(graph: &Graph, other: &Graph) -> bool {
    graph.len() == other.len()
        && graph
            .node_ids()
            .zip(other.node_ids())
            .all(|(a, b)| graph.name(a).ok() == other.name(b).ok())
}
