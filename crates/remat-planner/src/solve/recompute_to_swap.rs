//! Recomputations a copy can replace: a plan's last pass when swaps are allowed.
//!
//! Why. Near the floor the eviction passes recompute nearly the whole forward in the
//! backward, and swap only what they cannot rebuild. Over a link that is slow next to
//! compute (a transformer at 32 GB/s: a matmul's output copies in about 12 times its
//! recomputation) most recomputations are the right choice, but not all: the forward's
//! compute hides some copies out for free, and a tensor whose recomputation is long for its
//! bytes (attention's weighted values, a projection) can come back over the link while the
//! backward computes, if memory has room for it during the copy. Replacing its
//! recomputation also drops the recomputations that only fed it (its rebuild chain).
//!
//! How. Tensors recomputed by the plan, costliest recomputation per copy time first: copy
//! the tensor out right after its first computation (its `Free` waits for the copy), and
//! replace each recomputation by a copy back issued as early as memory allows (the device
//! bytes of every step it crosses, plus the tensor's, within the budget) and no earlier
//! than needed to hide the copy behind the computations it crosses. Then the
//! recomputations whose output nothing reads any more are dropped, with their `Free`, up
//! the chain. The plan's copies back are then issued by their readers' deadlines
//! ([`super::prefetch`]: the new copy may queue behind the others on the stream), its
//! copies out by the deadlines of their frees ([`super::copies_out`]; outside the eager
//! order, 8 layers + 50% at 32 GB/s: 26.09 -> 25.75%), and the simulator judges each change; one that is not faster, or not within the budget, is
//! undone. A change frees or takes memory elsewhere, so the candidates are ranked again and
//! tried in rounds until a round changes nothing. Pinned tensors and tensors the plan
//! already swaps are left alone.

use std::time::Instant;

use crate::eager;
use crate::ir::{Graph, NodeId};
use crate::plan::{Step, splice};
use crate::problem::{Planned, Problem, plan_from_steps};
use crate::sim::SimReport;

/// `planned` with some recomputations replaced by copies (see the module docs), when that
/// is faster within the budget; `None` when no replacement helped. Stops at `deadline`
/// (after one candidate at least).
pub fn replace_recomputations(
    problem: &Problem,
    planned: &Planned,
    name: &str,
    deadline: Instant,
) -> Option<Planned> {
    let graph = problem.graph;
    let per_byte = 1.0 / (problem.bandwidth * graph.time_unit_s());
    let mut best: Option<Planned> = None;
    let mut tried = 0usize;
    // Rounds: a change frees or takes memory elsewhere, so the tensors a round could not
    // copy get another turn in the next, until a round changes nothing.
    loop {
        let ranked = candidates(
            graph,
            &best.as_ref().unwrap_or(planned).plan.steps,
            problem.bandwidth,
        );
        let mut changed_any = false;
        for tensor in ranked {
            if tried > 0 && Instant::now() >= deadline {
                return best;
            }
            tried += 1;
            let current = best.as_ref().unwrap_or(planned);
            let steps = &current.plan.steps;
            let live = live_after_steps(&current.report, steps.len(), graph.static_bytes());
            let copy = copy_time(graph, tensor, problem.bandwidth);
            let Some(changed) =
                with_copies(graph, steps, tensor, &live, problem.budget_bytes, copy)
            else {
                continue;
            };
            // Its copies back meet their readers as the stream allows ([`super::prefetch`]).
            let changed =
                super::prefetch::issue_by_deadlines(graph, problem.budget_bytes, changed, per_byte);
            // And its copy out by the deadlines of the frees that wait for them
            // ([`super::copies_out`]): right after its tensor is made it may queue behind
            // copies of tensors kept much longer. Not in the eager order, whose copies out
            // start right after their producers.
            let changed = if graph.order_is_eager() {
                changed
            } else {
                super::copies_out::issue_by_deadlines(graph, changed, per_byte)
            };
            // The plan's own checks judge it: the simulator, the budget, and in the eager
            // order its form (a copy out right after the producer, as here).
            let decisions = eager::decisions(graph, &changed);
            let Ok(changed) = plan_from_steps(problem, name, changed, decisions) else {
                continue;
            };
            if changed.report.total_time < current.report.total_time {
                best = Some(changed);
                changed_any = true;
            }
        }
        if !changed_any {
            return best;
        }
    }
}

