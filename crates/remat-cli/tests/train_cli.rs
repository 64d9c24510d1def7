//! `remat train` end to end on tiny configurations.

mod common;
use common::remat;

use std::process::Output;

const TINY: &[&str] = &[
    "--layers",
    "2",
    "--d-model",
    "16",
    "--heads",
    "2",
    "--batch",
    "8",
    "--digits",
    "4",
    "--threads",
    "1",
];

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| {
            l.strip_prefix("step ")
                .and_then(|r| r.split("loss").nth(1))
                .and_then(|v| v.trim().parse().ok())
        })
        .collect()
}

#[test]
fn trains_and_the_loss_falls() {
    let args = [
        "train",
        "--steps",
        "300",
        "--lr",
        "1e-2",
        "--log-every",
        "30",
        "--layers",
        "2",
        "--d-model",
        "32",
        "--heads",
        "2",
    ];
    let out = remat(
        &[
            &args[..],
            &["--batch", "16", "--digits", "4", "--threads", "1"],
        ]
        .concat(),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let l = losses(&stdout);
    assert!(l.len() >= 10, "{stdout}");
    // Chance level is ln(10) = 2.30 on the reversed digits; a model that learns to copy
    // from the mirrored position gets far below it.
    let last = (l[l.len() - 3..].iter().sum::<f64>()) / 3.0;
    assert!(
        l[0] > 2.0 && last < 1.2,
        "loss did not fall: {} -> {last}\n{stdout}",
        l[0]
    );
    for needle in [
        "tokens/s",
        "step time",
        "activations",
        "optimizer state",
        "total (peak of the sum)",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in\n{stdout}");
    }
}

#[test]
fn compare_prints_every_policy_with_identical_gradients() {
    let out = remat(
        &[
            &[
                "train",
                "--compare",
                "--compare-steps",
                "2",
                "--dropout",
                "0.1",
            ],
            TINY,
        ]
        .concat(),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for policy in [
        "store-all",
        "per-block",
        "sqrt-blocks",
        "recompute-all",
        "every:4",
        "depth:3",
        "sqrt",
    ] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(policy))
            .unwrap_or_else(|| panic!("no row for {policy}:\n{stdout}"));
        assert!(row.trim_end().ends_with("yes"), "{row}");
    }
    assert!(stdout.contains("grads bit-identical"), "{stdout}");
    assert!(
        stdout.contains("1 warm-up + 2 timed steps per policy, repeated up to 0.4 s (median)"),
        "{stdout}"
    );
}

