//! Copies back issued by their readers' deadlines: the plan's last polish when it swaps.
//!
//! Why. The eviction passes issue each copy back as early as hides its own copy time
//! ([`crate::exact::evict::hoist_swap_ins`]), one copy at a time. The host-to-device stream
//! runs copies one after another, so where several come back for readers close together (a
//! training step's end reads every gradient buffer; near the floor the pinned buffers are
//! swapped out in the backward and all come back for it) each copy hides behind the same
//! few computations and they queue: 8 layers at the floor + 5%, 32 GB/s, waited 1.2 ms of
//! a 25 ms step at the end while the device had 200 MB free over the last 0.4 ms.
//!
//! How. Each copy back's deadline is the start of the first computation that reads it,
//! on the compute clock without waits. Backward over deadlines (latest first), as a single
//! machine meets deadlines best: each copy is to end by its deadline or by the start of
//! the copy placed after it, whichever is earlier, so it should start its copy time before
//! that; its `SwapIn` moves earlier until the computations before it start no later than
//! then, or one step more would pass the budget (it holds its bytes from its issue) or
//! cross its own `Free` or `SwapOut`. A copy memory stops early is late; the copies before
//! it then aim at where it really starts. A copy never moves later. The simulator judges
//! the result, and the plan is kept only when faster.

use crate::eager;
use crate::ir::Graph;
use crate::plan::Step;
use crate::problem::{Planned, Problem, plan_from_steps};

/// `planned` with its copies back issued by their deadlines ([`issue_by_deadlines`]), when
/// that is faster within the budget (the simulator judges, and in the eager order the
/// form's checks); `None` when the plan copies nothing back or nothing got faster.
pub fn polish(problem: &Problem, planned: &Planned, name: &str) -> Option<Planned> {
    let steps = &planned.plan.steps;
    if !steps.iter().any(|s| matches!(s, Step::SwapIn { .. })) {
        return None;
    }
    let graph = problem.graph;
    let per_byte = 1.0 / (problem.bandwidth * graph.time_unit_s());
    let moved = issue_by_deadlines(graph, problem.budget_bytes, steps.clone(), per_byte);
    if moved == *steps {
        return None;
    }
    let decisions = eager::decisions(graph, &moved);
    let polished = plan_from_steps(problem, name, moved, decisions).ok()?;
    (polished.report.total_time < planned.report.total_time).then_some(polished)
}

