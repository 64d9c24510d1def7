//! Orders of the K models' steps in one training step.
//!
//! An [`Interleaving`] is a topological order of the combined graph that keeps each model's
//! own node order, so each model's step runs as it would alone (its random draws and its
//! gradient sums follow its own order); the models' sequences are merged, and the
//! [`Order`] says how. Shared nodes (label `None`) keep their order among themselves; in a
//! graph whose order is fixed ([`Graph::order_is_fixed`]) each shared node is moreover a
//! barrier: everything before it in the given order stays before it, everything after it
//! after, since a fused op's effects (random draws, gradient sums) belong to every model it
//! serves.
//!
//! The merge is a list schedule over K + 1 chains (each model's nodes, then the shared
//! ones): the next node is the ready chain head with the smallest key. The given order
//! satisfies every constraint, so some head is always ready and every order is a valid
//! topological order of the combined graph.

use std::cmp::Ordering;

use super::{MultiError, Multiplexed};
use crate::error::SimError;
use crate::ir::{Graph, Node, NodeId, Phase};
use crate::lower::lower;
use crate::plan::{Decision, Step};
use crate::sim::{SimReport, simulate_steps};

/// How the K models' steps are merged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    /// MuTWO's multiplexing: model 0's forward, then model `i`'s backward beside model
    /// `i + 1`'s forward, then the last model's backward. Each pair is merged by progress
    /// (the share of its compute time each sequence has run), so one model frees activations
    /// as the other makes them, and a prefetch for one model's backward has the other's
    /// forward to hide behind.
    Interleaved,
    /// Every model's forward, then every model's backward: all activations alive at once.
    ForwardsThenBackwards,
    /// Model 0's whole step, then model 1's, ...: the least memory, nothing to hide a swap
    /// behind but the model's own backward.
    OneAfterAnother,
    /// The combined graph's own node order.
    AsGiven,
}

impl Order {
    /// Every order, in the order reports list them.
    pub const ALL: [Order; 4] = [
        Order::Interleaved,
        Order::ForwardsThenBackwards,
        Order::OneAfterAnother,
        Order::AsGiven,
    ];

    /// The name tables and plans use.
    pub fn name(self) -> &'static str {
        match self {
            Order::Interleaved => "interleaved",
            Order::ForwardsThenBackwards => "forwards-then-backwards",
            Order::OneAfterAnother => "one-after-another",
            Order::AsGiven => "as-given",
        }
    }

    /// Where a node goes in the merge: (major, progress). Smaller runs first.
    fn major(self, model: usize, phase: Phase, models: usize) -> f64 {
        let backward = usize::from(phase == Phase::Backward);
        let major = match self {
            Order::Interleaved => model + backward,
            Order::ForwardsThenBackwards => backward * models + model,
            Order::OneAfterAnother => 2 * model + backward,
            Order::AsGiven => 0,
        };
        major as f64
    }
}

/// The combined graph's nodes in one [`Order`], and the same graph renumbered in that order
/// (node `p` of [`Interleaving::graph`] is node [`Interleaving::nodes`]`[p]` of the given
/// graph), so that every strategy, which runs nodes in graph order, plans in this order.
#[derive(Clone, Debug)]
pub struct Interleaving {
    order: Order,
    nodes: Vec<NodeId>,
    position: Vec<usize>,
    graph: Graph,
}

impl Multiplexed {
    /// The K models' steps in `order` (see [`Order`]). It sits here, with the orders, so
    /// the combined graph knows nothing of them.
    pub fn interleave(&self, order: Order) -> Result<Interleaving, MultiError> {
        Interleaving::new(self, order)
    }
}

