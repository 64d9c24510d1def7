//! `remat reshard SRC DST --world-size M`: N ranks to M ranks, byte-exact; and
//! `remat reshard verify A B`.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use remat_reshard::{
    Checkpoint, ExecOptions, Format, NameRule, Preset, TargetSpec, execute, finalize, peak_buffer,
    plan, rank_stats, verify,
};

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct Args {
    #[command(subcommand)]
    sub: Option<Sub>,
    /// Source checkpoint: a directory (remat, PyTorch DCP or Hugging Face layout) or one
    /// .safetensors file.
    #[arg(required = true)]
    src: Option<PathBuf>,
    /// Output directory.
    #[arg(required = true)]
    dst: Option<PathBuf>,
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
    /// Bound on buffered memory (e.g. 256MiB, 1GiB).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
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
        a: PathBuf,
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

/// Parses `123`, `64KiB`, `256MiB`, `1GiB` (also KB/MB/GB, K/M/G as binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 256MiB"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("`{s}`: unknown unit `{unit}`")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("`{s}` overflows"))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(Sub::Verify {
        a,
        b,
        from_a,
        from_b,
    }) = args.sub
    {
        return run_verify(&a, &b, from_a, from_b);
    }
    let (Some(src), Some(dst)) = (args.src.as_deref(), args.dst.as_deref()) else {
        bail!("usage: remat reshard SRC DST --world-size M");
    };
    let Some(world_size) = args.world_size else {
        bail!("--world-size M is required");
    };
    let ckpt =
        Checkpoint::open(src, args.from).with_context(|| format!("reading {}", src.display()))?;
    report_skipped(&ckpt);
    let spec = TargetSpec {
        world_size,
        format: args.format,
        rules: args.place.clone(),
        preset: args.preset,
    };
    let plan = plan(&ckpt, &spec)?;
    eprintln!(
        "{}: {} layout, {} ranks, {} tensors, {} -> {} ranks ({} layout)",
        src.display(),
        ckpt.format.name(),
        ckpt.world_size,
        ckpt.tensors.len(),
        ckpt.world_size,
        world_size,
        args.format.name()
    );
    if args.dry_run {
        print_dry_run(&plan, args.max_buffer, args.rank);
        return Ok(());
    }
    if args.finalize {
        finalize(&ckpt, &plan, dst, args.force)?;
        println!(
            "checked {} parts and wrote the index of {}",
            plan.world_size,
            dst.display()
        );
        return Ok(());
    }
    let total: u64 = plan
        .files
        .iter()
        .filter(|f| args.rank.is_none_or(|r| f.rank == r))
        .map(|f| f.data_len)
        .sum();
    let bar = progress_bar(total);
    let tick = |n: u64| bar.inc(n);
    let opts = ExecOptions {
        max_buffer: args.max_buffer,
        overwrite: args.force,
        rank: args.rank,
        progress: Some(&tick),
    };
    let report = execute(&ckpt, &plan, dst, &opts)?;
    bar.finish_and_clear();
    println!(
        "wrote {} files, {:.3} GB in {:.2} s: {:.2} GB/s (buffers peaked at {:.1} MiB)",
        report.files_written,
        report.bytes_written as f64 / 1e9,
        report.seconds,
        report.gb_per_s(),
        report.buffer_bytes as f64 / (1u64 << 20) as f64
    );
    if let Some(r) = args.rank {
        println!(
            "rank {r} done; once every rank is, run the same command with --finalize instead of --rank"
        );
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

/// Bytes in the largest binary unit that keeps a number of at least one.
fn human(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

fn print_dry_run(plan: &remat_reshard::Plan, max_buffer: u64, rank: Option<usize>) {
    println!("| rank | files | write | read | read amplification | source files | runs |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for s in rank_stats(plan)
        .iter()
        .filter(|s| rank.is_none_or(|r| s.rank == r))
    {
        println!(
            "| {} | {} | {} | {} | {:.3} | {} | {} |",
            s.rank,
            s.files,
            human(s.bytes_written),
            human(s.bytes_read),
            s.read_amplification(),
            s.source_files,
            s.runs
        );
    }
    println!(
        "peak buffer memory: {} (bound {}, {} worker threads)",
        human(peak_buffer(plan, max_buffer, rank)),
        human(max_buffer),
        rayon_threads()
    );
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Files the reader left out are said, never dropped silently.
fn report_skipped(ckpt: &Checkpoint) {
    for f in &ckpt.skipped {
        eprintln!("note: skipping {}: {}", f.path.display(), f.reason);
    }
}

fn run_verify(
    a: &Path,
    b: &Path,
    from_a: Option<Format>,
    from_b: Option<Format>,
) -> anyhow::Result<()> {
    let ca = Checkpoint::open(a, from_a).with_context(|| format!("reading {}", a.display()))?;
    let cb = Checkpoint::open(b, from_b).with_context(|| format!("reading {}", b.display()))?;
    report_skipped(&ca);
    report_skipped(&cb);
    let bar = progress_bar(ca.total_bytes());
    let tick = |n: u64| bar.inc(n);
    let report = verify(&ca, &cb, Some(&tick))?;
    bar.finish_and_clear();
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

#[cfg(test)]
mod tests {
    use super::{human, parse_size};

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("MiB").is_err());
        assert_eq!(human(1000), "1000 B");
        assert_eq!(human(3 << 19), "1.50 MiB");
    }
}
