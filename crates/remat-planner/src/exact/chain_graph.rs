//! Mapping a training graph whose forward pass is a chain onto the chain DP, and the DP's
//! schedule back onto the graph.
//!
//! Forward node `k-1` (in order) is stage `k`: it computes `x_k` and may read only `x_{k-1}`.
//! Each backward operation joins the group `G_t` of the highest stage it reads (or the group
//! of the operation before it when it reads no forward tensor), and may read only `x_{t-1}`
//! and `x_t`: this is the shape of the gradient graphs of sequential networks (Checkmate's
//! VGG graphs: `layer_backward` reads the layer's input and output and the incoming
//! gradient). Backward tensors are never recomputed, so their memory is a fixed profile that
//! the DP sees as `grad_live_before` / `grad_peak_during` per group.

use super::chain::{ByteChain, ChainSolution, ChainStep};
use crate::ir::{Graph, NodeId, Phase};
use crate::plan::{Decision, Step};

/// A training graph seen as a chain.
#[derive(Clone, Debug)]
pub struct GraphChain {
    /// `forward[k-1]` is the node computing `x_k`.
    pub forward: Vec<NodeId>,
    /// `groups[t]`: the backward nodes of `G_t`, in execution order (`groups[0]` is empty).
    pub groups: Vec<Vec<NodeId>>,
    /// The chain in bytes, with `unit_bytes` still to choose.
    pub chain: ByteChain,
}

/// Why a graph is not a chain (the message names the node).
pub fn chain_of(graph: &Graph) -> Result<GraphChain, String> {
    let forward: Vec<NodeId> = (0..graph.len())
        .filter(|&v| graph.node(v).phase == Phase::Forward)
        .collect();
    let n = forward.len();
    if n == 0 || n == graph.len() {
        return Err("the graph has no forward/backward split".into());
    }
    // stage_of[v] = k for forward node v computing x_k.
    let mut stage_of = vec![usize::MAX; graph.len()];
    for (i, &v) in forward.iter().enumerate() {
        stage_of[v] = i + 1;
    }
    check_forward_chain(graph, &forward, &stage_of)?;
    let groups = backward_groups(graph, n, &stage_of)?;
    let chain = byte_chain(graph, &forward, &groups, &stage_of);
    Ok(GraphChain {
        forward,
        groups,
        chain,
    })
}

fn check_forward_chain(
    graph: &Graph,
    forward: &[NodeId],
    stage_of: &[usize],
) -> Result<(), String> {
    if forward.iter().enumerate().any(|(i, &v)| v != i) {
        return Err("backward nodes are interleaved with forward nodes".into());
    }
    for (i, &v) in forward.iter().enumerate() {
        for &input in &graph.node(v).inputs {
            if stage_of[input] != i {
                let node = graph.node(v);
                return Err(format!(
                    "forward node `{}` reads `{}`, not its predecessor: the forward pass is not a chain",
                    node.name,
                    graph.node(input).name
                ));
            }
        }
    }
    Ok(())
}

fn backward_groups(
    graph: &Graph,
    n: usize,
    stage_of: &[usize],
) -> Result<Vec<Vec<NodeId>>, String> {
    let mut groups = vec![Vec::new(); n + 1];
    let mut current = n;
    for v in n..graph.len() {
        let node = graph.node(v);
        let stages: Vec<usize> = node
            .inputs
            .iter()
            .map(|&i| stage_of[i])
            .filter(|&s| s != usize::MAX)
            .collect();
        if let Some(&hi) = stages.iter().max() {
            if hi > current {
                return Err(format!(
                    "backward node `{}` reads stage {hi} after the backward pass reached stage {current}",
                    node.name
                ));
            }
            if let Some(&lo) = stages.iter().min().filter(|&&lo| lo + 1 < hi) {
                return Err(format!(
                    "backward node `{}` reads stages {lo} and {hi}: not adjacent, so not a chain",
                    node.name
                ));
            }
            current = hi.max(1);
        }
        groups[current].push(v);
    }
    Ok(groups)
}

