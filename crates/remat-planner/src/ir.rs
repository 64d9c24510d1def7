//! The graph IR: operations in a fixed execution order, each producing one tensor.
//!
//! A [`Graph`] is an index arena: node `i` is the `i`-th operation of the training step and
//! also names the tensor it produces. Inputs always point to earlier nodes, so the node
//! order is a topological order and is the schedule when nothing is recomputed or swapped.
//! Graphs are only built through [`Graph::new`], which checks every invariant the simulator
//! and the strategies rely on.
//!
//! **Pinned nodes.** [`Graph::with_pinned`] marks nodes whose tensor must be computed exactly
//! once: a pinned tensor may be kept or swapped out and back, never dropped and recomputed.
//! The engine's gradient buffers are the case in point: later backward ops accumulate into
//! them in place, so running the zero-cost node that creates one a second time would
//! silently restart the sum. The mark lives on the graph rather than on [`Node`] so every
//! existing node literal stays valid; the simulator rejects a plan that computes a pinned
//! node twice, and [`Graph::may_drop`] tells strategies which tensors they may recompute.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Index of a node in [`Graph::nodes`]; the tensor a node produces has the same index.
pub type NodeId = usize;

/// A graph that breaks an IR invariant (what [`Graph::new`] checks). It lives beside the
/// graph so the IR imports no other module of the crate.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum GraphError {
    #[error("node `{node}`: input {input} does not exist")]
    MissingInput { node: String, input: String },
    #[error("node `{node}`: input {input} comes at or after it, so the order is not topological")]
    NotTopological { node: String, input: String },
    #[error("node `{node}`: input {input} is listed twice")]
    DuplicateInput { node: String, input: NodeId },
    #[error("node `{node}`: field `{field}` is {value}, it must be finite and non-negative")]
    Cost {
        node: String,
        field: &'static str,
        value: f64,
    },
    #[error("time unit {value} s is not a positive finite number")]
    TimeUnit { value: f64 },
    #[error("the graph has no operations")]
    Empty,
    #[error(
        "node `{node}`: static bytes plus the output bytes of every node up to it exceed 2^64 bytes"
    )]
    BytesOverflow { node: String },
    #[error(
        "node `{node}`: the total compute time reaches {total:e}, too large to simulate (with recomputations it would not stay a finite number)"
    )]
    TimeOverflow { node: String, total: f64 },
    #[error("pinned node {id} does not exist: the graph has {count} nodes")]
    PinnedMissing { id: NodeId, count: usize },
    #[error(
        "graph `{graph}` marks no backward node: the eager order recomputes only in the backward pass, so it needs the nodes' phases (`phase: backward` from the loss on)"
    )]
    EagerWithoutBackward { graph: String },
}

/// Which pass of the training step an operation belongs to. The loss counts as backward,
/// as in Checkmate's graphs: it is the first operation that exists only for training.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Forward,
    Backward,
}

/// One operation and the tensor it produces.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    pub phase: Phase,
    /// Time to compute the operation once, in the graph's time unit
    /// ([`Graph::time_unit_s`] seconds).
    pub compute_time: f64,
    /// Bytes of the tensor the operation produces.
    pub output_bytes: u64,
    /// Nodes whose outputs this operation reads, each listed once.
    pub inputs: Vec<NodeId>,
}

/// A validated training graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    name: String,
    nodes: Vec<Node>,
    /// Parameters, gradients and optimizer state: resident for the whole step.
    static_bytes: u64,
    /// Seconds per unit of [`Node::compute_time`]; swap times are converted with it.
    time_unit_s: f64,
    /// `users[v]`: the nodes reading `v`'s output, ascending.
    users: Vec<Vec<NodeId>>,
    /// `pinned[v]`: `v` must be computed exactly once (see the module docs).
    pinned: Vec<bool>,
    /// `may_drop[v]`: see [`Graph::may_drop`]; derived from `pinned`.
    may_drop: Vec<bool>,
    /// Whether schedules must compute nodes for the first time in node order (see
    /// [`Graph::with_fixed_order`]).
    fixed_order: bool,
    /// With the eager order ([`Graph::with_eager_order`]), `held_until[v]`: the node before
    /// whose first computation `v` may not leave the device ([`Graph::eager_holds`]).
    held_until: Option<Vec<NodeId>>,
}

