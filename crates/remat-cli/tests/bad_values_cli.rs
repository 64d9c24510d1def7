//! Bad values on the command line, every command alike: `error: {flag} {value}: {what is
//! wrong}` on stderr, nothing before it on stdout, exit status 2 (a usage error, as clap's
//! own); a run that fails once it works exits 1. The same values through Python are in
//! python/tests/test_one_voice.py, which checks the two say the same.

mod common;
use common::remat;

/// Runs `args`; asserts exit 2, an empty stdout, and stderr starting with `error: {says}`
/// and ending with the help hint.
fn refused(args: &[&str], says: &str) {
    let out = remat(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(
        out.stdout.is_empty(),
        "{args:?} printed before its error:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stderr.starts_with(&format!("error: {says}")),
        "{args:?}: {stderr}"
    );
    assert!(
        stderr
            .trim_end()
            .ends_with("For more information, try '--help'."),
        "{stderr}"
    );
}

#[test]
fn negative_numbers_are_read_as_values_and_refused_by_remat() {
    let dir = tempfile::tempdir().unwrap();
    let g = common::write_chain(dir.path(), "g", 4, 10, 0);
    let g = g.to_str().unwrap();
    refused(
        &["plan", g, "--budget", "-1GB"],
        "--budget -1GB: the value is negative; give a number of bytes",
    );
    refused(
        &["train", "--memory-budget", "-1GB"],
        "--memory-budget -1GB: the value is negative",
    );
    refused(
        &["train", "--steps", "-5"],
        "--steps -5: the value is negative",
    );
    refused(
        &["plan", g, "--budget", "0.5", "--time-limit", "-1"],
        "--time-limit -1: the value is negative",
    );
    refused(
        &["profile", "--layers", "-1", "--out", "x.json"],
        "--layers -1: the value is negative",
    );
}

#[test]
fn zero_where_zero_means_nothing_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let g = common::write_chain(dir.path(), "g", 4, 10, 0);
    let g = g.to_str().unwrap();
    for (flag, args) in [
        ("--steps", vec!["train", "--steps", "0"]),
        ("--batch", vec!["train", "--batch", "0"]),
        ("--threads", vec!["train", "--threads", "0"]),
        ("--compare-steps", vec!["train", "--compare-steps", "0"]),
        ("--runs", vec!["profile", "--runs", "0", "--out", "x.json"]),
    ] {
        refused(&args, &format!("{flag} 0: must be at least 1"));
    }
    refused(
        &["plan", g, "--budget", "0.5", "--time-limit", "0"],
        "--time-limit 0: must be more than 0 seconds",
    );
    refused(
        &["plan", g, "--budget", "0.5", "--bandwidth", "0"],
        "--bandwidth 0: comes to 0 bytes per second",
    );
    refused(
        &["plan", g, "--budget", "0"],
        "--budget 0: comes to 0 bytes, which holds nothing",
    );
    refused(
        &["train", "--memory-budget", "0"],
        "--memory-budget 0: comes to 0 bytes, which holds nothing",
    );
}

#[test]
fn a_budget_in_bytes_under_a_kilobyte_is_refused_when_given() {
    let dir = tempfile::tempdir().unwrap();
    let g = common::write_chain(dir.path(), "g", 4, 10, 0);
    let g = g.to_str().unwrap();
    let says = "1 byte cannot hold a training step (a budget in bytes is at least 1 KiB); did you mean a fraction (1.0) or a size (1GiB)?";
    refused(
        &["plan", g, "--budget", "1"],
        &format!("--budget 1: {says}"),
    );
    refused(
        &["train", "--memory-budget", "1"],
        &format!("--memory-budget 1: {says}"),
    );
    refused(
        &["spec", "inspect", "--memory-budget", "1"],
        &format!("--memory-budget 1: {says}"),
    );
}

#[test]
fn flags_that_make_no_model_or_do_not_go_together_are_told_before_any_header() {
    refused(
        &["train", "--heads", "3"],
        "--heads 3: must divide --d-model 64",
    );
    refused(
        &["train", "--heads", "4", "--kv-heads", "3"],
        "--kv-heads 3: must divide --heads 4",
    );
    refused(
        &[
            "train",
            "--policy",
            "auto:fastest",
            "--memory-budget",
            "1MiB",
        ],
        "--policy auto:fastest: unknown strategy `fastest`",
    );
    let dir = tempfile::tempdir().unwrap();
    let g = common::write_chain(dir.path(), "g", 4, 10, 0);
    let g = g.to_str().unwrap();
    let out = dir.path().join("plan.json");
    refused(
        &[
            "plan",
            g,
            "--budget",
            "0.7",
            "--compare",
            "--out",
            out.to_str().unwrap(),
        ],
        "--compare runs every strategy and writes nothing: it cannot take --out",
    );
    refused(
        &["plan", g, "--budget", "0.7,0.5"],
        "give one --budget without --compare (got 2)",
    );
    refused(
        &["plan", g, "--budget", "0.7", "--order", "zigzag"],
        "--order zigzag: unknown order",
    );
    refused(
        &["plan", g, "--budget", "0.7", "--strategy", "fastest"],
        "--strategy fastest: unknown strategy `fastest`; known: store-all",
    );
    refused(
        &["plan", g, "--budget", "0.7", "--strategy", "every:0"],
        "--strategy every:0: ",
    );
    refused(
        &["plan", g, "--budget", "0.7", "--plot", "t.jpg"],
        "--plot t.jpg: needs a .svg or .png file name",
    );
    assert!(!out.exists());
}

