//! Bad input to the spec-driven and pipeline commands ends in a clear error naming what is
//! wrong: never a panic, an abort, a hang, or a silent success.

use std::process::Command;

/// Runs remat; returns (exit code, stdout, stderr). A signal (abort) has no code: -1.
fn remat(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_remat"))
        .args(args)
        .output()
        .expect("run remat");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts that remat fails with an ordinary error (exit 1 or clap's 2) whose message
/// contains every one of `needles`, and does not panic.
fn fails_with(args: &[&str], needles: &[&str]) -> String {
    let (code, out, err) = remat(args);
    assert!(
        code == 1 || code == 2,
        "remat {args:?}: exit {code}\nstdout: {out}\nstderr: {err}"
    );
    assert!(!err.contains("panicked"), "remat {args:?} panicked: {err}");
    for needle in needles {
        assert!(
            err.contains(needle),
            "remat {args:?}: error lacks `{needle}`: {err}"
        );
    }
    err
}

fn qwen3_spec() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/qwen3.toml")
}

#[test]
fn zero_model_dimensions_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.toml");
    let out = out.to_str().unwrap();
    for (key, named) in [
        ("num_hidden_layers=0", "num_hidden_layers"),
        ("seq_len=0", "seq_len"),
        ("vocab_size=0", "vocab_size"),
        ("head_dim=0", "head_dim"),
    ] {
        fails_with(&["spec", "derive", "--set", key, "-o", out], &[named]);
    }
    assert!(!std::path::Path::new(out).exists(), "partial output");
    fails_with(
        &[
            "bench", "spec", "--layers", "0", "--seq", "8", "--hidden", "32", "--batch", "1",
            "--rounds", "1",
        ],
        // Refused as a flag, in the commands' words, before any config is built; the
        // config's own check (naming num_hidden_layers) is reached through --block-set below.
        &["--layers 0: must be at least 1"],
    );
    fails_with(
        &[
            "bench", "spec", "--seq", "0", "--layers", "1", "--hidden", "32", "--batch", "1",
            "--rounds", "1",
        ],
        &["--seq 0: must be at least 1"],
    );
    for (set, named) in [
        ("num_hidden_layers=0", "num_hidden_layers"),
        ("rms_norm_eps=-1", "rms_norm_eps"),
        ("intermediate_size=0", "intermediate_size"),
    ] {
        fails_with(
            &[
                "train",
                "--spec",
                qwen3_spec(),
                "--steps",
                "1",
                "--batch",
                "4",
                "--block-set",
                set,
            ],
            &[named],
        );
    }
}

#[test]
fn absurd_stage_counts_are_refused_before_building() {
    fails_with(
        &[
            "train",
            "--stages",
            "18446744073709551615",
            "--steps",
            "1",
            "--batch",
            "8",
        ],
        &["--stages 18446744073709551615", "64"],
    );
    fails_with(
        &["train", "--stages", "500", "--steps", "1", "--batch", "8"],
        &["--stages 500"],
    );
}

#[test]
fn bench_pipeline_bounds_its_flags() {
    for (flags, named) in [
        (
            &["--micro-batches", "18446744073709551615"][..],
            "--micro-batches 18446744073709551615",
        ),
        (&["--micro-batches", "1000000"], "--micro-batches 1000000"),
        (
            &["--threads-per-stage", "100000"],
            "--threads-per-stage 100000",
        ),
        (&["--rows", "18446744073709551615"], "--rows"),
    ] {
        let mut args = vec!["bench", "pipeline", "--stages", "2", "--repeats", "1"];
        args.extend_from_slice(flags);
        fails_with(&args, &[named]);
    }
}

#[test]
fn impossible_parameter_sizes_are_errors_not_aborts() {
    fails_with(
        &[
            "train",
            "--spec",
            qwen3_spec(),
            "--steps",
            "1",
            "--batch",
            "4",
            "--memory-budget",
            "64MiB",
            "--mode",
            "lora",
            "--lora-rank",
            "100000000",
        ],
        &["out of memory", "model parameters"],
    );
    fails_with(
        &[
            "train",
            "--spec",
            qwen3_spec(),
            "--steps",
            "1",
            "--batch",
            "4",
            "--block-set",
            "head_dim=1000000000",
        ],
        &["cannot allocate"],
    );
}

#[test]
fn huge_layer_counts_are_refused_quickly() {
    fails_with(
        &[
            "spec",
            "inspect",
            "qwen3",
            "--set",
            "num_hidden_layers=1000000000",
        ],
        &["layer count 1000000000"],
    );
    fails_with(
        &[
            "train",
            "--spec",
            qwen3_spec(),
            "--steps",
            "1",
            "--batch",
            "4",
            "--block-set",
            "num_hidden_layers=100000000",
        ],
        &["layer count 100000000"],
    );
    // A deep but allowed stack compiles in well under a second: its layers share a plan.
    let (code, out, err) = remat(&[
        "spec",
        "inspect",
        "qwen3",
        "--set",
        "num_hidden_layers=4096",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("4096 layers"), "{out}");
}

#[test]
fn byte_counts_that_overflow_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(qwen3_spec()).unwrap().replacen(
        "shape = [\"B\", \"T\", \"D\"]",
        "shape = [\"4294967296\", \"4294967296\", \"4\"]",
        2,
    );
    let spec = dir.path().join("big.toml");
    std::fs::write(&spec, text).unwrap();
    fails_with(
        &[
            "spec",
            "inspect",
            spec.to_str().unwrap(),
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/qwen3.config.toml"),
        ],
        &["overflow"],
    );
    fails_with(
        &[
            "spec",
            "inspect",
            "qwen3",
            "--set",
            "hidden_size=9223372036854775807",
        ],
        &["overflow"],
    );
}

