//! networkx node-link JSON, as in the Checkmate/Moccasin graphs of `../shared/graphs`.
//!
//! Two node schemas are read:
//! - training graphs: `id`, `name`, `backward`, `cost_cpu` (time), `cost_ram` (output
//!   bytes); links `{"source": u, "target": v}`. Node ids are a topological order and that
//!   order is the schedule: a link from a later to an earlier node is an error.
//! - general DAGs (Moccasin's random layered graph): the node key is `id` or else `name`,
//!   `duration` (time), `out_cost` (output bytes), `param_cost` (static bytes); links
//!   `{"0": u, "1": v}`. With no backward marking there is no given schedule, so nodes are
//!   ordered topologically (Kahn's algorithm, smallest key first) and all are forward.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::{Fields, ImportOptions, key_text};
use crate::error::ImportError;
use crate::ir::{Graph, Node, NodeId, Phase};

/// One node as read, before ordering.
struct RawNode {
    key: String,
    name: String,
    backward: bool,
    time: f64,
    bytes: u64,
    params: u64,
}

pub(crate) fn from_value(
    file: &str,
    object: &Map<String, Value>,
    options: ImportOptions,
) -> Result<Graph, ImportError> {
    let schema = |what: &str| ImportError::Schema {
        file: file.to_string(),
        what: what.to_string(),
    };
    let nodes = object
        .get("nodes")
        .and_then(Value::as_array)
        .ok_or_else(|| schema("field `nodes` is missing or not an array"))?;
    let links = object
        .get("links")
        .and_then(Value::as_array)
        .ok_or_else(|| schema("field `links` is not an array"))?;
    let raw = nodes
        .iter()
        .enumerate()
        .map(|(i, v)| raw_node(file, i, v))
        .collect::<Result<Vec<_>, _>>()?;
    let mut index = HashMap::new();
    for (i, node) in raw.iter().enumerate() {
        if index.insert(node.key.clone(), i).is_some() {
            return Err(ImportError::Field {
                file: file.to_string(),
                node: node.key.clone(),
                field: "id".into(),
                what: "appears twice".into(),
            });
        }
    }
    let edges = links
        .iter()
        .enumerate()
        .map(|(i, link)| edge(file, i, link, &index))
        .collect::<Result<Vec<_>, _>>()?;
    let training = raw.iter().any(|n| n.backward) || nodes_have(nodes, "cost_cpu");
    let order = if training {
        id_order(file, &raw, &edges)?
    } else {
        topological_order(file, &raw, &edges)?
    };
    build(file, object, raw, &edges, &order, options)
}

fn nodes_have(nodes: &[Value], field: &str) -> bool {
    nodes
        .first()
        .and_then(Value::as_object)
        .is_some_and(|o| o.contains_key(field))
}

fn raw_node(file: &str, i: usize, value: &Value) -> Result<RawNode, ImportError> {
    let object = value.as_object().ok_or_else(|| ImportError::Schema {
        file: file.to_string(),
        what: format!("nodes[{i}] is not an object"),
    })?;
    let key_value = object
        .get("id")
        .or_else(|| object.get("name"))
        .ok_or_else(|| ImportError::Field {
            file: file.to_string(),
            node: format!("nodes[{i}]"),
            field: "id".into(),
            what: "missing (and no `name` to use instead)".into(),
        })?;
    let key = key_text(key_value);
    let name = object.get("name").map_or_else(|| key.clone(), key_text);
    let fields = Fields {
        file,
        node: format!("{key} `{name}`"),
        object,
    };
    if object.contains_key("cost_cpu") {
        Ok(RawNode {
            time: fields.cost("cost_cpu")?,
            bytes: fields.bytes("cost_ram")?,
            backward: fields.boolean("backward")?,
            params: 0,
            key,
            name,
        })
    } else {
        Ok(RawNode {
            time: fields.cost("duration")?,
            bytes: fields.bytes("out_cost")?,
            backward: false,
            params: match object.get("param_cost") {
                Some(_) => fields.bytes("param_cost")?,
                None => 0,
            },
            key,
            name,
        })
    }
}

