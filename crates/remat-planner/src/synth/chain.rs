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
    nodes.push(Node {
        name: "loss".into(),
        phase: Phase::Backward,
        compute_time: 10.0,
        output_bytes: 4,
        inputs: vec![layers - 1],
    });
    for k in 0..layers {
        let fw = layers - 1 - k;
        let mut inputs = nodes[fw].inputs.clone();
        inputs.push(fw);
        inputs.push(layers + k);
        inputs.sort_unstable();
        inputs.dedup();
        nodes.push(Node {
            name: format!("layer{fw}_backward"),
            phase: Phase::Backward,
            compute_time: 2.0 * nodes[fw].compute_time,
            output_bytes: nodes[fw].output_bytes,
            inputs,
        });
    }
    // Inputs always point backwards by construction.
    match Graph::new(format!("synthetic-{layers}x2-seed{seed}"), nodes, 0, 1e-6) {
        Ok(graph) => graph,
        Err(e) => unreachable!("synthetic graphs are valid by construction: {e}"),
    }
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
