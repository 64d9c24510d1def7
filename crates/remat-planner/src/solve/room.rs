//! Room for late copies back: tensors dropped over the tight steps before a reader that
//! waits on the link, so that its copies back can be issued earlier (a polish of plans
//! that swap).
//!
//! Why. Near the floor a training step's end reads every gradient buffer, and the passes
//! swap those buffers out in the backward (pinned: they cannot be rebuilt) because their
//! next use is the farthest. They come back after the last tight steps of the backward,
//! where the device has no room for them, and queue on the link: 8 layers at the floor +
//! 5% over 32 GB/s held `l0.q.rope.add` and `l0.k.rope.add` (16.8 MB, read a few steps
//! later by the scores' backward) across `bwd:l0.softmax` and `bwd:l0.scale` with under
//! 3 MB to spare, and then waited 987 us of a 25 ms step for 52 MB of buffers with 476 us
//! of compute left to hide them. Dropping such a tensor over the tight steps and
//! rebuilding it after them (its chain of ancestors not on the device then) trades a
//! little recomputation for room the copies back can use; the passes never make that
//! trade, since the eviction picks the buffers first.
//!
//! How. First the lazy frees go: each `Free` moves to right after its tensor's last use
//! (not past a copy out still in flight, whose end it waits for); memory only drops.
//! Then, in rounds, the computations that wait for copies back, longest wait first: a
//! reader's late copies are those of its inputs that end after the compute stream reached
//! it. Walking back from the first of them over the compute time they take, the first
//! steps where the largest of them could not be issued (less room than its bytes) stop
//! them all: that run of steps is the tight block. A candidate is a tensor resident over
//! the whole block, read by none of its steps, that may be dropped ([`Graph::may_drop`]),
//! with no copy out while resident, and read again after the block: it is freed after its
//! last use before the block and rebuilt right before its next reader, with every ancestor
//! not on the device there (its chain, at most [`MAX_CHAIN`] nodes, no pinned one), each
//! freed after its last reader in the chain. Cheapest chain per byte first; each change is
//! followed by the copies back by their deadlines ([`super::prefetch::issue_by_deadlines`])
//! and judged by the simulator (and in the eager order by the form's checks); the first
//! one faster within the budget is kept and the next round starts from it, until a round
//! keeps nothing or the deadline. Measured at 32 GB/s, the floor + 5%: 8 layers 36.97 ->
//! 35.71% (the end's wait 987 -> 458 us), 32 layers 39.15-39.38 -> 38.69-38.83% (4.6 ->
//! 3.8 ms: there the buffers brought back after the last block are more than the block's
//! tensors can make room for).

use std::time::Instant;

use crate::eager;
use crate::ir::{Graph, NodeId};
use crate::plan::{Step, live_bytes_after};
use crate::problem::{Planned, Problem, plan_from_steps};
use crate::sim::simulate_traced;

use super::prefetch::{compute_clock, early_frees, issue_by_deadlines};

/// The most nodes one rebuild chain may recompute: a longer chain costs more than the
/// copies it could hide near the end of a step.
pub const MAX_CHAIN: usize = 64;

/// The most candidates judged per waiting reader in a round.
const CANDIDATES_PER_ROUND: usize = 8;

/// Steps without a tight one that end a tight block (see `candidates`).
const BLOCK_GAP: usize = 16;

/// The most steps a tight block spans.
const MAX_BLOCK_STEPS: usize = 4096;

/// The most waiting readers looked at in a round, longest wait first.
const READERS_PER_ROUND: usize = 8;

