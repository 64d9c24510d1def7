//! `remat._native.reshard` / `verify`: a reshard request through [`remat_reshard::run`],
//! the same function `remat reshard` calls. Results are dicts of plain values.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use remat_reshard::run::{self, Action, Event, Outcome, Request};
use remat_reshard::target::check_world_size;
use remat_reshard::{Format, NameRule, Preset, RankStats, ReshardError, TargetSpec, VerifyReport};

use crate::errors::{argument_error, plain, raise, unit_error};

/// A size such as `256MiB`, `1GiB`, `1.5GB`, `4096` (see `remat_units`: GB = 10^9 bytes,
/// GiB = 2^30); with `nonzero`, at least one byte, as `remat reshard --max-buffer` reads
/// it. `remat.ArgumentError` naming `field`.
#[pyfunction]
#[pyo3(signature = (text, field = "max_buffer", nonzero = false))]
pub fn parse_size(py: Python<'_>, text: &str, field: &str, nonzero: bool) -> PyResult<u64> {
    let read = if nonzero {
        remat_units::parse_nonzero_size
    } else {
        remat_units::parse_size
    };
    read(text, field).map_err(|e| unit_error(py, e))
}

/// Reshards `src` into `dst` on `world_size` ranks (see `remat.reshard`).
#[pyfunction]
#[pyo3(signature = (src, dst, world_size, format = "remat", source_format = None,
    preset = None, place = Vec::new(), max_buffer = 256 << 20, dry_run = false,
    force = false, rank = None, finalize = false))]
#[allow(clippy::too_many_arguments)] // Python's keyword arguments, one each.
pub fn reshard<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    world_size: u64,
    format: &str,
    source_format: Option<&str>,
    preset: Option<&str>,
    place: Vec<(String, String)>,
    max_buffer: u64,
    dry_run: bool,
    force: bool,
    rank: Option<usize>,
    finalize: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let world_size = checked_world_size(py, world_size)?;
    let format = parse_format(py, "format", format)?;
    let source_format = source_format
        .map(|f| parse_format(py, "source_format", f))
        .transpose()?;
    let preset = preset.map(|p| parse_preset(py, p)).transpose()?;
    let rules = place
        .iter()
        .map(|(pattern, rule)| parse_rule(py, pattern, rule))
        .collect::<PyResult<Vec<_>>>()?;
    let action = match (dry_run, finalize) {
        (true, true) => return Err(argument(py, "dry_run and finalize: give one of them")),
        (true, false) => Action::DryRun,
        (false, true) => Action::Finalize,
        (false, false) => Action::Write,
    };
    if finalize && rank.is_some() {
        return Err(argument(
            py,
            "rank and finalize: finalize checks every rank's part; run it without rank",
        ));
    }
    let request = Request {
        src: &src,
        dst: &dst,
        source_format,
        spec: TargetSpec {
            world_size,
            format,
            rules,
            preset,
        },
        max_buffer,
        rank,
        action,
        overwrite: force,
    };
    let mut seen = Seen::default();
    let outcome = py
        .detach(|| run::reshard(&request, |e| seen.record(e, &src, format, rank), None))
        .map_err(|e| run_error(py, &e))?;
    let report = seen.into_dict(py)?;
    report.set_item("world_size", world_size)?;
    report.set_item("format", format.name())?;
    report.set_item("dry_run", dry_run)?;
    match outcome {
        Outcome::DryRun(dry) => {
            report.set_item("peak_buffer", dry.peak_buffer)?;
            report.set_item("max_buffer", dry.max_buffer)?;
            report.set_item("threads", dry.threads)?;
        }
        Outcome::Finalized { parts } => {
            report.set_item("finalized", true)?;
            report.set_item("parts", parts)?;
        }
        Outcome::Written(w) => {
            report.set_item("files_written", w.files_written)?;
            report.set_item("bytes_written", w.bytes_written)?;
            report.set_item("seconds", w.seconds)?;
            report.set_item("gb_per_s", w.gb_per_s())?;
            report.set_item("buffer_bytes", w.buffer_bytes)?;
        }
    }
    Ok(report)
}

