//! Derived per-tensor attributes, as in MuTWO's profiling table (Purandare et al., 2023).
//!
//! For a tensor read in both passes, the idle interval runs from its last forward access to
//! its first backward access: the window in which swapping or recomputing it saves memory.
//! Graphs without a backward pass (general DAGs) and tensors accessed in one pass only use
//! the longest gap between two consecutive accesses instead, so the same strategies apply.

use serde::Serialize;

use crate::ir::{Graph, NodeId, Phase};

/// MuTWO's attributes of one tensor. Times are in the graph's time unit. Serialized with
/// the derived `recompute_ratio` as a field too (null when the recompute time is zero).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(into = "AttrsView")]
pub struct TensorAttrs {
    pub memory_size: u64,
    /// Last forward node accessing the tensor (its producer counts as an access).
    pub last_fw_access: Option<NodeId>,
    pub first_bw_access: Option<NodeId>,
    pub last_bw_access: Option<NodeId>,
    /// (last access before the gap, first access after it); None when no node runs between
    /// two consecutive accesses.
    pub idle: Option<(NodeId, NodeId)>,
    /// Compute time of the nodes strictly inside the idle interval.
    pub inactive_time: f64,
    /// Time to copy the tensor one way at the configured bandwidth.
    pub swap_time: f64,
    /// Tensors it is recomputed from (initially its producer's inputs).
    pub recomp_srcs: Vec<NodeId>,
    /// Compute time of its producer.
    pub recomp_time: f64,
    /// Time to recompute it from `recomp_srcs` (its own plus the sources' chains).
    pub total_recomp_time: f64,
    /// How many recomputations include it (itself and the chains that pass through it).
    pub recomp_cnt: u32,
}

/// [`TensorAttrs`] as serialized: every field plus the ratio, which is computed from
/// `total_recomp_time` on demand so that it can never be stale in the struct.
#[derive(Serialize)]
struct AttrsView {
    memory_size: u64,
    last_fw_access: Option<NodeId>,
    first_bw_access: Option<NodeId>,
    last_bw_access: Option<NodeId>,
    idle: Option<(NodeId, NodeId)>,
    inactive_time: f64,
    swap_time: f64,
    recomp_srcs: Vec<NodeId>,
    recomp_time: f64,
    total_recomp_time: f64,
    recomp_cnt: u32,
    recompute_ratio: Option<f64>,
}

impl From<TensorAttrs> for AttrsView {
    fn from(a: TensorAttrs) -> AttrsView {
        let ratio = a.recompute_ratio();
        AttrsView {
            memory_size: a.memory_size,
            last_fw_access: a.last_fw_access,
            first_bw_access: a.first_bw_access,
            last_bw_access: a.last_bw_access,
            idle: a.idle,
            inactive_time: a.inactive_time,
            swap_time: a.swap_time,
            recomp_srcs: a.recomp_srcs,
            recomp_time: a.recomp_time,
            total_recomp_time: a.total_recomp_time,
            recomp_cnt: a.recomp_cnt,
            recompute_ratio: ratio.is_finite().then_some(ratio),
        }
    }
}

impl TensorAttrs {
    /// memory_size / total_recomp_time: bytes saved per unit of recompute time.
    pub fn recompute_ratio(&self) -> f64 {
        if self.total_recomp_time > 0.0 {
            self.memory_size as f64 / self.total_recomp_time
        } else {
            f64::INFINITY
        }
    }
}

/// Computes the attributes of every tensor at `bandwidth` bytes per second.
pub fn tensor_attrs(graph: &Graph, bandwidth: f64) -> Vec<TensorAttrs> {
    let prefix = prefix_times(graph);
    (0..graph.len())
        .map(|id| one_tensor(graph, id, bandwidth, &prefix))
        .collect()
}