/// `planned` with tensors dropped over the tight steps before its waits for copies back
/// (see the module docs), when that is faster within the budget; `None` when the plan waits
/// for no copy back or nothing got faster. Stops at `deadline` (after one candidate at
/// least).
pub fn make_room(
    problem: &Problem,
    planned: &Planned,
    name: &str,
    deadline: Instant,
) -> Option<Planned> {
    let graph = problem.graph;
    let per_byte = 1.0 / (problem.bandwidth * graph.time_unit_s());
    let judged = |steps: Vec<Step>, against: &Planned| {
        let steps = issue_by_deadlines(graph, problem.budget_bytes, steps, per_byte);
        let decisions = eager::decisions(graph, &steps);
        let changed = plan_from_steps(problem, name, steps, decisions).ok()?;
        (changed.report.total_time < against.report.total_time).then_some(changed)
    };
    let mut best: Option<Planned> = None;
    let mut tried = 0usize;
    // Rounds: a kept change moves the copies and the waits, so the readers are found again.
    loop {
        let current = best.as_ref().unwrap_or(planned);
        let steps = early_frees(graph, &current.plan.steps);
        let mut kept = false;
        'readers: for late in late_readers(graph, &steps, problem, per_byte) {
            let candidates = candidates(graph, &steps, &late, problem.budget_bytes);
            for candidate in candidates.into_iter().take(CANDIDATES_PER_ROUND) {
                if tried > 0 && Instant::now() >= deadline {
                    return best;
                }
                tried += 1;
                let current = best.as_ref().unwrap_or(planned);
                if let Some(better) = judged(candidate.apply(graph, &steps), current) {
                    best = Some(better);
                    kept = true;
                    break 'readers;
                }
            }
        }
        if !kept {
            return best;
        }
    }
}

/// A computation that waits for copies back, with its late copies.
struct Late {
    /// Step of the waiting computation.
    reader: usize,
    /// Step of the first late copy back (`SwapIn`).
    first_copy: usize,
    /// The largest late copy's bytes, and all of their copy time in the graph's unit.
    largest: u64,
    copy_time: f64,
}

/// The computations that wait for copies back, longest wait first (at most
/// [`READERS_PER_ROUND`]), each with its late copies.
fn late_readers(graph: &Graph, steps: &[Step], problem: &Problem, per_byte: f64) -> Vec<Late> {
    let Ok((_, times)) = simulate_traced(graph, steps, problem.bandwidth) else {
        return Vec::new();
    };
    let mut waiting: Vec<(usize, NodeId)> = steps
        .iter()
        .enumerate()
        .filter_map(|(k, s)| match *s {
            Step::Compute { node } if times[k].wait > 0.0 => Some((k, node)),
            _ => None,
        })
        .collect();
    waiting.sort_by(|a, b| times[b.0].wait.total_cmp(&times[a.0].wait));
    waiting.truncate(READERS_PER_ROUND);
    let mut out = Vec::new();
    for (reader, node) in waiting {
        let ready = times[reader].start - times[reader].wait;
        let inputs = &graph.node(node).inputs;
        // The latest copy back of each input before the reader, when it ends late.
        let (mut first_copy, mut bytes, mut largest) = (None, 0u64, 0u64);
        let mut seen = vec![false; graph.len()];
        for k in (0..reader).rev() {
            if let Step::SwapIn { tensor } = steps[k]
                && inputs.contains(&tensor)
                && !seen[tensor]
            {
                seen[tensor] = true;
                if times[k].end > ready {
                    let size = graph.node(tensor).output_bytes;
                    first_copy = Some(k);
                    bytes += size;
                    largest = largest.max(size);
                }
            }
        }
        let Some(first_copy) = first_copy else {
            continue;
        };
        out.push(Late {
            reader,
            first_copy,
            largest,
            copy_time: bytes as f64 * per_byte,
        });
    }
    out
}

/// One change: `tensor` freed after step `free_after` and rebuilt by `chain` (its
/// ancestors first, the tensor last) right before step `rebuild_before`.
struct Candidate {
    tensor: NodeId,
    free_after: usize,
    rebuild_before: usize,
    chain: Vec<NodeId>,
    /// Chain compute time per byte freed.
    cost_per_byte: f64,
}

impl Candidate {
    fn apply(&self, graph: &Graph, steps: &[Step]) -> Vec<Step> {
        let mut out = Vec::with_capacity(steps.len() + 2 * self.chain.len() + 1);
        for (k, &step) in steps.iter().enumerate() {
            if k == self.rebuild_before {
                out.extend(rebuild_steps(graph, &self.chain));
            }
            out.push(step);
            if k == self.free_after {
                out.push(Step::Free {
                    tensor: self.tensor,
                });
            }
        }
        out
    }
}