/// The peak-activation cell of `policy`'s row, in KiB.
fn peak_kib(stdout: &str, policy: &str) -> f64 {
    let row = stdout
        .lines()
        .find(|l| l.starts_with(&format!("{policy} ")))
        .unwrap_or_else(|| panic!("no row for {policy}:\n{stdout}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[2], "KiB", "{row}");
    cells[1].parse().unwrap()
}

#[test]
fn compare_applies_the_memory_budget_and_recompute_all_peaks_lowest() {
    let unbounded = remat(&[&["train", "--compare", "--compare-steps", "1"], TINY].concat());
    let (stdout, stderr) = text(&unbounded);
    assert!(unbounded.status.success(), "{stdout}\n{stderr}");
    // recompute-all frees what it rebuilds right after use: the lowest activation peak.
    let all = peak_kib(&stdout, "recompute-all");
    for policy in ["store-all", "per-block", "sqrt", "every:4", "depth:3"] {
        assert!(all < peak_kib(&stdout, policy), "{policy}\n{stdout}");
    }
    let out = remat(
        &[
            &[
                "train",
                "--compare",
                "--compare-steps",
                "1",
                "--memory-budget",
                "200KiB",
            ],
            TINY,
        ]
        .concat(),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let row = |p: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(&format!("{p} ")))
            .unwrap_or_else(|| panic!("no row for {p}:\n{stdout}"))
            .to_string()
    };
    assert!(row("store-all").contains("over budget"), "{stdout}");
    assert!(row("recompute-all").trim_end().ends_with("yes"), "{stdout}");
    assert!(
        stdout.contains("over --memory-budget 200.00 KiB: store-all"),
        "{stdout}"
    );
    assert!(
        stdout.contains("store-all does not fit the budget"),
        "{stdout}"
    );
}

#[test]
fn zero_steps_batch_or_seq_is_an_error_naming_the_flag() {
    for (flag, value, want) in [
        ("--steps", "0", "--steps 0: must be at least 1"),
        ("--batch", "0", "--batch 0: must be at least 1"),
    ] {
        let small = [
            "--layers",
            "1",
            "--d-model",
            "16",
            "--heads",
            "2",
            "--digits",
            "4",
        ];
        let out = remat(&[&["train", flag, value], &small[..]].concat());
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{flag} {value}: {stdout}");
        assert!(stderr.contains(want), "{stderr}");
        assert!(!stdout.contains("tokens/s"), "{stdout}");
    }
    let data = std::env::temp_dir().join(format!("remat-seq0-{}.txt", std::process::id()));
    std::fs::write(&data, "some text to train on, long enough").unwrap();
    let out = remat(&["train", "--data", data.to_str().unwrap(), "--seq", "0"]);
    std::fs::remove_file(&data).ok();
    assert!(!out.status.success());
    assert!(
        text(&out).1.contains("--seq 0: must be at least 1"),
        "{}",
        text(&out).1
    );
}

#[test]
fn too_small_a_budget_is_an_out_of_memory_error_with_a_hint() {
    let out = remat(
        &[
            &["train", "--steps", "2", "--memory-budget", "120KiB"],
            TINY,
        ]
        .concat(),
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains("out of memory while running node"),
        "{stderr}"
    );
    assert!(stderr.contains("budget 120.00 KiB ("), "{stderr}");
    assert!(stderr.contains("hint: "), "{stderr}");
    assert!(
        stderr.contains("--policy store-all needs --memory-budget"),
        "{stderr}"
    );
    // Nothing fits 120 KiB: the hint names the smallest peak and the policy reaching it.
    assert!(
        stderr.contains("the smallest peak is") && stderr.contains("under --policy recompute-all"),
        "{stderr}"
    );

    let bad = remat(&["train", "--memory-budget", "lots"]);
    assert!(!bad.status.success());
    assert!(text(&bad).1.contains("not a size"), "{}", text(&bad).1);
}

#[test]
fn dump_grads_then_init_and_character_data() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let grads = dir.join("grads.safetensors");
    let g = grads.to_str().unwrap();
    let out = remat(&[&["train", "--steps", "1", "--dump-grads", g], TINY].concat());
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(
        text(&out)
            .0
            .contains("wrote the first step's gradients (21 tensors) and its batch and loss"),
        "{}",
        text(&out).0
    );
    // The gradient file has the parameters' names and shapes, so it loads as parameters.
    let out = remat(&[&["train", "--steps", "1", "--init", g], TINY].concat());
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(
        text(&out).0.contains("loaded parameters"),
        "{}",
        text(&out).0
    );
    // A model of another width refuses it, naming the tensor.
    let out = remat(&[
        "train",
        "--steps",
        "1",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--digits",
        "4",
        "--init",
        g,
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out)
            .1
            .contains("model.embed_tokens.weight has shape [11, 16]"),
        "{}",
        text(&out).1
    );

    let data = dir.join("text.txt");
    std::fs::write(
        &data,
        "the quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let out = remat(
        &[
            &[
                "train",
                "--steps",
                "3",
                "--seq",
                "16",
                "--data",
                data.to_str().unwrap(),
            ],
            TINY,
        ]
        .concat(),
    );
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(
        text(&out)
            .0
            .contains("character-level text, 900 characters, vocabulary 28"),
        "{}",
        text(&out).0
    );
    let missing = remat(&["train", "--data", dir.join("absent.txt").to_str().unwrap()]);
    assert!(
        text(&missing).1.contains("absent.txt"),
        "{}",
        text(&missing).1
    );
}
