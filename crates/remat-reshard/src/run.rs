//! A reshard as the front ends ask for it (`remat reshard`, the Python package): open the
//! source (its layout detected unless given), plan the target, then write it, or only say
//! what writing would cost (dry run), or check one-rank parts and write the index
//! (finalize). And verification of two layouts by path. Front ends show what happens
//! through [`Event`]s and a byte counter, and print the [`Outcome`]; the steps are here, so
//! the binary and the bindings do the same thing with the same messages.

use std::path::{Path, PathBuf};

use remat_units::plural;
use thiserror::Error;

use crate::checkpoint::{Checkpoint, Format, SkippedFile};
use crate::error::ReshardError;
use crate::exec::{ExecOptions, ExecReport, execute, finalize, peak_buffer};
use crate::location::{Location, Remote, StoreOptions};
use crate::plan::{Plan, RankStats, plan, rank_stats};
use crate::remote::RemoteCheckpoint;
use crate::remote::fetch;
use crate::remote::mirror;
use crate::remote::sink::{self, Source};
use crate::target::TargetSpec;
use crate::verify::{VerifyReport, verify};

/// Why a request failed: reading a source (the message says which), or anything after.
#[derive(Debug, Error)]
pub enum RunError {
    // Boxed: the path beside a whole ReshardError would double every Result's size.
    #[error("reading {}: {error}", path.display())]
    Read {
        path: PathBuf,
        error: Box<ReshardError>,
    },
    #[error(transparent)]
    Reshard(#[from] ReshardError),
}

impl RunError {
    /// The resharder's error underneath.
    pub fn reshard_error(&self) -> &ReshardError {
        match self {
            RunError::Read { error, .. } => error,
            RunError::Reshard(error) => error,
        }
    }
}

/// What to do once the target is planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Write every file (or one rank's, with [`Request::rank`]).
    Write,
    /// Write nothing; report per-rank bytes, reads and the buffer peak.
    DryRun,
    /// After one-rank runs: check every part and write the index.
    Finalize,
}

/// One reshard.
#[derive(Clone, Debug)]
pub struct Request<'a> {
    pub src: &'a Path,
    pub dst: &'a Path,
    /// Source layout; detected when `None`.
    pub source_format: Option<Format>,
    pub spec: TargetSpec,
    /// Bound on buffered bytes across worker threads.
    pub max_buffer: u64,
    /// Only this target rank's files (with [`Action::Write`] or [`Action::DryRun`]).
    pub rank: Option<usize>,
    pub action: Action,
    /// Replace existing output.
    pub overwrite: bool,
}

/// What happens, in order, for front ends to show.
pub enum Event<'a> {
    /// A file the source's reader left out, with why.
    Skipped(&'a SkippedFile),
    /// The source is read and the target planned.
    Planned(&'a Checkpoint, &'a Plan),
    /// Writing starts: this many bytes will be written.
    Writing { total_bytes: u64 },
    /// Verification starts: this many bytes will be compared.
    Comparing { total_bytes: u64 },
}

/// What a dry run found.
#[derive(Clone, Debug, PartialEq)]
pub struct DryRun {
    /// Per target rank (only [`Request::rank`]'s when given).
    pub ranks: Vec<RankStats>,
    /// Peak bytes the copy buffers would hold.
    pub peak_buffer: u64,
    pub max_buffer: u64,
    /// Worker threads the machine offers.
    pub threads: usize,
}

/// What a request did.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    DryRun(DryRun),
    /// Parts checked and the index written; `parts` is the target world size.
    Finalized {
        parts: usize,
    },
    Written(ExecReport),
}

/// Opens a checkpoint, its layout detected unless given; errors say it was being read.
pub fn open(path: &Path, format: Option<Format>) -> Result<Checkpoint, RunError> {
    Checkpoint::open(path, format).map_err(|error| RunError::Read {
        path: path.to_path_buf(),
        error: Box::new(error),
    })
}

