//! `remat._native.Graph`: a planner graph, loaded from remat's JSON or networkx node-link.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use remat_planner::error::ImportError;
use remat_planner::import::{ImportOptions, load, parse, remat_json};
use remat_planner::{Graph, Phase};

use remat_planner::output::{check_outputs, write_all_atomic};

use crate::errors::{plain, raise};

/// A training step's graph: operations in execution order with compute times, output
/// bytes and inputs, plus static bytes. Immutable; shared with the plans made from it.
#[pyclass(name = "Graph", module = "remat._native", frozen)]
pub struct PyGraph {
    pub graph: Arc<Graph>,
}

#[pymethods]
impl PyGraph {
    /// Reads a graph file (remat JSON or networkx node-link JSON). `time_unit_s` is the
    /// seconds per cost unit of unitless (networkx) files; remat files state their own.
    #[staticmethod]
    #[pyo3(signature = (path, time_unit_s = 1e-6))]
    fn load(py: Python<'_>, path: PathBuf, time_unit_s: f64) -> PyResult<PyGraph> {
        let graph = load(&path, ImportOptions { time_unit_s }).map_err(|e| import_error(py, e))?;
        Ok(PyGraph::new(graph))
    }

    /// Parses a graph from JSON text; `file` names it in errors.
    #[staticmethod]
    #[pyo3(signature = (text, file = "<string>", time_unit_s = 1e-6))]
    fn parse(py: Python<'_>, text: &str, file: &str, time_unit_s: f64) -> PyResult<PyGraph> {
        let graph =
            parse(file, text, ImportOptions { time_unit_s }).map_err(|e| import_error(py, e))?;
        Ok(PyGraph::new(graph))
    }

    #[getter]
    fn name(&self) -> &str {
        self.graph.name()
    }
    #[getter]
    fn num_nodes(&self) -> usize {
        self.graph.len()
    }
    /// Peak device bytes when every activation is kept (static bytes included).
    #[getter]
    fn store_all_peak(&self) -> u64 {
        self.graph.store_all_peak()
    }
    /// The least any schedule needs: static bytes plus the largest operation's inputs and
    /// output.
    #[getter]
    fn memory_floor(&self) -> u64 {
        self.graph.memory_floor()
    }
    /// The least peak recomputation alone can reach, static bytes included, and whether
    /// that is the least peak itself (the exact search, small graphs) or a certified lower
    /// bound on it (pinned tensors held across each operation).
    #[getter]
    fn recompute_floor(&self) -> (u64, bool) {
        let floor = remat_planner::floor::recompute_floor(&self.graph);
        (floor.bytes, floor.exact)
    }
    #[getter]
    fn static_bytes(&self) -> u64 {
        self.graph.static_bytes()
    }
    /// Seconds per unit of the compute times.
    #[getter]
    fn time_unit_s(&self) -> f64 {
        self.graph.time_unit_s()
    }
    /// Sum of every node's compute time, once (graph time units).
    #[getter]
    fn base_time(&self) -> f64 {
        self.graph.base_time()
    }

    /// Every node as a dict: name, phase, compute_time, output_bytes, inputs, pinned.
    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (id, node) in self.graph.nodes().iter().enumerate() {
            let d = PyDict::new(py);
            d.set_item("name", &node.name)?;
            let phase = match node.phase {
                Phase::Forward => "forward",
                Phase::Backward => "backward",
            };
            d.set_item("phase", phase)?;
            d.set_item("compute_time", node.compute_time)?;
            d.set_item("output_bytes", node.output_bytes)?;
            d.set_item("inputs", node.inputs.clone())?;
            d.set_item("pinned", self.graph.is_pinned(id))?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// The graph in remat's JSON schema (what `remat plan` reads).
    fn to_json(&self) -> String {
        remat_json::to_json(&self.graph)
    }

    /// Writes [`Self::to_json`] to `path`: checked first, temporary name, synced, renamed.
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        check_outputs(&[("path", &path)]).map_err(|e| plain(py, "OutputError", e))?;
        write_all_atomic(&[(path.clone(), self.to_json().into_bytes())])
            .map_err(|e| plain(py, "OutputError", e))
    }

    fn __len__(&self) -> usize {
        self.graph.len()
    }
}

impl PyGraph {
    pub fn new(graph: Graph) -> PyGraph {
        PyGraph {
            graph: Arc::new(graph),
        }
    }
}

/// `remat.GraphError` with the importer's message and `file`, `node`, `field` as
/// attributes where the error names them.
fn import_error(py: Python<'_>, error: ImportError) -> PyErr {
    let message = error.to_string();
    raise(py, "GraphError", message, |d| {
        let (file, node, field): (&str, Option<&str>, Option<&str>) = match &error {
            ImportError::Io { file, .. }
            | ImportError::Json { file, .. }
            | ImportError::Schema { file, .. }
            | ImportError::Link { file, .. }
            | ImportError::Graph { file, .. } => (file, None, None),
            ImportError::Field {
                file, node, field, ..
            } => (file, Some(node), Some(field)),
            ImportError::Cycle { file, node, .. } => (file, Some(node), None),
        };
        d.set_item("file", file)?;
        d.set_item("node", node)?;
        d.set_item("field", field)
    })
}
