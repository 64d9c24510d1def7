//! Copies out issued in the order of their deadlines.
//!
//! Why. The device-to-host stream runs copies one after another in the order they are
//! issued, and a `Free` of a tensor with a copy in flight waits for it (the simulator's
//! rule). The passes and [`super::recompute_to_swap`] issue each copy out right after its
//! tensor is made, so a tensor freed soon after it is made can queue behind copies made a
//! little earlier whose tensors stay on the device longer, and its `Free` holds up the
//! compute stream. Near the floor of a transformer at 32 GB/s the copies out nearly fill
//! the forward; on 8 layers + 50% step 6 gets 26.09 -> 25.75% with this order. (Where a
//! `Free` waits on its tensor's own copy, or on copies due earlier, no order helps: on 8
//! layers + 10% `l4.k.rope.add`'s `Free` would wait 1.5 ms, freed 0.3 ms after it is made,
//! and step 6 turns the copy down either way.)
//!
//! How. On the compute clock (no waits), each copy out is released when its tensor is
//! made (the end of its computation, or of its copy back) and its deadline is the start of
//! its tensor's next `Free` (none: no deadline). The stream is scheduled by earliest
//! deadline first among the released copies, which on one machine keeps the largest
//! lateness least when the copies could be preempted, and is a good rule when they cannot.
//! Each `SwapOut` is then issued right after the later of its tensor's making and the
//! previous copy's `SwapOut`, so that the stream's order is that one; a copy whose place
//! would come after its own `Free` keeps its old one. Memory does not change (a copy out
//! neither allocates nor frees), so the budget holds; the simulator judges the times.

use crate::ir::Graph;
use crate::plan::{Step, splice};

use super::prefetch::compute_clock;

/// One copy out of `steps`.
struct CopyOut {
    /// Index of its `SwapOut` step.
    at: usize,
    /// Index of the step that made its tensor resident (a `Compute` or a `SwapIn`).
    made: usize,
    /// Index of its tensor's next `Free`, if any.
    freed: Option<usize>,
    /// Compute-clock time its tensor is ready.
    release: f64,
    /// Compute-clock time of its `Free`; infinity without one.
    deadline: f64,
    /// Its copy time.
    duration: f64,
}

/// `steps` with its copies out reissued by their deadlines (see the module docs);
/// unchanged when fewer than two copies out. `per_byte`: copy time per byte in the graph's
/// time unit.
pub fn issue_by_deadlines(graph: &Graph, steps: Vec<Step>, per_byte: f64) -> Vec<Step> {
    let clock = compute_clock(graph, &steps);
    let copies = copies_out(graph, &steps, &clock, per_byte);
    if copies.len() < 2 {
        return steps;
    }
    let order = earliest_deadline_first(&copies);
    // Where each copy goes: after step `after[c]` (its making, or the previous copy's new
    // place, whichever is later), in stream order among copies placed after the same step.
    let mut after = vec![0usize; copies.len()];
    let mut previous: Option<usize> = None;
    for &c in &order {
        let copy = &copies[c];
        let place = previous.map_or(copy.made, |p| p.max(copy.made));
        let place = match copy.freed {
            Some(freed) if place >= freed => copy.at - 1,
            _ => place,
        };
        after[c] = place;
        previous = Some(place);
    }
    // Rebuild: every `SwapOut` of a copy leaves its place and goes right after its step,
    // in stream order (`order`) among copies placed after the same step.
    let mut moved = vec![false; steps.len()];
    for copy in &copies {
        moved[copy.at] = true;
    }
    let inserted = order
        .iter()
        .map(|&c| (after[c] + 1, steps[copies[c].at]))
        .collect();
    splice(&steps, |i| moved[i], inserted)
}

/// The copies out of `steps` with what [`issue_by_deadlines`] needs; a `SwapOut` whose
/// tensor was not made before it (an invalid schedule) is left out.
fn copies_out(graph: &Graph, steps: &[Step], clock: &[f64], per_byte: f64) -> Vec<CopyOut> {
    // Each step's tensor's next `Free` after it (one backward scan), and the step that
    // last made each tensor resident, as the forward scan goes.
    let mut next_free = vec![None; steps.len()];
    let mut upcoming: Vec<Option<usize>> = vec![None; graph.len()];
    for (i, step) in steps.iter().enumerate().rev() {
        match *step {
            Step::Free { tensor } => upcoming[tensor] = Some(i),
            Step::SwapOut { tensor } => next_free[i] = upcoming[tensor],
            _ => {}
        }
    }
    let mut made: Vec<Option<usize>> = vec![None; graph.len()];
    let mut copies = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        match *step {
            Step::Compute { node: t } | Step::SwapIn { tensor: t } => made[t] = Some(i),
            Step::SwapOut { tensor } => {
                let Some(m) = made[tensor] else {
                    continue;
                };
                let release = match steps[m] {
                    Step::Compute { node } => clock[m] + graph.node(node).compute_time,
                    // A copy back ends some time after its issue; its own copy time is
                    // the least.
                    _ => clock[m] + graph.node(tensor).output_bytes as f64 * per_byte,
                };
                let freed = next_free[i];
                copies.push(CopyOut {
                    at: i,
                    made: m,
                    freed,
                    release,
                    deadline: freed.map_or(f64::INFINITY, |k| clock[k]),
                    duration: graph.node(tensor).output_bytes as f64 * per_byte,
                });
            }
            Step::Free { .. } => {}
        }
    }
    copies
}

