//! The graph IR: operations in a fixed execution order, each producing one tensor.
//!
//! A [`Graph`] is an index arena: node `i` is the `i`-th operation of the training step and
//! also names the tensor it produces. Inputs always point to earlier nodes, so the node
//! order is a topological order and is the schedule when nothing is recomputed or swapped.
//! Graphs are only built through [`Graph::new`], which checks every invariant the simulator
//! and the strategies rely on.

use serde::{Deserialize, Serialize};

use crate::error::GraphError;

/// Index of a node in [`Graph::nodes`]; the tensor a node produces has the same index.
pub type NodeId = usize;

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
        Ok(Graph {
            name: name.into(),
            nodes,
            static_bytes,
            time_unit_s,
            users,
        })
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

fn input_name(id: NodeId) -> String {
    format!("#{id}")
}

#[cfg(test)]
mod tests {
    use super::*;

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
