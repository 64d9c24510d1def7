//! `remat bench reshard`: generate a ~2 GiB checkpoint on 8 ranks, reshard it to 3 and to
//! 1, and compare the write rate with a plain memory copy of the same bytes measured in
//! the same run; report peak resident memory against the buffer bound.
//!
//! Why one file of ~750 lines: it is one benchmark run from start to end (generate, reshard,
//! the machine's own copy rates measured beside it, the object-store runs), and it reads top
//! to bottom in the order of the report it prints; nothing in it is used elsewhere.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::ProgressBar;
use remat_reshard::safetensors::{encode_header, pack_entries};
use remat_reshard::{
    Checkpoint, Dtype, ExecOptions, Format, NameRule, Placement, Rule, TargetSpec, execute, plan,
    verify,
};

use crate::error::{Context, Result, bail};

#[derive(clap::Args)]
pub struct Args {
    /// Size of the generated checkpoint in GiB.
    #[arg(long, default_value_t = 2.0)]
    gib: f64,
    /// Where to generate it (default: /dev/shm when present, so that the page cache, not
    /// the disk, is measured; else the system temp directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Buffer bound handed to the executor.
    #[arg(long, default_value = "256MiB", value_parser = remat_units::flag::buffer, allow_hyphen_values = true)]
    max_buffer: u64,
    /// Also verify every output against the source (streams everything once more).
    #[arg(long)]
    verify: bool,
    /// Number of small tensors in the many-tensors run.
    #[arg(long, default_value_t = 60_000, value_parser = remat_units::flag::count::<usize>, allow_hyphen_values = true)]
    small_tensors: usize,
    /// Where the object-store runs go: `local` (none), `s3` (s3://remat-bench/run-PID), or
    /// an s3://bucket/prefix URL; the bucket must exist. The same 8-rank checkpoint is
    /// uploaded, then resharded store to store beside the local-file runs.
    #[arg(long, default_value = "local")]
    store: String,
    /// S3-compatible endpoint for --store (else AWS_ENDPOINT_URL and the usual AWS_*).
    #[arg(long)]
    endpoint: Option<String>,
}

/// One generated tensor: name, dtype, shape, placement on the 8 source ranks.
struct Spec {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    placement: Placement,
}

/// A transformer-like mix: dim-0 and dim-1 sharded matrices in bf16 and f32, and small
/// replicated vectors, scaled so that the total is about `bytes`.
fn model(bytes: u64) -> Vec<Spec> {
    let hidden = 2048u64;
    let per_layer = hidden * 3 * hidden * 2
        + hidden * hidden * 4
        + 2 * hidden * 4 * hidden * 2
        + hidden * 4 * 2;
    let layers = (bytes / per_layer).max(1);
    let mut out = Vec::new();
    for l in 0..layers {
        let p = |s: &str| format!("layers.{l}.{s}");
        out.push(Spec {
            name: p("attn.qkv.weight"),
            dtype: Dtype::BF16,
            shape: vec![3 * hidden, hidden],
            placement: Placement::Shard(0),
        });
        out.push(Spec {
            name: p("attn.out.weight"),
            dtype: Dtype::F32,
            shape: vec![hidden, hidden],
            placement: Placement::Shard(1),
        });
        out.push(Spec {
            name: p("mlp.up.weight"),
            dtype: Dtype::BF16,
            shape: vec![4 * hidden, hidden],
            placement: Placement::Shard(0),
        });
        out.push(Spec {
            name: p("mlp.down.weight"),
            dtype: Dtype::BF16,
            shape: vec![hidden, 4 * hidden],
            placement: Placement::Shard(1),
        });
        out.push(Spec {
            name: p("norm1.weight"),
            dtype: Dtype::F32,
            shape: vec![hidden],
            placement: Placement::Replicate,
        });
        out.push(Spec {
            name: p("norm2.weight"),
            dtype: Dtype::F32,
            shape: vec![hidden],
            placement: Placement::Replicate,
        });
    }
    out
}

