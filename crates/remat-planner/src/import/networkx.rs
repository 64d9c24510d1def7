//! networkx node-link JSON, as in the Checkmate/Moccasin graphs of `../shared/graphs`.
//!
//! Two node schemas are read:
//! - training graphs: `id`, `name`, `backward`, `cost_cpu` (time), `cost_ram` (output
//!   bytes); links `{"source": u, "target": v}`. Integer node ids are a topological order
//!   and that order is the schedule: a link from a later to an earlier node is an error.
//!   When every id is a string, the file's node order is the schedule instead (it is the
//!   only order the file states), and it must be topological.
//! - general DAGs (Moccasin's random layered graph): the node key is `id` or else `name`,
//!   `duration` (time), `out_cost` (output bytes), `param_cost` (static bytes); links
//!   `{"0": u, "1": v}`. All nodes are forward (there is no backward marking). The schedule
//!   is the file's `graph.order` when it has one: Moccasin's generator writes the
//!   topological order its experiments use there, and the paper's byte budgets are
//!   fractions of that order's peak, so any other order would plan a different problem.
//!   It must list every node once and put each link's source before its target. Without
//!   it, nodes are ordered topologically (Kahn's algorithm, smallest key first).
//!
//! The schema is chosen once per file, from the fields the nodes use (any training field
//! makes it a training graph), so a node missing a field is told the field of the file's
//! schema. A cycle is reported as such, with its path, before any order is checked.
//!
//! The link list is `links` or, as networkx 3.4 and later can write it, `edges`. An
//! undirected graph (`"directed": false`) is refused: its links have no reading direction.

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
    if object.get("directed") == Some(&Value::Bool(false)) {
        return Err(schema(
            "the graph is undirected (`directed` is false): a data-flow graph needs links \
             that say which node reads which",
        ));
    }
    let links = link_list(object).map_err(|what| schema(&what))?;
    let training = is_training(nodes);
    let raw = nodes
        .iter()
        .enumerate()
        .map(|(i, v)| raw_node(file, i, v, training))
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
    if let Some(cycle) = find_cycle(raw.len(), &edges) {
        return Err(cycle_error(file, &raw, &cycle));
    }
    let order = if training {
        id_order(file, &raw, &edges)?
    } else if let Some(stated) = object.get("graph").and_then(|g| g.get("order")) {
        stated_order(file, stated, &raw, &index, &edges)?
    } else {
        topological_order(&raw, &edges)
    };
    build(file, object, raw, &edges, &order, options)
}

/// The link list: `links`, as Checkmate's and Moccasin's files and networkx before 3.4
/// write it, or `edges`, the name networkx 3.4 introduced (`node_link_data(G, edges=...)`)
/// and makes its default later. Both at once is ambiguous.
fn link_list(object: &Map<String, Value>) -> Result<&Vec<Value>, String> {
    let (key, value) = match (object.get("links"), object.get("edges")) {
        (Some(_), Some(_)) => {
            return Err("has both `links` and `edges`: which one lists the links?".into());
        }
        (Some(v), None) => ("links", v),
        (None, Some(v)) => ("edges", v),
        (None, None) => return Err("field `links` (or `edges`) is missing".into()),
    };
    value
        .as_array()
        .ok_or_else(|| format!("field `{key}` is not an array"))
}

/// Fields only Checkmate's training schema uses.
const TRAINING_FIELDS: [&str; 3] = ["cost_cpu", "cost_ram", "backward"];

/// Whether any node uses a field of the training schema.
fn is_training(nodes: &[Value]) -> bool {
    nodes
        .iter()
        .filter_map(Value::as_object)
        .any(|o| TRAINING_FIELDS.iter().any(|field| o.contains_key(*field)))
}

