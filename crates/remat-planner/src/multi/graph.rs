//! The multiplexed training graph: K models' steps in one planner graph, a model label per
//! node.

use super::MultiError;
use crate::ir::{Graph, Node, NodeId};

/// K models' training steps in one graph. Node `v` belongs to model `label(v)`, or to
/// several models when the label is `None` (a fused op, a step's shared end).
#[derive(Clone, Debug, PartialEq)]
pub struct Multiplexed {
    graph: Graph,
    labels: Vec<Option<usize>>,
    names: Vec<String>,
}

impl Multiplexed {
    /// The K graphs side by side: model `k`'s nodes follow model `k - 1`'s (node names get a
    /// `m{k}/` prefix), static memory is the sum, and compute times are converted to the
    /// first graph's time unit. Pinned nodes stay pinned; if any graph fixes its order, so
    /// does the union (every [`Order`](super::Order) keeps each model's own order, which is
    /// what the mark asks of that model).
    pub fn union(graphs: &[Graph]) -> Result<Multiplexed, MultiError> {
        let first = graphs.first().ok_or(MultiError::NoGraphs)?;
        let unit = first.time_unit_s();
        let mut nodes = Vec::with_capacity(graphs.iter().map(Graph::len).sum());
        let mut labels = Vec::with_capacity(nodes.capacity());
        let mut pinned = Vec::new();
        let mut static_bytes = 0u64;
        for (model, g) in graphs.iter().enumerate() {
            let offset = nodes.len();
            let scale = g.time_unit_s() / unit;
            for node in g.nodes() {
                nodes.push(Node {
                    name: format!("m{model}/{}", node.name),
                    phase: node.phase,
                    compute_time: node.compute_time * scale,
                    output_bytes: node.output_bytes,
                    inputs: node.inputs.iter().map(|&i| i + offset).collect(),
                });
                labels.push(Some(model));
            }
            pinned.extend(g.pinned().map(|p| p + offset));
            static_bytes =
                static_bytes
                    .checked_add(g.static_bytes())
                    .ok_or_else(|| MultiError::Combined {
                        models: graphs.len(),
                        error: crate::GraphError::BytesOverflow {
                            node: format!("static bytes of model {model}"),
                        },
                    })?;
        }
        let name = graphs.iter().map(Graph::name).collect::<Vec<_>>().join("+");
        let combined = |error| MultiError::Combined {
            models: graphs.len(),
            error,
        };
        let mut graph = Graph::new(name, nodes, static_bytes, unit)
            .and_then(|g| g.with_pinned(pinned))
            .map_err(combined)?;
        if graphs.iter().any(Graph::order_is_fixed) {
            graph = graph.with_fixed_order();
        }
        Ok(Multiplexed {
            graph,
            labels,
            names: graphs.iter().map(|g| g.name().to_string()).collect(),
        })
    }

    /// One graph that already holds K models' steps (the engine records them into one),
    /// with `labels[v]` the model of node `v`: `Some(0)` to `Some(K - 1)`, or `None` for a
    /// node several models share. The graph is kept as it is, node order included, so the
    /// plans made for it name its nodes. Every model from 0 to the largest label must own
    /// at least one node.
    pub fn from_labels(
        graph: Graph,
        labels: Vec<Option<usize>>,
    ) -> Result<Multiplexed, MultiError> {
        if labels.len() != graph.len() {
            return Err(MultiError::LabelCount {
                labels: labels.len(),
                nodes: graph.len(),
            });
        }
        let last = labels
            .iter()
            .flatten()
            .max()
            .copied()
            .ok_or(MultiError::NoModels)?;
        let mut owns = vec![false; last + 1];
        for &m in labels.iter().flatten() {
            owns[m] = true;
        }
        if let Some(model) = owns.iter().position(|&o| !o) {
            return Err(MultiError::EmptyModel { model, last });
        }
        let names = (0..=last).map(|m| format!("model {m}")).collect();
        Ok(Multiplexed {
            graph,
            labels,
            names,
        })
    }

