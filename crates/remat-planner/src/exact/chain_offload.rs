//! The chain DP with offloading (`chain-offload`): recomputation and host offloading
//! combined, in the spirit of Beaumont et al.'s work on combining rematerialization and
//! offloading for chains.
//!
//! Some states are *offloaded checkpoints* `0 < c_1 < .. < c_{k-1}`: the forward sweep
//! copies each to the host as soon as it is computed and frees it after its one forward
//! reader, so it costs no device memory afterwards. The sweep runs up to a top boundary
//! `c_k`, kept on the device. The backward then runs segment by segment from the top,
//! `(c_k, n]`, `(c_{k-1}, c_k]`, .., `(0, c_1]`, each one by the recompute DP's `R(c, t, m)`
//! with its left state resident; while a segment runs, the checkpoint of the segment
//! below is prefetched, so its bytes come off that segment's memory and its copy hides
//! behind the segment's compute.
//!
//! The costs are the simulator's: a copy-out starts when its state is computed and the
//! sweep waits for it when it frees the state after the next forward step (so it is exposed
//! by `max(0, copy - fwd)`); a prefetch starts with its segment and the segment below waits
//! for it (exposed by `max(0, copy - segment time)`). Copies on each stream never overlap,
//! since each is waited for before the next starts. So with
//! `g(c, t)` = least time of segment `(c, t]` and every segment below it:
//!
//! - `g(0, t) = R(0, t, M)`;
//! - `g(c, t) = min over p < c` of `R(c, t, M_p) + max(0, copy(p) - R(..)) + out(p) + g(p, c)`,
//!   where `M_p` is the budget less `x_p`'s prefetched bytes (none for `p = 0`, the input)
//!   and `out(p)` the exposed copy-out of `x_p`;
//! - a boundary `c` whose backward group reads `x_c` may also stay resident after the
//!   segment above, so the segment below runs as `K(p, c, ..)` instead of recomputing it
//!   (`g` carries that flag);
//! - the plan's time is `min over c` of `fwd(1..=c) + g(c, n)`; `c = 0` is recompute-only.
//!
//! This is an O(n^3) search on top of one table fill. Memory is counted in the units of
//! `chain-dp` ([`super::chain_strategy::resolution`]); the forward sweep holds two states
//! at a time, which the simulator checks. The strategy returns the faster of this plan and
//! `chain-dp`'s, so it is never slower than recompute-only, and with no bandwidth no
//! offload pays off and the two coincide.

use std::time::Instant;

use super::chain::{ChainSolution, ChainTable, fill_chain};
use super::chain_graph::{GraphChain, chain_of, decisions_of};
use super::chain_strategy::{ChainDp, resolution};
use crate::error::PlanError;
use crate::plan::Step;
use crate::problem::{Planned, Problem, plan_from_steps};
use crate::strategy::Strategy;

pub const NAME: &str = "chain-offload";

/// The chain DP extended with offloaded checkpoints.
pub struct ChainOffload;

impl Strategy for ChainOffload {
    fn name(&self) -> String {
        NAME.into()
    }
    fn summary(&self) -> &'static str {
        "chain DP with offloaded checkpoints: recompute and swap combined (chain-shaped graphs)"
    }
    fn search_cost(&self) -> crate::strategy::SearchCost {
        crate::strategy::SearchCost::TABLE
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        combine(ChainDp.plan(problem), offload_plan(problem))
    }
    /// chain-dp's plan under the deadline, then the offloading table only when time is
    /// left (it fills one more table of the same size).
    fn plan_until(&self, problem: &Problem, deadline: Instant) -> Result<Planned, PlanError> {
        let recompute_only = ChainDp.plan_until(problem, deadline);
        let offloaded = if Instant::now() < deadline {
            offload_plan(problem)
        } else {
            None
        };
        combine(recompute_only, offloaded)
    }
}

/// The faster of the recompute-only and the offloading plan, named `chain-offload`.
fn combine(
    recompute_only: Result<Planned, PlanError>,
    offloaded: Option<Planned>,
) -> Result<Planned, PlanError> {
    let recompute_only = recompute_only.map(|p| rename(p, NAME));
    match (offloaded, recompute_only) {
        (Some(a), Ok(b)) if a.report.total_time < b.report.total_time => Ok(a),
        (_, Ok(b)) => Ok(b),
        (Some(a), Err(_)) => Ok(a),
        (None, Err(e)) => Err(match e {
            PlanError::OverBudget {
                budget, best_peak, ..
            } => PlanError::OverBudget {
                strategy: NAME.into(),
                budget,
                best_peak,
            },
            PlanError::NotApplicable { why, .. } => PlanError::NotApplicable {
                strategy: NAME.into(),
                why,
            },
            other => other,
        }),
    }
}

fn rename(mut planned: Planned, name: &str) -> Planned {
    planned.plan.strategy = name.to_string();
    planned
}

/// One segment of the backward: `(c, t]` run with `m` units while `prefetch` is copied in;
/// `keep_t`: `x_t` is still resident from the segment above (`K` instead of `R`).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Segment {
    c: usize,
    t: usize,
    m: usize,
    keep_t: bool,
    prefetch: usize,
}

