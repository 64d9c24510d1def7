//! remat's own graph schema, which the engine's profiler writes.
//!
//! ```json
//! {
//!   "format": "remat-graph",
//!   "version": 1,
//!   "name": "mlp-4",
//!   "time_unit_s": 1e-6,
//!   "static_bytes": 1048576,
//!   "nodes": [
//!     {"name": "fc1", "phase": "forward", "compute_time": 12.5, "output_bytes": 4096, "inputs": []},
//!     {"name": "fc1_backward", "phase": "backward", "compute_time": 20.0, "output_bytes": 4096, "inputs": [0]},
//!     {"name": "grad:fc1.w", "phase": "backward", "compute_time": 0.0, "output_bytes": 4096, "inputs": [], "pinned": true}
//!   ]
//! }
//! ```
//!
//! - `nodes` are in execution order; `inputs` are indices into `nodes`, each earlier than
//!   the node itself.
//! - `phase` is `forward` or `backward` (the loss is backward).
//! - `compute_time` is in units of `time_unit_s` seconds (default 1 when absent);
//!   `output_bytes` and `static_bytes` (parameters, gradients, optimizer state) are bytes.
//! - `pinned` (optional, default `false`): the node must be computed exactly once; its
//!   tensor may be kept or swapped, never dropped and recomputed (the engine's gradient
//!   buffers, which later ops accumulate into in place). See [`Graph::with_pinned`].
//!   Written only when `true`.
//! - `fixed_order` (optional, top level, default `false`): first computations must follow
//!   the node order ([`Graph::with_fixed_order`]): a step whose random ops draw from one
//!   stream in order (dropout), or that accumulates in place in node order. Written only
//!   when `true`.

use serde::Serialize;
use serde_json::{Map, Value};

use super::Fields;
use crate::error::ImportError;
use crate::ir::{Graph, Node, Phase};

/// Value of the `format` field.
pub const FORMAT: &str = "remat-graph";
/// Schema version written and read.
pub const VERSION: u64 = 1;

pub(crate) fn from_value(file: &str, object: &Map<String, Value>) -> Result<Graph, ImportError> {
    let top = Fields {
        file,
        node: "(graph)".into(),
        object,
    };
    let schema = |what: String| ImportError::Schema {
        file: file.to_string(),
        what,
    };
    let version = top.get("version")?;
    if version.as_u64() != Some(VERSION) {
        return Err(schema(format!(
            "field `version` is {version}, this build reads version {VERSION}"
        )));
    }
    let name = top.string("name")?.to_string();
    let static_bytes = match object.get("static_bytes") {
        Some(_) => top.bytes("static_bytes")?,
        None => 0,
    };
    let time_unit_s = match object.get("time_unit_s") {
        Some(_) => top.cost("time_unit_s")?,
        None => 1.0,
    };
    let raw = top
        .get("nodes")?
        .as_array()
        .ok_or_else(|| schema("field `nodes` is not an array".into()))?;
    let mut nodes = Vec::with_capacity(raw.len());
    let mut pinned = Vec::new();
    for (index, value) in raw.iter().enumerate() {
        let (node, is_pinned) = node(file, index, value, raw.len())?;
        nodes.push(node);
        if is_pinned {
            pinned.push(index);
        }
    }
    let as_import = |error| ImportError::Graph {
        file: file.to_string(),
        error,
    };
    let fixed_order = match object.get("fixed_order") {
        Some(_) => top.boolean("fixed_order")?,
        None => false,
    };
    let graph = Graph::new(name, nodes, static_bytes, time_unit_s)
        .and_then(|graph| graph.with_pinned(pinned))
        .map_err(as_import)?;
    Ok(if fixed_order {
        graph.with_fixed_order()
    } else {
        graph
    })
}

/// One node and its `pinned` mark.
fn node(
    file: &str,
    index: usize,
    value: &Value,
    count: usize,
) -> Result<(Node, bool), ImportError> {
    let object = value.as_object().ok_or_else(|| ImportError::Schema {
        file: file.to_string(),
        what: format!("nodes[{index}] is not an object"),
    })?;
    let mut fields = Fields {
        file,
        node: format!("#{index}"),
        object,
    };
    let name = fields.string("name")?.to_string();
    fields.node = format!("#{index} `{name}`");
    let phase = match fields.string("phase")? {
        "forward" => Phase::Forward,
        "backward" => Phase::Backward,
        other => {
            return Err(fields.error(
                "phase",
                format!("`{other}` is neither `forward` nor `backward`"),
            ));
        }
    };
    let inputs_value = fields.get("inputs")?;
    let inputs_array = inputs_value
        .as_array()
        .ok_or_else(|| fields.error("inputs", "is not an array of node indices"))?;
    let mut inputs = Vec::with_capacity(inputs_array.len());
    for input in inputs_array {
        let Some(i) = input.as_u64().map(|i| i as usize) else {
            return Err(fields.error("inputs", format!("{input} is not a node index")));
        };
        if i >= count {
            return Err(fields.error("inputs", format!("links to missing node {i}")));
        }
        if i >= index {
            return Err(fields.error(
                "inputs",
                format!("reads node {i}, which is not earlier: the order is not topological"),
            ));
        }
        inputs.push(i);
    }
    let pinned = match object.get("pinned") {
        Some(_) => fields.boolean("pinned")?,
        None => false,
    };
    let node = Node {
        compute_time: fields.cost("compute_time")?,
        output_bytes: fields.bytes("output_bytes")?,
        name,
        phase,
        inputs,
    };
    Ok((node, pinned))
}