/// The computations of `chain` in its order, each node but the last freed right after
/// the last computation of the chain that reads it (the last one is what the chain
/// rebuilds; the plan's own steps free it later).
fn rebuild_steps(graph: &Graph, chain: &[NodeId]) -> Vec<Step> {
    let Some((_, ancestors)) = chain.split_last() else {
        return Vec::new();
    };
    // last_reader[j]: position in `chain` of the last node reading chain[j].
    let mut last_reader: Vec<usize> = (0..chain.len()).collect();
    for (j, &node) in chain.iter().enumerate() {
        for &input in &graph.node(node).inputs {
            if let Some(i) = chain.iter().position(|&c| c == input) {
                last_reader[i] = last_reader[i].max(j);
            }
        }
    }
    let mut out = Vec::with_capacity(2 * chain.len());
    for (j, &node) in chain.iter().enumerate() {
        out.push(Step::Compute { node });
        for (i, &ancestor) in ancestors.iter().enumerate() {
            if last_reader[i] == j {
                out.push(Step::Free { tensor: ancestor });
            }
        }
    }
    out
}

/// Whether each tensor is on the device before step `at` runs.
fn resident_before(graph: &Graph, steps: &[Step], at: usize) -> Vec<bool> {
    let mut resident = vec![false; graph.len()];
    for step in &steps[..at.min(steps.len())] {
        match *step {
            Step::Compute { node: t } | Step::SwapIn { tensor: t } => resident[t] = true,
            Step::Free { tensor } => resident[tensor] = false,
            Step::SwapOut { .. } => {}
        }
    }
    resident
}

/// The ancestors of `tensor` that are not on the device (`resident`) and must be computed
/// again to rebuild it there, in an order that computes inputs first, `tensor` last;
/// `None` when the chain would need a pinned tensor or exceed [`MAX_CHAIN`] nodes.
fn rebuild_chain(graph: &Graph, tensor: NodeId, resident: &[bool]) -> Option<Vec<NodeId>> {
    const NEW: u8 = 0;
    const OPEN: u8 = 1;
    const DONE: u8 = 2;
    let mut order = Vec::new();
    let mut state = vec![NEW; graph.len()];
    let mut opened = 0usize;
    // Depth first; a node is emitted once every input it needs is: inputs first.
    let mut stack = vec![(tensor, false)];
    while let Some((node, expanded)) = stack.pop() {
        if expanded {
            state[node] = DONE;
            order.push(node);
            continue;
        }
        if state[node] != NEW {
            continue;
        }
        state[node] = OPEN;
        opened += 1;
        if opened > MAX_CHAIN {
            return None;
        }
        stack.push((node, true));
        for &input in &graph.node(node).inputs {
            if resident[input] || state[input] == DONE {
                continue;
            }
            // A pinned tensor may never be dropped (`may_drop` is false for it).
            if !graph.may_drop(input) {
                return None;
            }
            stack.push((input, false));
        }
    }
    Some(order)
}

/// The changes worth judging for the late copies of `late`, cheapest chain per byte first.
fn candidates(graph: &Graph, steps: &[Step], late: &Late, budget_bytes: u64) -> Vec<Candidate> {
    let Some(cap) = budget_bytes.checked_sub(graph.static_bytes()) else {
        return Vec::new();
    };
    let live = live_bytes_after(graph, steps);
    let clock = compute_clock(graph, steps);
    // The copies would have to start their copy time before the reader. Walking back
    // from the first of them, the first steps where the largest could not be issued
    // (under `largest` bytes to spare) stop them all: the tight block is that run of such
    // steps (gaps of under `BLOCK_GAP` steps), which a candidate must be absent over.
    let first_copy = late.first_copy;
    let issue_by = clock[late.reader] - late.copy_time;
    let mut from = first_copy;
    while from > 0 && clock[from] > issue_by {
        from -= 1;
    }
    let tight = |k: usize| live[k] + late.largest > cap;
    let Some(last) = (from..first_copy).rev().find(|&k| tight(k)) else {
        return Vec::new();
    };
    let mut first = last;
    let mut k = last;
    while k > from && last - k < MAX_BLOCK_STEPS {
        k -= 1;
        if tight(k) {
            first = k;
        } else if first - k >= BLOCK_GAP {
            break;
        }
    }
    let resident = resident_before(graph, steps, first + 1);
    let mut found = Vec::new();
    for tensor in (0..graph.len()).filter(|&t| resident[t]) {
        if !graph.may_drop(tensor) {
            continue;
        }
        if let Some(candidate) = candidate_for(graph, steps, tensor, first, last) {
            found.push(candidate);
        }
    }
    found.sort_by(|a, b| a.cost_per_byte.total_cmp(&b.cost_per_byte));
    found
}