fn nbytes(s: &Spec) -> u64 {
    s.dtype.bytes_for(s.shape.iter().product()).unwrap_or(0)
}

/// Writes the tensors as one file of pseudo-random bytes, streamed.
fn write_global(path: &Path, specs: &[Spec]) -> Result<()> {
    let entries = pack_entries(
        specs
            .iter()
            .map(|s| (s.name.as_str(), s.dtype, s.shape.as_slice(), nbytes(s))),
    );
    let mut out = BufWriter::with_capacity(
        8 << 20,
        File::create(path).with_context(|| path.display().to_string())?,
    );
    out.write_all(&encode_header(&entries, &BTreeMap::new()))?;
    let total: u64 = specs.iter().map(nbytes).sum();
    let mut block = vec![0u8; 8 << 20];
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut written = 0u64;
    while written < total {
        for w in block.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            w.copy_from_slice(&state.to_le_bytes());
        }
        let n = (total - written).min(block.len() as u64) as usize;
        out.write_all(&block[..n])?;
        written += n as u64;
    }
    out.flush()?;
    Ok(())
}

/// CPU seconds (user + system) used so far according to `stat_path`; the machine is
/// shared, so CPU time shows efficiency when wall time is inflated by other processes.
fn cpu_seconds(stat_path: &str) -> f64 {
    let stat = std::fs::read_to_string(stat_path).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Linux reports these in USER_HZ, 100 on every mainstream configuration.
    (ticks(11) + ticks(12)) / 100.0
}

/// Single-threaded memcpy rate over buffers larger than the caches: GB per wall second
/// and per CPU second.
fn memcpy_rate(bytes: u64) -> (f64, f64) {
    let len = 256usize << 20;
    let src = vec![1u8; len];
    let mut dst = vec![2u8; len];
    dst.copy_from_slice(&src);
    let started = Instant::now();
    let cpu = cpu_seconds("/proc/thread-self/stat");
    let mut done = 0u64;
    while done < bytes {
        let n = (bytes - done).min(len as u64) as usize;
        dst[..n].copy_from_slice(&src[..n]);
        std::hint::black_box(&mut dst);
        done += n as u64;
    }
    let cpu = (cpu_seconds("/proc/thread-self/stat") - cpu).max(0.01);
    (
        bytes as f64 / started.elapsed().as_secs_f64() / 1e9,
        bytes as f64 / cpu / 1e9,
    )
}

/// Single-threaded rates of copying a warm buffer into fresh pages, in GB per wall
/// second: into new anonymous memory (page faults and zeroing included), into a new file
/// of the output's file system with `write` (one kernel copy: the executor's own path),
/// and into a new file through a shared mapping (fallocate + mmap + one memcpy).
/// Writing a checkpoint creates new pages, so these, not the warm memcpy, are the
/// ceilings of any writer.
fn fresh_page_rates(bytes: u64, scratch: &Path) -> Result<(f64, f64, f64)> {
    let len = (64usize << 20).min(bytes.max(1) as usize);
    let src = vec![1u8; len];
    let started = Instant::now();
    let mut done = 0u64;
    while done < bytes {
        let n = (bytes - done).min(len as u64) as usize;
        let mut fresh: Vec<u8> = Vec::with_capacity(n);
        fresh.extend_from_slice(&src[..n]);
        std::hint::black_box(&fresh);
        done += n as u64;
    }
    let anon = bytes as f64 / started.elapsed().as_secs_f64() / 1e9;
    std::fs::create_dir_all(scratch)?;
    let started = Instant::now();
    let mut done = 0u64;
    let mut i = 0;
    while done < bytes {
        let n = (bytes - done).min(len as u64) as usize;
        remat_reshard::fsio::copy_into_fresh_file(&scratch.join(format!("f{i}")), &src[..n])?;
        done += n as u64;
        i += 1;
    }
    let mapped = bytes as f64 / started.elapsed().as_secs_f64() / 1e9;
    std::fs::remove_dir_all(scratch)?;
    std::fs::create_dir_all(scratch)?;
    let started = Instant::now();
    let mut done = 0u64;
    let mut i = 0;
    while done < bytes {
        let n = (bytes - done).min(len as u64) as usize;
        std::fs::write(scratch.join(format!("w{i}")), &src[..n])?;
        done += n as u64;
        i += 1;
    }
    let written = bytes as f64 / started.elapsed().as_secs_f64() / 1e9;
    std::fs::remove_dir_all(scratch)?;
    Ok((anon, written, mapped))
}

