//! Checkpoint cuts: where the forward pass narrows to one tensor, and which of those the
//! eviction should keep.
//!
//! Why. Near the floor the greedy eviction is myopic in a way that costs a lot: it drops a
//! transformer's residual stream (8 MiB, "cheap" per byte to rebuild while its producer is
//! resident) to make room in one layer's backward, then rebuilds it from the layer before,
//! and so on down: the generator's 8 layers at the recompute floor + 5% recomputed each
//! layer 10-19 times (46.1%), where keeping every other residual tensor costs 38.4%. The
//! structure it misses is the checkpointing one (Chen et al. 2016; Rotor): tensors that
//! alone carry the forward from one stretch to the next are where a segment can be rebuilt
//! from, and keeping some of them bounds every rebuild chain to the segment since the
//! last one kept. Which ones, and how far apart, depends on the budget, so candidate sets
//! at a few spacings are handed to the eviction as protected tensors (dropped only when
//! nothing else can go) and each is judged by the schedule it gives; the greedy still
//! decides everything else.
//!
//! A cut, on a graph numbered in its run order: a forward tensor `c` (neither pinned nor
//! empty) read by a forward node after `c`, such that no other such tensor computed before
//! `c` is read by a forward node after `c`. (Backward readers are left out: the backward
//! reads most of the forward; on a graph without a backward pass every node counts as
//! forward.) Two filters make a cut worth keeping: its segment (forward compute since the
//! previous cut) is not negligible (an embedding lookup or a norm's last step rebuilds for
//! almost nothing), and its bytes are not far above the typical cut's (a transformer's
//! logits are a cut too, at 16 times the residual stream's bytes).

use crate::ir::{Graph, NodeId, Phase};

/// Spacings tried: every cut, every second, ... every `MAX_SPACING`-th, each at every
/// offset (ten sets).
const MAX_SPACING: usize = 4;

/// A cut whose segment computes less than this share of the median segment is not kept.
const MIN_SEGMENT_SHARE: f64 = 0.25;

/// A cut larger than this many times the median cut is not kept.
const MAX_BYTES_OVER_MEDIAN: u64 = 2;

/// The cuts of `graph` in its own order (see the module docs), in that order.
pub fn forward_cuts(graph: &Graph) -> Vec<NodeId> {
    let n = graph.len();
    let forward = |v: NodeId| !graph.has_backward() || graph.node(v).phase == Phase::Forward;
    let counted = |v: NodeId| forward(v) && !graph.is_pinned(v) && graph.node(v).output_bytes > 0;
    // The last forward reader of each counted tensor, and how many counted tensors cross
    // each gap between positions (a difference array: +1 from the producer, -1 at the
    // last reader).
    let mut last_reader = vec![None; n];
    let mut crossing = vec![0i64; n + 1];
    for (v, last) in last_reader.iter_mut().enumerate() {
        if !counted(v) {
            continue;
        }
        *last = graph.users(v).iter().copied().filter(|&w| forward(w)).max();
        if let Some(w) = last.filter(|&w| w > v) {
            crossing[v] += 1;
            crossing[w] -= 1;
        }
    }
    let mut cuts = Vec::new();
    let mut across = 0i64;
    for v in 0..n {
        across += crossing[v];
        // `across` counts the tensors crossing the gap right after v, v included.
        if across == 1 && last_reader[v].is_some_and(|w| w > v) {
            cuts.push(v);
        }
    }
    cuts
}

/// The candidate sets of tensors to protect: the cuts worth keeping, at every spacing up
/// to four (`MAX_SPACING`) and every offset; each set as a mask over the graph's nodes. Empty
/// when the graph has fewer than two such cuts.
pub fn protected_sets(graph: &Graph) -> Vec<Vec<bool>> {
    let kept = worth_keeping(graph, &forward_cuts(graph));
    if kept.len() < 2 {
        return Vec::new();
    }
    let mut sets = Vec::new();
    for spacing in 1..=MAX_SPACING.min(kept.len()) {
        for offset in 0..spacing {
            let mut mask = vec![false; graph.len()];
            for &c in kept.iter().skip(offset).step_by(spacing) {
                mask[c] = true;
            }
            sets.push(mask);
        }
    }
    sets
}

/// The cuts that pass both filters of the module docs.
fn worth_keeping(graph: &Graph, cuts: &[NodeId]) -> Vec<NodeId> {
    if cuts.is_empty() {
        return Vec::new();
    }
    let forward = |v: NodeId| !graph.has_backward() || graph.node(v).phase == Phase::Forward;
    let mut segments = Vec::with_capacity(cuts.len());
    let mut since = 0.0;
    let mut next = 0;
    for v in 0..=cuts[cuts.len() - 1] {
        if forward(v) {
            since += graph.node(v).compute_time;
        }
        if v == cuts[next] {
            segments.push(since);
            since = 0.0;
            next += 1;
        }
    }
    let median_segment = median(segments.iter().copied(), f64::total_cmp);
    let median_bytes = median(cuts.iter().map(|&c| graph.node(c).output_bytes), Ord::cmp);
    cuts.iter()
        .zip(&segments)
        .filter(|&(&c, &segment)| {
            segment >= MIN_SEGMENT_SHARE * median_segment
                && graph.node(c).output_bytes <= MAX_BYTES_OVER_MEDIAN * median_bytes
        })
        .map(|(&c, _)| c)
        .collect()
}

