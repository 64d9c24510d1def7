//! Swaps only, Belady style: a plan for every budget that a fixed order's steps can hold,
//! in milliseconds at any size.
//!
//! Why. On large graphs whose profile is above the budget over most of the order
//! (random layered n=5,000 at 0.8 of its peak), recomputation sticks a few percent over the
//! budget: a copy needs its inputs, freed long before, so every copy pulls a chain of
//! ancestors with it. A swapped tensor needs nothing: it is copied to the host after a
//! reader, freed, and brought back before its next reader, whatever its inputs did. So
//! while some step's memory is above the budget, the tensor resident there with the most
//! bytes over the longest stretch of over-budget steps between two of its readers (the
//! farthest next use, as in Belady's replacement) is taken off the device for that gap.
//! Where the host link is fast this is often the best plan outright; where it is slow the
//! plan is slow, and the search keeps it only when nothing faster fits.
//!
//! Timing of one gap between uses at positions `a` and `b` of the order: `SwapOut` right
//! after the compute at `a`, `Free` after the compute at `a + 1` (the copy runs beside
//! it), `SwapIn` before the compute at `b - 1` (the copy back runs beside that one). The
//! tensor is off the device during the computes `a + 2 ..= b - 2`. The simulator's memory
//! changes only at the steps, not with the copies' timing, so the peak computed here is the
//! peak the simulator reports, at any bandwidth.

use crate::error::PlanError;
use crate::ir::{Graph, NodeId};
use crate::plan::{Decision, Step};
use crate::strategy::{Planned, Problem, plan_from_steps};

use super::order::positions;

/// One tensor off the device between its uses at positions `a` and `b` (`b >= a + 4`).
#[derive(Clone, Copy, Debug)]
struct Gap {
    tensor: NodeId,
    a: usize,
    b: usize,
}

impl Gap {
    /// The computes during which the tensor is off the device.
    fn off(&self) -> std::ops::RangeInclusive<usize> {
        self.a + 2..=self.b - 2
    }
}

/// The plan of `order` (a topological order of the graph) with swaps chosen until every
/// step fits the budget; an error naming the smallest peak reached when some step cannot
/// be lowered (every tensor resident there is read within two steps of it).
pub fn plan_swaps(problem: &Problem, order: &[NodeId], name: &str) -> Result<Planned, PlanError> {
    let graph = problem.graph;
    let pos = positions(order);
    let uses = uses_in_order(graph, &pos);
    let mut live = store_all_live(graph, order, &uses);
    let mut taken: Vec<Gap> = Vec::new();
    let mut gap_taken: Vec<Vec<bool>> = uses.iter().map(|u| vec![false; u.len()]).collect();
    while let Some((s, &peak)) = live
        .iter()
        .enumerate()
        .max_by_key(|&(k, &l)| (l, usize::MAX - k))
    {
        if peak <= problem.budget_bytes {
            break;
        }
        let (lo, hi) = over_run(&live, s, problem.budget_bytes);
        let Some((gap, index)) = best_gap(graph, &uses, &gap_taken, s, (lo, hi)) else {
            return Err(PlanError::OverBudget {
                strategy: name.into(),
                budget: problem.budget_bytes,
                best_peak: peak,
            });
        };
        gap_taken[gap.tensor][index] = true;
        let bytes = graph.node(gap.tensor).output_bytes;
        for k in gap.off() {
            live[k] -= bytes;
        }
        taken.push(gap);
    }
    let steps = steps_with_swaps(order, &uses, &taken);
    let decisions = decisions_of(graph, order, &taken);
    plan_from_steps(problem, name, steps, decisions)
}

/// For each tensor, the positions where it is made and read, ascending and distinct.
fn uses_in_order(graph: &Graph, pos: &[usize]) -> Vec<Vec<usize>> {
    (0..graph.len())
        .map(|v| {
            let mut at: Vec<usize> = graph.users(v).iter().map(|&u| pos[u]).collect();
            at.push(pos[v]);
            at.sort_unstable();
            at.dedup();
            at
        })
        .collect()
}

/// Live bytes during each compute of the store-all schedule of `order`, static included.
fn store_all_live(graph: &Graph, order: &[NodeId], uses: &[Vec<usize>]) -> Vec<u64> {
    let mut freed_at = vec![0u64; order.len()];
    for (v, at) in uses.iter().enumerate() {
        let last = *at.last().expect("a tensor is made somewhere");
        freed_at[last] += graph.node(v).output_bytes;
    }
    let mut live = graph.static_bytes();
    order
        .iter()
        .enumerate()
        .map(|(k, &v)| {
            live += graph.node(v).output_bytes;
            let during = live;
            live -= freed_at[k];
            during
        })
        .collect()
}

/// The run of consecutive over-budget steps around `s`.
fn over_run(live: &[u64], s: usize, budget: u64) -> (usize, usize) {
    let mut lo = s;
    while lo > 0 && live[lo - 1] > budget {
        lo -= 1;
    }
    let mut hi = s;
    while hi + 1 < live.len() && live[hi + 1] > budget {
        hi += 1;
    }
    (lo, hi)
}