impl Interleaving {
    pub(crate) fn new(multi: &Multiplexed, order: Order) -> Result<Interleaving, MultiError> {
        let given = multi.graph();
        let nodes = if order == Order::AsGiven {
            (0..given.len()).collect()
        } else {
            let profile = memory_progress(multi);
            let cap = (order == Order::Interleaved).then(|| {
                let apart = merge(multi, &keys(multi, Order::OneAfterAnother, &profile), None);
                (store_all_peak_in(given, &apart), profile.rise.as_slice())
            });
            merge(multi, &keys(multi, order, &profile), cap)
        };
        let mut position = vec![0; nodes.len()];
        for (p, &v) in nodes.iter().enumerate() {
            position[v] = p;
        }
        let renumbered = nodes
            .iter()
            .map(|&v| {
                let node = given.node(v);
                Node {
                    inputs: node.inputs.iter().map(|&i| position[i]).collect(),
                    ..node.clone()
                }
            })
            .collect();
        let combined = |error| MultiError::Combined {
            models: multi.models(),
            error,
        };
        let mut graph = Graph::new(
            given.name(),
            renumbered,
            given.static_bytes(),
            given.time_unit_s(),
        )
        .and_then(|g| g.with_pinned(given.pinned().map(|v| position[v])))
        .map_err(combined)?;
        if given.order_is_fixed() {
            graph = graph.with_fixed_order();
        }
        Ok(Interleaving {
            order,
            nodes,
            position,
            graph,
        })
    }

    pub fn order(&self) -> Order {
        self.order
    }
    /// The given graph's nodes in this order.
    pub fn nodes(&self) -> &[NodeId] {
        &self.nodes
    }
    /// Where the given graph's node `v` runs in this order.
    pub fn position(&self, v: NodeId) -> usize {
        self.position[v]
    }
    /// The given graph renumbered in this order (same names, costs, pins and static bytes).
    pub fn graph(&self) -> &Graph {
        &self.graph
    }
    /// Whether this order differs from the given graph's.
    pub fn reorders(&self) -> bool {
        self.nodes.iter().enumerate().any(|(p, &v)| p != v)
    }

    /// Steps over the renumbered graph, as steps over the given graph's nodes.
    pub fn to_given(&self, steps: &[Step]) -> Vec<Step> {
        let at = |p: NodeId| self.nodes[p];
        steps
            .iter()
            .map(|&step| match step {
                Step::Compute { node } => Step::Compute { node: at(node) },
                Step::Free { tensor } => Step::Free { tensor: at(tensor) },
                Step::SwapOut { tensor } => Step::SwapOut { tensor: at(tensor) },
                Step::SwapIn { tensor } => Step::SwapIn { tensor: at(tensor) },
            })
            .collect()
    }

    /// Decisions over the renumbered graph (indexed by position), as decisions over the
    /// given graph (indexed and naming nodes by the given ids).
    pub fn decisions_to_given(&self, decisions: &[Decision]) -> Vec<Decision> {
        let at = |p: NodeId| self.nodes[p];
        let mut given = vec![Decision::Keep; decisions.len()];
        for (p, decision) in decisions.iter().enumerate() {
            given[at(p)] = match decision {
                Decision::Keep => Decision::Keep,
                Decision::Swap {
                    swap_out_after,
                    prefetch_at,
                    use_at,
                } => Decision::Swap {
                    swap_out_after: at(*swap_out_after),
                    prefetch_at: at(*prefetch_at),
                    use_at: at(*use_at),
                },
                Decision::Recompute {
                    from,
                    drop_after,
                    use_at,
                } => Decision::Recompute {
                    from: from.iter().map(|&f| at(f)).collect(),
                    drop_after: at(*drop_after),
                    use_at: at(*use_at),
                },
            };
        }
        given
    }

    /// Store-all in this order (each tensor freed after its last reader), over the given
    /// graph's nodes.
    pub fn store_all_steps(&self) -> Vec<Step> {
        let keep = vec![Decision::Keep; self.graph.len()];
        // Keeping everything lowers without error on any valid graph: no window to check.
        let lowered = lower(&self.graph, &keep, 1.0).map(|l| l.steps);
        self.to_given(&lowered.unwrap_or_default())
    }

    /// The simulator's peak and timing of store-all in this order at `bandwidth`.
    pub fn store_all_report(&self, bandwidth: f64) -> Result<SimReport, SimError> {
        let keep = vec![Decision::Keep; self.graph.len()];
        match lower(&self.graph, &keep, bandwidth) {
            Ok(lowered) => simulate_steps(&self.graph, &lowered.steps, bandwidth),
            Err(crate::PlanError::InvalidSchedule { error, .. }) => Err(error),
            Err(_) => Err(SimError::Bandwidth { value: bandwidth }),
        }
    }
}