impl Graph {
    /// Builds a graph and checks it: every input names an earlier node (a later or missing
    /// one is a link to a missing node or an order that is not topological), costs are
    /// finite and non-negative, no input is listed twice.
    pub fn new(
        name: impl Into<String>,
        nodes: Vec<Node>,
        static_bytes: u64,
        time_unit_s: f64,
    ) -> Result<Graph, GraphError> {
        if !(time_unit_s.is_finite() && time_unit_s > 0.0) {
            return Err(GraphError::TimeUnit { value: time_unit_s });
        }
        if nodes.is_empty() {
            return Err(GraphError::Empty);
        }
        for (id, node) in nodes.iter().enumerate() {
            check_node(id, node, nodes.len())?;
        }
        check_totals(&nodes, static_bytes)?;
        let mut users = vec![Vec::new(); nodes.len()];
        for (id, node) in nodes.iter().enumerate() {
            for &input in &node.inputs {
                users[input].push(id);
            }
        }
        let count = nodes.len();
        Ok(Graph {
            name: name.into(),
            nodes,
            static_bytes,
            time_unit_s,
            users,
            pinned: vec![false; count],
            may_drop: vec![true; count],
            fixed_order: false,
            held_until: None,
        })
    }

    /// The same graph with every compute time set to 1: for heuristics that should also try
    /// a choice that depends on the graph's structure only, not on profiled (noisy) times.
    pub fn with_unit_costs(&self) -> Graph {
        let mut g = self.clone();
        for node in &mut g.nodes {
            node.compute_time = 1.0;
        }
        g
    }

    /// The same graph with the nodes `ids` pinned (computed exactly once: kept or swapped,
    /// never dropped and recomputed), in addition to any already pinned. An id that names
    /// no node is an error.
    pub fn with_pinned(
        mut self,
        ids: impl IntoIterator<Item = NodeId>,
    ) -> Result<Graph, GraphError> {
        for id in ids {
            let Some(mark) = self.pinned.get_mut(id) else {
                return Err(GraphError::PinnedMissing {
                    id,
                    count: self.nodes.len(),
                });
            };
            *mark = true;
        }
        self.may_drop = droppable(&self.nodes, &self.pinned, &self.users);
        Ok(self)
    }

    /// The same graph, marked so that no planner changes the order of first computations.
    ///
    /// A planner may otherwise run the operations in any topological order that lowers
    /// memory (see [`crate::solve`]). Graphs whose operations have side effects in node
    /// order need the mark: the engine's profiled steps draw dropout masks from one random
    /// stream in node order, and sum gradient contributions into buffers in node order, so
    /// another order would change the bits of the result.
    pub fn with_fixed_order(mut self) -> Graph {
        self.fixed_order = true;
        self
    }

    /// Whether first computations must follow node order ([`Graph::with_fixed_order`]).
    pub fn order_is_fixed(&self) -> bool {
        self.fixed_order
    }

    /// The same graph, planned in the eager order: the plans PyTorch's autograd runs as they
    /// are (see [`crate::eager`] for the rules and the checks). Fixes the node order too.
    /// A graph without backward nodes is refused: the form recomputes only in the backward.
    ///
    /// The mark lives on the graph, as the fixed order does, so that every strategy sees it
    /// through the [`crate::problem::Problem`] it already takes: the eviction keeps a held
    /// tensor ([`Graph::eager_may_leave`]) and [`crate::problem::plan_from_steps`] puts any
    /// strategy's schedule into the form before the simulator judges it.
    pub fn with_eager_order(mut self) -> Result<Graph, GraphError> {
        if !self.has_backward() {
            return Err(GraphError::EagerWithoutBackward {
                graph: self.name.clone(),
            });
        }
        self.held_until = Some(self.eager_holds());
        self.fixed_order = true;
        Ok(self)
    }