    /// The combined graph; plans name its nodes.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }
    /// The model of each node (`None`: shared by several models).
    pub fn labels(&self) -> &[Option<usize>] {
        &self.labels
    }
    /// The model of node `v` (`None`: shared, or no such node).
    pub fn label(&self, v: NodeId) -> Option<usize> {
        self.labels.get(v).copied().flatten()
    }
    /// Number of models, K.
    pub fn models(&self) -> usize {
        self.names.len()
    }
    /// Model `m`'s name: its graph's name for a union, `model m` otherwise.
    pub fn model_name(&self, m: usize) -> &str {
        self.names.get(m).map_or("shared", String::as_str)
    }
    /// The least memory any schedule of the K models together needs: the static memory of
    /// all of them plus the largest operation's inputs and output ([`Graph::memory_floor`]).
    pub fn floor(&self) -> u64 {
        self.graph.memory_floor()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ir::Phase;

    /// f0 -> f1 -> loss -> b1 -> b0: a two-layer training chain, `bytes` per activation.
    pub(crate) fn tiny(name: &str, bytes: u64, static_bytes: u64) -> Graph {
        let node = |n: &str, phase, inputs: Vec<NodeId>| Node {
            name: n.into(),
            phase,
            compute_time: if phase == Phase::Forward { 1.0 } else { 2.0 },
            output_bytes: bytes,
            inputs,
        };
        let nodes = vec![
            node("f0", Phase::Forward, vec![]),
            node("f1", Phase::Forward, vec![0]),
            node("loss", Phase::Backward, vec![1]),
            node("b1", Phase::Backward, vec![1, 2]),
            node("b0", Phase::Backward, vec![0, 3]),
        ];
        Graph::new(name, nodes, static_bytes, 1.0).unwrap()
    }

    #[test]
    fn union_offsets_inputs_sums_static_and_labels_each_model() {
        let a = tiny("a", 10, 100);
        let b = tiny("b", 20, 50).with_pinned([0]).unwrap();
        let m = Multiplexed::union(&[a.clone(), b]).unwrap();
        assert_eq!(m.models(), 2);
        assert_eq!(m.graph().len(), 10);
        assert_eq!(m.graph().static_bytes(), 150);
        assert_eq!(m.graph().name(), "a+b");
        assert_eq!(m.graph().node(8).inputs, vec![6, 7]);
        assert_eq!(m.graph().node(8).name, "m1/b1");
        assert_eq!(m.label(2), Some(0));
        assert_eq!(m.label(7), Some(1));
        assert!(m.graph().is_pinned(5) && !m.graph().is_pinned(0));
        assert_eq!((m.model_name(0), m.model_name(1)), ("a", "b"));
        // The floor is all static memory plus the largest node with its inputs (b1 of b).
        assert_eq!(m.floor(), 150 + 3 * 20);
        assert!(!m.graph().order_is_fixed());
        let fixed = Multiplexed::union(&[a.clone(), a.with_fixed_order()]).unwrap();
        assert!(fixed.graph().order_is_fixed());
    }

    #[test]
    fn union_converts_time_units() {
        let a = tiny("a", 10, 0);
        let nodes = tiny("b", 10, 0).nodes().to_vec();
        let b = Graph::new("b", nodes, 0, 2.0).unwrap();
        let m = Multiplexed::union(&[a, b]).unwrap();
        assert_eq!(m.graph().time_unit_s(), 1.0);
        assert_eq!(m.graph().node(5).compute_time, 2.0);
        assert_eq!(m.graph().base_time(), 8.0 + 16.0);
    }

    #[test]
    fn bad_inputs_are_named() {
        assert_eq!(Multiplexed::union(&[]), Err(MultiError::NoGraphs));
        let g = tiny("a", 10, 0);
        let err = Multiplexed::from_labels(g.clone(), vec![Some(0); 4]).unwrap_err();
        assert_eq!(
            err,
            MultiError::LabelCount {
                labels: 4,
                nodes: 5
            }
        );
        assert!(err.to_string().contains("4 model labels") && err.to_string().contains("5 nodes"));
        let err = Multiplexed::from_labels(g.clone(), vec![None; 5]).unwrap_err();
        assert_eq!(err, MultiError::NoModels);
        let gap = vec![Some(0), Some(0), None, Some(2), Some(2)];
        let err = Multiplexed::from_labels(g.clone(), gap).unwrap_err();
        assert_eq!(err, MultiError::EmptyModel { model: 1, last: 2 });
        assert!(err.to_string().contains("model 1 has no nodes"), "{err}");
        let huge = Graph::new("h", g.nodes().to_vec(), u64::MAX / 2 + 100, 1.0).unwrap();
        let err = Multiplexed::union(&[huge.clone(), huge]).unwrap_err();
        assert!(
            matches!(err, MultiError::Combined { models: 2, .. }),
            "{err}"
        );
    }

    #[test]
    fn from_labels_keeps_the_graph_as_given() {
        let g = tiny("a", 10, 7);
        let labels = vec![Some(1), Some(1), None, Some(0), Some(0)];
        let m = Multiplexed::from_labels(g.clone(), labels.clone()).unwrap();
        assert_eq!(m.graph(), &g);
        assert_eq!(m.labels(), &labels[..]);
        assert_eq!(m.models(), 2);
        assert_eq!(m.label(2), None);
        assert_eq!(m.model_name(1), "model 1");
    }
}
