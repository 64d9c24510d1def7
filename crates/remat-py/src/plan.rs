//! `remat._native.plan` and `remat._native.Plan`: one planning request through
//! [`remat_planner::request`], the same function `remat plan` calls.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use remat_planner::budget;
use remat_planner::output::{OutputError, check_outputs, write_all_atomic};
use remat_planner::request::{self, ImageFormat, RequestError};
use remat_planner::solve::bound::Bound;
use remat_planner::{Graph, PlanError, PlanOrder, Planned, Problem, Step, registry};

use crate::errors::{argument_error, plain, raise, unit_error};
use crate::graph::PyGraph;

/// Registry names of every strategy (parameterized ones, `every:N` and the like, are
/// accepted by name too).
#[pyfunction]
pub fn strategies() -> Vec<String> {
    registry().iter().map(|s| s.name()).collect()
}

/// Bytes of a budget written as `8GiB`, `1e9`, `1234` or a fraction `0.7` of the graph's
/// store-all peak, as `remat plan --budget` reads it; `remat.ArgumentError` naming `flag`.
#[pyfunction]
#[pyo3(signature = (text, graph, flag = "budget"))]
pub fn parse_budget(py: Python<'_>, text: &str, graph: &PyGraph, flag: &str) -> PyResult<u64> {
    budget::parse_budget(text, &graph.graph, flag).map_err(|e| unit_error(py, e))
}

/// Checks a budget for a training step not profiled yet (`auto_checkpoint`'s
/// `memory_budget`), as `remat train --memory-budget` and `remat spec inspect
/// --memory-budget` read theirs: readable, a fraction in (0, 1], bytes at least 1 KiB.
#[pyfunction]
#[pyo3(signature = (text, flag = "memory_budget"))]
pub fn check_budget(py: Python<'_>, text: &str, flag: &str) -> PyResult<()> {
    remat_units::parse_budget(text, flag)
        .and_then(|b| b.check_step())
        .map_err(|e| unit_error(py, e))
}

/// Bytes per second of `32GB/s`, `16GiB/s`, `1e9`; errors name `flag`.
#[pyfunction]
#[pyo3(signature = (text, flag = "bandwidth"))]
pub fn parse_bandwidth(py: Python<'_>, text: &str, flag: &str) -> PyResult<f64> {
    remat_units::parse_bandwidth(text, flag).map_err(|e| unit_error(py, e))
}

/// Seconds above 0 and at most `max` (`remat plan --time-limit`); errors name `flag`.
#[pyfunction]
#[pyo3(signature = (text, flag, max = 1_000_000))]
pub fn parse_seconds(py: Python<'_>, text: &str, flag: &str, max: u64) -> PyResult<f64> {
    remat_units::parse_seconds(text, flag, max).map_err(|e| unit_error(py, e))
}

/// A whole number of at least `min` (`remat reshard --world-size`); errors name `flag`.
#[pyfunction]
#[pyo3(signature = (text, flag, min = 1))]
pub fn parse_count(py: Python<'_>, text: &str, flag: &str, min: u64) -> PyResult<u64> {
    remat_units::parse_count(text, flag, min).map_err(|e| unit_error(py, e))
}

/// Bytes as `remat` prints them (`1.50 MiB`).
#[pyfunction]
pub fn human_bytes(bytes: u64) -> String {
    remat_units::human_bytes(bytes)
}

/// Plans `graph` under `budget_bytes` with the strategy named `strategy`, or with the
/// anytime search when it is None (the fastest plan found within `time_limit` seconds;
/// default: 1 s up to 1,000 nodes, 1 ms per node above), as `remat plan` does. Refuses a
/// budget below the graph's memory floor before planning. `order` is the plan form, as
/// `remat plan --order` takes it for one graph (`free`, `node`, `eager`; default: the
/// graph's own marks); an eager plan's JSON says `"order": "eager"`, and a budget under
/// the eager floor is a `BudgetError`.
#[pyfunction]
#[pyo3(signature = (graph, budget_bytes, strategy = None, bandwidth = 32e9, time_limit = None, order = None))]
pub fn plan(
    py: Python<'_>,
    graph: &PyGraph,
    budget_bytes: u64,
    strategy: Option<String>,
    bandwidth: f64,
    time_limit: Option<f64>,
    order: Option<String>,
) -> PyResult<PyPlan> {
    if !(bandwidth.is_finite() && bandwidth >= 1.0) {
        return Err(plain(
            py,
            "ArgumentError",
            format!(
                "bandwidth {bandwidth}: must be a finite number of bytes per second, at least 1"
            ),
        ));
    }
    if let Some(t) = time_limit
        && !(t.is_finite() && t > 0.0)
    {
        return Err(plain(
            py,
            "ArgumentError",
            format!("time_limit {t}: must be a positive finite number of seconds"),
        ));
    }
    let graph = match order.as_deref() {
        None => Arc::clone(&graph.graph),
        Some(name) => {
            let Some(form) = PlanOrder::from_name(name) else {
                let known: Vec<&str> = PlanOrder::ALL.iter().map(|o| o.name()).collect();
                // As `remat plan --order` words it, after the argument's name.
                return Err(argument_error(
                    py,
                    "order",
                    name,
                    format!("order {name}: unknown order; known: {}", known.join(", ")),
                ));
            };
            let marked = request::with_order(graph.graph.as_ref().clone(), form)
                .map_err(|e| request_error(py, &graph.graph, e))?;
            Arc::new(marked)
        }
    };
    let problem = Problem {
        graph: &graph,
        budget_bytes,
        bandwidth,
    };
    let limit = time_limit.map(Duration::from_secs_f64);
    let outcome = py.detach(|| request::plan(&problem, strategy.as_deref(), limit, |_| {}));
    let planned = outcome.result.map_err(|e| request_error(py, &graph, e))?;
    let mut notes: Vec<String> = outcome
        .skipped
        .iter()
        .map(|(name, why)| format!("note: {name}: {why}"))
        .collect();
    notes.extend(
        outcome
            .failed
            .iter()
            .map(|(name, e)| format!("warning: {name} failed and was left out: {e}")),
    );
    Ok(PyPlan {
        graph: Arc::clone(&graph),
        planned,
        notes,
        bound: outcome.bound,
    })
}