    /// Whether plans must be in the eager order ([`Graph::with_eager_order`]).
    pub fn order_is_eager(&self) -> bool {
        self.held_until.is_some()
    }

    /// For every tensor, the node until whose first computation eager autograd holds it on
    /// the device: a forward tensor until its last forward reader (the model's code holds
    /// it until then; only the copy autograd saves may be dropped or offloaded), a backward
    /// tensor until its last reader (autograd frees it, nothing rebuilds or offloads it).
    /// A tensor with no such reader is held by nobody after its own computation (the entry
    /// is the tensor itself). Computed from the phases, whether the graph is marked or not.
    pub fn eager_holds(&self) -> Vec<NodeId> {
        (0..self.len())
            .map(|v| {
                let backward = self.nodes[v].phase == Phase::Backward;
                self.users[v]
                    .iter()
                    .rev()
                    .find(|&&u| backward || self.nodes[u].phase == Phase::Forward)
                    .copied()
                    .unwrap_or(v)
            })
            .collect()
    }

    /// Whether, in a graph planned in the eager order, `tensor` may leave the device
    /// (be freed, to be swapped back or rebuilt) once `now`'s first computation has run:
    /// not while a node that holds it is still ahead. Always true in other orders.
    pub fn eager_may_leave(&self, tensor: NodeId, now: NodeId) -> bool {
        match &self.held_until {
            Some(held) => held.get(tensor).is_none_or(|&h| h <= now),
            None => true,
        }
    }

    /// Whether `id` must be computed exactly once (kept or swapped, never recomputed).
    pub fn is_pinned(&self, id: NodeId) -> bool {
        self.pinned.get(id).copied().unwrap_or(false)
    }

    /// The pinned nodes, ascending.
    pub fn pinned(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.pinned
            .iter()
            .enumerate()
            .filter_map(|(id, &p)| p.then_some(id))
    }

    /// Whether a strategy may drop `id` while it still has readers and recompute it for
    /// them. False for a pinned tensor, and for a tensor whose recomputation for its last
    /// reader could need a pinned tensor that is already dead by then: recomputing it
    /// reads its inputs, rebuilding any that were dropped from their own inputs, and the
    /// first pinned tensor met on such a path must still be on the device (its last reader
    /// not yet run) since it cannot be rebuilt. Conservative: it assumes every unpinned
    /// ancestor may have been dropped.
    pub fn may_drop(&self, id: NodeId) -> bool {
        self.may_drop.get(id).copied().unwrap_or(false)
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id]
    }
    pub fn len(&self) -> usize {
        self.nodes.len()
    }
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
    pub fn static_bytes(&self) -> u64 {
        self.static_bytes
    }
    pub fn time_unit_s(&self) -> f64 {
        self.time_unit_s
    }
    /// The nodes reading `id`'s output, in execution order.
    pub fn users(&self, id: NodeId) -> &[NodeId] {
        &self.users[id]
    }
    /// Time of one pass over the graph with nothing recomputed.
    pub fn base_time(&self) -> f64 {
        self.nodes.iter().map(|n| n.compute_time).sum()
    }
    /// Whether the graph marks a backward pass (Checkmate's training graphs do, general
    /// DAGs such as the random layered graph do not).
    pub fn has_backward(&self) -> bool {
        self.nodes.iter().any(|n| n.phase == Phase::Backward)
    }
    /// The last node that reads `id`'s output, or `id` itself when nothing reads it.
    pub fn last_use(&self, id: NodeId) -> NodeId {
        self.users[id].last().copied().unwrap_or(id)
    }
    /// Peak memory with nothing recomputed: each output lives from its producer until its
    /// last reader has run (an output nobody reads lives only during its own operation).
    pub fn store_all_peak(&self) -> u64 {
        let mut freed_after: Vec<Vec<NodeId>> = vec![Vec::new(); self.len()];
        for id in 0..self.len() {
            freed_after[self.last_use(id)].push(id);
        }
        let mut live = self.static_bytes;
        let mut peak = live;
        for (id, node) in self.nodes.iter().enumerate() {
            live += node.output_bytes;
            peak = peak.max(live);
            for &done in &freed_after[id] {
                live -= self.nodes[done].output_bytes;
            }
        }
        peak
    }
    /// The least memory any schedule needs: the largest "one output plus all its inputs"
    /// (plus static memory). No strategy can go below it.
    pub fn memory_floor(&self) -> u64 {
        let largest = self.nodes.iter().map(|n| {
            n.output_bytes
                + n.inputs
                    .iter()
                    .map(|&i| self.nodes[i].output_bytes)
                    .sum::<u64>()
        });
        self.static_bytes + largest.max().unwrap_or(0)
    }
}