/// A link as (source, target) indices into the raw nodes.
fn edge(
    file: &str,
    i: usize,
    link: &Value,
    index: &HashMap<String, usize>,
) -> Result<(usize, usize), ImportError> {
    let error = |what: String| ImportError::Link {
        file: file.to_string(),
        link: i,
        what,
    };
    let object = link
        .as_object()
        .ok_or_else(|| error("is not an object".into()))?;
    let end = |a: &str, b: &str| -> Result<usize, ImportError> {
        let value = object
            .get(a)
            .or_else(|| object.get(b))
            .ok_or_else(|| error(format!("has no `{a}` (or `{b}`)")))?;
        let key = key_text(value);
        index
            .get(&key)
            .copied()
            .ok_or_else(|| error(format!("`{a}` names node {key}, which does not exist")))
    };
    Ok((end("source", "0")?, end("target", "1")?))
}

/// Training graphs: ids are the schedule. Every link must go forward in id order.
fn id_order(
    file: &str,
    raw: &[RawNode],
    edges: &[(usize, usize)],
) -> Result<Vec<usize>, ImportError> {
    let mut ids = Vec::with_capacity(raw.len());
    for node in raw {
        let id = node.key.parse::<i64>().map_err(|_| ImportError::Field {
            file: file.to_string(),
            node: node.key.clone(),
            field: "id".into(),
            what: "is not an integer position".into(),
        })?;
        ids.push(id);
    }
    let mut order: Vec<usize> = (0..raw.len()).collect();
    order.sort_by_key(|&i| ids[i]);
    for &(u, v) in edges {
        if ids[u] >= ids[v] {
            // A cycle shows up here too; name it as the broken order it is.
            return Err(ImportError::Field {
                file: file.to_string(),
                node: format!("{} `{}`", raw[v].key, raw[v].name),
                field: "id".into(),
                what: format!(
                    "reads node {} `{}`, which does not come earlier: the order is not topological",
                    raw[u].key, raw[u].name
                ),
            });
        }
    }
    Ok(order)
}

/// General DAGs: Kahn's algorithm, smallest key position first; a leftover node is on a
/// cycle.
fn topological_order(
    file: &str,
    raw: &[RawNode],
    edges: &[(usize, usize)],
) -> Result<Vec<usize>, ImportError> {
    let n = raw.len();
    let mut indegree = vec![0usize; n];
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); n];
    for &(u, v) in edges {
        indegree[v] += 1;
        out[u].push(v);
    }
    let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<(i64, usize)>> = (0..n)
        .filter(|&i| indegree[i] == 0)
        .map(|i| std::cmp::Reverse((sort_key(&raw[i].key, i), i)))
        .collect();
    let mut order = Vec::with_capacity(n);
    while let Some(std::cmp::Reverse((_, u))) = ready.pop() {
        order.push(u);
        for &v in &out[u] {
            indegree[v] -= 1;
            if indegree[v] == 0 {
                ready.push(std::cmp::Reverse((sort_key(&raw[v].key, v), v)));
            }
        }
    }
    if let Some(stuck) = (0..n).find(|&i| indegree[i] > 0) {
        return Err(ImportError::Cycle {
            file: file.to_string(),
            node: format!("{} `{}`", raw[stuck].key, raw[stuck].name),
        });
    }
    Ok(order)
}

fn sort_key(key: &str, position: usize) -> i64 {
    key.parse().unwrap_or(position as i64)
}