/// `tensor`, resident at step `first`, dropped over `first..=last` and rebuilt before its
/// next reader after them, if it is read by none of those steps, has no copy out while
/// resident, is read again before its `Free` and its chain can be rebuilt there.
fn candidate_for(
    graph: &Graph,
    steps: &[Step],
    tensor: NodeId,
    first: usize,
    last: usize,
) -> Option<Candidate> {
    let reads = |k: usize| match steps[k] {
        Step::Compute { node } => graph.node(node).inputs.contains(&tensor),
        _ => false,
    };
    // Its last use before `first`, in the residency that covers `first`.
    let mut free_after = None;
    for k in (0..=first).rev() {
        match steps[k] {
            Step::SwapOut { tensor: t } if t == tensor => return None,
            Step::Compute { node } if node == tensor => {
                free_after.get_or_insert(k);
                break;
            }
            Step::SwapIn { tensor: t } if t == tensor => {
                free_after.get_or_insert(k);
                break;
            }
            _ if reads(k) => {
                if k == first {
                    return None;
                }
                free_after.get_or_insert(k);
            }
            _ => {}
        }
    }
    let free_after = free_after?;
    let mut rebuild_before = None;
    for (k, &step) in steps.iter().enumerate().skip(first + 1) {
        match step {
            Step::Free { tensor: t } | Step::SwapOut { tensor: t } if t == tensor => return None,
            _ if reads(k) => {
                if k <= last {
                    return None;
                }
                rebuild_before = Some(k);
                break;
            }
            _ => {}
        }
    }
    let rebuild_before = rebuild_before?;
    let mut resident = resident_before(graph, steps, rebuild_before);
    resident[tensor] = false;
    let chain = rebuild_chain(graph, tensor, &resident)?;
    let cost: f64 = chain.iter().map(|&n| graph.node(n).compute_time).sum();
    Some(Candidate {
        tensor,
        free_after,
        rebuild_before,
        chain,
        cost_per_byte: cost / graph.node(tensor).output_bytes.max(1) as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::test_node as node;
    use crate::sim::simulate_steps;

    /// 100 bytes copy in 5 units (20 bytes per unit of time).
    const BANDWIDTH: f64 = 20.0;
    const BUDGET: u64 = 510;

    /// A pinned `g` copied out behind `h` and back for the end, and a cheap `c` (read by
    /// `s` at the end) held across the tight `t` (300 bytes): there is room for `g` only
    /// after `t` is freed, one unit of compute before the end, so the end waits 4 units.
    fn a_late_copy_behind_a_held_tensor() -> (Graph, Vec<Step>) {
        let graph = Graph::new(
            "late copy",
            vec![
                node("x", 100, 1.0, vec![]),
                node("g", 100, 1.0, vec![0]),
                node("h", 10, 5.0, vec![0]),
                node("c", 100, 1.0, vec![0]),
                node("t", 300, 2.0, vec![0]),
                node("r", 0, 1.0, vec![4]),
                node("s", 0, 1.0, vec![3]),
                node("end", 0, 1.0, vec![1, 2, 5, 6]),
            ],
            0,
            1.0,
        )
        .expect("a valid graph")
        .with_pinned([1])
        .expect("g exists");
        use Step::*;
        let steps = vec![
            Compute { node: 0 },
            Compute { node: 1 },
            SwapOut { tensor: 1 },
            Compute { node: 2 },
            Free { tensor: 1 },
            Compute { node: 3 },
            Compute { node: 4 },
            Compute { node: 5 },
            Free { tensor: 4 },
            SwapIn { tensor: 1 },
            Compute { node: 6 },
            Free { tensor: 3 },
            Compute { node: 7 },
        ];
        (graph, steps)
    }

    fn planned(problem: &Problem, steps: Vec<Step>) -> Planned {
        let decisions = eager::decisions(problem.graph, &steps);
        plan_from_steps(problem, "test", steps, decisions).expect("a valid plan")
    }

    #[test]
    fn a_held_tensor_is_rebuilt_after_the_tight_step_so_the_copy_back_hides() {
        let (graph, steps) = a_late_copy_behind_a_held_tensor();
        let problem = Problem {
            graph: &graph,
            budget_bytes: BUDGET,
            bandwidth: BANDWIDTH,
        };
        let before = planned(&problem, steps);
        assert_eq!(before.report.stall_time, 4.0, "{:?}", before.report);
        let far = Instant::now() + std::time::Duration::from_secs(10);
        let after = make_room(&problem, &before, "test", far).expect("a faster plan");
        // `c` goes before `t` and is computed again for `s`: one unit of recomputation for
        // the four units of waiting.
        assert_eq!(after.report.stall_time, 0.0, "{:?}", after.plan.steps);
        assert_eq!(after.report.recompute_time, 1.0);
        assert_eq!(after.report.total_time, before.report.total_time - 3.0);
        assert!(after.report.peak_bytes <= BUDGET);
        let computes_of_c = after
            .plan
            .steps
            .iter()
            .filter(|s| **s == Step::Compute { node: 3 })
            .count();
        assert_eq!(computes_of_c, 2);
    }

    #[test]
    fn no_room_is_made_where_nothing_waits() {
        let (graph, steps) = a_late_copy_behind_a_held_tensor();
        // A link fast enough that the copy back hides behind `s`.
        let problem = Problem {
            graph: &graph,
            budget_bytes: BUDGET,
            bandwidth: 1_000.0,
        };
        let before = planned(&problem, steps);
        assert_eq!(before.report.stall_time, 0.0);
        let far = Instant::now() + std::time::Duration::from_secs(10);
        assert!(make_room(&problem, &before, "test", far).is_none());
    }

    #[test]
    fn a_held_tensor_whose_rebuild_needs_a_pinned_tensor_gone_is_no_candidate() {
        let (graph, steps) = a_late_copy_behind_a_held_tensor();
        // `c` read from `g` instead of `x`: rebuilding it after `t` needs `g`, pinned and on
        // the host then.
        let mut nodes = graph.nodes().to_vec();
        nodes[3].inputs = vec![1];
        let graph = Graph::new("late copy", nodes, 0, 1.0)
            .expect("a valid graph")
            .with_pinned([1])
            .expect("g exists");
        let mut resident = resident_before(&graph, &steps, 9);
        resident[3] = false;
        assert!(!resident[1]);
        assert_eq!(rebuild_chain(&graph, 3, &resident), None);
    }

    #[test]
    fn a_chain_computes_every_input_before_its_readers() {
        // a -> b -> d, a -> c -> d, b -> c: a diamond with a shortcut, nothing resident.
        let graph = Graph::new(
            "diamond",
            vec![
                node("a", 10, 1.0, vec![]),
                node("b", 10, 1.0, vec![0]),
                node("c", 10, 1.0, vec![0, 1]),
                node("d", 10, 1.0, vec![1, 2]),
            ],
            0,
            1.0,
        )
        .expect("a valid graph");
        let chain = rebuild_chain(&graph, 3, &[false; 4]).expect("a chain");
        assert_eq!(chain.len(), 4);
        assert_eq!(chain.last(), Some(&3));
        for (j, &n) in chain.iter().enumerate() {
            for input in &graph.node(n).inputs {
                let at = chain.iter().position(|c| c == input).expect("in the chain");
                assert!(at < j, "{chain:?}");
            }
        }
        // Its steps free each ancestor after its last reader in the chain, and run.
        let mut steps = rebuild_steps(&graph, &chain);
        steps.push(Step::Free { tensor: 3 });
        let report = simulate_steps(&graph, &steps, 1.0).expect("a valid schedule");
        assert_eq!(report.peak_bytes, 30);
    }

    #[test]
    fn frees_move_to_the_last_use_but_not_before_a_copy_out_ends() {
        let (graph, steps) = a_late_copy_behind_a_held_tensor();
        use Step::*;
        // `x` is read last by `t` (step 6) and freed at the very end.
        let mut lazy = steps.clone();
        lazy.push(Free { tensor: 0 });
        let early = early_frees(&graph, &lazy);
        let at = |s: Step| early.iter().position(|x| *x == s).expect("present");
        assert_eq!(at(Free { tensor: 0 }), at(Compute { node: 4 }) + 1);
        // `g`'s free waits for its copy out: it stays after `h`.
        assert_eq!(at(Free { tensor: 1 }), at(Compute { node: 2 }) + 1);
        let a = simulate_steps(&graph, &lazy, BANDWIDTH).expect("valid");
        let b = simulate_steps(&graph, &early, BANDWIDTH).expect("valid");
        assert_eq!(a.total_time, b.total_time);
        assert!(b.peak_bytes <= a.peak_bytes);
    }
}