/// Recomputed, unpinned tensors of some bytes that the plan never copies, by the
/// recomputation time a copy would save per unit of copy time, largest first.
fn candidates(graph: &Graph, steps: &[Step], bandwidth: f64) -> Vec<NodeId> {
    let mut computed = vec![0u32; graph.len()];
    let mut copied = vec![false; graph.len()];
    for step in steps {
        match *step {
            Step::Compute { node } => computed[node] += 1,
            Step::SwapOut { tensor } | Step::SwapIn { tensor } => copied[tensor] = true,
            Step::Free { .. } => {}
        }
    }
    let mut ranked: Vec<(f64, NodeId)> = (0..graph.len())
        .filter(|&t| {
            computed[t] > 1 && !copied[t] && !graph.is_pinned(t) && graph.node(t).output_bytes > 0
        })
        .map(|t| {
            let again = f64::from(computed[t] - 1);
            // The inputs rebuilt for it, shared among their readers.
            let chain: f64 = graph
                .node(t)
                .inputs
                .iter()
                .filter(|&&i| computed[i] > 1 && !graph.is_pinned(i))
                .map(|&i| {
                    let share = f64::from(computed[i] - 1).min(again);
                    share * graph.node(i).compute_time / graph.users(i).len().max(1) as f64
                })
                .sum();
            let saved = again * graph.node(t).compute_time + chain;
            (
                saved / copy_time(graph, t, bandwidth).max(f64::MIN_POSITIVE),
                t,
            )
        })
        .collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    ranked.into_iter().map(|(_, t)| t).collect()
}

/// A copy of `t` in the graph's time unit.
fn copy_time(graph: &Graph, t: NodeId, bandwidth: f64) -> f64 {
    graph.node(t).output_bytes as f64 / (bandwidth * graph.time_unit_s())
}

/// Device bytes (static included) after each of the plan's `steps`, read from the
/// simulator's timeline of that plan (a point at each step that changed them).
fn live_after_steps(report: &SimReport, steps: usize, static_bytes: u64) -> Vec<u64> {
    let mut points = report.timeline.iter().peekable();
    let mut live = static_bytes;
    (0..steps)
        .map(|step| {
            while let Some(point) = points.next_if(|p| p.step == step) {
                live = point.bytes;
            }
            live
        })
        .collect()
}

/// `steps` with `t` copied out after its first computation and each recomputation replaced
/// by a copy back (hoisted as the module docs say), then the recomputations left unread
/// dropped; `None` when `t` has no recomputation to replace.
fn with_copies(
    graph: &Graph,
    steps: &[Step],
    t: NodeId,
    live: &[u64],
    budget: u64,
    copy: f64,
) -> Option<Vec<Step>> {
    let computes: Vec<usize> = (0..steps.len())
        .filter(|&i| steps[i] == Step::Compute { node: t })
        .collect();
    let (&first, recomputes) = computes.split_first()?;
    if recomputes.is_empty() {
        return None;
    }
    let bytes = graph.node(t).output_bytes;
    let mut removed = vec![false; steps.len()];
    // Steps to insert before index `i` (an index of `steps.len()` appends).
    let mut inserted: Vec<(usize, Step)> = vec![(first + 1, Step::SwapOut { tensor: t })];
    let mut dropped_computes = Vec::new();
    for &at in recomputes {
        // The copy back may start no earlier than the `Free` that ended the last stretch.
        let freed = (first..at)
            .rev()
            .find(|&i| steps[i] == Step::Free { tensor: t })?;
        let mut before = at;
        let mut hidden = 0.0;
        while before > freed + 1 && hidden < copy {
            let i = before - 1;
            let held = live[i].max(live[i - 1]).saturating_add(bytes);
            if held > budget {
                break;
            }
            if let Step::Compute { node } = steps[i] {
                hidden += graph.node(node).compute_time;
            }
            before = i;
        }
        removed[at] = true;
        dropped_computes.push(at);
        inserted.push((before, Step::SwapIn { tensor: t }));
    }
    drop_unread(graph, steps, &mut removed, dropped_computes);
    Some(splice(steps, |i| removed[i], inserted))
}