/// Live backward bytes: before each group and at the peak inside it.
fn byte_chain(
    graph: &Graph,
    forward: &[NodeId],
    groups: &[Vec<NodeId>],
    stage_of: &[usize],
) -> ByteChain {
    let n = forward.len();
    let mut chain = ByteChain {
        state_bytes: vec![0],
        fwd_time: vec![0.0],
        bwd_time: vec![0.0; n + 1],
        reads_output: vec![false; n + 1],
        grad_live_before: vec![0; n + 1],
        grad_peak_during: vec![0; n + 1],
        unit_bytes: 1,
    };
    for &v in forward {
        chain.state_bytes.push(graph.node(v).output_bytes);
        chain.fwd_time.push(graph.node(v).compute_time);
    }
    let mut live = 0u64;
    for t in (1..=n).rev() {
        chain.grad_live_before[t] = live;
        let mut peak = live;
        for &v in &groups[t] {
            let node = graph.node(v);
            chain.bwd_time[t] += node.compute_time;
            chain.reads_output[t] |= node.inputs.iter().any(|&i| stage_of[i] == t);
            live += node.output_bytes;
            peak = peak.max(live);
            live -= backward_freed_after(graph, v)
                .map(|u| graph.node(u).output_bytes)
                .sum::<u64>();
        }
        chain.grad_peak_during[t] = peak;
    }
    chain
}

/// Backward tensors whose last use is `v` (its inputs and, when nothing reads it, `v`).
fn backward_freed_after(graph: &Graph, v: NodeId) -> impl Iterator<Item = NodeId> + '_ {
    let node = graph.node(v);
    let own = graph.users(v).is_empty().then_some(v);
    node.inputs
        .iter()
        .copied()
        .filter(move |&i| graph.node(i).phase == Phase::Backward && graph.last_use(i) == v)
        .chain(own)
}

impl GraphChain {
    /// The schedule of a chain solution as plan steps.
    pub fn steps(&self, graph: &Graph, solution: &ChainSolution) -> Vec<Step> {
        let mut steps = Vec::with_capacity(solution.steps.len() * 2);
        for step in &solution.steps {
            match *step {
                ChainStep::Forward(k) => steps.push(Step::Compute {
                    node: self.forward[k - 1],
                }),
                ChainStep::Free(k) => steps.push(Step::Free {
                    tensor: self.forward[k - 1],
                }),
                ChainStep::Backward(t) => {
                    for &v in &self.groups[t] {
                        steps.push(Step::Compute { node: v });
                        steps.extend(
                            backward_freed_after(graph, v).map(|tensor| Step::Free { tensor }),
                        );
                    }
                }
            }
        }
        steps
    }
}

/// Per-tensor summary of a schedule: computed once is kept; computed more often is
/// recomputed from its inputs, dropped after its last forward-pass use and needed again
/// at its first backward use.
pub fn decisions_of(graph: &Graph, steps: &[Step]) -> Vec<Decision> {
    let mut computed = vec![0u32; graph.len()];
    for step in steps {
        if let Step::Compute { node } = *step {
            computed[node] += 1;
        }
    }
    (0..graph.len())
        .map(|v| {
            if computed[v] <= 1 {
                return Decision::Keep;
            }
            let users = graph.users(v);
            let last_fw = users
                .iter()
                .copied()
                .filter(|&u| graph.node(u).phase == Phase::Forward)
                .max();
            let first_bw = users
                .iter()
                .copied()
                .find(|&u| graph.node(u).phase == Phase::Backward);
            Decision::Recompute {
                from: graph.node(v).inputs.clone(),
                drop_after: last_fw.unwrap_or(v),
                use_at: first_bw.unwrap_or_else(|| graph.last_use(v)),
            }
        })
        .collect()
}