/// Indices of `copies` in the order one stream runs them by earliest deadline first among
/// those released (ties: the earlier issued first).
fn earliest_deadline_first(copies: &[CopyOut]) -> Vec<usize> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    // Deadlines (times, not negative: their bits order as they do) and then the issue
    // index, as a min-heap key.
    let key = |c: usize| Reverse((copies[c].deadline.to_bits(), copies[c].at, c));

    let mut by_release: Vec<usize> = (0..copies.len()).collect();
    by_release.sort_by(|&a, &b| {
        copies[a]
            .release
            .total_cmp(&copies[b].release)
            .then(copies[a].at.cmp(&copies[b].at))
    });
    let mut ready = BinaryHeap::new();
    let mut order = Vec::with_capacity(copies.len());
    let mut now = 0.0f64;
    let mut next = 0;
    while order.len() < copies.len() {
        while next < by_release.len() && copies[by_release[next]].release <= now {
            let c = by_release[next];
            ready.push(key(c));
            next += 1;
        }
        let Some(Reverse((_, _, c))) = ready.pop() else {
            now = copies[by_release[next]].release;
            continue;
        };
        order.push(c);
        now += copies[c].duration;
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::test_node as node;
    use crate::sim::simulate_steps;

    /// `long1` and `long2` are made first and kept to the end; `short` is made next and
    /// freed soon after. Issued as made, `short`'s copy queues behind both and its `Free`
    /// waits 18 units; by deadlines it goes before `long2`'s (still queued when `long1`'s
    /// ends) and waits 8.
    #[test]
    fn a_copy_freed_sooner_goes_first() {
        let graph = Graph::new(
            "three copies",
            vec![
                node("long1", 10, 1.0, vec![]),
                node("long2", 10, 1.0, vec![]),
                node("short", 10, 1.0, vec![]),
                node("a", 1, 10.0, vec![2]),
                node("b", 1, 40.0, vec![3]),
                node("end", 1, 1.0, vec![0, 1, 4]),
            ],
            0,
            1.0,
        )
        .expect("a valid graph");
        use Step::*;
        // A copy takes 10 units at 1 byte a unit.
        let steps = vec![
            Compute { node: 0 },
            SwapOut { tensor: 0 },
            Compute { node: 1 },
            SwapOut { tensor: 1 },
            Compute { node: 2 },
            SwapOut { tensor: 2 },
            Compute { node: 3 },
            Free { tensor: 2 },
            Compute { node: 4 },
            Free { tensor: 3 },
            Free { tensor: 0 },
            Free { tensor: 1 },
            SwapIn { tensor: 0 },
            SwapIn { tensor: 1 },
            Compute { node: 5 },
        ];
        let before = simulate_steps(&graph, &steps, 1.0).expect("valid");
        let reissued = issue_by_deadlines(&graph, steps.clone(), 1.0);
        let after = simulate_steps(&graph, &reissued, 1.0).expect("valid");
        // The end waits 20 for the two copies back either way.
        assert_eq!(before.stall_time, 18.0 + 20.0, "{before:?}");
        assert_eq!(after.stall_time, 8.0 + 20.0, "{reissued:?}");
        assert_eq!(after.total_time, before.total_time - 10.0);
        assert_eq!(after.peak_bytes, before.peak_bytes);
        assert_eq!(
            &reissued[..7],
            &[
                Compute { node: 0 },
                SwapOut { tensor: 0 },
                Compute { node: 1 },
                Compute { node: 2 },
                SwapOut { tensor: 2 },
                SwapOut { tensor: 1 },
                Compute { node: 3 },
            ]
        );
        assert_eq!(&reissued[7..], &steps[7..]);
    }

    /// With one copy out, or copies already issued in deadline order, nothing moves.
    #[test]
    fn copies_in_deadline_order_stay() {
        let graph = Graph::new(
            "one",
            vec![node("x", 4, 1.0, vec![]), node("y", 1, 5.0, vec![0])],
            0,
            1.0,
        )
        .expect("a valid graph");
        use Step::*;
        let steps = vec![
            Compute { node: 0 },
            SwapOut { tensor: 0 },
            Compute { node: 1 },
            Free { tensor: 0 },
        ];
        assert_eq!(issue_by_deadlines(&graph, steps.clone(), 1.0), steps);
        // Two copies, the one freed first issued first.
        let graph = Graph::new(
            "two",
            vec![
                node("x", 4, 1.0, vec![]),
                node("z", 4, 1.0, vec![]),
                node("y", 1, 5.0, vec![0]),
                node("end", 1, 1.0, vec![1, 2]),
            ],
            0,
            1.0,
        )
        .expect("a valid graph");
        let steps = vec![
            Compute { node: 0 },
            SwapOut { tensor: 0 },
            Compute { node: 1 },
            SwapOut { tensor: 1 },
            Compute { node: 2 },
            Free { tensor: 0 },
            Compute { node: 3 },
            Free { tensor: 1 },
        ];
        assert_eq!(issue_by_deadlines(&graph, steps.clone(), 1.0), steps);
    }
}
