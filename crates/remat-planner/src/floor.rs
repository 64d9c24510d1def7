//! The recompute floor: the least peak that recomputation alone (no swaps) can reach on a
//! graph, exact on small graphs and a certified lower bound on large ones.
//!
//! [`Graph::memory_floor`] (static bytes plus the largest "one output plus all its inputs")
//! is exact when swaps are allowed: every other tensor can wait on the host. Without swaps
//! it can be far too low, because a pinned tensor ([`Graph::with_pinned`]: computed exactly
//! once, never recomputed) must stay on the device from its one computation until its last
//! reader has run, whatever else is computed in between. [`recompute_floor`] counts those
//! tensors.
//!
//! **The schedules it ranges over.** Every schedule the simulator accepts that has no swap
//! (each `Compute` has its inputs on the device, a pinned node is computed once, every node
//! is computed at least once), and, for a graph whose order is fixed
//! ([`Graph::order_is_fixed`]), whose first computations follow node order, as every planner
//! keeps them there.
//!
//! **The certified bound ([`certified_recompute_floor`]).** Take any node `v` and the step
//! `s` of its first computation. At `s` the device holds static memory, `v`'s inputs and
//! `v`'s output (allocated before the op runs). It also holds every pinned tensor `p` that
//! is neither `v` nor one of its inputs when both hold:
//! 1. `p` was computed before `s`: `p` is a strict ancestor of `v` (every computation of `v`
//!    reads its inputs, each computed before it, and so on up the graph), or, with a fixed
//!    order, `p` comes before `v` in node order;
//! 2. some reader `u` of `p` is computed after `s`: `u` is a strict descendant of `v` (every
//!    computation of `u` follows one of `v`), or, with a fixed order, `u` comes after `v`
//!    (its first computation follows `v`'s).
//!
//! `u` is computed at least once and reads `p` then; `p` cannot be computed again nor come
//! back from the host, so it stays on the device from its one computation to `u`'s, across
//! `s`. These tensors are distinct, so the peak is at least their sum.
//!
//! It also looks one computation back from `s`. Each input `i` of `v` is on the device at
//! `s` without a swap, so it was computed last at some step before `s` and held from there
//! on; let `j` be the input computed last, at step `t`. At `t` the device holds `j`, its
//! inputs (read then) and every other input of `v` (each computed before `t` and held
//! until `s`): `v`'s inputs plus those inputs of `j` that are not inputs of `v`. Which
//! input is `j` depends on the schedule, so the bound takes the least over `j`. On graphs
//! whose nodes read several earlier ones this is well above the largest operation
//! (Moccasin's random layered graph of 1,000 nodes: 46.05 KB against 36.76 KB; of 5,000:
//! 96.69 KB against 74.38 KB).
//!
//! The bound is the largest of these sums over `v`. With no pinned tensor it is at least
//! [`Graph::memory_floor`], and it is never below it.
//!
//! **Exact on small graphs ([`least_recompute_peak`]).** A search over the states (computed
//! at least once, on the device): computing a node raises the peak to static + the resident
//! bytes + its output, freeing costs nothing; the least largest step cost from nothing to
//! "all computed" (a bottleneck shortest path, by Dijkstra) is the least peak, and the
//! search ends early once it has seen more states than its limit.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use serde::Serialize;

use crate::ir::{Graph, NodeId};
use crate::plan::Step;
use crate::solve::order::Precedence;

/// Graphs of at most this many nodes get the exact least peak ([`least_recompute_peak`]).
pub const EXACT_NODES: usize = 12;

/// States the exact search visits at most before [`recompute_floor`] falls back to the
/// certified bound.
pub const EXACT_STATE_LIMIT: usize = 500_000;

/// The least peak of recompute-only schedules, or a lower bound on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RecomputeFloor {
    /// Bytes, static memory included.
    pub bytes: u64,
    /// Whether `bytes` is the least peak itself (found by the exact search) rather than a
    /// certified lower bound on it.
    pub exact: bool,
}

/// What a recompute floor is, in the words of the errors that name it.
pub fn floor_kind(exact: bool) -> &'static str {
    if exact {
        "the least peak of any schedule without swaps"
    } else {
        "a lower bound on the peak of any schedule without swaps: the largest operation with \
         the pinned tensors held across it, or an operation's inputs when its last-made input \
         was made"
    }
}