fn build(
    file: &str,
    object: &Map<String, Value>,
    raw: Vec<RawNode>,
    edges: &[(usize, usize)],
    order: &[usize],
    options: ImportOptions,
) -> Result<Graph, ImportError> {
    let mut position = vec![0usize; raw.len()];
    for (p, &i) in order.iter().enumerate() {
        position[i] = p;
    }
    let mut inputs: Vec<Vec<NodeId>> = vec![Vec::new(); raw.len()];
    for (link, &(u, v)) in edges.iter().enumerate() {
        let list = &mut inputs[position[v]];
        if list.contains(&position[u]) {
            return Err(ImportError::Link {
                file: file.to_string(),
                link,
                what: format!("repeats the link {} -> {}", raw[u].key, raw[v].key),
            });
        }
        list.push(position[u]);
    }
    let static_bytes = raw.iter().map(|n| n.params).sum();
    let mut slots: Vec<Option<RawNode>> = raw.into_iter().map(Some).collect();
    let mut nodes = Vec::with_capacity(order.len());
    for (p, &i) in order.iter().enumerate() {
        let Some(r) = slots[i].take() else { continue };
        let mut node_inputs = std::mem::take(&mut inputs[p]);
        node_inputs.sort_unstable();
        nodes.push(Node {
            name: r.name,
            phase: if r.backward {
                Phase::Backward
            } else {
                Phase::Forward
            },
            compute_time: r.time,
            output_bytes: r.bytes,
            inputs: node_inputs,
        });
    }
    let name = object
        .get("graph")
        .and_then(|g| g.get("name"))
        .map_or_else(|| file.to_string(), key_text);
    Graph::new(name, nodes, static_bytes, options.time_unit_s).map_err(|source| {
        ImportError::Graph {
            file: file.to_string(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use crate::import::{ImportOptions, parse};

    const TRAIN: &str = r#"{"directed": true, "multigraph": false, "graph": {"name": "tiny"},
      "nodes": [
        {"name": "c1", "backward": false, "cost_cpu": 3, "cost_ram": 100, "id": 0},
        {"name": "Loss", "backward": true, "cost_cpu": 1, "cost_ram": 4, "id": 1},
        {"name": "c1_backward", "backward": true, "cost_cpu": 6, "cost_ram": 100, "id": 2}],
      "links": [{"source": 0, "target": 1}, {"source": 0, "target": 2}, {"source": 1, "target": 2}]}"#;

    #[test]
    fn training_schema() {
        let g = parse("t.json", TRAIN, ImportOptions::default()).unwrap();
        assert_eq!(g.name(), "tiny");
        assert_eq!(g.node(2).inputs, vec![0, 1]);
        assert!(g.has_backward());
        assert_eq!(g.time_unit_s(), 1e-6);
    }

    #[test]
    fn layered_schema_is_sorted_topologically() {
        let text = r#"{"directed": true, "graph": {}, "nodes": [
            {"name": 0, "duration": 1, "out_cost": 5, "param_cost": 7},
            {"name": 1, "duration": 2, "out_cost": 6, "param_cost": 0},
            {"name": 2, "duration": 3, "out_cost": 7, "param_cost": 0}],
          "links": [{"0": 0, "1": 2}, {"0": 2, "1": 1}]}"#;
        let g = parse("r.json", text, ImportOptions::default()).unwrap();
        let names: Vec<_> = g.nodes().iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["0", "2", "1"]);
        assert_eq!(g.static_bytes(), 7);
        let cyclic = text.replace(r#"{"0": 0, "1": 2}"#, r#"{"0": 1, "1": 2}"#);
        let err = parse("r.json", &cyclic, ImportOptions::default()).unwrap_err();
        assert!(err.to_string().contains("cycle"), "{err}");
    }

    #[test]
    fn errors_name_node_and_field() {
        let cases = [
            (
                r#""cost_cpu": 6"#,
                r#""cost_cpu": -6"#,
                "c1_backward",
                "cost_cpu",
            ),
            (
                r#"{"source": 1, "target": 2}"#,
                r#"{"source": 1, "target": 9}"#,
                "link 2",
                "9",
            ),
            (
                r#"{"source": 0, "target": 1}"#,
                r#"{"source": 2, "target": 1}"#,
                "Loss",
                "not topological",
            ),
            (r#""cost_ram": 4,"#, "", "Loss", "cost_ram"),
        ];
        for (from, to, who, what) in cases {
            let err = parse(
                "bad.json",
                &TRAIN.replace(from, to),
                ImportOptions::default(),
            )
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("bad.json") && err.contains(who) && err.contains(what),
                "{err}"
            );
        }
    }
}
