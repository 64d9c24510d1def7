//! `remat._native.simulate`: the planner's simulator on a schedule written in Python.
//!
//! The PyTorch side builds schedules the planner did not make (the steps eager autograd
//! will really take under a keep / offload / recompute decision), and asks the same
//! simulator that judges every plan for their peak and time, so Python never keeps a second
//! memory model of its own.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use remat_planner::Step;
use remat_planner::sim::simulate_steps;

use crate::errors::plain;
use crate::graph::PyGraph;

/// Simulates `steps` (`(op, node)` pairs, op one of compute, free, swap_out, swap_in) over
/// `graph` at `bandwidth` bytes per second. Returns a dict: peak_bytes, peak_step,
/// total_time, base_time, recompute_time, stall_time (graph time units) and timeline
/// (`(step, time, bytes)` after each step that changed the memory). An invalid schedule
/// raises `remat.PlanError` naming the step and node.
#[pyfunction]
#[pyo3(signature = (graph, steps, bandwidth = 32e9))]
pub fn simulate<'py>(
    py: Python<'py>,
    graph: &PyGraph,
    steps: Vec<(String, usize)>,
    bandwidth: f64,
) -> PyResult<Bound<'py, PyDict>> {
    let mut schedule = Vec::with_capacity(steps.len());
    for (index, (op, node)) in steps.iter().enumerate() {
        schedule.push(match op.as_str() {
            "compute" => Step::Compute { node: *node },
            "free" => Step::Free { tensor: *node },
            "swap_out" => Step::SwapOut { tensor: *node },
            "swap_in" => Step::SwapIn { tensor: *node },
            other => {
                return Err(plain(
                    py,
                    "PlanError",
                    format!(
                        "step {index}: unknown op `{other}` (compute, free, swap_out or swap_in)"
                    ),
                ));
            }
        });
    }
    let report = py
        .detach(|| simulate_steps(&graph.graph, &schedule, bandwidth))
        .map_err(|e| plain(py, "PlanError", e))?;
    let out = PyDict::new(py);
    out.set_item("peak_bytes", report.peak_bytes)?;
    out.set_item("peak_step", report.peak_step)?;
    out.set_item("total_time", report.total_time)?;
    out.set_item("base_time", report.base_time)?;
    out.set_item("recompute_time", report.recompute_time)?;
    out.set_item("stall_time", report.stall_time)?;
    let timeline: Vec<(usize, f64, u64)> = report
        .timeline
        .iter()
        .map(|t| (t.step, t.time, t.bytes))
        .collect();
    out.set_item("timeline", timeline)?;
    Ok(out)
}

/// Draws memory timelines as the CLI's plots do (`.svg` or `.png` by the file name) and
/// writes the file atomically: `series` are `(label, [(seconds, bytes), ...])`, drawn as step
/// lines in the CLI's colours (the first grey, the next blue, then orange and green), with
/// the budget as a horizontal line. Errors are `remat.ArgumentError` (file name) and
/// `remat.OutputError` (writing).
#[pyfunction]
pub fn plot_timelines(
    py: Python<'_>,
    path: std::path::PathBuf,
    title: String,
    series: Vec<(String, Vec<(f64, f64)>)>,
    budget_bytes: Option<u64>,
) -> PyResult<()> {
    use remat_planner::output::{check_outputs, write_all_atomic};
    use remat_planner::plot::{Chart, Series};
    use remat_planner::request::ImageFormat;
    const COLORS: [[u8; 3]; 4] = [
        [150, 150, 150],
        [31, 119, 180],
        [255, 127, 14],
        [44, 160, 44],
    ];
    let format = ImageFormat::from_path(&path).ok_or_else(|| {
        plain(
            py,
            "ArgumentError",
            format!("{}: plot needs a .svg or .png file name", path.display()),
        )
    })?;
    check_outputs(&[("path", path.as_path())]).map_err(|e| plain(py, "OutputError", e))?;
    let chart = Chart {
        title,
        x_label: "time (s)".into(),
        y_label: "device memory (bytes)".into(),
        series: series
            .iter()
            .enumerate()
            .map(|(i, (label, points))| Series::new(label, points.clone(), COLORS[i % 4]))
            .collect(),
        hline: budget_bytes.map(|b| ("budget".to_string(), b as f64, [214, 39, 40])),
    };
    let bytes = match format {
        ImageFormat::Svg => chart.to_svg().into_bytes(),
        ImageFormat::Png => chart
            .to_png(1200, 600)
            .map_err(|e| plain(py, "OutputError", e))?,
    };
    py.detach(|| write_all_atomic(&[(path.clone(), bytes)]))
        .map_err(|e| plain(py, "OutputError", e))
}
