//! `mpirun -n N remat train --stages S` (feature `mpi`): one stage per rank. Gradients after
//! a step equal the threaded pipeline's and one stage's bit for bit under both schedules and
//! every stage policy; data-parallel replicas equal the threaded replicas; a failing or
//! killed rank ends the whole run with an error naming the stage and micro-batch.
//!
//! Needs Open MPI's `mpirun` on PATH (skips, saying so, without it). On a machine with fewer
//! cores than ranks Open MPI needs `--oversubscribe`, and as root `--allow-run-as-root`.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::read_dump;

const REMAT: &str = env!("CARGO_BIN_EXE_remat");

fn have_mpirun() -> bool {
    let found = Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipping: mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)");
    }
    found
}

fn mpirun_command(ranks: usize, args: &[&str]) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--oversubscribe",
        "--allow-run-as-root",
        "-n",
        &ranks.to_string(),
        REMAT,
    ]);
    cmd.args(args);
    cmd
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
}

fn run_ok(mut cmd: Command, what: &str) -> String {
    let out = cmd.output().expect("the command starts");
    assert!(out.status.success(), "{what}: {}", text(&out));
    text(&out)
}

/// A 4-block GPT with dropout, 8 sequences in 4 micro-batches, one step unless `extra` says.
fn train_args(stages: usize, threads: usize, dump: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "train",
        "--layers",
        "4",
        "--d-model",
        "32",
        "--batch",
        "8",
        "--dropout",
        "0.1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--stages".into(), stages.to_string()]);
    args.extend(["--threads".into(), threads.to_string()]);
    args.extend(["--dump-grads".into(), dump.display().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    for (flag, default) in [("--steps", "1"), ("--micro-batches", "4")] {
        if !extra.contains(&flag) {
            args.extend([flag.into(), default.into()]);
        }
    }
    args
}

fn threaded(args: &[String]) -> Command {
    let mut cmd = Command::new(REMAT);
    cmd.args(args);
    cmd
}

fn mpi(ranks: usize, args: &[String]) -> Command {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    mpirun_command(ranks, &args)
}

fn scratch(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.safetensors"))
}

#[test]
fn mpi_gradients_equal_threaded_and_one_stage() {
    if !have_mpirun() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let one = scratch(dir, "one");
    run_ok(threaded(&train_args(1, 1, &one, &[])), "one stage");
    let one = read_dump(&one);
    for stages in [2, 4] {
        for schedule in ["gpipe", "1f1b"] {
            for policy in [
                "store-all",
                "recompute-all",
                "selective:2",
                "memory:40KiB",
                "auto",
            ] {
                let label = format!("S={stages} {schedule} {policy}");
                let extra = ["--schedule", schedule, "--stage-policy", policy];
                let t = scratch(
                    dir,
                    &format!("t{stages}{schedule}{}", policy.replace(':', "")),
                );
                let m = scratch(
                    dir,
                    &format!("m{stages}{schedule}{}", policy.replace(':', "")),
                );
                // One kernel thread per stage in both runs.
                run_ok(threaded(&train_args(stages, stages, &t, &extra)), &label);
                let out = run_ok(mpi(stages, &train_args(stages, 1, &m, &extra)), &label);
                assert!(out.contains("(MPI ranks)"), "{label}: {out}");
                assert!(out.contains("as the schedule moves"), "{label}: {out}");
                let (t, m) = (read_dump(&t), read_dump(&m));
                assert!(
                    m == t,
                    "{label}: MPI gradients differ from the threaded pipeline's"
                );
                assert!(m == one, "{label}: MPI gradients differ from one stage's");
            }
        }
    }
}

#[test]
fn replicas_match_threaded_replicas_over_steps() {
    if !have_mpirun() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for (ranks, stages) in [(4, 2), (4, 1)] {
        let replicas = (ranks / stages).to_string();
        let label = format!("{ranks} ranks, {stages} stage(s)");
        let (t, m) = (scratch(dir, "rt"), scratch(dir, "rm"));
        let steps = ["--steps", "3", "--micro-batches", "2", "--log-every", "1"];
        let mut targs = train_args(stages, stages, &t, &steps);
        targs.extend(["--replicas".into(), replicas.clone()]);
        let threaded_out = run_ok(threaded(&targs), &label);
        let mpi_out = run_ok(mpi(ranks, &train_args(stages, 1, &m, &steps)), &label);
        assert!(
            mpi_out.contains(&format!("{replicas} data-parallel replicas")),
            "{mpi_out}"
        );
        assert!(
            read_dump(&m) == read_dump(&t),
            "{label}: first-step gradients differ"
        );
        // The replicas stay in step: the losses of later steps agree too.
        let losses = |out: &str| -> Vec<String> {
            out.lines()
                .filter(|l| l.starts_with("step "))
                .map(str::to_string)
                .collect()
        };
        assert_eq!(losses(&mpi_out), losses(&threaded_out), "{label}");
        assert_eq!(losses(&mpi_out).len(), 3, "{mpi_out}");
    }
    // A world that is no multiple of the stages is refused.
    let args = train_args(2, 1, &scratch(dir, "bad"), &[]);
    let out = mpi(3, &args).output().unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("3 MPI ranks cannot run 2-stage pipelines"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_stage_out_of_memory_ends_every_rank_naming_stage_and_micro_batch() {
    if !have_mpirun() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let args = train_args(
        2,
        1,
        &scratch(tmp.path(), "oom"),
        &["--memory-budget", "600KiB"],
    );
    let out = mpi(2, &args).output().unwrap();
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("failed: training step 0: stage 0, micro-batch"),
        "{all}"
    );
    assert!(all.contains("out of memory"), "{all}");
    assert!(all.contains("ending every rank of the run"), "{all}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

/// The children of `parent` whose environment says they are MPI rank `rank`.
fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
    let wanted = format!("OMPI_COMM_WORLD_RANK={rank}");
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The parent pid is the second field after the parenthesised command name.
            let ppid: u32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let has = env.split(|&b| b == 0).any(|v| v == wanted.as_bytes());
            (ppid == parent && has).then_some(pid)
        })
}

#[test]
fn a_killed_rank_ends_the_run_and_the_survivor_says_where_it_stood() {
    if !have_mpirun() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let args = train_args(2, 1, &scratch(tmp.path(), "kill"), &["--steps", "1000000"]);
    let mut child = mpi(2, &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until rank 1 runs, then give it time to be inside the training loop.
    let deadline = Instant::now() + Duration::from_secs(60);
    let victim = loop {
        if let Some(pid) = rank_pid(child.id(), 1) {
            break pid;
        }
        assert!(Instant::now() < deadline, "rank 1 never started");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_secs(2));
    let killed = Instant::now();
    let status = Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // mpirun must end the run on its own: poll, and kill it only if the test fails.
    let limit = Duration::from_secs(30);
    let exit = loop {
        if let Some(exit) = child.try_wait().unwrap() {
            break Some(exit);
        }
        if killed.elapsed() > limit {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let all = text(&out);
    let exit = exit.unwrap_or_else(|| panic!("the run went on {limit:?} after rank 1 died: {all}"));
    assert!(!exit.success(), "{all}");
    assert!(
        all.contains("rank 0 (stage 0, replica 0) was ended by the launcher: stage 0, micro-batch"),
        "{all}"
    );
}

/// `remat bench pipeline --transport mpi`: one row per stage count, and the bytes the ranks
/// sent per step equal what the schedule moves.
#[test]
fn bench_pipeline_over_mpi_counts_the_bytes_the_schedule_moves() {
    if !have_mpirun() {
        return;
    }
    let out = Command::new(REMAT)
        .args(["bench", "pipeline", "--transport", "mpi", "--layers", "4"])
        .args(["--d-model", "32", "--rows", "1", "--repeats", "1"])
        .output()
        .unwrap();
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    let rows: Vec<&str> = all
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| ["1", "2", "4"].contains(&w))
        })
        .collect();
    assert_eq!(rows.len(), 3, "{all}");
    for row in &rows {
        assert!(row.trim_end().ends_with("yes"), "{row}");
    }
    // 2 stages, 8 micro-batches of 1 x 24 tokens x 32 wide f32: 8 x 3072 B each way.
    assert!(rows[1].contains("24576 + 24576"), "{}", rows[1]);
}