/// [`Graph::may_drop`] for every node: `horizon[v]` is the earliest last use among the
/// pinned tensors that a recomputation of `v` may have to read (directly, or through unpinned
/// ancestors that may have been dropped too); `v` may be dropped when its own last use comes
/// no later than that. One pass in node order, since inputs come first.
fn droppable(nodes: &[Node], pinned: &[bool], users: &[Vec<NodeId>]) -> Vec<bool> {
    let last_use = |id: NodeId| users[id].last().copied().unwrap_or(id);
    let mut horizon = vec![NodeId::MAX; nodes.len()];
    for (id, node) in nodes.iter().enumerate() {
        horizon[id] = node
            .inputs
            .iter()
            .map(|&i| if pinned[i] { last_use(i) } else { horizon[i] })
            .min()
            .unwrap_or(NodeId::MAX);
    }
    // A tensor nobody reads is never needed again, so dropping it costs no recomputation.
    (0..nodes.len())
        .map(|id| !pinned[id] && (users[id].is_empty() || last_use(id) <= horizon[id]))
        .collect()
}

fn check_node(id: NodeId, node: &Node, count: usize) -> Result<(), GraphError> {
    let bad_cost = |field: &'static str, value: f64| GraphError::Cost {
        node: node.name.clone(),
        field,
        value,
    };
    if !(node.compute_time.is_finite() && node.compute_time >= 0.0) {
        return Err(bad_cost("compute_time", node.compute_time));
    }
    let mut seen = std::collections::HashSet::new();
    for &input in &node.inputs {
        if input >= count {
            return Err(GraphError::MissingInput {
                node: node.name.clone(),
                input: input.to_string(),
            });
        }
        if input >= id {
            return Err(GraphError::NotTopological {
                node: node.name.clone(),
                input: format!("{} (node {input})", input_name(input)),
            });
        }
        if !seen.insert(input) {
            return Err(GraphError::DuplicateInput {
                node: node.name.clone(),
                input,
            });
        }
    }
    Ok(())
}

/// Bounds every sum the simulator and the strategies form, so none wraps or leaves the
/// finite numbers: device memory never exceeds static bytes plus every output once (a
/// tensor is on the device at most once), so that sum must fit in a u64; time sums include
/// recomputations, which a plan may repeat up to about once per node per node, so the base
/// time times n^2 must stay finite.
fn check_totals(nodes: &[Node], static_bytes: u64) -> Result<(), GraphError> {
    let mut bytes = static_bytes;
    let mut time = 0.0f64;
    let headroom = (nodes.len() as f64 + 1.0).powi(2);
    for node in nodes {
        bytes = bytes
            .checked_add(node.output_bytes)
            .ok_or_else(|| GraphError::BytesOverflow {
                node: node.name.clone(),
            })?;
        time += node.compute_time;
        if !(time * headroom).is_finite() {
            return Err(GraphError::TimeOverflow {
                node: node.name.clone(),
                total: time,
            });
        }
    }
    Ok(())
}

/// A forward node of `bytes` output and `time` compute reading `inputs`: the graphs that
/// unit tests build by hand.
#[cfg(test)]
pub(crate) fn test_node(name: &str, bytes: u64, time: f64, inputs: Vec<NodeId>) -> Node {
    Node {
        name: name.into(),
        phase: Phase::Forward,
        compute_time: time,
        output_bytes: bytes,
        inputs,
    }
}

