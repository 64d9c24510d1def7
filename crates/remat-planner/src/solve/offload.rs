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
//! it), `SwapIn` before the compute at `b - 1` (the copy back runs beside that one); or,
//! where a copy takes longer than one compute, as many computes each way as the copy
//! takes (both are planned, the faster plan kept). The simulator's memory
//! changes only at the steps, not with the copies' timing, so the peak computed here is the
//! peak the simulator reports, at any bandwidth.

use crate::error::PlanError;
use crate::ir::{Graph, NodeId};
use crate::plan::{Decision, Step};
use crate::problem::{Planned, Problem, plan_from_steps};

use super::order::{Evaluator, Searched, positions};

/// One tensor off the device between its uses at positions `a` and `b`: copied out after
/// the compute at `a`, freed after the compute at `free_after`, copied back before the
/// compute at `back_before` (`a <= free_after < back_before - 1 < b`).
#[derive(Clone, Copy, Debug)]
struct Gap {
    tensor: NodeId,
    a: usize,
    b: usize,
    free_after: usize,
    back_before: usize,
}

impl Gap {
    /// The computes during which the tensor is off the device.
    fn off(&self) -> std::ops::RangeInclusive<usize> {
        self.free_after + 1..=self.back_before - 1
    }
}

/// Where a gap's free and copy back go.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Timing {
    /// Freed right after the copy out, copied back right before the use: the compute waits
    /// for both copies, but a tensor read two steps apart can leave the device between
    /// (what a budget near the floor needs).
    Immediate,
    /// One compute each way: the most bytes off the device, stalls where a copy takes
    /// longer than that compute.
    OneCompute,
    /// As many computes each way as the copy takes at the problem's bandwidth (by the
    /// graph's compute times), so the copies hide behind compute: fewer bytes off per gap.
    CopyTime,
}

/// Running sums of the compute times along an order, and the copy time per byte, to place
/// a gap's free and copy back.
struct Clock {
    /// `sum[k]`: compute time of positions `0..k`.
    sum: Vec<f64>,
    per_byte: f64,
    timing: Timing,
}

impl Clock {
    fn of(problem: &Problem, order: &[NodeId], timing: Timing) -> Clock {
        let graph = problem.graph;
        let mut sum = Vec::with_capacity(order.len() + 1);
        let mut t = 0.0;
        sum.push(t);
        for &v in order {
            t += graph.node(v).compute_time;
            sum.push(t);
        }
        Clock {
            sum,
            per_byte: 1.0 / (problem.bandwidth * graph.time_unit_s()),
            timing,
        }
    }

    /// The gap of `tensor` between its uses at `a` and `b`, if any compute is left off.
    fn gap(&self, tensor: NodeId, bytes: u64, a: usize, b: usize) -> Option<Gap> {
        let (free_after, back_before) = match self.timing {
            Timing::Immediate => (a, b),
            Timing::OneCompute => (a + 1, b.checked_sub(1)?),
            Timing::CopyTime => {
                let copy = bytes as f64 * self.per_byte;
                // The first compute after `a` by whose end the copy out is done...
                let start = self.sum[a + 1];
                let f = self.sum.partition_point(|&t| t < start + copy).max(a + 2) - 1;
                // ...and the last compute before `b` from whose start the copy back ends.
                let end = self.sum[b];
                let s = self.sum.partition_point(|&t| t <= end - copy).min(b);
                (f, s.checked_sub(1)?.min(b - 1))
            }
        };
        (free_after + 2 <= back_before && back_before <= b).then_some(Gap {
            tensor,
            a,
            b,
            free_after,
            back_before,
        })
    }
}

/// The plan of `order` (a topological order of the graph) with swaps chosen until every
/// step fits the budget, the fastest of the timings (`Timing`) that fit; an error naming the
/// smallest peak reached when none fits (some step where every tensor resident is read
/// right before or after it).
pub fn plan_swaps(problem: &Problem, order: &[NodeId], name: &str) -> Result<Planned, PlanError> {
    let graph = problem.graph;
    let uses = uses_in_order(graph, &positions(order));
    // The store-all profile of the order, as the order search keeps it.
    let mut eval = Evaluator::new(graph, problem.budget_bytes);
    let store_all = Searched::new(order.to_vec(), &mut eval);
    let mut best: Option<Result<Planned, PlanError>> = None;
    for timing in [Timing::CopyTime, Timing::OneCompute, Timing::Immediate] {
        let clock = Clock::of(problem, order, timing);
        let live = store_all.live().to_vec();
        let planned = plan_swaps_timed(problem, order, name, &clock, &uses, live);
        best = Some(match (best, planned) {
            (Some(Ok(b)), Ok(p)) if p.report.total_time < b.report.total_time => Ok(p),
            (Some(Ok(b)), _) => Ok(b),
            (_, planned) => planned,
        });
    }
    best.expect("timings tried")
}

