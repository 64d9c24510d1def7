//! `remat train --stages` end to end: the per-stage table and the bubble line; bad flags are
//! errors naming the flag.

mod common;
use common::{read_dump, remat};

const SMALL: [&str; 10] = [
    "train",
    "--layers",
    "3",
    "--d-model",
    "32",
    "--batch",
    "8",
    "--steps",
    "3",
    "--threads",
];

#[test]
fn pipelined_training_prints_stages_and_bubble() {
    for schedule in ["gpipe", "1f1b"] {
        let mut args = SMALL.to_vec();
        args.extend([
            "3",
            "--stages",
            "3",
            "--micro-batches",
            "4",
            "--schedule",
            schedule,
            "--stage-policy",
            "memory:64KiB",
        ]);
        let out = remat(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{schedule}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(&format!("schedule {schedule}, stage policy memory:65536")),
            "{stdout}"
        );
        assert!(
            stdout.contains("peak memory") && stdout.contains("busy"),
            "{stdout}"
        );
        for stage in ["0        0..1", "1        1..2", "2        2..3"] {
            assert!(
                stdout.contains(stage),
                "missing stage row {stage:?} in {stdout}"
            );
        }
        assert!(stdout.contains("ideal (P-1)/(M+P-1) = 0.333"), "{stdout}");
        assert!(stdout.contains("step     0  loss"), "{stdout}");
    }
}

#[test]
fn bad_pipeline_flags_are_errors() {
    let cases: [(&[&str], &str); 6] = [
        (&["--stages", "4"], "--stages 4 exceeds --layers 3"),
        (
            &["--stages", "2", "--micro-batches", "3"],
            "--batch 8 must split evenly into --micro-batches 3",
        ),
        (
            &["--stages", "2", "--schedule", "zigzag"],
            "unknown schedule `zigzag`",
        ),
        (
            &["--stages", "2", "--stage-policy", "selective:x"],
            "`x` is not a positive interval",
        ),
        (
            &["--stages", "2", "--micro-batches", "4", "--replicas", "3"],
            "--batch 8 must split evenly into 3 replica(s) x --micro-batches 4",
        ),
        (
            &["--stages", "2", "--stage-policy", "automatic"],
            "expected store-all, recompute-all, selective:N, memory:BYTES or auto",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = SMALL.to_vec();
        args.push("1");
        args.extend_from_slice(extra);
        let out = remat(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} should fail");
        assert!(stderr.contains(expected), "{extra:?}: {stderr}");
    }
}

/// The README's command, as printed there, with few steps: the default GPT has 2 blocks, so
/// without --layers the depth grows to the 4 stages (and the output says so).
#[test]
fn the_readme_pipeline_command_runs() {
    let out = remat(&[
        "train",
        "--stages",
        "4",
        "--micro-batches",
        "8",
        "--schedule",
        "1f1b",
        "--stage-policy",
        "selective:2",
        "--steps",
        "2",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("using --layers 4"), "{stdout}");
    assert!(stdout.contains("4 stages"), "{stdout}");
    for stage in ["0        0..1", "3        3..4"] {
        assert!(
            stdout.contains(stage),
            "missing stage row {stage:?} in {stdout}"
        );
    }
    assert!(stdout.contains("ideal (P-1)/(M+P-1) = 0.273"), "{stdout}");
}

#[test]
fn policy_is_refused_with_stages() {
    let mut args = SMALL.to_vec();
    args.extend(["1", "--stages", "2", "--policy", "sqrt"]);
    let out = remat(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--policy cannot be combined with --stages"),
        "{stderr}"
    );
}

/// `--dump-grads` with `--stages`: the file of `--stages 2` and `--stages 3` (one thread per
/// stage) equals `--stages 1` byte for byte under both schedules and a recomputing stage
/// policy, with dropout; `--init` loads the parameters on every stage.
#[test]
fn dump_grads_and_init_with_stages_equal_one_stage() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, stages: &str, extra: &[&str]| {
        let path = tmp.path().join(name);
        let mut args = SMALL.to_vec();
        args[8] = "1"; // --steps 1
        args.extend([
            stages,
            "--stages",
            stages,
            "--micro-batches",
            "4",
            "--dropout",
            "0.1",
        ]);
        args.extend(["--dump-grads", path.to_str().unwrap()]);
        args.extend_from_slice(extra);
        let out = remat(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{args:?}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("wrote the first step's gradients (30 tensors)"),
            "{stdout}"
        );
        read_dump(&path)
    };
    let one = run("one.safetensors", "1", &[]);
    assert!(
        one.0
            .iter()
            .any(|(n, _, _)| n == "model.embed_tokens.weight")
    );
    for stages in ["2", "3"] {
        for schedule in ["gpipe", "1f1b"] {
            for policy in ["store-all", "recompute-all", "selective:2"] {
                let got = run(
                    &format!("s{stages}-{schedule}-{policy}.safetensors"),
                    stages,
                    &["--schedule", schedule, "--stage-policy", policy],
                );
                assert!(
                    got == one,
                    "--stages {stages} {schedule} {policy}: gradients differ from one stage"
                );
            }
        }
    }
    // The dump has the parameters' names and shapes, so it loads as parameters.
    let init = tmp.path().join("one.safetensors");
    let init = init.to_str().unwrap();
    let from_init_1 = run("init1.safetensors", "1", &["--init", init]);
    let from_init_3 = run("init3.safetensors", "3", &["--init", init]);
    assert!(from_init_1 == from_init_3, "--init: stages disagree");
    assert!(from_init_1 != one, "--init changed nothing");
}
