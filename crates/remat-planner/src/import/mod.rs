//! Importers: remat's own JSON schema ([`remat_json`]) and networkx node-link JSON
//! ([`networkx`], Checkmate's and Moccasin's graphs). [`load`] picks by content.

pub mod networkx;
pub mod remat_json;

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::ImportError;
use crate::ir::Graph;

/// Options for formats that do not carry everything the IR needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ImportOptions {
    /// Seconds per unit of the file's compute costs, for formats whose costs are unitless
    /// (networkx graphs). remat's schema states its own unit and ignores this.
    pub time_unit_s: f64,
}

impl Default for ImportOptions {
    /// Checkmate's profiled costs are read as microseconds.
    fn default() -> Self {
        ImportOptions { time_unit_s: 1e-6 }
    }
}

/// Reads a graph file in either schema.
pub fn load(path: &Path, options: ImportOptions) -> Result<Graph, ImportError> {
    let file = path.display().to_string();
    if path.is_dir() {
        return Err(ImportError::Schema {
            what: directory_hint(path),
            file,
        });
    }
    let text = std::fs::read_to_string(path).map_err(|error| ImportError::Io {
        file: file.clone(),
        error,
    })?;
    parse(&file, &text, options)
}

/// The error text for a directory given as a graph: the `.json` files in it, if any.
fn directory_hint(dir: &Path) -> String {
    const LISTED: usize = 5;
    let mut graphs: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.ends_with(".json"))
                .collect()
        })
        .unwrap_or_default();
    graphs.sort();
    let mut what = String::from("is a directory, not a graph file");
    if !graphs.is_empty() {
        let more = graphs.len().saturating_sub(LISTED);
        graphs.truncate(LISTED);
        what.push_str(&format!("; it holds {}", graphs.join(", ")));
        if more > 0 {
            what.push_str(&format!(" and {more} more .json files"));
        }
        what.push_str(": pass one of them");
    }
    what
}

/// Parses a graph from text; `file` names it in errors.
pub fn parse(file: &str, text: &str, options: ImportOptions) -> Result<Graph, ImportError> {
    let value: Value = serde_json::from_str(text).map_err(|error| ImportError::Json {
        file: file.to_string(),
        error,
    })?;
    let object = value.as_object().ok_or_else(|| ImportError::Schema {
        file: file.to_string(),
        what: "the top level is not a JSON object".into(),
    })?;
    if object.get("format").and_then(Value::as_str) == Some(remat_json::FORMAT) {
        remat_json::from_value(file, object)
    } else if object.contains_key("links") || object.contains_key("edges") {
        networkx::from_value(file, object, options)
    } else {
        Err(ImportError::Schema {
            file: file.to_string(),
            what: format!(
                "neither a remat graph (\"format\": \"{}\") nor networkx node-link JSON (\"links\" or \"edges\")",
                remat_json::FORMAT
            ),
        })
    }
}

/// Field access that names the node and field on error.
pub(crate) struct Fields<'a> {
    pub file: &'a str,
    pub node: String,
    pub object: &'a Map<String, Value>,
}

impl Fields<'_> {
    pub fn error(&self, field: &str, what: impl Into<String>) -> ImportError {
        ImportError::Field {
            file: self.file.to_string(),
            node: self.node.clone(),
            field: field.to_string(),
            what: what.into(),
        }
    }

    pub fn get(&self, field: &str) -> Result<&Value, ImportError> {
        self.object
            .get(field)
            .ok_or_else(|| self.error(field, "missing"))
    }

    /// A finite, non-negative number.
    pub fn cost(&self, field: &str) -> Result<f64, ImportError> {
        let value = self.get(field)?;
        let number = value
            .as_f64()
            .ok_or_else(|| self.error(field, format!("{value} is not a number")))?;
        if !(number.is_finite() && number >= 0.0) {
            return Err(self.error(field, format!("{number} is negative or not finite")));
        }
        Ok(number)
    }

    /// A non-negative integer count of bytes.
    pub fn bytes(&self, field: &str) -> Result<u64, ImportError> {
        let value = self.get(field)?;
        if let Some(bytes) = value.as_u64() {
            return Ok(bytes);
        }
        // Profilers sometimes write integral floats; accept those, refuse anything else.
        match value.as_f64() {
            Some(f) if f >= 0.0 && f.fract() == 0.0 && f < 1.8e19 => Ok(f as u64),
            Some(f) if f < 0.0 => Err(self.error(field, format!("{f} bytes is negative"))),
            _ => Err(self.error(field, format!("{value} is not a byte count"))),
        }
    }

    pub fn boolean(&self, field: &str) -> Result<bool, ImportError> {
        let value = self.get(field)?;
        value
            .as_bool()
            .ok_or_else(|| self.error(field, format!("{value} is not true or false")))
    }

    pub fn string(&self, field: &str) -> Result<&str, ImportError> {
        let value = self.get(field)?;
        value
            .as_str()
            .ok_or_else(|| self.error(field, format!("{value} is not a string")))
    }
}

/// Renders a node key (networkx ids may be numbers or strings).
pub(crate) fn key_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}