#[test]
fn flags_that_would_be_ignored_are_errors() {
    for flags in [
        &["--micro-batches", "3"][..],
        &["--schedule", "gpipe"],
        &["--stage-policy", "recompute-all"],
    ] {
        let mut args = vec!["train", "--steps", "1"];
        args.extend_from_slice(flags);
        fails_with(&args, &[flags[0], "--stages"]);
    }
    fails_with(
        &[
            "train",
            "--stages",
            "2",
            "--steps",
            "1",
            "--batch",
            "8",
            "--swap-dir",
            "/tmp",
        ],
        &["--swap-dir"],
    );
    for (set, named) in [
        ("vocab_size=3", "vocab_size"),
        ("batch=1000000", "--batch"),
        ("seq_len=7", "seq_len"),
        ("foo=1", "`foo`"),
    ] {
        fails_with(
            &[
                "train",
                "--block",
                "qwen3",
                "--steps",
                "1",
                "--batch",
                "4",
                "--block-set",
                set,
            ],
            &["--block-set", named],
        );
    }
    let dir = tempfile::tempdir().unwrap();
    for outputs in ["[]", "[\"out\", \"h\"]"] {
        let text = std::fs::read_to_string(qwen3_spec()).unwrap().replacen(
            "outputs = [\"out\"]",
            &format!("outputs = {outputs}"),
            1,
        );
        let spec = dir.path().join("outputs.toml");
        std::fs::write(&spec, text).unwrap();
        fails_with(
            &[
                "train",
                "--spec",
                spec.to_str().unwrap(),
                "--steps",
                "1",
                "--batch",
                "4",
            ],
            &["output"],
        );
    }
}

#[test]
fn lora_alpha_must_be_finite_and_positive() {
    for alpha in ["NaN", "inf", "0", "-1"] {
        fails_with(
            &[
                "train",
                "--spec",
                qwen3_spec(),
                "--steps",
                "1",
                "--batch",
                "4",
                "--mode",
                "lora",
                &format!("--lora-alpha={alpha}"),
            ],
            &["LoRA alpha"],
        );
    }
}

#[test]
fn error_causes_print_once() {
    let err = fails_with(
        &["train", "--spec", "/nonexistent/q.toml", "--steps", "1"],
        &["cannot read"],
    );
    assert_eq!(err.matches("No such file").count(), 1, "{err}");
    let err = fails_with(
        &[
            "train",
            "--stages",
            "2",
            "--steps",
            "1",
            "--batch",
            "8",
            "--memory-budget",
            "4KiB",
        ],
        &["out of memory"],
    );
    assert_eq!(err.matches(" short)").count(), 1, "{err}");
}

#[test]
fn stage_policy_reads_sizes_like_memory_budget_and_needs_positive_intervals() {
    for policy in ["memory:1TiB", "memory:12kib"] {
        let (code, _, err) = remat(&[
            "train",
            "--stages",
            "2",
            "--steps",
            "1",
            "--batch",
            "8",
            "--stage-policy",
            policy,
        ]);
        assert_eq!(code, 0, "{policy}: {err}");
    }
    fails_with(
        &[
            "train",
            "--stages",
            "2",
            "--steps",
            "1",
            "--batch",
            "8",
            "--stage-policy",
            "selective:0",
        ],
        &["selective:0", "positive"],
    );
}

#[test]
fn derived_specs_say_which_flags_match_them() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("d.toml");
    let (code, _, err) = remat(&["spec", "derive", "-o", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    fails_with(
        &["train", "--spec", out.to_str().unwrap(), "--steps", "1"],
        &["[4, 64, 128]", "--batch", "--digits"],
    );
}

#[test]
fn shape_errors_say_what_the_entry_is() {
    let dir = tempfile::tempdir().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/qwen3.config.toml");
    let base = std::fs::read_to_string(qwen3_spec()).unwrap();
    let write = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    // Integers are dimensions too.
    let ints = write(
        "ints.toml",
        base.replacen(
            "shape = [\"B\", \"T\", \"D\"]",
            "shape = [\"B\", \"T\", 128]",
            1,
        ),
    );
    let (code, _, err) = remat(&["spec", "inspect", &ints, "--config", config]);
    assert_eq!(code, 0, "{err}");
    let negative = write(
        "neg.toml",
        base.replacen(
            "shape = [\"B\", \"T\", \"D\"]",
            "shape = [\"B\", \"T\", \"-1\"]",
            1,
        ),
    );
    let err = fails_with(
        &["spec", "inspect", &negative, "--config", config],
        &["`-1`"],
    );
    assert!(!err.contains("--set -1"), "{err}");
    let selfref = write(
        "self.toml",
        base.replacen("D = \"hidden_size\"", "D = \"D\"", 1),
    );
    let err = fails_with(
        &["spec", "inspect", &selfref, "--config", config],
        &["is a dim"],
    );
    assert!(!err.contains("neither a dim"), "{err}");
}