fn raw_node(file: &str, i: usize, value: &Value, training: bool) -> Result<RawNode, ImportError> {
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
    if training {
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

/// Training graphs: integer ids are the schedule; all-string ids leave the file order as
/// the only stated one. Every link must go forward in that order.
fn id_order(
    file: &str,
    raw: &[RawNode],
    edges: &[(usize, usize)],
) -> Result<Vec<usize>, ImportError> {
    let ids: Vec<Option<i64>> = raw.iter().map(|n| n.key.parse::<i64>().ok()).collect();
    let rank: Vec<i64> = if ids.iter().all(Option::is_some) {
        ids.iter().map(|id| id.unwrap_or_default()).collect()
    } else if let Some(i) = ids.iter().position(Option::is_some) {
        // Some integers, some strings: neither order is the file's intent for sure.
        let string = ids.iter().position(Option::is_none).unwrap_or(i);
        return Err(ImportError::Field {
            file: file.to_string(),
            node: format!("{} `{}`", raw[string].key, raw[string].name),
            field: "id".into(),
            what: format!(
                "is a string while node {} has an integer id: use integer positions throughout, or strings throughout (the file order is then the schedule)",
                raw[i].key
            ),
        });
    } else {
        (0..raw.len() as i64).collect()
    };
    let mut order: Vec<usize> = (0..raw.len()).collect();
    order.sort_by_key(|&i| rank[i]);
    for &(u, v) in edges {
        if rank[u] >= rank[v] {
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

/// General DAGs with a `graph.order`: that order, checked to name every node once and to
/// be topological.
fn stated_order(
    file: &str,
    stated: &Value,
    raw: &[RawNode],
    index: &HashMap<String, usize>,
    edges: &[(usize, usize)],
) -> Result<Vec<usize>, ImportError> {
    let schema = |what: String| ImportError::Schema {
        file: file.to_string(),
        what: format!("`graph.order` {what}"),
    };
    let entries = stated
        .as_array()
        .ok_or_else(|| schema("is not an array of node ids".into()))?;
    let mut order = Vec::with_capacity(raw.len());
    let mut position = vec![usize::MAX; raw.len()];
    for (p, entry) in entries.iter().enumerate() {
        let key = key_text(entry);
        let &i = index
            .get(&key)
            .ok_or_else(|| schema(format!("entry {p} names node {key}, which does not exist")))?;
        if position[i] != usize::MAX {
            return Err(schema(format!(
                "lists node {key} twice (entries {} and {p})",
                position[i]
            )));
        }
        position[i] = p;
        order.push(i);
    }
    if let Some(missing) = position.iter().position(|&p| p == usize::MAX) {
        return Err(schema(format!(
            "leaves out node {} `{}` ({} of {} nodes listed)",
            raw[missing].key,
            raw[missing].name,
            entries.len(),
            raw.len()
        )));
    }
    for &(u, v) in edges {
        if position[u] > position[v] {
            return Err(ImportError::Field {
                file: file.to_string(),
                node: format!("{} `{}`", raw[v].key, raw[v].name),
                field: "graph.order".into(),
                what: format!(
                    "comes before node {} `{}`, which it reads: the order is not topological",
                    raw[u].key, raw[u].name
                ),
            });
        }
    }
    Ok(order)
}

/// A cycle of the link graph as node indices (first == last), if any. Kahn's algorithm
/// removes every node not on or behind a cycle; each node left has a predecessor left, so
/// walking predecessors from one of them must repeat a node, and the walk from the first
/// repeat is a cycle.
fn find_cycle(n: usize, edges: &[(usize, usize)]) -> Option<Vec<usize>> {
    let mut indegree = vec![0usize; n];
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut preds: Vec<Vec<usize>> = vec![Vec::new(); n];
    for &(u, v) in edges {
        indegree[v] += 1;
        out[u].push(v);
        preds[v].push(u);
    }
    let mut stack: Vec<usize> = (0..n).filter(|&i| indegree[i] == 0).collect();
    while let Some(u) = stack.pop() {
        for &v in &out[u] {
            indegree[v] -= 1;
            if indegree[v] == 0 {
                stack.push(v);
            }
        }
    }
    let start = (0..n).find(|&i| indegree[i] > 0)?;
    let mut seen_at = vec![usize::MAX; n];
    let mut walk = Vec::new();
    let mut at = start;
    while seen_at[at] == usize::MAX {
        seen_at[at] = walk.len();
        walk.push(at);
        at = *preds[at].iter().find(|&&p| indegree[p] > 0)?;
    }
    // `walk` follows links backwards; the cycle is its tail from `at`, reversed.
    let mut cycle: Vec<usize> = walk[seen_at[at]..].to_vec();
    cycle.reverse();
    cycle.push(cycle[0]);
    Some(cycle)
}

fn cycle_error(file: &str, raw: &[RawNode], cycle: &[usize]) -> ImportError {
    let label = |i: usize| format!("{} `{}`", raw[i].key, raw[i].name);
    ImportError::Cycle {
        file: file.to_string(),
        node: label(cycle[0]),
        path: cycle
            .iter()
            .map(|&i| label(i))
            .collect::<Vec<_>>()
            .join(" -> "),
    }
}

/// General DAGs (acyclic: checked before): Kahn's algorithm, smallest key position first.
fn topological_order(raw: &[RawNode], edges: &[(usize, usize)]) -> Vec<usize> {
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
    order
}

fn sort_key(key: &str, position: usize) -> i64 {
    key.parse().unwrap_or(position as i64)
}

/// The sum of every node's `param_cost`, checked: a sum past u64::MAX is an error naming
/// the node that overflows it (a wrapped sum would plan against a tiny static size).
fn static_bytes(file: &str, raw: &[RawNode]) -> Result<u64, ImportError> {
    let mut total = 0u64;
    for node in raw {
        total = total
            .checked_add(node.params)
            .ok_or_else(|| ImportError::Field {
                file: file.to_string(),
                node: format!("{} `{}`", node.key, node.name),
                field: "param_cost".into(),
                what: format!(
                    "{} bytes brings the graph's parameter bytes past 2^64 - 1",
                    node.params
                ),
            })?;
    }
    Ok(total)
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
    let static_bytes = static_bytes(file, &raw)?;
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
    Graph::new(name, nodes, static_bytes, options.time_unit_s).map_err(|error| ImportError::Graph {
        file: file.to_string(),
        error,
    })
}

#[cfg(test)]
mod tests;