/// The file system type under `path`, from /proc/mounts (longest matching mount point).
fn fs_type(path: &Path) -> String {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((*f.get(1)?, *f.get(2)?))
        })
        .filter(|(m, _)| path.starts_with(m))
        .max_by_key(|(m, _)| m.len())
        .map_or_else(|| "unknown".into(), |(m, t)| format!("{t} at {m}"))
}

/// Rate of copying the source files with the file system's own copy (what `cp` does), in
/// GB per wall second: the ceiling the destination file system allows.
fn file_copy_rate(src: &Path, scratch: &Path) -> Result<f64> {
    std::fs::create_dir_all(scratch)?;
    let started = Instant::now();
    let mut bytes = 0;
    for entry in std::fs::read_dir(src)? {
        let entry = entry?;
        bytes += std::fs::copy(entry.path(), scratch.join(entry.file_name()))?;
    }
    let rate = bytes as f64 / started.elapsed().as_secs_f64() / 1e9;
    std::fs::remove_dir_all(scratch)?;
    Ok(rate)
}

/// Peak resident set size so far (VmHWM), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Resident memory by kind, from /proc/self/status: anonymous (heap, buffers), file
/// pages mapped (the source maps) and shared memory (files of a tmpfs such as /dev/shm
/// count here when mapped), in bytes.
#[derive(Clone, Copy, Default, Debug)]
struct Resident {
    anon: u64,
    file: u64,
    shmem: u64,
}

impl Resident {
    fn now() -> Resident {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map_or(0, |kb| kb * 1024)
        };
        Resident {
            anon: field("RssAnon:"),
            file: field("RssFile:"),
            shmem: field("RssShmem:"),
        }
    }

    fn max(self, o: Resident) -> Resident {
        Resident {
            anon: self.anon.max(o.anon),
            file: self.file.max(o.file),
            shmem: self.shmem.max(o.shmem),
        }
    }
}

/// The kernel keeps a high-water mark of the whole RSS only (VmHWM), not of its kinds:
/// a thread samples them every millisecond while `work` runs and keeps each one's
/// maximum (a peak shorter than a millisecond can be missed; VmHWM bounds their sum).
fn sample_resident<T>(work: impl FnOnce() -> T) -> (T, Resident) {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut peak = Resident::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(Resident::now());
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            peak.max(Resident::now())
        });
        let out = work();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let peak = sampler.join().unwrap_or_default();
        (out, peak)
    })
}

/// Resets VmHWM to the current RSS, so each run's peak is its own.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

struct Row {
    run: String,
    bytes: u64,
    seconds: f64,
    cpu: f64,
    memcpy: (f64, f64),
    fresh: (f64, f64, f64),
    file_copy: f64,
    peak_rss: u64,
    bound: u64,
    base_rss: u64,
    /// Sampled peaks by kind during the run, and the anonymous memory before it.
    resident: Resident,
    idle: Resident,
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn mib(b: u64) -> String {
    format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64)
}