/// Swaps chosen with one placement of the gaps (`clock`), from the store-all `live` bytes
/// of each step of `order` and each tensor's `uses` there.
fn plan_swaps_timed(
    problem: &Problem,
    order: &[NodeId],
    name: &str,
    clock: &Clock,
    uses: &[Vec<usize>],
    mut live: Vec<u64>,
) -> Result<Planned, PlanError> {
    let graph = problem.graph;
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
        let Some((gap, index)) = best_gap(graph, clock, uses, &gap_taken, s, (lo, hi)) else {
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
    let steps = steps_with_swaps(order, uses, &taken);
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
    clock: &Clock,
    uses: &[Vec<usize>],
    gap_taken: &[Vec<bool>],
    s: usize,
    (lo, hi): (usize, usize),
) -> Option<(Gap, usize)> {
    let mut best: Option<(u128, Gap, usize)> = None;
    for (v, at) in uses.iter().enumerate() {
        // Resident at s with a gap around it: made before s, used after s.
        if at[0] >= s || *at.last().expect("made somewhere") <= s || graph.is_pinned(v) {
            continue;
        }
        // The uses just before and after s (s itself is not a use: then nothing is off).
        let index = at.partition_point(|&p| p < s) - 1;
        if at[index + 1] == s {
            continue;
        }
        // In the eager order a held value leaves only after its holder, and a backward
        // value never (see [`crate::eager`]); positions are node ids there (node order).
        if !graph.eager_may_leave(v, at[index])
            || (graph.order_is_eager() && graph.node(v).phase == crate::ir::Phase::Backward)
        {
            continue;
        }
        let bytes = graph.node(v).output_bytes;
        let Some(gap) = clock.gap(v, bytes, at[index], at[index + 1]) else {
            continue;
        };
        if gap_taken[v][index] || !gap.off().contains(&s) {
            continue;
        }
        let off = gap.off();
        let covered = (*off.end()).min(hi) + 1 - (*off.start()).max(lo);
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
        free_after[g.free_after].push(g.tensor);
        swap_in_before[g.back_before].push(g.tensor);
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
                prefetch_at: order[g.back_before],
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

    /// A chain 0 -> 1 -> ... -> 13 whose last node 14 also reads node 0 (100 bytes), with
    /// nodes 6 and 7 large, so steps 6-8 are above a budget of 150 bytes; every compute takes
    /// one unit and a copy of node 0 two and a half. One compute each way stalls at both
    /// copies; the copy-time placement frees node 0 after compute 4 and brings it back
    /// before compute 11, still clear of steps 6-8, with no stall, and is the plan kept.
    #[test]
    fn copies_longer_than_a_compute_are_spread_over_enough_computes() {
        use crate::ir::{Node, Phase};
        let node = |bytes: u64, inputs: Vec<NodeId>| Node {
            name: format!("n{}", inputs.first().map_or(0, |i| i + 1)),
            phase: Phase::Forward,
            compute_time: 1.0,
            output_bytes: bytes,
            inputs,
        };
        let mut nodes = vec![node(100, vec![])];
        for k in 1..=13 {
            nodes.push(node(if k == 6 || k == 7 { 50 } else { 10 }, vec![k - 1]));
        }
        nodes.push(node(1, vec![0, 13]));
        let g = Graph::new("chain", nodes, 0, 1.0).expect("valid");
        let p = Problem {
            graph: &g,
            budget_bytes: 150,
            bandwidth: 40.0,
        };
        let order: Vec<NodeId> = (0..g.len()).collect();
        let uses = uses_in_order(&g, &positions(&order));
        let live = Searched::new(order.clone(), &mut Evaluator::new(&g, 150))
            .live()
            .to_vec();
        let clock = Clock::of(&p, &order, Timing::OneCompute);
        let one = plan_swaps_timed(&p, &order, "t", &clock, &uses, live).expect("fits");
        assert!(one.report.stall_time > 0.0, "{:?}", one.report);
        let planned = plan_swaps(&p, &order, "t").expect("fits");
        assert_eq!(planned.report.stall_time, 0.0, "{:?}", planned.report);
        assert!(planned.report.peak_bytes <= 150);
        let at = |step: Step| planned.plan.steps.iter().position(|&s| s == step);
        let free = at(Step::Free { tensor: 0 }).expect("node 0 freed");
        assert_eq!(at(Step::Compute { node: 4 }).map(|c| c + 1), Some(free));
        let back = at(Step::SwapIn { tensor: 0 }).expect("node 0 back");
        assert_eq!(at(Step::Compute { node: 11 }), Some(back + 1));
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