/// Drops, up the chain from the removed computations at `worklist`, every recomputation
/// (not a first computation) whose output no remaining `Compute` reads and no `SwapOut`
/// copies before its next `Free` (or the end), with that `Free`.
fn drop_unread(graph: &Graph, steps: &[Step], removed: &mut [bool], mut worklist: Vec<usize>) {
    while let Some(at) = worklist.pop() {
        let Step::Compute { node } = steps[at] else {
            continue;
        };
        for &input in &graph.node(node).inputs {
            if graph.is_pinned(input) {
                continue;
            }
            // The stretch of `input` that `at` read: its last computation before `at`.
            let Some(made) = (0..at)
                .rev()
                .find(|&i| !removed[i] && steps[i] == Step::Compute { node: input })
            else {
                continue;
            };
            let recomputed = (0..made).any(|i| steps[i] == Step::Compute { node: input });
            if !recomputed {
                continue;
            }
            let end = (made + 1..steps.len())
                .find(|&i| !removed[i] && steps[i] == Step::Free { tensor: input });
            let stop = end.unwrap_or(steps.len());
            let read = (made + 1..stop).any(|i| {
                !removed[i]
                    && match steps[i] {
                        Step::Compute { node } => graph.node(node).inputs.contains(&input),
                        Step::SwapOut { tensor } => tensor == input,
                        _ => false,
                    }
            });
            if !read {
                removed[made] = true;
                if let Some(end) = end {
                    removed[end] = true;
                }
                worklist.push(made);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::test_node as node;
    use crate::sim::simulate_steps;

    /// `a -> b` (costly), `b` read again at the end after `c` and `d`; the plan drops `a`
    /// and `b` and rebuilds both: 7 units of recomputation.
    fn chain_and_plan(bandwidth: f64) -> (Graph, Vec<Step>) {
        let graph = Graph::new(
            "chain",
            vec![
                node("a", 4, 2.0, vec![]),
                node("b", 4, 5.0, vec![0]),
                node("c", 4, 3.0, vec![1]),
                node("d", 4, 3.0, vec![2]),
                node("end", 1, 1.0, vec![1, 3]),
            ],
            0,
            1.0,
        )
        .expect("a valid graph");
        use Step::*;
        let steps = vec![
            Compute { node: 0 },
            Compute { node: 1 },
            Free { tensor: 0 },
            Compute { node: 2 },
            Free { tensor: 1 },
            Compute { node: 3 },
            Free { tensor: 2 },
            Compute { node: 0 },
            Compute { node: 1 },
            Free { tensor: 0 },
            Compute { node: 4 },
        ];
        let report = simulate_steps(&graph, &steps, bandwidth).expect("valid");
        assert_eq!(report.recompute_time, 7.0);
        (graph, steps)
    }

    fn replaced(bandwidth: f64) -> (f64, Option<Planned>) {
        let (graph, steps) = chain_and_plan(bandwidth);
        let problem = Problem {
            graph: &graph,
            budget_bytes: 12,
            bandwidth,
        };
        let planned =
            plan_from_steps(&problem, "test", steps, eager::decisions(&graph, &[])).expect("fits");
        let before = planned.report.total_time;
        (
            before,
            replace_recomputations(&problem, &planned, "test", Instant::now()),
        )
    }

    /// Over a link where `b` copies in less than `a` and `b` take to recompute, the copy
    /// replaces both recomputations (`a`'s only fed `b`), within the budget.
    #[test]
    fn a_copy_replaces_a_recomputation_and_its_chain() {
        let (before, better) = replaced(1.0);
        let Some(better) = better else {
            panic!("no replacement found");
        };
        let report = &better.report;
        assert!(report.peak_bytes <= 12);
        assert_eq!(report.recompute_time, 0.0, "{:?}", better.plan.steps);
        assert!(report.total_time < before);
    }

    /// Over a slow link (a copy of `b` takes 40 units each way) nothing is replaced.
    #[test]
    fn a_slower_copy_replaces_nothing() {
        assert!(replaced(0.1).1.is_none());
    }
}