/// `steps` with each `SwapIn` moved earlier as the module docs say; unchanged when
/// `budget_bytes` is under the static bytes or nothing moves. `per_byte`: copy time per
/// byte in the graph's time unit.
pub fn issue_by_deadlines(
    graph: &Graph,
    budget_bytes: u64,
    mut steps: Vec<Step>,
    per_byte: f64,
) -> Vec<Step> {
    let Some(cap) = budget_bytes.checked_sub(graph.static_bytes()) else {
        return steps;
    };
    // live[k]: device bytes (static excluded) once step k has run; clock[k]: compute time
    // of the steps before k.
    let mut live = Vec::with_capacity(steps.len());
    let mut clock = Vec::with_capacity(steps.len() + 1);
    let (mut bytes_now, mut time_now) = (0u64, 0.0);
    for step in &steps {
        clock.push(time_now);
        match *step {
            Step::Compute { node } => {
                bytes_now += graph.node(node).output_bytes;
                time_now += graph.node(node).compute_time;
            }
            Step::SwapIn { tensor } => bytes_now += graph.node(tensor).output_bytes,
            Step::Free { tensor } => {
                bytes_now = bytes_now.saturating_sub(graph.node(tensor).output_bytes);
            }
            Step::SwapOut { .. } => {}
        }
        live.push(bytes_now);
    }
    // The copies back with their deadlines, latest deadline first (ties: the later issued
    // first, so their order on the stream stays). A backward scan finds each copy's reader.
    let mut next_read = vec![f64::INFINITY; graph.len()];
    let mut copies: Vec<(f64, usize)> = Vec::new();
    for (j, step) in steps.iter().enumerate().rev() {
        match *step {
            Step::Compute { node } => {
                for &input in &graph.node(node).inputs {
                    next_read[input] = clock[j];
                }
            }
            Step::SwapIn { tensor } if next_read[tensor].is_finite() => {
                copies.push((next_read[tensor], j));
            }
            _ => {}
        }
    }
    copies.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
    // Where each copy is now: moving one shifts those between its old and new place.
    let mut at: Vec<usize> = copies.iter().map(|&(_, j)| j).collect();
    let mut stream_free_by = f64::INFINITY;
    for c in 0..copies.len() {
        let j = at[c];
        let Step::SwapIn { tensor } = steps[j] else {
            continue;
        };
        let bytes = graph.node(tensor).output_bytes;
        let start_by = copies[c].0.min(stream_free_by) - bytes as f64 * per_byte;
        let mut to = j;
        while to > 0 && clock[to] > start_by {
            let k = to - 1;
            let own = matches!(steps[k], Step::Free { tensor: t } | Step::SwapOut { tensor: t } if t == tensor);
            let before = if k == 0 { 0 } else { live[k - 1] };
            if own || before.max(live[k]) + bytes > cap {
                break;
            }
            to = k;
        }
        stream_free_by = clock[to].max(start_by);
        if to == j {
            continue;
        }
        let step = steps.remove(j);
        steps.insert(to, step);
        let before = if to == 0 { 0 } else { live[to - 1] };
        live.remove(j);
        live.insert(to, before + bytes);
        for held in &mut live[to + 1..=j] {
            *held += bytes;
        }
        clock.remove(j);
        let issued = clock[to];
        clock.insert(to, issued);
        for other in &mut at[c + 1..] {
            if (to..j).contains(other) {
                *other += 1;
            }
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Node, Phase};
    use crate::sim::simulate_steps;

    fn node(name: &str, bytes: u64, time: f64, inputs: Vec<usize>) -> Node {
        Node {
            name: name.into(),
            phase: Phase::Forward,
            compute_time: time,
            output_bytes: bytes,
            inputs,
        }
    }

    /// `a` and `b` copied out, three computations, and an end that reads both: copied back
    /// right before the end (each copy alone hides behind nothing), the second queues
    /// behind the first. 100 bytes copy in 2 units.
    fn two_copies_for_one_reader() -> (Graph, Vec<Step>) {
        let graph = Graph::new(
            "two copies",
            vec![
                node("a", 100, 1.0, vec![]),
                node("b", 100, 1.0, vec![]),
                node("w1", 10, 4.0, vec![]),
                node("w2", 10, 4.0, vec![2]),
                node("w3", 10, 4.0, vec![3]),
                node("end", 0, 1.0, vec![0, 1, 4]),
            ],
            0,
            1.0,
        )
        .expect("a valid graph");
        use Step::*;
        let steps = vec![
            Compute { node: 0 },
            SwapOut { tensor: 0 },
            Compute { node: 1 },
            SwapOut { tensor: 1 },
            Compute { node: 2 },
            Free { tensor: 0 },
            Free { tensor: 1 },
            Compute { node: 3 },
            Free { tensor: 2 },
            Compute { node: 4 },
            Free { tensor: 3 },
            SwapIn { tensor: 0 },
            SwapIn { tensor: 1 },
            Compute { node: 5 },
        ];
        (graph, steps)
    }

    const PER_BYTE: f64 = 0.02;

    #[test]
    fn copies_for_one_reader_are_spread_over_the_compute_before_it() {
        let (graph, steps) = two_copies_for_one_reader();
        let before = simulate_steps(&graph, &steps, 1.0 / PER_BYTE).expect("valid");
        assert_eq!(before.stall_time, 4.0);
        let moved = issue_by_deadlines(&graph, 1_000, steps, PER_BYTE);
        let after = simulate_steps(&graph, &moved, 1.0 / PER_BYTE).expect("valid");
        // Both copies now run during w3, `b` first as before.
        assert_eq!(after.stall_time, 0.0, "{moved:?}");
        assert_eq!(after.total_time, before.total_time - 4.0);
        let position = |t: usize| moved.iter().position(|s| *s == Step::SwapIn { tensor: t });
        assert!(position(1) < position(0));
    }

    #[test]
    fn a_copy_back_stays_where_the_budget_has_no_room_for_it_earlier() {
        let (graph, steps) = two_copies_for_one_reader();
        // The plan's own peak: both copies and w3 at the end. Only one copy fits during w3.
        let moved = issue_by_deadlines(&graph, 210, steps, PER_BYTE);
        let after = simulate_steps(&graph, &moved, 1.0 / PER_BYTE).expect("valid");
        assert!(after.peak_bytes <= 210, "{after:?}");
        assert_eq!(after.stall_time, 2.0, "{moved:?}");
    }
}