/// The untaken gap off the device at step `s` removing the most bytes times over-budget
/// steps of `run`, with its index in the tensor's uses; pinned tensors stay (a pinned
/// tensor is accumulated into in place, see [`Graph::with_pinned`]).
fn best_gap(
    graph: &Graph,
    uses: &[Vec<usize>],
    gap_taken: &[Vec<bool>],
    s: usize,
    (lo, hi): (usize, usize),
) -> Option<(Gap, usize)> {
    let mut best: Option<(u128, Gap, usize)> = None;
    for (v, at) in uses.iter().enumerate() {
        // Resident at s with a gap around it: made at or before s - 2, used after s + 2.
        if at[0] + 2 > s || *at.last().expect("made somewhere") < s + 2 || graph.is_pinned(v) {
            continue;
        }
        let index = at.partition_point(|&p| p < s + 2) - 1;
        let gap = Gap {
            tensor: v,
            a: at[index],
            b: at[index + 1],
        };
        if gap_taken[v][index] || gap.b < gap.a + 4 || !gap.off().contains(&s) {
            continue;
        }
        let covered = (gap.b - 2).min(hi) + 1 - (gap.a + 2).max(lo);
        let score = graph.node(v).output_bytes as u128 * covered as u128;
        if best.is_none_or(|b| score > b.0) {
            best = Some((score, gap, index));
        }
    }
    best.map(|(_, gap, index)| (gap, index))
}

/// Computes in `order`, the gaps' swaps and frees, and each tensor freed after its last use.
fn steps_with_swaps(order: &[NodeId], uses: &[Vec<usize>], gaps: &[Gap]) -> Vec<Step> {
    let n = order.len();
    let (mut swap_in_before, mut swap_out_after, mut free_after) = (
        vec![Vec::new(); n],
        vec![Vec::new(); n],
        vec![Vec::new(); n],
    );
    for g in gaps {
        swap_out_after[g.a].push(g.tensor);
        free_after[g.a + 1].push(g.tensor);
        swap_in_before[g.b - 1].push(g.tensor);
    }
    for (v, at) in uses.iter().enumerate() {
        free_after[*at.last().expect("made somewhere")].push(v);
    }
    let mut steps = Vec::with_capacity(n * 2 + gaps.len() * 3);
    for (k, &v) in order.iter().enumerate() {
        steps.extend(
            swap_in_before[k]
                .iter()
                .map(|&t| Step::SwapIn { tensor: t }),
        );
        steps.push(Step::Compute { node: v });
        steps.extend(
            swap_out_after[k]
                .iter()
                .map(|&t| Step::SwapOut { tensor: t }),
        );
        steps.extend(free_after[k].iter().map(|&t| Step::Free { tensor: t }));
    }
    steps
}

/// Keep, or the first gap of each swapped tensor (the plan's steps hold every gap).
fn decisions_of(graph: &Graph, order: &[NodeId], gaps: &[Gap]) -> Vec<Decision> {
    let mut decisions = vec![Decision::Keep; graph.len()];
    for g in gaps {
        if matches!(decisions[g.tensor], Decision::Keep) {
            decisions[g.tensor] = Decision::Swap {
                swap_out_after: order[g.a],
                prefetch_at: order[g.b - 1],
                use_at: order[g.b],
            };
        }
    }
    decisions
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::layered::{LayeredParams, random_layered};

    fn problem(graph: &Graph, fraction: f64, bandwidth: f64) -> Problem<'_> {
        Problem {
            graph,
            budget_bytes: (graph.store_all_peak() as f64 * fraction) as u64,
            bandwidth,
        }
    }

    /// On random layered graphs at 0.8 and 0.6 of the peak, the swaps fit, the simulator
    /// reports the peak computed here, and nothing is recomputed.
    #[test]
    fn swaps_fit_where_the_simulator_says_so() {
        for seed in 0..3 {
            let g = random_layered(&LayeredParams::moccasin(300), seed).expect("valid");
            for fraction in [0.8, 0.6] {
                let p = problem(&g, fraction, 1e9);
                let planned =
                    plan_swaps(&p, &(0..g.len()).collect::<Vec<_>>(), "t").expect("swaps fit");
                assert!(planned.report.peak_bytes <= p.budget_bytes);
                assert_eq!(planned.report.recompute_time, 0.0);
                assert!(
                    planned
                        .plan
                        .steps
                        .iter()
                        .any(|s| matches!(s, Step::SwapOut { .. }))
                );
            }
        }
    }

    /// A budget no swap can reach (below what one step's own inputs and output need) is
    /// refused with the smallest peak reached.
    #[test]
    fn a_step_that_cannot_be_lowered_is_reported() {
        let g = random_layered(&LayeredParams::moccasin(120), 1).expect("valid");
        let p = Problem {
            graph: &g,
            budget_bytes: g.memory_floor().saturating_sub(1),
            bandwidth: 1e9,
        };
        match plan_swaps(&p, &(0..g.len()).collect::<Vec<_>>(), "t") {
            Err(PlanError::OverBudget { best_peak, .. }) => assert!(best_peak > p.budget_bytes),
            other => panic!("expected over budget, got {:?}", other.map(|p| p.report)),
        }
    }
}
