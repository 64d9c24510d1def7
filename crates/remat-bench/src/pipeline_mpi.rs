//! `remat bench pipeline --transport mpi`: the same pipelined training step with every stage
//! an MPI rank (`mpirun -n S remat train --stages S`) and with every stage a thread of one
//! process, for S = 1, 2 and 4 stages and 8 micro-batches (1F1B, one kernel thread per
//! stage): step time and bubble fraction side by side as ratios, and the bytes the ranks
//! sent per step against what the schedule moves (S-1 boundaries x 8 micro-batches, an
//! activation forward and its gradient back across each).
//!
//! Both runs are `remat train` processes started here, measured by the same code (the
//! per-step time and bubble it prints), so the ratio is the transport's cost. `mpirun`
//! must be on PATH and this binary built with `--features mpi`.

use std::process::Command;

use remat_report::{Layout, render};

use crate::error::{Context, Result, bail};

/// What `--transport mpi` measures with.
pub struct MpiBench {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub rows: usize,
    pub repeats: usize,
}

const MICRO_BATCHES: usize = 8;
const STAGES: [usize; 3] = [1, 2, 4];

/// What one `remat train --stages` run printed.
struct Printed {
    step_seconds: f64,
    bubble: f64,
    /// Activation and gradient bytes sent per step, and whether they equal the schedule's.
    sent: Option<(u64, u64, bool)>,
}

fn train_args(b: &MpiBench, stages: usize) -> Vec<String> {
    let layers = b.layers.max(4);
    [
        "train".to_string(),
        "--layers".into(),
        layers.to_string(),
        "--d-model".into(),
        b.d_model.to_string(),
        "--heads".into(),
        b.heads.to_string(),
        "--batch".into(),
        (b.rows * MICRO_BATCHES).to_string(),
        "--stages".into(),
        stages.to_string(),
        "--micro-batches".into(),
        MICRO_BATCHES.to_string(),
        "--schedule".into(),
        "1f1b".into(),
        "--steps".into(),
        (b.repeats.max(1) + 1).to_string(),
        "--log-every".into(),
        "1000000".into(),
    ]
    .into_iter()
    .collect()
}

fn run_threaded(exe: &str, b: &MpiBench, stages: usize) -> Result<Printed> {
    let mut cmd = Command::new(exe);
    cmd.args(train_args(b, stages));
    // One kernel thread per stage, as each rank gets.
    cmd.args(["--threads", &stages.to_string()]);
    parse(cmd, &format!("threaded, {stages} stage(s)"))
}

fn run_mpi(exe: &str, b: &MpiBench, stages: usize) -> Result<Printed> {
    let mut cmd = Command::new("mpirun");
    // Ranks may outnumber cores; as root Open MPI refuses to run without the second flag.
    cmd.args([
        "--oversubscribe",
        "--allow-run-as-root",
        "-n",
        &stages.to_string(),
        exe,
    ]);
    cmd.args(train_args(b, stages));
    cmd.args(["--threads", &stages.to_string()]);
    parse(cmd, &format!("mpirun -n {stages}"))
}

fn parse(mut cmd: Command, what: &str) -> Result<Printed> {
    let out = cmd
        .output()
        .with_context(|| format!("{what}: cannot start it (is mpirun on PATH?)"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{what} failed: {}{}",
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The text between `prefix` and `end` on the first line holding both in that order.
    let field = |prefix: &str, end: &str| -> Option<String> {
        stdout.lines().find_map(|line| {
            let stop = line.find(end)?;
            let start = line[..stop].rfind(prefix)? + prefix.len();
            Some(line[start..stop].trim().to_string())
        })
    };
    let number = |prefix, end| -> Result<f64> {
        field(prefix, end)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{what}: no `{prefix}` in its output: {stdout}"))
    };
    let sent = stdout
        .lines()
        .find_map(|l| l.strip_prefix("sent per step: "))
        .map(|line| {
            let bytes: Vec<u64> = line
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            let act = bytes.first().copied().unwrap_or(0);
            let grad = bytes.get(1).copied().unwrap_or(0);
            (act, grad, line.contains("as the schedule moves"))
        });
    Ok(Printed {
        step_seconds: number("(", " s per step in the pipeline")?,
        bubble: number("bubble fraction: measured ", ",")?,
        sent,
    })
}

pub fn run(b: &MpiBench) -> Result<()> {
    let exe = std::env::current_exe().context("locating the remat binary")?;
    let exe = exe.display().to_string();
    println!(
        "GPT L={} d={} heads={}; {MICRO_BATCHES} micro-batches of {} sequences, 1F1B, one kernel thread per stage; {} timed steps after one warm-up",
        b.layers.max(4),
        b.d_model,
        b.heads,
        b.rows,
        b.repeats.max(1)
    );
    let mut rows = Vec::new();
    for stages in STAGES {
        let threaded = run_threaded(&exe, b, stages)?;
        let mpi = run_mpi(&exe, b, stages)?;
        let ratio = |a: f64, t: f64| match t > 0.0 {
            true => format!("{:.2}", a / t),
            false => "-".into(),
        };
        let (act, grad, equal) = mpi.sent.unwrap_or((0, 0, false));
        rows.push(vec![
            stages.to_string(),
            format!("{:.4} s", threaded.step_seconds),
            format!("{:.4} s", mpi.step_seconds),
            ratio(mpi.step_seconds, threaded.step_seconds),
            format!("{:.3}", threaded.bubble),
            format!("{:.3}", mpi.bubble),
            ratio(mpi.bubble, threaded.bubble),
            format!("{act} + {grad}"),
            match equal {
                true => "yes".into(),
                false => "NO".into(),
            },
        ]);
    }
    let header = [
        "stages",
        "step (threads)",
        "step (MPI)",
        "x time",
        "bubble (threads)",
        "bubble (MPI)",
        "x bubble",
        "bytes sent per step (act + grad)",
        "= what the schedule moves",
    ];
    println!("{}", render(Layout::Aligned, &header, &rows));
    Ok(())
}