/// The recompute floor of `graph`: exact for graphs of at most [`EXACT_NODES`] nodes (the
/// search of [`least_recompute_peak`]), else [`certified_recompute_floor`]. Never above the
/// least peak of any recompute-only schedule (see the module docs), never below
/// [`Graph::memory_floor`].
pub fn recompute_floor(graph: &Graph) -> RecomputeFloor {
    let exact = (graph.len() <= EXACT_NODES)
        .then(|| least_recompute_peak(graph, EXACT_STATE_LIMIT))
        .flatten();
    if let Some(bytes) = exact {
        return RecomputeFloor { bytes, exact: true };
    }
    RecomputeFloor {
        bytes: certified_recompute_floor(graph),
        exact: false,
    }
}

/// The certified lower bound of the module docs: static bytes plus, over every node `v`, the
/// largest sum of `v`'s output, its inputs, and the pinned tensors that must be on the
/// device when `v` is first computed. `O(nodes + edges)` per 64 pinned tensors.
pub fn certified_recompute_floor(graph: &Graph) -> u64 {
    let extra = if graph.order_is_fixed() {
        pinned_across_in_order(graph)
    } else {
        pinned_across_in_dag(graph)
    };
    let largest = (0..graph.len())
        .map(|v| {
            operation_bytes(graph, v)
                .saturating_add(extra[v])
                .max(last_input_bytes(graph, v))
        })
        .max()
        .unwrap_or(0);
    graph.static_bytes().saturating_add(largest)
}

/// A node's output plus its inputs: what its computation holds by itself.
fn operation_bytes(graph: &Graph, v: NodeId) -> u64 {
    let node = graph.node(v);
    node.inputs
        .iter()
        .map(|&i| graph.node(i).output_bytes)
        .fold(node.output_bytes, u64::saturating_add)
}

/// The look one computation back of the module docs: `v`'s inputs, and the least over its
/// inputs `j` of `j`'s own inputs that are not inputs of `v` (held when `j` was computed
/// last). 0 for a node without inputs.
fn last_input_bytes(graph: &Graph, v: NodeId) -> u64 {
    let mut inputs = graph.node(v).inputs.clone();
    inputs.sort_unstable();
    inputs.dedup();
    let bytes = |i: NodeId| graph.node(i).output_bytes;
    let own: u64 = inputs
        .iter()
        .map(|&i| bytes(i))
        .fold(0, u64::saturating_add);
    let least_extra = inputs
        .iter()
        .map(|&j| {
            let mut before = graph.node(j).inputs.clone();
            before.sort_unstable();
            before.dedup();
            before
                .into_iter()
                .filter(|k| inputs.binary_search(k).is_err())
                .map(bytes)
                .fold(0, u64::saturating_add)
        })
        .min();
    least_extra.map_or(0, |extra| own.saturating_add(extra))
}

/// Fixed order: pinned `p` is on the device at `v`'s first computation when `p < v` and a
/// reader of `p` comes after `v`, i.e. `p < v < last_use(p)`, unless `p` is an input of `v`.
/// A difference array over node order, then the inputs taken back out.
fn pinned_across_in_order(graph: &Graph) -> Vec<u64> {
    let n = graph.len();
    let mut delta = vec![0i128; n + 1];
    for p in graph.pinned() {
        let last = graph.last_use(p);
        if last > p + 1 {
            let bytes = i128::from(graph.node(p).output_bytes);
            delta[p + 1] += bytes;
            delta[last] -= bytes;
        }
    }
    let mut running = 0i128;
    (0..n)
        .map(|v| {
            running += delta[v];
            let inputs_counted: i128 = graph
                .node(v)
                .inputs
                .iter()
                .filter(|&&i| graph.is_pinned(i) && i < v && v < graph.last_use(i))
                .map(|&i| i128::from(graph.node(i).output_bytes))
                .sum();
            u64::try_from(running - inputs_counted).unwrap_or(0)
        })
        .collect()
}

