//! `remat train --policy auto`: an infeasible budget is an error stating the smallest
//! feasible budget, and training at exactly that budget works, with the measured peak equal
//! to the predicted one.

use std::process::Command;

fn train(budget: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_remat"))
        .args([
            "train",
            "--steps",
            "3",
            "--layers",
            "1",
            "--d-model",
            "32",
            "--heads",
            "2",
        ])
        .args([
            "--batch",
            "4",
            "--digits",
            "4",
            "--threads",
            "1",
            "--policy",
            "auto",
        ])
        .args(["--memory-budget", budget])
        .output()
        .expect("the remat binary runs")
}

#[test]
fn infeasible_budget_names_the_smallest_feasible_one_which_then_trains() {
    let out = train("4KiB");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let smallest: u64 = err
        .split("smallest feasible budget is ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no smallest feasible budget in: {err}"));
    let out = train(&smallest.to_string());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let peak_row = text
        .lines()
        .find(|l| l.trim_start().starts_with("peak MiB"))
        .unwrap_or_else(|| panic!("no peak row in: {text}"));
    let cells: Vec<&str> = peak_row.split_whitespace().collect();
    assert_eq!(cells[2], cells[3], "predicted vs measured peak: {peak_row}");
}

fn remat(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_remat"))
        .args(args)
        .output()
        .expect("the remat binary runs")
}

#[test]
fn flags_auto_does_not_use_are_errors_naming_the_flag() {
    for (extra, flag) in [
        (&["--stages", "2"][..], "--stages"),
        (&["--compare"][..], "--compare"),
        (&["--dump-grads", "g.safetensors"][..], "--dump-grads"),
    ] {
        let mut args = vec![
            "train",
            "--steps",
            "1",
            "--policy",
            "auto",
            "--memory-budget",
            "64MiB",
        ];
        args.extend_from_slice(extra);
        let out = remat(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} should fail");
        assert!(
            err.contains(&format!("{flag} cannot be combined with --policy auto")),
            "{extra:?}: {err}"
        );
    }
}

#[test]
fn profiling_a_qwen3_model_says_why_it_cannot() {
    let out = remat(&["profile", "--model", "qwen3", "--out", "unused.json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--model qwen3") && err.contains("spec runtime") && err.contains("`gpt`"),
        "{err}"
    );
    assert!(!std::path::Path::new("unused.json").exists());
}