fn input_name(id: NodeId) -> String {
    format!("#{id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_times_print_in_scientific_notation() {
        let text = GraphError::TimeOverflow {
            node: "n".into(),
            total: 1e308,
        }
        .to_string();
        assert!(text.contains("1e308") && text.len() < 200, "{text}");
    }

    fn node(name: &str, bytes: u64, inputs: Vec<NodeId>) -> Node {
        Node {
            name: name.into(),
            phase: Phase::Forward,
            compute_time: 1.0,
            output_bytes: bytes,
            inputs,
        }
    }

    #[test]
    fn store_all_peak_frees_after_last_reader() {
        // a(10) -> b(20) -> c(5); c also reads a. While c runs: a, b, c live = 35.
        let g = Graph::new(
            "t",
            vec![
                node("a", 10, vec![]),
                node("b", 20, vec![0]),
                node("c", 5, vec![0, 1]),
            ],
            100,
            1.0,
        )
        .unwrap();
        assert_eq!(g.store_all_peak(), 135);
        assert_eq!(g.memory_floor(), 135);
        assert_eq!(g.users(0), &[1, 2]);
    }

    #[test]
    fn rejects_empty_graphs_and_totals_that_overflow() {
        assert_eq!(Graph::new("t", vec![], 0, 1.0), Err(GraphError::Empty));
        // Two outputs of 2^63 bytes: the second one makes the sum wrap a u64.
        let big = vec![node("a", 1 << 63, vec![]), node("b", 1 << 63, vec![0])];
        assert_eq!(
            Graph::new("t", big, 0, 1.0),
            Err(GraphError::BytesOverflow { node: "b".into() })
        );
        // Static bytes count too.
        let err = Graph::new("t", vec![node("a", 2, vec![])], u64::MAX - 1, 1.0).unwrap_err();
        assert!(err.to_string().contains("`a`") && err.to_string().contains("2^64"));
        // A finite but huge cost leaves no room for recomputation sums.
        let mut slow = node("slow", 1, vec![]);
        slow.compute_time = 1e308;
        let err = Graph::new("t", vec![slow], 0, 1.0).unwrap_err();
        assert!(
            matches!(err, GraphError::TimeOverflow { ref node, .. } if node == "slow"),
            "{err}"
        );
    }

    #[test]
    fn pins_are_validated_and_limit_what_may_be_dropped() {
        // p (pinned) is last read by b. Recomputing a for b finds p alive, but recomputing b
        // for c needs p (directly and through a), which is dead by then. c and q have no
        // readers: dropping them never calls for a recomputation.
        let g = Graph::new(
            "t",
            vec![
                node("p", 1, vec![]),
                node("a", 1, vec![0]),
                node("b", 1, vec![1, 0]),
                node("c", 1, vec![2]),
                node("q", 1, vec![]),
            ],
            0,
            1.0,
        )
        .unwrap();
        assert!((0..5).all(|id| g.may_drop(id) && !g.is_pinned(id)));
        let err = g.clone().with_pinned([0, 5]).unwrap_err();
        assert_eq!(err, GraphError::PinnedMissing { id: 5, count: 5 });
        assert!(err.to_string().contains("node 5"), "{err}");
        let pinned = g.with_pinned([0]).unwrap();
        assert!(pinned.is_pinned(0) && !pinned.is_pinned(1) && !pinned.is_pinned(9));
        assert_eq!(pinned.pinned().collect::<Vec<_>>(), vec![0]);
        let may: Vec<bool> = (0..5).map(|id| pinned.may_drop(id)).collect();
        assert_eq!(may, vec![false, true, false, true, true]);
    }

    #[test]
    fn rejects_later_input_and_negative_cost() {
        let err = Graph::new(
            "t",
            vec![node("a", 1, vec![1]), node("b", 1, vec![])],
            0,
            1.0,
        )
        .unwrap_err();
        assert!(err.to_string().contains("`a`"), "{err}");
        let mut n = node("neg", 1, vec![]);
        n.compute_time = -1.0;
        let err = Graph::new("t", vec![n], 0, 1.0).unwrap_err();
        assert!(err.to_string().contains("neg") && err.to_string().contains("compute_time"));
    }
}