/// The offloading plan, if one fits in the simulator.
fn offload_plan(problem: &Problem) -> Option<Planned> {
    let graph = problem.graph;
    let mut mapped = chain_of(graph).ok()?;
    let avail = problem.budget_bytes.checked_sub(graph.static_bytes())?;
    let res = resolution(&mapped.chain, avail).ok()?;
    mapped.chain.unit_bytes = if res.lossless {
        mapped.chain.lossless_unit()
    } else {
        avail.div_ceil(res.units as u64).max(1)
    };
    let units = mapped.chain.budget_units(avail);
    let table = fill_chain(&mapped.chain, units).ok()?;
    let copy =
        |k: usize| mapped.chain.state_bytes[k] as f64 / (problem.bandwidth * graph.time_unit_s());
    let segments = search(&mapped, &table, units, copy)?;
    if segments.len() < 2 {
        return None; // recompute-only: chain-dp's own plan covers it
    }
    let steps = lower(graph, &mapped, &table, &segments);
    let decisions = decisions_of(graph, &steps);
    plan_from_steps(problem, NAME, steps, decisions).ok()
}

/// The DP over segment boundaries; returns the segments, top first.
///
/// `g[keep][c][t]`: least time of segment `(c, t]` and all below it, `keep` saying that
/// `x_t` is resident at its start. A boundary `c` whose backward group reads `x_c` may stay
/// resident after the segment above (it was that segment's left state), sparing its
/// recomputation below at the cost of its bytes there.
fn search<M: super::chain::ChainModel>(
    mapped: &GraphChain,
    table: &ChainTable<'_, M>,
    units: usize,
    copy: impl Fn(usize) -> f64,
) -> Option<Vec<Segment>> {
    let chain = &mapped.chain;
    let n = chain.state_bytes.len() - 1;
    let kept = |k: usize| chain.state_bytes[k].div_ceil(chain.unit_bytes) as usize;
    let out = |p: usize| (copy(p) - chain.fwd_time[p + 1]).max(0.0);
    let budget_below = |p: usize| {
        let held = kept(0) + if p > 0 { kept(p) } else { 0 };
        units.checked_sub(held)
    };
    type Choice = (usize, bool);
    let mut g = vec![vec![vec![f64::INFINITY; n + 1]; n + 1]; 2];
    let mut choice: Vec<Vec<Vec<Choice>>> = vec![vec![vec![(usize::MAX, false); n + 1]; n + 1]; 2];
    for keep in [false, true] {
        for (t, cell) in g[usize::from(keep)][0].iter_mut().enumerate().skip(1) {
            *cell = table.time(keep, 0, t, units);
        }
    }
    for c in 1..n {
        for t in c + 1..=n {
            for keep in [false, true] {
                let k = usize::from(keep);
                for p in 0..c {
                    let Some(m) = budget_below(p) else { continue };
                    let seg = table.time(keep, c, t, m);
                    let (stall, offload) = if p > 0 {
                        ((copy(p) - seg).max(0.0), out(p))
                    } else {
                        (0.0, 0.0)
                    };
                    for keep_c in [false, chain.reads_output[c]] {
                        let total = seg + stall + offload + g[usize::from(keep_c)][p][c];
                        if total < g[k][c][t] {
                            g[k][c][t] = total;
                            choice[k][c][t] = (p, keep_c);
                        }
                    }
                }
            }
        }
    }
    let fwd_before = |c: usize| chain.fwd_time[1..=c].iter().sum::<f64>();
    let cost = |c: usize| fwd_before(c) + g[0][c][n];
    let top = (0..n)
        .filter(|&c| g[0][c][n].is_finite())
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))?;
    let mut segments = Vec::new();
    let (mut c, mut t, mut keep) = (top, n, false);
    loop {
        let (p, keep_c) = choice[usize::from(keep)][c][t];
        let m = if c == 0 { units } else { budget_below(p)? };
        segments.push(Segment {
            c,
            t,
            m,
            keep_t: keep,
            prefetch: if c == 0 { 0 } else { p },
        });
        if c == 0 {
            break;
        }
        (c, t, keep) = (p, c, keep_c);
    }
    Some(segments)
}

/// Plan steps: the forward sweep to the top boundary with copy-outs, then the segments
/// with their prefetches.
fn lower<M: super::chain::ChainModel>(
    graph: &crate::ir::Graph,
    mapped: &GraphChain,
    table: &ChainTable<'_, M>,
    segments: &[Segment],
) -> Vec<Step> {
    let node = |k: usize| mapped.forward[k - 1];
    let top = segments.first().map_or(0, |s| s.c);
    let offloaded: Vec<usize> = segments
        .iter()
        .map(|s| s.prefetch)
        .filter(|&p| p > 0)
        .collect();
    let mut steps = Vec::new();
    for j in 1..=top {
        steps.push(Step::Compute { node: node(j) });
        if offloaded.contains(&j) {
            // Start the copy now so it overlaps the next forward step.
            steps.push(Step::SwapOut { tensor: node(j) });
        }
        if j > 1 {
            steps.push(Step::Free {
                tensor: node(j - 1),
            });
        }
    }
    for (i, seg) in segments.iter().enumerate() {
        if seg.prefetch > 0 {
            steps.push(Step::SwapIn {
                tensor: node(seg.prefetch),
            });
        }
        let solution = ChainSolution {
            time: 0.0,
            steps: table.schedule(seg.keep_t, seg.c, seg.t, seg.m),
            recomputations: 0,
        };
        steps.extend(mapped.steps(graph, &solution));
        // The left state stays only if the segment below keeps it as its `x_t`.
        let kept_below = segments.get(i + 1).is_some_and(|below| below.keep_t);
        if seg.c > 0 && !kept_below {
            steps.push(Step::Free {
                tensor: node(seg.c),
            });
        }
    }
    steps
}

#[cfg(test)]
mod tests;
