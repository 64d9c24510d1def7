//! `remat reshard SRC DST --world-size M`: N ranks to M ranks, byte-exact; and
//! `remat reshard verify A B`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::bail;
use indicatif::{ProgressBar, ProgressStyle};
use remat_reshard::location::StoreOptions;
use remat_reshard::run::{self, Action, DryRun, Event, Outcome, Request};
use remat_reshard::{Format, NameRule, Preset, TargetSpec};
use remat_units::{human_bytes, plural};

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct Args {
    #[command(subcommand)]
    sub: Option<Sub>,
    /// Source checkpoint: a directory (remat, PyTorch DCP or Hugging Face layout) or one
    /// .safetensors file; or a URL: s3://bucket/prefix, file:///dir.
    #[arg(required = true)]
    src: Option<PathBuf>,
    /// Output directory, or a URL (s3://bucket/prefix, file:///dir).
    #[arg(required = true)]
    dst: Option<PathBuf>,
    /// S3-compatible endpoint for s3:// URLs (MinIO, a gateway), overriding
    /// AWS_ENDPOINT_URL; credentials come from the usual AWS_* environment variables.
    #[arg(long, global = true)]
    endpoint: Option<String>,
    /// Target number of ranks, 1 to 2^20.
    #[arg(long, short = 'w', value_parser = world_size_arg, allow_hyphen_values = true)]
    world_size: Option<usize>,
    /// Output layout: remat (rank files + index), dcp (PyTorch-loadable), hf (whole tensors).
    #[arg(long, default_value = "remat", value_parser = parse_format)]
    format: Format,
    /// Source layout, detected when omitted.
    #[arg(long, value_parser = parse_format)]
    from: Option<Format>,
    /// Placement of tensors no --place rule matches: simple (whole tensors balanced by
    /// bytes) or parallel (split on dim 0). Default: the source's placement on M ranks.
    #[arg(long, value_parser = parse_preset)]
    preset: Option<Preset>,
    /// PATTERN=RULE, first match wins: RULE is shard(D), replicate, whole, rank:R or
    /// source; PATTERN a glob over tensor names (`layers.*.mlp.*`).
    #[arg(long = "place", value_name = "PATTERN=RULE", value_parser = parse_rule)]
    place: Vec<NameRule>,
    /// Bound on buffered memory, at least 1 byte, e.g. 256MiB, 1GiB, 1.5GB (GB = 10^9
    /// bytes, GiB = 2^30, units in any case).
    #[arg(long, default_value = "256MiB", value_parser = crate::units::buffer_arg, allow_hyphen_values = true)]
    max_buffer: u64,
    /// Print per-rank bytes, files, read amplification and peak buffer; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Produce only this target rank's files; run --finalize once every rank is done.
    #[arg(long, conflicts_with = "finalize", value_parser = rank_arg, allow_hyphen_values = true)]
    rank: Option<usize>,
    /// After --rank runs: check every part and write the index.
    #[arg(long)]
    finalize: bool,
    /// Replace existing output.
    #[arg(long)]
    force: bool,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Prove two layouts hold the same global tensors (streaming), or name the first
    /// differing tensor and element.
    Verify {
        /// A checkpoint: a path or a URL (s3://bucket/prefix, file:///dir).
        a: PathBuf,
        /// The other checkpoint: a path or a URL.
        b: PathBuf,
        /// Layout of A, detected when omitted.
        #[arg(long, value_parser = parse_format)]
        from_a: Option<Format>,
        /// Layout of B, detected when omitted.
        #[arg(long, value_parser = parse_format)]
        from_b: Option<Format>,
    },
}

/// A target world size: a count of ranks the resharder plans for (1 to 2^20), checked by
/// the library's own rule, as Python's `world_size` is.
fn world_size_arg(s: &str) -> Result<usize, String> {
    let m: usize = crate::units::count_arg(s)?;
    remat_reshard::target::check_world_size(m)
        .map(|()| m)
        .map_err(|e| e.to_string())
}

/// A target rank: a whole number from 0.
fn rank_arg(s: &str) -> Result<usize, String> {
    let r = remat_units::parse_count(s, "", 0).map_err(|e| e.problem.to_string())?;
    usize::try_from(r).map_err(|_| "out of range".to_string())
}

fn parse_format(s: &str) -> Result<Format, String> {
    Format::parse(s).ok_or_else(|| format!("unknown layout `{s}` (remat, dcp, hf)"))
}

fn parse_preset(s: &str) -> Result<Preset, String> {
    Preset::parse(s).ok_or_else(|| format!("unknown preset `{s}` (simple, parallel)"))
}

