//! `remat train` refuses bad or meaningless flags with a message naming the flag, instead
//! of panicking, hanging or silently ignoring them.

mod common;
use common::remat;

const TINY: &[&str] = &[
    "train",
    "--layers",
    "1",
    "--d-model",
    "16",
    "--heads",
    "2",
    "--batch",
    "2",
    "--digits",
    "3",
    "--threads",
    "1",
    "--steps",
    "1",
];

/// Runs `TINY` plus `extra`; asserts a clean failure (exit 1 or clap's 2, no panic) whose
/// stderr contains every one of `needles`, and returns stderr.
fn fails_with(extra: &[&str], needles: &[&str]) -> String {
    let out = remat(&[TINY, extra].concat());
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let code = out.status.code();
    assert!(
        matches!(code, Some(1) | Some(2)),
        "{extra:?}: exit {code:?}\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{extra:?}: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{extra:?}: no {n:?} in\n{stderr}");
    }
    stderr
}

#[test]
fn log_every_zero_is_refused_naming_the_flag() {
    fails_with(&["--log-every", "0"], &["--log-every", "0"]);
    let out = remat(&[TINY, &["--log-every", "1"]].concat());
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn bad_learning_rates_are_refused() {
    for lr in ["NaN", "inf", "-1", "0", "1e308"] {
        fails_with(&["--lr", lr], &["--lr", "(0, 1]"]);
    }
}

#[test]
fn policy_and_budget_messages_say_what_is_wrong() {
    for p in ["every:0", "depth:0"] {
        let err = fails_with(&["--policy", p], &["positive"]);
        assert!(!err.contains("unknown policy"), "{err}");
    }
    fails_with(
        &["--memory-budget", "-5MiB"],
        &["--memory-budget", "negative"],
    );
    fails_with(
        &["--memory-budget", "18446744073709551616"],
        &["--memory-budget", "out of range"],
    );
    // A fraction needs a reference peak; `remat train` measures none before the budget
    // holds.
    fails_with(
        &["--memory-budget", "0.5"],
        &["--memory-budget", "a fraction needs a reference peak"],
    );
}

#[test]
fn too_many_threads_is_an_error_not_a_hang() {
    for t in ["2000", "1000000000000"] {
        let mut args = TINY.to_vec();
        let at = args.iter().position(|a| *a == "--threads").unwrap();
        args[at + 1] = t;
        let out = remat(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(&format!("threads {t}")), "{stderr}");
    }
    let out = remat(&[
        "profile",
        "--threads",
        "2000",
        "--out",
        "/nonexistent/never-written.json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("threads 2000"), "{stderr}");
}

#[test]
fn seq_near_usize_max_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("ok.txt");
    std::fs::write(&data, "some text to train on, long enough").unwrap();
    let data = data.to_str().unwrap();
    fails_with(
        &["--data", data, "--seq", "18446744073709551615"],
        &["--seq", "too few"],
    );
}

#[test]
fn flags_the_run_would_ignore_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let grads = dir.path().join("g.safetensors");
    let grads = grads.to_str().unwrap();
    fails_with(
        &["--compare", "--dump-grads", grads],
        &["--dump-grads", "--compare"],
    );
    assert!(!std::path::Path::new(grads).exists());
    fails_with(
        &["--compare", "--policy", "sqrt"],
        &["--policy sqrt", "--compare"],
    );
    let swap = dir.path().to_str().unwrap();
    fails_with(&["--compare", "--swap-dir", swap], &["--swap-dir"]);
    fails_with(&["--swap-dir", swap], &["--swap-dir", "--policy auto"]);
    fails_with(&["--mode", "lora"], &["--mode lora", "--block"]);
}

#[test]
fn impossible_sizes_are_errors_and_the_hint_never_allocates_unboundedly() {
    for extra in [
        &["--batch", "1000000000000"][..],
        &["--digits", "1000000000000"],
        &["--layers", "1000000000000"],
        &["--ffn", "1000000000000"],
        &["--d-model", "1000000000000", "--heads", "2"],
    ] {
        let out = remat(&[&["train", "--steps", "1", "--threads", "1"], extra].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        // 2 where the flags alone make no model (its parameters overflow), 1 where the run
        // finds out (the task cannot be built).
        assert!(
            matches!(out.status.code(), Some(1) | Some(2)),
            "{extra:?}: {stderr}"
        );
        assert!(
            stderr.starts_with("error:") || stderr.contains("\nerror:"),
            "{stderr}"
        );
    }
    // Over the budget by far: the out-of-memory error with a hint, not an abort.
    let out = remat(&[
        "train",
        "--steps",
        "1",
        "--threads",
        "1",
        "--d-model",
        "131072",
        "--heads",
        "1024",
        "--memory-budget",
        "1MiB",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("out of memory") && stderr.contains("hint:"),
        "{stderr}"
    );
}
