//! A chain-like training graph. The forward pass is a chain of layers with occasional skip
//! connections (as in ResNets and U-Nets), sizes and times varying per layer; the loss follows; the backward pass mirrors
//! the forward one: the gradient op of layer i reads layer i's inputs, its output and the
//! previous gradient, and produces a tensor of layer i's size.

use crate::ir::{Graph, Node, NodeId, Phase};

/// A small linear congruential generator: reproducible graphs without a dependency.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A training graph with `layers` forward ops (2 * layers + 1 nodes in all).
pub fn training_graph(layers: usize, seed: u64) -> Graph {
    let layers = layers.max(1);
    let mut rng = Lcg(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut nodes: Vec<Node> = Vec::with_capacity(2 * layers + 1);
    for i in 0..layers {
        let mut inputs: Vec<NodeId> = Vec::new();
        if i > 0 {
            inputs.push(i - 1);
            // One layer in six also reads an earlier layer (a skip connection).
            if i > 2 && rng.below(6) == 0 {
                let back = 2 + rng.below(i.min(16) as u64 - 1) as usize;
                inputs.push(i - back);
            }
        }
        inputs.sort_unstable();
        inputs.dedup();
        nodes.push(Node {
            name: format!("layer{i}"),
            phase: Phase::Forward,
            compute_time: 20.0 + rng.below(400) as f64,
            output_bytes: (1 + rng.below(64)) << 20,
            inputs,
        });
    }
    let nodes = mirror_backward(nodes, 10.0, 4, |fw| format!("layer{fw}_backward"));
    // Inputs always point backwards by construction.
    match Graph::new(format!("synthetic-{layers}x2-seed{seed}"), nodes, 0, 1e-6) {
        Ok(graph) => graph,
        Err(e) => unreachable!("synthetic graphs are valid by construction: {e}"),
    }
}

/// `forward` (a chain of forward ops whose last one is the model's output) followed by the
/// loss (`loss_time`, `loss_bytes`, reading that output) and the backward pass mirroring
/// it: in reverse, the gradient op of layer `i`, named `backward_name(i)`, reads layer
/// `i`'s inputs, its output and the previous gradient, takes twice layer `i`'s time and
/// produces a tensor of its size. With no forward op, the loss reads nothing.
pub fn mirror_backward(
    mut nodes: Vec<Node>,
    loss_time: f64,
    loss_bytes: u64,
    backward_name: impl Fn(usize) -> String,
) -> Vec<Node> {
    let layers = nodes.len();
    nodes.push(Node {
        name: "loss".into(),
        phase: Phase::Backward,
        compute_time: loss_time,
        output_bytes: loss_bytes,
        inputs: layers.checked_sub(1).into_iter().collect(),
    });
    for k in 0..layers {
        let fw = layers - 1 - k;
        let mut inputs = nodes[fw].inputs.clone();
        inputs.push(fw);
        inputs.push(layers + k);
        inputs.sort_unstable();
        inputs.dedup();
        nodes.push(Node {
            name: backward_name(fw),
            phase: Phase::Backward,
            compute_time: 2.0 * nodes[fw].compute_time,
            output_bytes: nodes[fw].output_bytes,
            inputs,
        });
    }
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_determinism() {
        let a = training_graph(174, 1);
        assert_eq!(a.len(), 349);
        assert_eq!(a, training_graph(174, 1));
        assert_ne!(a, training_graph(174, 2));
        assert!(a.memory_floor() < a.store_all_peak());
    }
}