/// `prefix[i]`: compute time of nodes `0..i`.
pub(crate) fn prefix_times(graph: &Graph) -> Vec<f64> {
    let mut prefix = Vec::with_capacity(graph.len() + 1);
    let mut sum = 0.0;
    prefix.push(sum);
    for node in graph.nodes() {
        sum += node.compute_time;
        prefix.push(sum);
    }
    prefix
}

fn one_tensor(graph: &Graph, id: NodeId, bandwidth: f64, prefix: &[f64]) -> TensorAttrs {
    let node = graph.node(id);
    let accesses: Vec<NodeId> = std::iter::once(id)
        .chain(graph.users(id).iter().copied())
        .collect();
    let phase = |v: NodeId| graph.node(v).phase;
    let last_fw_access = accesses
        .iter()
        .copied()
        .filter(|&v| phase(v) == Phase::Forward)
        .max();
    let backward: Vec<NodeId> = accesses
        .iter()
        .copied()
        .filter(|&v| v != id && phase(v) == Phase::Backward)
        .collect();
    let first_bw_access = backward.first().copied();
    let last_bw_access = backward.last().copied();
    let idle = match (last_fw_access, first_bw_access) {
        (Some(a), Some(b)) => Some((a, b)),
        _ => longest_gap(&accesses, prefix),
    }
    .filter(|&(a, b)| b > a + 1);
    let inactive_time = idle.map_or(0.0, |(a, b)| prefix[b] - prefix[a + 1]);
    TensorAttrs {
        memory_size: node.output_bytes,
        last_fw_access,
        first_bw_access,
        last_bw_access,
        idle,
        inactive_time,
        swap_time: node.output_bytes as f64 / (bandwidth * graph.time_unit_s()),
        recomp_srcs: node.inputs.clone(),
        recomp_time: node.compute_time,
        total_recomp_time: node.compute_time,
        recomp_cnt: 1,
    }
}

fn longest_gap(accesses: &[NodeId], prefix: &[f64]) -> Option<(NodeId, NodeId)> {
    accesses.windows(2).map(|w| (w[0], w[1])).max_by(|x, y| {
        let gap = |(a, b): (NodeId, NodeId)| prefix[b] - prefix[a + 1];
        gap(*x).total_cmp(&gap(*y))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Node;

    #[test]
    fn training_chain_attributes() {
        // f0 -> f1 -> loss -> b1 (reads f1) -> b0 (reads f0, b1)
        let mk = |name: &str, phase, t, bytes, inputs: Vec<NodeId>| Node {
            name: name.into(),
            phase,
            compute_time: t,
            output_bytes: bytes,
            inputs,
        };
        let g = Graph::new(
            "t",
            vec![
                mk("f0", Phase::Forward, 1.0, 100, vec![]),
                mk("f1", Phase::Forward, 2.0, 50, vec![0]),
                mk("loss", Phase::Backward, 3.0, 1, vec![1]),
                mk("b1", Phase::Backward, 4.0, 50, vec![1, 2]),
                mk("b0", Phase::Backward, 5.0, 100, vec![0, 3]),
            ],
            0,
            1.0,
        )
        .unwrap();
        let a = tensor_attrs(&g, 50.0);
        // f0: last fw access f1 (1), first bw access b0 (4): inactive = loss + b1 = 7.
        assert_eq!(a[0].last_fw_access, Some(1));
        assert_eq!(a[0].first_bw_access, Some(4));
        assert_eq!(a[0].idle, Some((1, 4)));
        assert_eq!(a[0].inactive_time, 7.0);
        assert_eq!(a[0].swap_time, 2.0);
        assert_eq!(a[0].recompute_ratio(), 100.0);
        // f1 is read by the loss right after it: no idle interval.
        assert_eq!(a[1].first_bw_access, Some(2));
        assert_eq!(a[1].idle, None);
        assert_eq!(a[1].recomp_srcs, vec![0]);
        let json = serde_json::to_value(&a[0]).unwrap();
        assert_eq!(json["recompute_ratio"], 100.0);
        assert_eq!(json["inactive_time"], 7.0);
    }
}