/// A scratch directory removed when dropped, even on error.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn bench_dir(arg: Option<PathBuf>) -> Result<Scratch> {
    let base = arg.unwrap_or_else(|| {
        let shm = PathBuf::from("/dev/shm");
        if shm.is_dir() {
            shm
        } else {
            std::env::temp_dir()
        }
    });
    let dir = base.join(format!("remat-bench-reshard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
    Ok(Scratch(dir))
}

fn reshard_once(
    label: &str,
    src: &Path,
    dst: &Path,
    world: usize,
    max_buffer: u64,
    check: bool,
) -> Result<Row> {
    let ckpt = Checkpoint::open(src, None)?;
    let p = plan(&ckpt, &TargetSpec::new(world, Format::Remat))?;
    let largest = p
        .files
        .iter()
        .flat_map(|f| f.chunks.iter().map(|c| c.len))
        .max()
        .unwrap_or(0);
    let total: u64 = p.files.iter().map(|f| f.file_len()).sum();
    let memcpy = memcpy_rate(total);
    let fresh = fresh_page_rates(total, &dst.with_extension("fresh"))?;
    let file_copy = file_copy_rate(src, &dst.with_extension("copy"))?;
    let bar = ProgressBar::new(total);
    let tick = |n: u64| bar.inc(n);
    let opts = ExecOptions {
        max_buffer,
        progress: Some(&tick),
        ..Default::default()
    };
    let base_rss = {
        reset_peak_rss();
        peak_rss()
    };
    let cpu = cpu_seconds("/proc/self/stat");
    let idle = Resident::now();
    let (report, resident) = sample_resident(|| execute(&ckpt, &p, dst, &opts));
    let report = report?;
    let cpu = (cpu_seconds("/proc/self/stat") - cpu).max(0.01);
    let peak = peak_rss();
    bar.finish_and_clear();
    if check {
        let out = Checkpoint::open(dst, None)?;
        if let Some(d) = verify(&ckpt, &out, None)?.difference {
            bail!("8 -> {world} is not byte-exact: {d}");
        }
    }
    Ok(Row {
        run: format!("{label}8 -> {world}"),
        bytes: report.bytes_written,
        seconds: report.seconds,
        cpu,
        memcpy,
        fresh,
        file_copy,
        peak_rss: peak,
        bound: max_buffer + largest + base_rss,
        base_rss,
        resident,
        idle,
    })
}

/// Many small tensors (`count` of [16, 64] f32, 4 KiB each) sharded on dim 0: the cost
/// that grows with the number of tensors rather than their bytes.
fn small_model(count: usize) -> Vec<Spec> {
    (0..count)
        .map(|i| Spec {
            name: format!("small.{i:06}.weight"),
            dtype: Dtype::F32,
            shape: vec![16, 64],
            placement: Placement::Shard(0),
        })
        .collect()
}

/// Generates `specs` on 8 ranks under `dir/name`, returning the directory.
fn generate(dir: &Path, name: &str, specs: &[Spec]) -> Result<PathBuf> {
    let global = dir.join(format!("{name}.safetensors"));
    write_global(&global, specs)?;
    // One rule per tensor, or a single catch-all when every tensor is placed alike.
    let uniform = specs.windows(2).all(|w| w[0].placement == w[1].placement);
    let rules: Vec<NameRule> = if uniform {
        specs
            .first()
            .map(|s| NameRule {
                pattern: "*".into(),
                rule: Rule::Place(s.placement),
            })
            .into_iter()
            .collect()
    } else {
        specs
            .iter()
            .map(|s| NameRule {
                pattern: s.name.clone(),
                rule: Rule::Place(s.placement),
            })
            .collect()
    };
    let eight = dir.join(name);
    {
        let ckpt = Checkpoint::open(&global, None)?;
        let spec = TargetSpec {
            world_size: 8,
            format: Format::Remat,
            rules,
            preset: None,
        };
        execute(&ckpt, &plan(&ckpt, &spec)?, &eight, &ExecOptions::default())?;
    }
    std::fs::remove_file(&global)?;
    Ok(eight)
}

pub fn run(args: Args) -> Result<()> {
    let dir = bench_dir(args.dir)?;
    let specs = model((args.gib * (1u64 << 30) as f64) as u64);
    let started = Instant::now();
    let eight = generate(&dir.0, "ckpt-8", &specs)?;
    let src_bytes: u64 = specs.iter().map(nbytes).sum();
    eprintln!(
        "generated {} in {} tensors on 8 ranks under {} in {:.1} s",
        gib(src_bytes),
        specs.len(),
        dir.0.display(),
        started.elapsed().as_secs_f64()
    );
    eprintln!("writing under {}", fs_type(&dir.0));
    let mut rows = Vec::new();
    for world in [3usize, 1] {
        let out = dir.0.join(format!("ckpt-{world}"));
        rows.push(reshard_once(
            "",
            &eight,
            &out,
            world,
            args.max_buffer,
            args.verify,
        )?);
        std::fs::remove_dir_all(&out)?;
    }
    let store_rows = match store_url(&args.store) {
        Some(url) => store_runs(
            &eight,
            &url,
            args.endpoint.clone(),
            args.max_buffer,
            args.verify,
        )?,
        None => Vec::new(),
    };
    std::fs::remove_dir_all(&eight)?;
    let small = small_model(args.small_tensors);
    let started = Instant::now();
    let eight = generate(&dir.0, "small-8", &small)?;
    eprintln!(
        "generated {} small tensors on 8 ranks in {:.1} s",
        small.len(),
        started.elapsed().as_secs_f64()
    );
    for world in [3usize, 1] {
        let out = dir.0.join(format!("small-{world}"));
        let label = format!("{}k small: ", small.len() / 1000);
        let started = Instant::now();
        let mut row = reshard_once(&label, &eight, &out, world, args.max_buffer, args.verify)?;
        row.run = format!(
            "{} (open+plan+write {:.2} s)",
            row.run,
            started.elapsed().as_secs_f64()
        );
        rows.push(row);
        std::fs::remove_dir_all(&out)?;
    }
    println!(
        "| run | written | time | GB/s | warm memcpy GB/s | ratio | fresh anon memcpy GB/s | fresh file write GB/s | ratio | fresh file mmap memcpy GB/s | file copy GB/s | ratio | CPU s | GB per CPU s | CPU ratio to warm memcpy | peak RSS | RSS goal (idle + bound + largest chunk) | peak anon | peak file-mapped (RssFile + RssShmem) | anon growth over idle | anon bound |"
    );
    println!(
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for r in &rows {
        let rate = r.bytes as f64 / r.seconds / 1e9;
        let cpu_rate = r.bytes as f64 / r.cpu / 1e9;
        println!(
            "| {} | {} | {:.2} s | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {} |",
            r.run,
            gib(r.bytes),
            r.seconds,
            rate,
            r.memcpy.0,
            rate / r.memcpy.0,
            r.fresh.0,
            r.fresh.1,
            rate / r.fresh.1,
            r.fresh.2,
            r.file_copy,
            rate / r.file_copy,
            r.cpu,
            cpu_rate,
            cpu_rate / r.memcpy.1,
            mib(r.peak_rss),
            mib(r.bound),
            mib(r.resident.anon),
            mib(r.resident.file + r.resident.shmem),
            mib(r.resident.anon.saturating_sub(r.idle.anon)),
            mib(r.bound - r.base_rss)
        );
    }
    print_store_rows(&rows, &store_rows);
    println!(
        "(buffer bound {}, {} threads; PyTorch DCP consolidation: ~1.2 GB/s)",
        mib(args.max_buffer),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    Ok(())
}

/// The object-store prefix `--store` names, if any.
fn store_url(store: &str) -> Option<String> {
    match store {
        "local" => None,
        "s3" => Some(format!("s3://remat-bench/run-{}", std::process::id())),
        url => Some(url.trim_end_matches('/').to_string()),
    }
}

/// One reshard through the object store.
struct StoreRow {
    world: usize,
    bytes: u64,
    seconds: f64,
    fetched: remat_reshard::remote::fetch::FetchStats,
    resident: Resident,
    idle: Resident,
    bound: u64,
}

/// Uploads the 8-rank checkpoint under `url` (not timed), then reshards it store to
/// store onto 3 and 1 ranks, measuring rate, ranged reads and resident memory by kind.
fn store_runs(
    eight: &Path,
    url: &str,
    endpoint: Option<String>,
    max_buffer: u64,
    check: bool,
) -> Result<Vec<StoreRow>> {
    use remat_reshard::location::StoreOptions;
    use remat_reshard::run::{self, Outcome};
    let store = StoreOptions { endpoint };
    let src = format!("{url}/ckpt-8");
    let started = Instant::now();
    run::reshard_with(
        &store_request(&eight.to_string_lossy(), &src, 8, max_buffer),
        &store,
        |_| {},
        None,
    )?;
    eprintln!(
        "uploaded the 8-rank checkpoint to {src} in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut rows = Vec::new();
    for world in [3usize, 1] {
        let dst = format!("{url}/ckpt-{world}");
        let local = Checkpoint::open(eight, None)?;
        let p = plan(&local, &TargetSpec::new(world, Format::Remat))?;
        let largest = p
            .files
            .iter()
            .flat_map(|f| f.chunks.iter().map(|c| c.len))
            .max()
            .unwrap_or(0);
        drop(local);
        let idle = Resident::now();
        let started = Instant::now();
        let (outcome, resident) = sample_resident(|| {
            run::reshard_with(
                &store_request(&src, &dst, world, max_buffer),
                &store,
                |_| {},
                None,
            )
        });
        let seconds = started.elapsed().as_secs_f64();
        let Outcome::Written(report) = outcome? else {
            bail!("8 -> {world} through {url} wrote nothing");
        };
        if check {
            let v = run::verify_with((eight, None), (Path::new(&dst), None), &store, |_| {}, None)?;
            if let Some(d) = v.difference {
                bail!("8 -> {world} through {url} is not byte-exact: {d}");
            }
        }
        rows.push(StoreRow {
            world,
            bytes: report.bytes_written,
            seconds,
            fetched: report.fetched.unwrap_or_default(),
            resident,
            idle,
            bound: max_buffer + largest,
        });
    }
    Ok(rows)
}

/// A write of `src` onto `world` ranks at `dst`, replacing what is there.
fn store_request<'a>(
    src: &'a str,
    dst: &'a str,
    world: usize,
    max_buffer: u64,
) -> remat_reshard::run::Request<'a> {
    remat_reshard::run::Request {
        src: Path::new(src),
        dst: Path::new(dst),
        source_format: None,
        spec: TargetSpec::new(world, Format::Remat),
        max_buffer,
        rank: None,
        action: remat_reshard::run::Action::Write,
        overwrite: true,
    }
}

/// The object-store runs beside the local-file runs of the same checkpoint.
fn print_store_rows(local: &[Row], store: &[StoreRow]) {
    if store.is_empty() {
        return;
    }
    println!();
    println!(
        "| run | store | written | wall time | GB/s | ratio to local | requests | requested | needed | read amplification | peak anon | anon growth over idle | anon bound (buffer + largest chunk) | peak file-mapped |"
    );
    println!(
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for s in store {
        let Some(l) = local.iter().find(|r| r.run == format!("8 -> {}", s.world)) else {
            continue;
        };
        let local_rate = l.bytes as f64 / l.seconds / 1e9;
        let rate = s.bytes as f64 / s.seconds / 1e9;
        println!(
            "| 8 -> {w} | local files | {} | {:.2} s | {:.3} | 1.00 | - | - | - | - | {} | {} | {} | {} |",
            gib(l.bytes),
            l.seconds,
            local_rate,
            mib(l.resident.anon),
            mib(l.resident.anon.saturating_sub(l.idle.anon)),
            mib(l.bound - l.base_rss),
            mib(l.resident.file + l.resident.shmem),
            w = s.world
        );
        println!(
            "| 8 -> {w} | object store (store to store) | {} | {:.2} s | {:.3} | {:.3} | {} | {} | {} | {:.3} | {} | {} | {} | {} |",
            gib(s.bytes),
            s.seconds,
            rate,
            rate / local_rate,
            s.fetched.requests,
            mib(s.fetched.bytes_requested),
            mib(s.fetched.bytes_needed),
            s.fetched.read_amplification(),
            mib(s.resident.anon),
            mib(s.resident.anon.saturating_sub(s.idle.anon)),
            mib(s.bound),
            mib(s.resident.file + s.resident.shmem),
            w = s.world
        );
    }
}