/// Carries out `request`. `progress` receives bytes written (from worker threads).
/// Sources and destinations may be URLs (see [`reshard_with`]), reached with the
/// default [`StoreOptions`].
pub fn reshard(
    request: &Request,
    events: impl FnMut(Event<'_>),
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<Outcome, RunError> {
    reshard_with(request, &StoreOptions::default(), events, progress)
}

/// Carries out `request` where `src` and `dst` are local paths, `file://` URLs or
/// object-store URLs (`s3://bucket/prefix`), in any mix, reaching stores with `store`.
pub fn reshard_with(
    request: &Request,
    store: &StoreOptions,
    mut events: impl FnMut(Event<'_>),
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<Outcome, RunError> {
    check_request(request)?;
    let src_loc = Location::parse(&request.src.to_string_lossy(), store)?;
    let dst_loc = Location::parse(&request.dst.to_string_lossy(), store)?;
    if let (Location::Remote(s), Location::Remote(d)) = (&src_loc, &dst_loc) {
        check_remote_apart(s, d)?;
    }
    let opened = match &src_loc {
        Location::Local(path) => Opened::Local(open(path, request.source_format)?),
        Location::Remote(r) => Opened::Remote(Box::new(open_remote(r, request)?)),
    };
    let ckpt_ref = opened.ckpt();
    for skipped in &ckpt_ref.skipped {
        events(Event::Skipped(skipped));
    }
    let plan = plan(ckpt_ref, &request.spec)?;
    events(Event::Planned(ckpt_ref, &plan));
    let source = match &opened {
        Opened::Remote(rc) => Source::Remote(rc),
        Opened::Local(c) => Source::Local(c),
    };
    match request.action {
        Action::DryRun => Ok(Outcome::DryRun(dry_run(
            &plan,
            request.max_buffer,
            request.rank,
        ))),
        Action::Finalize => {
            match &dst_loc {
                Location::Local(dst) => finalize(ckpt_ref, &plan, dst, request.overwrite)?,
                Location::Remote(dst) => {
                    sink::finalize(ckpt_ref, &plan, dst, request.overwrite, request.max_buffer)?
                }
            }
            Ok(Outcome::Finalized {
                parts: plan.world_size,
            })
        }
        Action::Write => {
            events(Event::Writing {
                total_bytes: bytes_to_write(&plan, request.rank),
            });
            let options = ExecOptions {
                max_buffer: request.max_buffer,
                overwrite: request.overwrite,
                rank: request.rank,
                progress,
            };
            Ok(Outcome::Written(write(&source, &plan, &dst_loc, &options)?))
        }
    }
}

/// Refuses what the request's own values make impossible, before anything is read: a
/// buffer bound of 0 bytes (it holds nothing to copy), a world size of 0 or beyond
/// [`crate::target::MAX_WORLD_SIZE`], a rank the world size does not have. Front ends
/// refuse these first in the same words after their flag; this holds for library callers.
pub fn check_request(request: &Request) -> Result<(), ReshardError> {
    if request.max_buffer == 0 {
        return Err(ReshardError::Argument {
            argument: "max_buffer",
            value: "0".into(),
            what: remat_units::Problem::ZeroSize.to_string(),
        });
    }
    crate::target::check_world_size(request.spec.world_size)?;
    match request.rank {
        Some(rank) if rank >= request.spec.world_size => Err(ReshardError::Argument {
            argument: "rank",
            value: rank.to_string(),
            what: rank_outside(request.spec.world_size),
        }),
        _ => Ok(()),
    }
}

/// What is wrong with a rank at or beyond the target world size `m`.
pub fn rank_outside(m: usize) -> String {
    format!(
        "not a rank of the target world size {m} (ranks are 0 to {})",
        m.saturating_sub(1)
    )
}

fn open_remote(r: &Remote, request: &Request) -> Result<RemoteCheckpoint, RunError> {
    mirror::open(r, request.source_format, request.max_buffer).map_err(|error| RunError::Read {
        path: PathBuf::from(&r.url),
        error: Box::new(error),
    })
}

/// Refuses a remote destination that is, holds or lies inside a remote source (the
/// same URL prefix, as given).
fn check_remote_apart(src: &Remote, dst: &Remote) -> Result<(), ReshardError> {
    let (s, d) = (format!("{}/", src.url), format!("{}/", dst.url));
    if s.starts_with(&d) || d.starts_with(&s) {
        return Err(ReshardError::Target(format!(
            "output {} overlaps the source checkpoint {}",
            dst.url, src.url
        )));
    }
    Ok(())
}

/// Writes the plan: from a local or remote source, into a local directory (the
/// executor, after fetching a remote source's ranges) or an object store.
fn write(
    source: &Source,
    plan: &Plan,
    dst: &Location,
    options: &ExecOptions,
) -> Result<ExecReport, ReshardError> {
    match dst {
        Location::Remote(dst) => sink::execute(source, plan, dst, options),
        Location::Local(dst) => {
            let fetched = match source {
                Source::Remote(rc) => {
                    let slots: Vec<usize> = (0..plan.files.len())
                        .filter(|&i| options.rank.is_none_or(|r| plan.files[i].rank == r))
                        .collect();
                    let ranges = fetch::ranges_for(&rc.ckpt, plan, &slots);
                    Some(fetch::fetch(rc, ranges, options.max_buffer)?)
                }
                Source::Local(_) => None,
            };
            let mut report = execute(source.ckpt(), plan, dst, options)?;
            report.fetched = fetched;
            Ok(report)
        }
    }
}

/// One line saying what is resharded into what: `SRC: dcp layout, 4 ranks, 9 tensors,
/// 4 -> 3 ranks (remat layout)`.
pub fn describe(src: &Path, ckpt: &Checkpoint, plan: &Plan, format: Format) -> String {
    let ranks = |n: usize| plural(n as u64, "rank", "ranks");
    format!(
        "{}: {} layout, {}, {}, {} -> {} ({} layout)",
        src.display(),
        ckpt.format.name(),
        ranks(ckpt.world_size),
        plural(ckpt.tensors.len() as u64, "tensor", "tensors"),
        ckpt.world_size,
        ranks(plan.world_size),
        format.name()
    )
}

/// Bytes of the files to write (only `rank`'s when given).
pub fn bytes_to_write(plan: &Plan, rank: Option<usize>) -> u64 {
    plan.files
        .iter()
        .filter(|f| rank.is_none_or(|r| f.rank == r))
        .map(|f| f.data_len)
        .sum()
}

/// Per-rank statistics and the buffer peak, without writing.
pub fn dry_run(plan: &Plan, max_buffer: u64, rank: Option<usize>) -> DryRun {
    DryRun {
        ranks: rank_stats(plan)
            .into_iter()
            .filter(|s| rank.is_none_or(|r| s.rank == r))
            .collect(),
        peak_buffer: peak_buffer(plan, max_buffer, rank),
        max_buffer,
        threads: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    }
}

/// Opens `a` and `b` and compares them tensor by tensor (see [`verify()`]); `progress`
/// receives bytes compared. Either may be a URL (see [`verify_with`]).
pub fn verify_paths(
    a: (&Path, Option<Format>),
    b: (&Path, Option<Format>),
    events: impl FnMut(Event<'_>),
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<VerifyReport, RunError> {
    verify_with(a, b, &StoreOptions::default(), events, progress)
}

/// Bytes in flight while a remote checkpoint is fetched for verification.
const VERIFY_BUFFER: u64 = crate::exec::DEFAULT_MAX_BUFFER;

/// Opens a checkpoint to compare: a remote one is fetched whole into scratch first
/// (verification reads every byte), with [`VERIFY_BUFFER`] bytes in flight.
fn open_for_verify(
    path: &Path,
    format: Option<Format>,
    store: &StoreOptions,
) -> Result<Opened, RunError> {
    match Location::parse(&path.to_string_lossy(), store)? {
        Location::Local(p) => Ok(Opened::Local(open(&p, format)?)),
        Location::Remote(r) => {
            let read = |error: ReshardError| RunError::Read {
                path: PathBuf::from(&r.url),
                error: Box::new(error),
            };
            let rc = mirror::open(&r, format, VERIFY_BUFFER).map_err(read)?;
            fetch::fetch_all(&rc, VERIFY_BUFFER).map_err(read)?;
            Ok(Opened::Remote(Box::new(rc)))
        }
    }
}

enum Opened {
    Local(Checkpoint),
    Remote(Box<RemoteCheckpoint>),
}

impl Opened {
    fn ckpt(&self) -> &Checkpoint {
        match self {
            Opened::Local(c) => c,
            Opened::Remote(rc) => &rc.ckpt,
        }
    }
}

/// [`verify_paths`] with object stores reached through `store`.
pub fn verify_with(
    a: (&Path, Option<Format>),
    b: (&Path, Option<Format>),
    store: &StoreOptions,
    mut events: impl FnMut(Event<'_>),
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<VerifyReport, RunError> {
    let ca = open_for_verify(a.0, a.1, store)?;
    let cb = open_for_verify(b.0, b.1, store)?;
    let (ca, cb) = (ca.ckpt(), cb.ckpt());
    for skipped in ca.skipped.iter().chain(&cb.skipped) {
        events(Event::Skipped(skipped));
    }
    events(Event::Comparing {
        total_bytes: ca.total_bytes(),
    });
    Ok(verify(ca, cb, progress)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::safetensors::{TensorData, write_file};

    /// A one-file Hugging Face checkpoint with a [6, 4] f32 tensor `w` and a scalar `s`.
    fn source(dir: &Path) -> PathBuf {
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        let w: Vec<u8> = (0..24u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let s = 7i64.to_le_bytes();
        let tensors = [
            TensorData {
                name: "w",
                dtype: Dtype::F32,
                shape: &[6, 4],
                data: &w,
            },
            TensorData {
                name: "s",
                dtype: Dtype::I64,
                shape: &[],
                data: &s,
            },
        ];
        write_file(
            &src.join("model.safetensors"),
            &tensors,
            &Default::default(),
        )
        .unwrap();
        src
    }

    fn request<'a>(src: &'a Path, dst: &'a Path, m: usize, action: Action) -> Request<'a> {
        Request {
            src,
            dst,
            source_format: None,
            spec: TargetSpec::new(m, Format::Remat),
            max_buffer: 1 << 20,
            rank: None,
            action,
            overwrite: false,
        }
    }

    #[test]
    fn dry_run_writes_nothing_and_writing_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let src = source(dir.path());
        let dst = dir.path().join("out");
        let mut planned = Vec::new();
        let outcome = reshard(
            &request(&src, &dst, 3, Action::DryRun),
            |e| {
                if let Event::Planned(ckpt, plan) = e {
                    planned.push(describe(&src, ckpt, plan, Format::Remat));
                }
            },
            None,
        )
        .unwrap();
        let Outcome::DryRun(dry) = outcome else {
            panic!("expected a dry run, got {outcome:?}");
        };
        assert_eq!(dry.ranks.len(), 3);
        assert!(!dst.exists(), "a dry run wrote {}", dst.display());
        assert!(planned[0].ends_with("hf layout, 1 rank, 2 tensors, 1 -> 3 ranks (remat layout)"));
        let written = std::sync::atomic::AtomicU64::new(0);
        let tick = |n: u64| {
            written.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        };
        let mut total = 0;
        let outcome = reshard(
            &request(&src, &dst, 3, Action::Write),
            |e| {
                if let Event::Writing { total_bytes } = e {
                    total = total_bytes;
                }
            },
            Some(&tick),
        )
        .unwrap();
        assert!(
            matches!(outcome, Outcome::Written(ref r) if r.files_written == 3),
            "{outcome:?}"
        );
        assert_eq!(written.into_inner(), total);
        let report = verify_paths((&src, None), (&dst, None), |_| {}, None).unwrap();
        assert_eq!(report.difference, None);
        assert_eq!(report.tensors, 2);
    }

    #[test]
    fn errors_say_what_was_being_read_and_a_zero_world_size_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let err = reshard(
            &request(&missing, dir.path(), 2, Action::Write),
            |_| {},
            None,
        )
        .expect_err("no source");
        assert!(
            err.to_string()
                .starts_with(&format!("reading {}: ", missing.display())),
            "{err}"
        );
        let src = source(dir.path());
        let dst = dir.path().join("out");
        let err = reshard(&request(&src, &dst, 0, Action::Write), |_| {}, None)
            .expect_err("world size 0");
        assert!(
            matches!(err.reshard_error(), ReshardError::Target(_)),
            "{err}"
        );
        assert!(err.to_string().contains("at least 1"), "{err}");
        assert!(!dst.exists());
    }
}