#[derive(Serialize)]
struct FileOut<'a> {
    format: &'static str,
    version: u64,
    name: &'a str,
    time_unit_s: f64,
    static_bytes: u64,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    fixed_order: bool,
    nodes: Vec<NodeOut<'a>>,
}

/// A node as written: its fields, plus `pinned` when set (files without pins stay as they
/// were).
#[derive(Serialize)]
struct NodeOut<'a> {
    #[serde(flatten)]
    node: &'a Node,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pinned: bool,
}

/// Writes a graph in remat's schema.
pub fn to_json(graph: &Graph) -> String {
    let out = FileOut {
        format: FORMAT,
        version: VERSION,
        name: graph.name(),
        time_unit_s: graph.time_unit_s(),
        static_bytes: graph.static_bytes(),
        fixed_order: graph.order_is_fixed(),
        nodes: graph
            .nodes()
            .iter()
            .enumerate()
            .map(|(id, node)| NodeOut {
                node,
                pinned: graph.is_pinned(id),
            })
            .collect(),
    };
    serde_json::to_string_pretty(&out).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::import::{ImportOptions, parse};

    const GOOD: &str = r#"{"format": "remat-graph", "version": 1, "name": "g", "static_bytes": 8,
        "nodes": [
          {"name": "a", "phase": "forward", "compute_time": 1, "output_bytes": 4, "inputs": []},
          {"name": "b", "phase": "backward", "compute_time": 2.5, "output_bytes": 4, "inputs": [0]}
        ]}"#;

    #[test]
    fn round_trip() {
        let g = parse("g.json", GOOD, ImportOptions::default()).unwrap();
        assert_eq!(g.static_bytes(), 8);
        assert_eq!(g.node(1).phase, Phase::Backward);
        let again = parse("again.json", &to_json(&g), ImportOptions::default()).unwrap();
        assert_eq!(again, g);
    }

    #[test]
    fn pinned_marks_round_trip_and_default_to_false() {
        let text = GOOD.replace("\"inputs\": []}", "\"inputs\": [], \"pinned\": true}");
        let g = parse("p.json", &text, ImportOptions::default()).unwrap();
        assert!(g.is_pinned(0) && !g.is_pinned(1));
        let written = to_json(&g);
        assert_eq!(written.matches("\"pinned\"").count(), 1, "{written}");
        let again = parse("again.json", &written, ImportOptions::default()).unwrap();
        assert_eq!(again, g);
        // A graph without pins writes no `pinned` field at all.
        let plain = parse("g.json", GOOD, ImportOptions::default()).unwrap();
        assert!(!to_json(&plain).contains("pinned"));
        let bad = GOOD.replace("\"inputs\": [0]}", "\"inputs\": [0], \"pinned\": 1}");
        let err = parse("bad.json", &bad, ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bad.json") && err.contains("`b`") && err.contains("pinned"),
            "{err}"
        );
    }

    #[test]
    fn a_fixed_order_round_trips_and_defaults_to_free() {
        let plain = parse("g.json", GOOD, ImportOptions::default()).unwrap();
        assert!(!plain.order_is_fixed());
        assert!(!to_json(&plain).contains("fixed_order"));
        let text = GOOD.replace(
            "\"static_bytes\": 8,",
            "\"static_bytes\": 8, \"fixed_order\": true,",
        );
        let fixed = parse("f.json", &text, ImportOptions::default()).unwrap();
        assert!(fixed.order_is_fixed());
        let again = parse("again.json", &to_json(&fixed), ImportOptions::default()).unwrap();
        assert!(again.order_is_fixed());
        let bad = GOOD.replace(
            "\"static_bytes\": 8,",
            "\"static_bytes\": 8, \"fixed_order\": 1,",
        );
        let err = parse("bad.json", &bad, ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bad.json") && err.contains("fixed_order"),
            "{err}"
        );
    }

    #[test]
    fn another_version_is_shown_as_written() {
        let text = GOOD.replace("\"version\": 1", "\"version\": 2");
        let err = parse("v.json", &text, ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("v.json") && err.contains("`version` is 2,") && !err.contains("Some"),
            "{err}"
        );
    }

    #[test]
    fn errors_name_node_and_field() {
        let cases = [
            (
                "\"compute_time\": 2.5",
                "\"compute_time\": -2.5",
                "`b`",
                "compute_time",
            ),
            (
                "\"inputs\": [0]}",
                "\"inputs\": [7]}",
                "`b`",
                "missing node 7",
            ),
            (
                "\"inputs\": []}",
                "\"inputs\": [1]}",
                "`a`",
                "not topological",
            ),
            (
                "\"output_bytes\": 4, \"inputs\": []",
                "\"output_bytes\": -4, \"inputs\": []",
                "`a`",
                "negative",
            ),
        ];
        for (from, to, node, what) in cases {
            let text = GOOD.replace(from, to);
            let err = parse("bad.json", &text, ImportOptions::default())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("bad.json") && err.contains(node) && err.contains(what),
                "{err}"
            );
        }
    }
}