/// `remat.BudgetError` for a budget nothing fits (attributes `budget_bytes`,
/// `floor_bytes`, `best_peak` and `strategy` where known), `remat.PlanError` otherwise.
fn request_error(py: Python<'_>, graph: &Graph, error: RequestError) -> PyErr {
    let floor = graph.memory_floor();
    let budget_error = |budget: u64, best_peak: Option<u64>, strategy: Option<&str>| {
        raise(py, "BudgetError", error.to_string(), |d| {
            d.set_item("budget_bytes", budget)?;
            d.set_item("floor_bytes", floor)?;
            d.set_item("best_peak", best_peak)?;
            d.set_item("strategy", strategy)
        })
    };
    match &error {
        RequestError::BelowFloor { budget, .. }
        | RequestError::BelowRecomputeFloor { budget, .. }
        | RequestError::BelowEagerFloor { budget, .. } => budget_error(*budget, None, None),
        RequestError::Order { .. } => plain(py, "ArgumentError", error.to_string()),
        RequestError::SwapsNeeded {
            budget,
            strategy,
            least_peak,
            ..
        } => budget_error(*budget, *least_peak, Some(strategy)),
        RequestError::Infeasible {
            budget,
            best_peak,
            strategy,
        }
        | RequestError::Plan(PlanError::OverBudget {
            budget,
            best_peak,
            strategy,
        }) => budget_error(*budget, Some(*best_peak), Some(strategy)),
        RequestError::Plan(PlanError::ProvedInfeasible {
            budget, strategy, ..
        }) => budget_error(*budget, None, Some(strategy)),
        RequestError::Plan(other) => {
            let (strategy, message) = match other {
                // A name that is no strategy, worded as `remat plan --strategy` words it
                // after its flag.
                PlanError::UnknownStrategy { name, .. } | PlanError::BadParameter { name, .. } => {
                    (Some(name.clone()), format!("strategy {name}: {error}"))
                }
                PlanError::NotApplicable { strategy, .. }
                | PlanError::InvalidSchedule { strategy, .. } => {
                    (Some(strategy.clone()), error.to_string())
                }
                _ => (None, error.to_string()),
            };
            raise(py, "PlanError", message, |d| {
                d.set_item("strategy", strategy)
            })
        }
    }
}

/// A plan with the simulator's report of it. Times are in the graph's time units
/// (`time_unit_s` seconds each).
#[pyclass(name = "Plan", module = "remat._native", frozen)]
pub struct PyPlan {
    graph: Arc<Graph>,
    planned: Planned,
    notes: Vec<String>,
    bound: Option<Bound>,
}

