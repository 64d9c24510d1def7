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
//!     {"name": "fc1_backward", "phase": "backward", "compute_time": 20.0, "output_bytes": 4096, "inputs": [0]}
//!   ]
//! }
//! ```
//!
//! - `nodes` are in execution order; `inputs` are indices into `nodes`, each earlier than
//!   the node itself.
//! - `phase` is `forward` or `backward` (the loss is backward).
//! - `compute_time` is in units of `time_unit_s` seconds (default 1 when absent);
//!   `output_bytes` and `static_bytes` (parameters, gradients, optimizer state) are bytes.

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
    let version = top.get("version")?.as_u64();
    if version != Some(VERSION) {
        return Err(schema(format!(
            "field `version` is {:?}, this build reads {VERSION}",
            object.get("version")
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
    let nodes = raw
        .iter()
        .enumerate()
        .map(|(index, value)| node(file, index, value, raw.len()))
        .collect::<Result<Vec<_>, _>>()?;
    Graph::new(name, nodes, static_bytes, time_unit_s).map_err(|error| ImportError::Graph {
        file: file.to_string(),
        error,
    })
}

fn node(file: &str, index: usize, value: &Value, count: usize) -> Result<Node, ImportError> {
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
    Ok(Node {
        compute_time: fields.cost("compute_time")?,
        output_bytes: fields.bytes("output_bytes")?,
        name,
        phase,
        inputs,
    })
}

#[derive(Serialize)]
struct FileOut<'a> {
    format: &'static str,
    version: u64,
    name: &'a str,
    time_unit_s: f64,
    static_bytes: u64,
    nodes: &'a [Node],
}

/// Writes a graph in remat's schema.
pub fn to_json(graph: &Graph) -> String {
    let out = FileOut {
        format: FORMAT,
        version: VERSION,
        name: graph.name(),
        time_unit_s: graph.time_unit_s(),
        static_bytes: graph.static_bytes(),
        nodes: graph.nodes(),
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
