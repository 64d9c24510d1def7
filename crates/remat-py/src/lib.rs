//! `remat._native`: the planner and the resharder for Python, in process.
//!
//! A thin layer: every decision (budget parsing, the strategy search, atomic output, the
//! reshard orchestration) is a library function that `remat plan` / `remat reshard` call
//! too, so the two front ends cannot drift apart. Python-side argument handling and the
//! exception classes live in the `remat` package (`python/remat`); errors raised here are
//! instances of `remat.errors` classes, with the library's message and the values at fault
//! as attributes.

mod errors;
mod graph;
mod plan;
mod reshard;
mod sim;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<graph::PyGraph>()?;
    m.add_class::<plan::PyPlan>()?;
    m.add_function(wrap_pyfunction!(plan::strategies, m)?)?;
    m.add_function(wrap_pyfunction!(plan::plan, m)?)?;
    m.add_function(wrap_pyfunction!(plan::parse_budget, m)?)?;
    m.add_function(wrap_pyfunction!(plan::parse_bandwidth, m)?)?;
    m.add_function(wrap_pyfunction!(plan::check_budget, m)?)?;
    m.add_function(wrap_pyfunction!(plan::parse_seconds, m)?)?;
    m.add_function(wrap_pyfunction!(plan::parse_count, m)?)?;
    m.add_function(wrap_pyfunction!(plan::human_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(reshard::reshard, m)?)?;
    m.add_function(wrap_pyfunction!(reshard::verify, m)?)?;
    m.add_function(wrap_pyfunction!(reshard::parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(sim::simulate, m)?)?;
    m.add_function(wrap_pyfunction!(sim::plot_timelines, m)?)?;
    Ok(())
}