#[pymethods]
impl PyPlan {
    #[getter]
    fn graph(&self) -> PyGraph {
        PyGraph {
            graph: Arc::clone(&self.graph),
        }
    }
    #[getter]
    fn strategy(&self) -> &str {
        &self.planned.plan.strategy
    }
    #[getter]
    fn budget_bytes(&self) -> u64 {
        self.planned.plan.budget_bytes
    }
    #[getter]
    fn bandwidth(&self) -> f64 {
        self.planned.plan.bandwidth_bytes_per_s
    }
    /// Simulated peak device bytes, static bytes included.
    #[getter]
    fn peak_bytes(&self) -> u64 {
        self.planned.report.peak_bytes
    }
    #[getter]
    fn store_all_peak(&self) -> u64 {
        self.graph.store_all_peak()
    }
    #[getter]
    fn total_time(&self) -> f64 {
        self.planned.report.total_time
    }
    /// Every node's compute time once: store-all's time.
    #[getter]
    fn compute_time(&self) -> f64 {
        self.planned.report.base_time
    }
    #[getter]
    fn recompute_time(&self) -> f64 {
        self.planned.report.recompute_time
    }
    /// Time the compute stream waited on copies.
    #[getter]
    fn exposed_swap_time(&self) -> f64 {
        self.planned.report.stall_time
    }
    /// (total - store-all time) / store-all time, as `remat plan` prints it (in percent).
    #[getter]
    fn overhead(&self) -> f64 {
        self.planned.report.overhead()
    }
    #[getter]
    fn time_unit_s(&self) -> f64 {
        self.graph.time_unit_s()
    }
    /// Bytes of the tensors kept, swapped and recomputed.
    #[getter]
    fn bytes_by_fate(&self) -> (u64, u64, u64) {
        self.planned.report.bytes_by_fate(&self.graph)
    }
    /// A lower bound on the overhead of every schedule at this budget (a fraction, as
    /// `overhead`), or None.
    #[getter]
    fn lower_bound(&self) -> Option<f64> {
        self.bound.as_ref().map(|b| b.overhead)
    }
    /// What proved the bound and which schedules it holds for, or None.
    #[getter]
    fn lower_bound_source(&self) -> Option<(String, String)> {
        self.bound
            .as_ref()
            .map(|b| (b.source.clone(), b.holds_for.clone()))
    }
    /// Whether the plan runs the operations in another order than the graph's.
    #[getter]
    fn reorders(&self) -> bool {
        self.planned.plan.reorders()
    }
    /// What the search skipped or left out, one line each, as `remat plan` prints them.
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }
    /// The schedule: `(op, node)` with op one of compute, free, swap_out, swap_in.
    #[getter]
    fn steps(&self) -> Vec<(&'static str, usize)> {
        self.planned
            .plan
            .steps
            .iter()
            .map(|step| match *step {
                Step::Compute { node } => ("compute", node),
                Step::Free { tensor } => ("free", tensor),
                Step::SwapOut { tensor } => ("swap_out", tensor),
                Step::SwapIn { tensor } => ("swap_in", tensor),
            })
            .collect()
    }
    /// Device bytes after each step that changed them: `(step, time, bytes)`.
    #[getter]
    fn timeline(&self) -> Vec<(usize, f64, u64)> {
        self.planned
            .report
            .timeline
            .iter()
            .map(|t| (t.step, t.time, t.bytes))
            .collect()
    }
    /// The per-tensor decisions as the plan JSON writes them.
    fn decisions_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.planned.plan.decisions)
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))
    }
    /// The plan file (what `remat plan --out` writes); `remat.PlanError` when it cannot be
    /// written.
    fn to_json(&self, py: Python<'_>) -> PyResult<String> {
        self.planned
            .plan
            .to_json()
            .map_err(|e| plain(py, "PlanError", e))
    }
    /// The report lines `remat plan` prints (its lower-bound and order lines included).
    fn summary(&self) -> String {
        request::summary(&self.graph, &self.planned)
            + &request::bound_lines(&self.planned, self.bound.as_ref())
    }
    /// Writes the plan JSON to `path` and/or its memory timeline (`.svg` or `.png`) to
    /// `plot`, all or nothing: paths checked first, temporaries synced, then renamed.
    #[pyo3(signature = (path = None, plot = None))]
    fn save(&self, py: Python<'_>, path: Option<PathBuf>, plot: Option<PathBuf>) -> PyResult<()> {
        let format = match &plot {
            Some(p) => Some(ImageFormat::from_path(p).ok_or_else(|| {
                plain(
                    py,
                    "ArgumentError",
                    format!("{}: plot needs a .svg or .png file name", p.display()),
                )
            })?),
            None => None,
        };
        let targets: Vec<(&str, &std::path::Path)> = [("path", &path), ("plot", &plot)]
            .into_iter()
            .filter_map(|(flag, p)| p.as_deref().map(|p| (flag, p)))
            .collect();
        check_outputs(&targets).map_err(|e| output_error(py, e))?;
        let mut files = Vec::new();
        if let Some(p) = &path {
            let text = self
                .planned
                .plan
                .to_json()
                .map_err(|e| plain(py, "PlanError", e))?;
            files.push((p.clone(), text.into_bytes()));
        }
        if let (Some(p), Some(format)) = (&plot, format) {
            let problem = Problem {
                graph: &self.graph,
                budget_bytes: self.planned.plan.budget_bytes,
                bandwidth: self.planned.plan.bandwidth_bytes_per_s,
            };
            let image = py
                .detach(|| request::timeline_image(&problem, &self.planned, format))
                .map_err(|e| plain(py, "PlanError", e))?;
            files.push((p.clone(), image));
        }
        py.detach(|| write_all_atomic(&files))
            .map_err(|e| output_error(py, e))
    }
}

fn output_error(py: Python<'_>, error: OutputError) -> PyErr {
    plain(py, "OutputError", error)
}
