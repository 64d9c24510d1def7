//! `remat reshard SRC DST --world-size M`: N ranks to M ranks, byte-exact; and
//! `remat reshard verify A B`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::bail;
use indicatif::{ProgressBar, ProgressStyle};
use remat_reshard::location::StoreOptions;
use remat_reshard::run::{self, Action, DryRun, Event, Outcome, Request};
use remat_reshard::{Format, NameRule, Preset, TargetSpec};
use remat_units::human_bytes;

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
    /// Target number of ranks.
    #[arg(long, short = 'w')]
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
    /// Bound on buffered memory, e.g. 256MiB, 1GiB, 1.5GB (GB = 10^9 bytes, GiB = 2^30,
    /// units in any case).
    #[arg(long, default_value = "256MiB", value_parser = crate::units::size_arg)]
    max_buffer: u64,
    /// Print per-rank bytes, files, read amplification and peak buffer; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Produce only this target rank's files; run --finalize once every rank is done.
    #[arg(long, conflicts_with = "finalize")]
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
        bail!("usage: remat reshard SRC DST --world-size M");
    };
    let Some(world_size) = args.world_size else {
        bail!("--world-size M is required");
    };
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
            "checked {parts} parts and wrote the index of {}",
            dst.display()
        ),
        Outcome::Written(report) => {
            if let Some(bar) = bar.get() {
                bar.finish_and_clear();
            }
            println!(
                "wrote {} files, {:.3} GB in {:.2} s: {:.2} GB/s (buffers peaked at {})",
                report.files_written,
                report.bytes_written as f64 / 1e9,
                report.seconds,
                report.gb_per_s(),
                human_bytes(report.buffer_bytes)
            );
            if report.files_resumed > 0 {
                println!(
                    "{} files were already complete and certified in the store (not written again)",
                    report.files_resumed
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
        "peak buffer memory: {} (bound {}, {} worker threads)",
        human_bytes(dry.peak_buffer),
        human_bytes(dry.max_buffer),
        dry.threads
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
                "{} and {} hold the same {} tensors ({:.3} GB compared, {} chunk checksums checked)",
                a.display(),
                b.display(),
                report.tensors,
                report.bytes_compared as f64 / 1e9,
                report.chunks_checksummed
            );
            Ok(())
        }
    }
}