#[test]
fn the_benchmarks_read_their_flags_in_the_same_words_as_the_commands() {
    // The same value gets the same words from `remat train` and from `remat bench`.
    let cases: [(&[&str], &[&str], &str); 4] = [
        (
            &["train", "--steps", "0"],
            &["bench", "engine", "--steps", "0"],
            "--steps 0: must be at least 1",
        ),
        (
            &["train", "--steps", "-1"],
            &["bench", "multi", "--steps", "-1"],
            "--steps -1: the value is negative",
        ),
        (
            &["train", "--threads", "0"],
            &["bench", "auto", "--threads", "0"],
            "--threads 0: must be at least 1",
        ),
        (
            &["reshard", "a", "b", "-w", "2", "--max-buffer", "0"],
            &["bench", "reshard", "--max-buffer", "0"],
            "--max-buffer 0: comes to 0 bytes",
        ),
    ];
    for (command, bench, says) in cases {
        refused(command, says);
        refused(bench, says);
    }
    refused(
        &["bench", "pipeline", "--micro-batches", "2,0"],
        "--micro-batches 0: must be at least 1",
    );
    refused(
        &["bench", "plan", "--milp-time-limit", "0"],
        "--milp-time-limit 0: must be more than 0 seconds",
    );
}

#[test]
fn a_bad_value_is_told_before_a_missing_file() {
    refused(
        &["plan", "/nonexistent/graph.json", "--budget", "lots"],
        "--budget lots: not a size",
    );
}

#[test]
fn a_run_that_fails_exits_1_and_help_says_which_status_is_which() {
    let dir = tempfile::tempdir().unwrap();
    let g = common::write_chain(dir.path(), "g", 4, 10, 0);
    // Readable, but under the graph's floor: the run fails, the value was fine.
    let out = remat(&["plan", g.to_str().unwrap(), "--budget", "1KiB"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for command in [&["--help"][..], &["plan", "--help"], &["reshard", "--help"]] {
        let help = remat(command);
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(
            text.contains("Exit status: 0 done; 1 the command failed")
                && text.contains("2 a bad flag"),
            "{command:?}: {text}"
        );
    }
}

#[test]
fn plan_says_what_kept_sums_and_compare_prints_no_raw_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let g = common::write_chain(dir.path(), "g", 8, 10, 0);
    let g = g.to_str().unwrap();
    let out = remat(&["plan", g, "--budget", "0.5"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("(each operation's output by its fate, summed over the step: not held at once; the peak is)"),
        "{text}"
    );
    let out = remat(&[
        "plan",
        g,
        "--budget",
        "0.25,3MiB",
        "--compare",
        "--time-limit",
        "0.2",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("kept, swapped, recomputed: each operation's output by its fate"));
    let footnotes: Vec<&str> = text.lines().filter(|l| l.starts_with('[')).collect();
    assert!(!footnotes.is_empty(), "{text}");
    for line in footnotes {
        // A floor or least peak may carry its exact count after the binary figure,
        // "3.05 KiB (3123 bytes)"; a count alone is what must not appear.
        let figures_only = without_exact_counts(line);
        assert!(
            !figures_only.contains(" bytes"),
            "raw bytes in a footnote: {line}"
        );
    }
    assert!(
        text.contains("budget of 2.00 MiB is below the graph's floor of 3.00 MiB"),
        "{text}"
    );
}

/// `line` without the exact counts that follow a binary figure: "3.05 KiB (3123 bytes)"
/// becomes "3.05 KiB".
fn without_exact_counts(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(open) = rest.find(" (") {
        let tail = &rest[open + 2..];
        let digits = tail.chars().take_while(char::is_ascii_digit).count();
        let is_count = digits > 0 && tail[digits..].starts_with(" bytes)");
        let figure_before = ["KiB", "MiB", "GiB", "TiB"]
            .iter()
            .any(|unit| rest[..open].ends_with(unit));
        out.push_str(&rest[..open]);
        if is_count && figure_before {
            rest = &tail[digits + " bytes)".len()..];
        } else {
            out.push_str(" (");
            rest = tail;
        }
    }
    out.push_str(rest);
    out
}