/// Each node's merge key (major, progress), see [`Order`]. A model's node takes the major
/// of its model and phase and its progress by memory through that (model, phase) sequence
/// (see [`memory_progress`]); a shared node the largest key of its inputs, so it runs once
/// they have.
fn keys(multi: &Multiplexed, order: Order, profile: &Profile) -> Vec<(f64, f64)> {
    let g = multi.graph();
    let k = multi.models();
    let progress = &profile.progress;
    let mut keys = vec![(0.0, 0.0); g.len()];
    for v in 0..g.len() {
        keys[v] = match multi.label(v) {
            Some(m) => (order.major(m, g.node(v).phase, k), progress[v]),
            None => g
                .node(v)
                .inputs
                .iter()
                .map(|&i| keys[i])
                .max_by(|a, b| compare(*a, *b))
                .unwrap_or((0.0, 0.0)),
        };
    }
    keys
}

/// How far each model's node is through its model's step, by memory, in `[0, 1]`: for a
/// forward node, the share of the model's forward peak allocated once it has run; for a
/// backward node, the share of that peak freed before it runs. Measured on the model's own
/// store-all run (its nodes alone, in the given order; a tensor is freed after its last
/// reader of the same model). Merging by these keys starts a forward node of the next model
/// once the backward beside it has freed what the node's forward has allocated, so the two
/// models together hold about one model's activations, and the next forward's nodes fill
/// the backward's span, where prefetches need compute to hide behind. Both keys are made
/// non-decreasing along each model (running maxima), so the merge follows each model's
/// order. Shared nodes get 0 (their keys come from their inputs).
///
/// Also each backward node's rise: how far above its level before the node the model's own
/// live bytes will still climb in the rest of its backward (a gradient's transient), which
/// the interleaved merge keeps free for it.
fn memory_progress(multi: &Multiplexed) -> Profile {
    let g = multi.graph();
    let mut progress = vec![0.0; g.len()];
    let mut rise = vec![0u64; g.len()];
    for m in 0..multi.models() {
        let own: Vec<NodeId> = (0..g.len())
            .filter(|&v| multi.label(v) == Some(m))
            .collect();
        let mut last_read = vec![None; g.len()];
        for &v in &own {
            for &i in &g.node(v).inputs {
                last_read[i] = Some(v);
            }
        }
        let mut freed_after: Vec<Vec<NodeId>> = vec![Vec::new(); g.len()];
        for &v in &own {
            freed_after[last_read[v].unwrap_or(v)].push(v);
        }
        // Live bytes before each node allocates and while it runs.
        let mut live = 0u64;
        let mut before = Vec::with_capacity(own.len());
        let mut during = Vec::with_capacity(own.len());
        for &v in &own {
            before.push(live);
            live += g.node(v).output_bytes;
            during.push(live);
            for &t in &freed_after[v] {
                if multi.label(t) == Some(m) {
                    live -= g.node(t).output_bytes;
                }
            }
        }
        let forward = |j: usize| g.node(own[j]).phase == Phase::Forward;
        let peak = (0..own.len())
            .filter(|&j| forward(j))
            .map(|j| during[j])
            .max()
            .unwrap_or(0)
            .max(1) as f64;
        let mut highest = 0u64;
        for (j, &v) in own.iter().enumerate().rev() {
            if !forward(j) {
                highest = highest.max(during[j]);
                rise[v] = highest.saturating_sub(before[j]);
            }
        }
        let (mut allocated, mut freed) = (0.0f64, 0.0f64);
        for (j, &v) in own.iter().enumerate() {
            progress[v] = if forward(j) {
                allocated = allocated.max(during[j] as f64 / peak);
                allocated
            } else {
                freed = freed.max((peak - before[j] as f64) / peak);
                freed
            };
        }
    }
    Profile { progress, rise }
}

/// [`memory_progress`]'s measurements, indexed by node.
struct Profile {
    progress: Vec<f64>,
    rise: Vec<u64>,
}

/// Store-all's peak when `g`'s nodes run in `order` (each tensor freed after its last
/// reader in that order).
fn store_all_peak_in(g: &Graph, order: &[NodeId]) -> u64 {
    let mut reads_left: Vec<usize> = (0..g.len()).map(|v| g.users(v).len()).collect();
    let mut live = g.static_bytes();
    let mut peak = live;
    for &v in order {
        live += g.node(v).output_bytes;
        peak = peak.max(live);
        live -= release(g, v, &mut reads_left);
    }
    peak
}