/// What the request's events said: skipped files, the plan line, per-rank statistics.
#[derive(Default)]
struct Seen {
    skipped: Vec<(String, String)>,
    summary: Option<String>,
    source: Option<(String, usize, usize)>,
    ranks: Vec<RankStats>,
}

impl Seen {
    fn record(&mut self, event: Event<'_>, src: &std::path::Path, f: Format, rank: Option<usize>) {
        match event {
            Event::Skipped(s) => self
                .skipped
                .push((s.path.display().to_string(), s.reason.clone())),
            Event::Planned(ckpt, plan) => {
                self.summary = Some(run::describe(src, ckpt, plan, f));
                self.source = Some((
                    ckpt.format.name().to_string(),
                    ckpt.world_size,
                    ckpt.tensors.len(),
                ));
                self.ranks = remat_reshard::rank_stats(plan)
                    .into_iter()
                    .filter(|s| rank.is_none_or(|r| s.rank == r))
                    .collect();
            }
            Event::Writing { .. } | Event::Comparing { .. } => {}
        }
    }

    fn into_dict(self, py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("summary", self.summary)?;
        if let Some((format, world_size, tensors)) = self.source {
            d.set_item("source_format", format)?;
            d.set_item("source_world_size", world_size)?;
            d.set_item("tensors", tensors)?;
        }
        d.set_item("skipped", self.skipped)?;
        let ranks = PyList::empty(py);
        for s in &self.ranks {
            let r = PyDict::new(py);
            r.set_item("rank", s.rank)?;
            r.set_item("files", s.files)?;
            r.set_item("bytes_written", s.bytes_written)?;
            r.set_item("bytes_read", s.bytes_read)?;
            r.set_item("read_amplification", s.read_amplification())?;
            r.set_item("source_files", s.source_files)?;
            r.set_item("runs", s.runs)?;
            ranks.append(r)?;
        }
        d.set_item("ranks", ranks)?;
        Ok(d)
    }
}

/// Compares two layouts tensor by tensor (see `remat.verify`).
#[pyfunction]
#[pyo3(signature = (a, b, format_a = None, format_b = None))]
pub fn verify<'py>(
    py: Python<'py>,
    a: PathBuf,
    b: PathBuf,
    format_a: Option<&str>,
    format_b: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let format_a = format_a
        .map(|f| parse_format(py, "format_a", f))
        .transpose()?;
    let format_b = format_b
        .map(|f| parse_format(py, "format_b", f))
        .transpose()?;
    let mut skipped = Vec::new();
    let report = py
        .detach(|| {
            run::verify_paths(
                (&a, format_a),
                (&b, format_b),
                |e| {
                    if let Event::Skipped(s) = e {
                        skipped.push((s.path.display().to_string(), s.reason.clone()));
                    }
                },
                None,
            )
        })
        .map_err(|e| run_error(py, &e))?;
    verify_dict(py, &a, &b, &report, skipped)
}

fn verify_dict<'py>(
    py: Python<'py>,
    a: &std::path::Path,
    b: &std::path::Path,
    report: &VerifyReport,
    skipped: Vec<(String, String)>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("same", report.difference.is_none())?;
    d.set_item("tensors", report.tensors)?;
    d.set_item("bytes_compared", report.bytes_compared)?;
    d.set_item("chunks_checksummed", report.chunks_checksummed)?;
    d.set_item("skipped", skipped)?;
    match &report.difference {
        None => d.set_item("difference", py.None())?,
        Some(diff) => {
            let x = PyDict::new(py);
            x.set_item("tensor", &diff.tensor)?;
            x.set_item("element", diff.element.clone())?;
            x.set_item("detail", &diff.detail)?;
            // As `remat reshard verify` says it.
            x.set_item(
                "message",
                format!("{} and {} differ: {diff}", a.display(), b.display()),
            )?;
            d.set_item("difference", x)?;
        }
    }
    Ok(d)
}