/// The upper median of a non-empty sequence.
fn median<T: Copy>(
    values: impl Iterator<Item = T>,
    cmp: impl Fn(&T, &T) -> std::cmp::Ordering,
) -> T {
    let mut values: Vec<T> = values.collect();
    values.sort_by(&cmp);
    values[values.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Node;
    use crate::synth::transformer::{TransformerParams, transformer};

    fn node(name: &str, phase: Phase, time: f64, bytes: u64, inputs: &[NodeId]) -> Node {
        Node {
            name: name.into(),
            phase,
            compute_time: time,
            output_bytes: bytes,
            inputs: inputs.to_vec(),
        }
    }

    #[test]
    fn every_tensor_of_a_chain_that_is_read_later_is_a_cut() {
        let nodes = vec![
            node("a", Phase::Forward, 1.0, 10, &[]),
            node("b", Phase::Forward, 1.0, 10, &[0]),
            node("c", Phase::Forward, 1.0, 10, &[1]),
            node("d", Phase::Forward, 1.0, 10, &[2]),
        ];
        let graph = Graph::new("chain", nodes, 0, 1e-6).expect("graph");
        assert_eq!(forward_cuts(&graph), vec![0, 1, 2]);
    }

    #[test]
    fn a_skip_connection_removes_the_cuts_it_spans_and_backward_readers_do_not() {
        // a -> b -> c -> d with a skip a -> d; e (backward) reads b and c.
        let nodes = vec![
            node("a", Phase::Forward, 1.0, 10, &[]),
            node("b", Phase::Forward, 1.0, 10, &[0]),
            node("c", Phase::Forward, 1.0, 10, &[1]),
            node("d", Phase::Forward, 1.0, 10, &[2, 0]),
            node("e", Phase::Backward, 1.0, 10, &[3, 1, 2]),
        ];
        let graph = Graph::new("skip", nodes, 0, 1e-6).expect("graph");
        // b and c are crossed by a; a is crossed by nothing else but is read after it.
        assert_eq!(forward_cuts(&graph), vec![0]);
    }

    #[test]
    fn a_pinned_tensor_read_at_the_end_does_not_hide_the_cuts() {
        let nodes = vec![
            node("tokens", Phase::Forward, 0.0, 10, &[]),
            node("h1", Phase::Forward, 1.0, 10, &[0]),
            node("h2", Phase::Forward, 1.0, 10, &[1]),
            node("loss", Phase::Forward, 1.0, 10, &[2, 0]),
        ];
        let plain = Graph::new("tokens", nodes, 0, 1e-6).expect("graph");
        assert_eq!(forward_cuts(&plain), vec![0]);
        let pinned = plain.with_pinned([0]).expect("pinned");
        assert_eq!(forward_cuts(&pinned), vec![1, 2]);
    }

    #[test]
    fn a_transformer_is_cut_at_its_residual_stream_and_keeps_neither_logits_nor_lookups() {
        let graph = transformer(&TransformerParams::gpt(2)).expect("transformer");
        let names = |ids: &[NodeId]| -> Vec<String> {
            ids.iter().map(|&c| graph.node(c).name.clone()).collect()
        };
        let cuts = forward_cuts(&graph);
        let all = names(&cuts);
        for want in [
            "embed",
            "l0.attn_residual",
            "l0.mlp_residual",
            "l1.mlp_residual",
            "lm_head",
        ] {
            assert!(all.iter().any(|c| c == want), "{want} in {all:?}");
        }
        let kept = names(&worth_keeping(&graph, &cuts));
        assert_eq!(
            kept,
            [
                "l0.attn_residual",
                "l0.mlp_residual",
                "l1.attn_residual",
                "l1.mlp_residual"
            ]
        );
    }

    #[test]
    fn the_sets_space_the_kept_cuts_at_every_offset() {
        let nodes: Vec<Node> = (0..9)
            .map(|v| {
                let inputs: Vec<NodeId> = if v == 0 { vec![] } else { vec![v - 1] };
                node(&format!("n{v}"), Phase::Forward, 1.0, 10, &inputs)
            })
            .collect();
        let graph = Graph::new("chain9", nodes, 0, 1e-6).expect("graph");
        let sets = protected_sets(&graph);
        // 8 cuts (n0..n7): spacings 1..4 give 1 + 2 + 3 + 4 sets.
        assert_eq!(sets.len(), 10);
        let members =
            |mask: &Vec<bool>| -> Vec<usize> { (0..mask.len()).filter(|&v| mask[v]).collect() };
        assert_eq!(members(&sets[0]), (0..8).collect::<Vec<_>>());
        assert_eq!(members(&sets[2]), vec![1, 3, 5, 7]);
        assert_eq!(members(&sets[9]), vec![3, 7]);
        // A graph without two cuts worth keeping has no sets.
        let two = Graph::new(
            "two",
            vec![node("a", Phase::Forward, 1.0, 10, &[])],
            0,
            1e-6,
        )
        .expect("graph");
        assert!(protected_sets(&two).is_empty());
    }
}