/// Bytes freed once `v` has run: its inputs it was the last reader of, and its own output
/// when nothing reads it.
fn release(g: &Graph, v: NodeId, reads_left: &mut [usize]) -> u64 {
    let mut freed = 0;
    for &i in &g.node(v).inputs {
        reads_left[i] -= 1;
        if reads_left[i] == 0 {
            freed += g.node(i).output_bytes;
        }
    }
    if g.users(v).is_empty() {
        freed += g.node(v).output_bytes;
    }
    freed
}

fn compare(a: (f64, f64), b: (f64, f64)) -> Ordering {
    a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1))
}

/// Chain `k < K`: model `k`'s nodes; chain K: the shared nodes; each in the given order.
/// Also, per node, the last shared node given before it.
fn chains(multi: &Multiplexed) -> (Vec<Vec<NodeId>>, Vec<Option<NodeId>>) {
    let mut chains: Vec<Vec<NodeId>> = vec![Vec::new(); multi.models() + 1];
    let mut last_shared = None;
    let shared_before = (0..multi.graph().len())
        .map(|v| {
            chains[multi.label(v).unwrap_or(multi.models())].push(v);
            let before = last_shared;
            if multi.label(v).is_none() {
                last_shared = Some(v);
            }
            before
        })
        .collect();
    (chains, shared_before)
}

/// The list schedule over the models' chains and the shared chain (see the module docs).
///
/// With a `cap` (bytes, and each backward node's rise from [`memory_progress`]), a forward
/// node is passed over while running it would leave less room under the cap than the
/// backward heads still need to climb (store-all accounting), so merging never costs more
/// memory than the cap unless nothing else is ready; the interleaved order uses the peak of
/// one model after another as its cap.
fn merge(multi: &Multiplexed, keys: &[(f64, f64)], cap: Option<(u64, &[u64])>) -> Vec<NodeId> {
    let g = multi.graph();
    let fixed = g.order_is_fixed();
    let (chains, shared_before) = chains(multi);
    let mut head = vec![0usize; chains.len()];
    let mut done = vec![false; g.len()];
    let mut order = Vec::with_capacity(g.len());
    let mut reads_left: Vec<usize> = (0..g.len()).map(|v| g.users(v).len()).collect();
    let mut live = g.static_bytes();
    while order.len() < g.len() {
        let next_of = |c: usize| chains[c].get(head[c]).copied();
        let ready = |v: NodeId| {
            let inputs = g.node(v).inputs.iter().all(|&i| done[i]);
            let barrier = !fixed
                || match multi.label(v) {
                    // Everything given before a shared node has run.
                    None => (0..multi.models()).all(|c| next_of(c).is_none_or(|h| h > v)),
                    // The shared node given before it has run.
                    Some(_) => shared_before[v].is_none_or(|s| done[s]),
                };
            inputs && barrier
        };
        let mut candidates: Vec<NodeId> = (0..chains.len())
            .filter_map(next_of)
            .filter(|&v| ready(v))
            .collect();
        candidates.sort_by(|&a, &b| compare(keys[a], keys[b]).then(a.cmp(&b)));
        let fits = |v: NodeId| {
            let Some((cap, rise)) = cap else { return true };
            let is_forward = multi.label(v).is_some() && g.node(v).phase == Phase::Forward;
            let climb = candidates
                .iter()
                .filter(|&&b| g.node(b).phase == Phase::Backward)
                .map(|&b| rise[b])
                .max()
                .unwrap_or(0);
            !is_forward || live + g.node(v).output_bytes + climb <= cap
        };
        let pick = candidates
            .iter()
            .copied()
            .find(|&v| fits(v))
            .or(candidates.first().copied());
        // The given order meets every constraint, so its earliest unscheduled node, which
        // heads its chain, is always ready; the fallback only guards that invariant.
        let v = pick.unwrap_or_else(|| (0..g.len()).find(|&v| !done[v]).unwrap_or(0));
        live += g.node(v).output_bytes;
        live -= release(g, v, &mut reads_left);
        let chain = multi.label(v).unwrap_or(multi.models());
        head[chain] += 1;
        done[v] = true;
        order.push(v);
    }
    order
}

#[cfg(test)]
mod tests;