/// Free order: pinned `p` is on the device at `v`'s first computation when `p` is a strict
/// ancestor of `v` and a reader of `p` a strict descendant of `v`, unless `p` is an input of
/// `v`. Ancestors and descendants are those of every schedule's precedence
/// ([`Precedence`]): the data edges and the chain of each pinned tensor's readers, which
/// run in node order (each may write it in place; the simulator refuses another order). A
/// gradient buffer's last reader, the step's end, thus comes after every backward
/// operation below its writer, and the buffer is held across them as in node order.
/// Pinned tensors are taken 64 at a time as bits: `ancestors[v]` (in node order, which the
/// precedence respects) and `reaches[v]`, the pinned tensors with a reader strictly below
/// `v` (in reverse node order).
fn pinned_across_in_dag(graph: &Graph) -> Vec<u64> {
    let n = graph.len();
    let prec = Precedence::of(graph);
    let pinned: Vec<NodeId> = graph.pinned().collect();
    let mut extra = vec![0u64; n];
    let mut bit = vec![None; n];
    let mut ancestors = vec![0u64; n];
    let mut reaches = vec![0u64; n];
    for block in pinned.chunks(64) {
        bit.iter_mut().for_each(|b| *b = None);
        for (k, &p) in block.iter().enumerate() {
            bit[p] = Some(1u64 << k);
        }
        let own = |id: NodeId| bit[id].unwrap_or(0);
        for v in 0..n {
            ancestors[v] = prec.preds[v]
                .iter()
                .fold(0, |acc, &i| acc | ancestors[i] | own(i));
        }
        for v in (0..n).rev() {
            reaches[v] = prec.succs[v].iter().fold(0, |acc, &u| {
                let read_by_u = graph.node(u).inputs.iter().fold(0, |m, &i| m | own(i));
                acc | reaches[u] | read_by_u
            });
        }
        for v in 0..n {
            let inputs = graph.node(v).inputs.iter().fold(own(v), |m, &i| m | own(i));
            let mut held = ancestors[v] & reaches[v] & !inputs;
            while held != 0 {
                let k = held.trailing_zeros() as usize;
                extra[v] = extra[v].saturating_add(graph.node(block[k]).output_bytes);
                held &= held - 1;
            }
        }
    }
    extra
}

/// The least peak over recompute-only schedules (see the module docs); `None` when the
/// graph has more than 64 nodes or the search would visit more than `state_limit` states.
pub fn least_recompute_peak(graph: &Graph, state_limit: usize) -> Option<u64> {
    least_recompute_schedule(graph, state_limit).map(|(peak, _)| peak)
}

/// [`least_recompute_peak`] with a schedule that reaches it (computes and frees only), found
/// by a bottleneck Dijkstra over (computed, resident) node sets.
pub fn least_recompute_schedule(graph: &Graph, state_limit: usize) -> Option<(u64, Vec<Step>)> {
    let n = graph.len();
    if n > 64 {
        return None;
    }
    let all = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
    let input_mask: Vec<u64> = (0..n)
        .map(|v| graph.node(v).inputs.iter().fold(0, |m, &i| m | 1 << i))
        .collect();
    let bytes_of = |set: u64| -> u64 {
        (0..n)
            .filter(|&i| set >> i & 1 == 1)
            .map(|i| graph.node(i).output_bytes)
            .fold(0, u64::saturating_add)
    };
    // A first computation also waits for its precedence (the earlier readers of a pinned
    // input, and in a fixed order every earlier node): see [`Precedence`].
    let prec = Precedence::of(graph);
    let first_after: Vec<u64> = prec
        .preds
        .iter()
        .map(|preds| preds.iter().fold(0, |m, &p| m | 1 << p))
        .collect();
    let start: State = (0, 0);
    let mut best: Reached = HashMap::new();
    let mut queue = BinaryHeap::new();
    best.insert(start, (graph.static_bytes(), None));
    queue.push(Reverse((graph.static_bytes(), start)));
    while let Some(Reverse((peak, state))) = queue.pop() {
        if best.get(&state).is_some_and(|&(b, _)| b < peak) {
            continue;
        }
        let (computed, resident) = state;
        if computed == all {
            return Some((peak, walk_back(&best, state)));
        }
        if best.len() > state_limit {
            return None;
        }
        let live = graph.static_bytes().saturating_add(bytes_of(resident));
        let mut next = Vec::new();
        for (v, &needs) in input_mask.iter().enumerate() {
            let bit = 1u64 << v;
            if resident & bit != 0 {
                next.push((peak, (computed, resident & !bit), Step::Free { tensor: v }));
                continue;
            }
            let first = computed & bit == 0;
            let blocked = needs & !resident != 0
                || (!first && graph.is_pinned(v))
                || (first && first_after[v] & !computed != 0);
            if !blocked {
                let reached = peak.max(live.saturating_add(graph.node(v).output_bytes));
                let to = (computed | bit, resident | bit);
                next.push((reached, to, Step::Compute { node: v }));
            }
        }
        for (cost, to, step) in next {
            if best.get(&to).is_none_or(|&(b, _)| cost < b) {
                best.insert(to, (cost, Some((state, step))));
                queue.push(Reverse((cost, to)));
            }
        }
    }
    None
}

/// (computed at least once, on the device), one bit per node.
type State = (u64, u64);

/// Each state's least peak so far and the state and step it was reached from.
type Reached = HashMap<State, (u64, Option<(State, Step)>)>;

/// The steps from the empty state to `end`, following each state's best predecessor.
fn walk_back(best: &Reached, end: State) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut at = end;
    while let Some(&(_, Some((from, step)))) = best.get(&at) {
        steps.push(step);
        at = from;
    }
    steps.reverse();
    steps
}

#[cfg(test)]
mod tests;