fn argument(py: Python<'_>, message: impl ToString) -> PyErr {
    plain(py, "ArgumentError", message)
}

/// A world size the resharder plans for (1 to 2^20), or an error naming `world_size` in
/// the words `remat reshard --world-size` uses after its flag.
fn checked_world_size(py: Python<'_>, m: u64) -> PyResult<usize> {
    let text = m.to_string();
    remat_units::parse_count(&text, "world_size", 1).map_err(|e| unit_error(py, e))?;
    let m = usize::try_from(m).unwrap_or(usize::MAX);
    check_world_size(m)
        .map(|()| m)
        .map_err(|e| argument_error(py, "world_size", &text, format!("world_size {text}: {e}")))
}

/// A layout name, refused in the words `remat reshard --format` uses after its flag.
fn parse_format(py: Python<'_>, argument_name: &str, text: &str) -> PyResult<Format> {
    Format::parse(text).ok_or_else(|| {
        argument_error(
            py,
            argument_name,
            text,
            format!("{argument_name} {text}: unknown layout `{text}` (remat, dcp, hf)"),
        )
    })
}

/// A preset name, refused in the words `remat reshard --preset` uses after its flag.
fn parse_preset(py: Python<'_>, text: &str) -> PyResult<Preset> {
    Preset::parse(text).ok_or_else(|| {
        argument_error(
            py,
            "preset",
            text,
            format!("preset {text}: unknown preset `{text}` (simple, parallel)"),
        )
    })
}

fn parse_rule(py: Python<'_>, pattern: &str, rule: &str) -> PyResult<NameRule> {
    NameRule::parse(&format!("{pattern}={rule}")).ok_or_else(|| {
        argument(
            py,
            format!(
                "place: ({pattern:?}, {rule:?}) is not (PATTERN, RULE) with RULE one of shard(D), replicate, whole, rank:R, source"
            ),
        )
    })
}

/// `remat.ReshardError` with the resharder's message; `path` (the file) and `tensor` as
/// attributes where the error names them. A request's own bad value is an
/// `remat.ArgumentError`, as the front ends' readers raise it.
fn run_error(py: Python<'_>, error: &run::RunError) -> PyErr {
    if let ReshardError::Argument { .. } = error.reshard_error() {
        return argument(py, error);
    }
    let inner = error.reshard_error();
    let (path, tensor) = located(inner);
    let path = path
        .map(|p| p.display().to_string())
        .or_else(|| match error {
            run::RunError::Read { path, .. } => Some(path.display().to_string()),
            run::RunError::Reshard(_) => None,
        });
    raise(py, "ReshardError", error.to_string(), |d| {
        d.set_item("path", path)?;
        d.set_item("tensor", tensor)
    })
}

/// The file and tensor an error names, when it names them.
fn located(e: &ReshardError) -> (Option<&std::path::Path>, Option<&str>) {
    use ReshardError as E;
    match e {
        E::Io { path, .. }
        | E::Truncated { path, .. }
        | E::HeaderBeyondFile { path, .. }
        | E::HeaderJson { path, .. }
        | E::Index { path, .. }
        | E::UnknownLayout { path, .. }
        | E::OutputExists { path }
        | E::Part { path, .. } => (Some(path), None),
        E::UnknownDtype { path, tensor, .. }
        | E::ShapeOverflow { path, tensor, .. }
        | E::DataOutOfFile { path, tensor, .. }
        | E::BadTensor { path, tensor, .. }
        | E::Checksum { path, tensor, .. } => (Some(path), Some(tensor.as_str())),
        E::DtypeMismatch {
            tensor, first_file, ..
        } => (Some(first_file), Some(tensor.as_str())),
        E::Overlap { tensor, .. }
        | E::ReplicaMismatch { tensor, .. }
        | E::Hole { tensor, .. }
        | E::Plan { tensor, .. } => (None, Some(tensor.as_str()).filter(|t| !t.is_empty())),
        E::Target(_) | E::Argument { .. } => (None, None),
    }
}