fn parse_rule(s: &str) -> Result<NameRule, String> {
    NameRule::parse(s).ok_or_else(|| {
        format!(
            "`{s}` is not PATTERN=RULE with RULE one of shard(D), replicate, whole, rank:R, source"
        )
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let store = StoreOptions {
        endpoint: args.endpoint.clone(),
    };
    if let Some(Sub::Verify {
        a,
        b,
        from_a,
        from_b,
    }) = args.sub
    {
        return run_verify((&a, from_a), (&b, from_b), &store);
    }
    let (Some(src), Some(dst)) = (args.src.as_deref(), args.dst.as_deref()) else {
        return Err(crate::usage!("usage: remat reshard SRC DST --world-size M"));
    };
    let Some(world_size) = args.world_size else {
        return Err(crate::usage!("--world-size M is required"));
    };
    if let Some(rank) = args.rank
        && rank >= world_size
    {
        return Err(crate::usage!(
            "--rank {rank}: {}",
            run::rank_outside(world_size)
        ));
    }
    let action = if args.dry_run {
        Action::DryRun
    } else if args.finalize {
        Action::Finalize
    } else {
        Action::Write
    };
    let request = Request {
        src,
        dst,
        source_format: args.from,
        spec: TargetSpec {
            world_size,
            format: args.format,
            rules: args.place.clone(),
            preset: args.preset,
        },
        max_buffer: args.max_buffer,
        rank: args.rank,
        action,
        overwrite: args.force,
    };
    // The bar appears once writing starts (a dry run or a finalize draws none).
    let bar = OnceLock::new();
    let tick = |n: u64| {
        if let Some(bar) = bar.get() {
            ProgressBar::inc(bar, n);
        }
    };
    let outcome = run::reshard_with(
        &request,
        &store,
        |event| match event {
            Event::Skipped(f) => eprintln!("note: skipping {}: {}", f.path.display(), f.reason),
            Event::Planned(ckpt, plan) => {
                eprintln!("{}", run::describe(src, ckpt, plan, args.format));
            }
            Event::Writing { total_bytes } => {
                let _ = bar.set(progress_bar(total_bytes));
            }
            Event::Comparing { .. } => {}
        },
        Some(&tick),
    )?;
    match outcome {
        Outcome::DryRun(dry) => print_dry_run(&dry),
        Outcome::Finalized { parts } => println!(
            "checked {} and wrote the index of {}",
            plural(parts as u64, "part", "parts"),
            dst.display()
        ),
        Outcome::Written(report) => {
            if let Some(bar) = bar.get() {
                bar.finish_and_clear();
            }
            println!(
                "wrote {}, {} in {:.2} s: {} (buffers peaked at {})",
                plural(report.files_written as u64, "file", "files"),
                human_bytes(report.bytes_written),
                report.seconds,
                remat_units::human_bandwidth(
                    report.bytes_written as f64 / report.seconds.max(1e-9)
                ),
                human_bytes(report.buffer_bytes)
            );
            if report.files_resumed > 0 {
                println!(
                    "{} already complete and certified in the store (not written again)",
                    plural(report.files_resumed as u64, "file was", "files were")
                );
            }
            if let Some(f) = &report.fetched {
                println!(
                    "read the source with {} ranged requests: {} requested for {} needed (read amplification {:.3})",
                    f.requests,
                    human_bytes(f.bytes_requested),
                    human_bytes(f.bytes_needed),
                    f.read_amplification()
                );
            }
            if let Some(r) = args.rank {
                println!(
                    "rank {r} done; once every rank is, run the same command with --finalize instead of --rank"
                );
            }
        }
    }
    Ok(())
}

fn progress_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn print_dry_run(dry: &DryRun) {
    println!("| rank | files | write | read | read amplification | source files | runs |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for s in &dry.ranks {
        println!(
            "| {} | {} | {} | {} | {:.3} | {} | {} |",
            s.rank,
            s.files,
            human_bytes(s.bytes_written),
            human_bytes(s.bytes_read),
            s.read_amplification(),
            s.source_files,
            s.runs
        );
    }
    println!(
        "peak buffer memory: {} (bound {}, {})",
        human_bytes(dry.peak_buffer),
        human_bytes(dry.max_buffer),
        plural(dry.threads as u64, "worker thread", "worker threads")
    );
}

fn run_verify(
    (a, from_a): (&Path, Option<Format>),
    (b, from_b): (&Path, Option<Format>),
    store: &StoreOptions,
) -> anyhow::Result<()> {
    let bar = OnceLock::new();
    let tick = |n: u64| {
        if let Some(bar) = bar.get() {
            ProgressBar::inc(bar, n);
        }
    };
    let report = run::verify_with(
        (a, from_a),
        (b, from_b),
        store,
        |event| match event {
            Event::Skipped(f) => eprintln!("note: skipping {}: {}", f.path.display(), f.reason),
            Event::Comparing { total_bytes } => {
                let _ = bar.set(progress_bar(total_bytes));
            }
            Event::Planned(..) | Event::Writing { .. } => {}
        },
        Some(&tick),
    )?;
    if let Some(bar) = bar.get() {
        bar.finish_and_clear();
    }
    match report.difference {
        Some(d) => bail!("{} and {} differ: {d}", a.display(), b.display()),
        None => {
            println!(
                "{} and {} hold the same {} ({} compared, {} checked)",
                a.display(),
                b.display(),
                plural(report.tensors as u64, "tensor", "tensors"),
                human_bytes(report.bytes_compared),
                plural(
                    report.chunks_checksummed as u64,
                    "chunk checksum",
                    "chunk checksums"
                )
            );
            Ok(())
        }
    }
}
