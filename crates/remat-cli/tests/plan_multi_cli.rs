//! `remat plan A.json B.json ...` end to end: several graphs planned together under one
//! budget, the swap table, the per-model stalls and the comparison; bad input refused.

mod common;
use common::remat_text as remat;

use std::path::{Path, PathBuf};

/// A training chain of `layers` layers in remat's JSON schema: 1 MiB activations, forward
/// 100 us per layer, backward 200 us, 1 MiB of static memory.
fn write_chain(dir: &Path, name: &str, layers: usize) -> PathBuf {
    common::write_chain(dir, name, layers, 100, 1 << 20)
}

fn utf8(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn plans_two_graphs_together_and_says_who_hides_which_swap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = write_chain(dir.path(), "a", 8);
    let b = write_chain(dir.path(), "b", 6);
    let out = dir.path().join("plan.json");
    let (ok, text) = remat(&[
        "plan",
        utf8(&a),
        utf8(&b),
        "--budget",
        "0.6",
        "--strategy",
        "mutwo",
        "--bandwidth",
        "20GB/s",
        "--out",
        utf8(&out),
    ]);
    assert!(ok, "{text}");
    for expected in [
        "model 0       a: 17 nodes",
        "model 1       b: 13 nodes",
        "order         interleaved",
        "strategy      mutwo",
        "| together, interleaved",
        "| together, one-after-another",
        "| each alone, one after another",
        "exposed stall ms",
        "plan written to",
    ] {
        assert!(text.contains(expected), "missing {expected:?}:\n{text}");
    }
    // Either a swap table naming each swap's model, or the line saying there is none.
    assert!(
        text.contains("| swapped tensor") || text.contains("swaps         none"),
        "{text}"
    );
    let plan = std::fs::read_to_string(&out).expect("the plan file");
    let plan = remat_planner::Plan::from_json(&plan).expect("a plan");
    assert_eq!(plan.node_count, 30);
    assert_eq!(plan.graph, "a+b");
}

#[test]
fn several_graphs_refuse_what_takes_one_and_name_bad_values() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = write_chain(dir.path(), "a", 4);
    let b = write_chain(dir.path(), "b", 4);
    let run = |extra: &[&str]| {
        let mut args = vec!["plan", utf8(&a), utf8(&b)];
        args.extend_from_slice(extra);
        remat(&args)
    };
    let (ok, text) = run(&["--budget", "0.7", "--compare"]);
    assert!(
        !ok && text.contains("--compare") && text.contains("one graph"),
        "{text}"
    );
    let (ok, text) = run(&["--budget", "0.7", "--order", "zigzag"]);
    assert!(
        !ok && text.contains("--order zigzag") && text.contains("interleaved"),
        "{text}"
    );
    let (ok, text) = run(&["--budget", "100KiB"]);
    assert!(
        !ok && text.contains("below the floor of the 2 models"),
        "{text}"
    );
    let (ok, text) = run(&["--budget", "0.7,0.5"]);
    assert!(!ok && text.contains("one --budget"), "{text}");
    let missing = dir.path().join("missing.json");
    let (ok, text) = remat(&["plan", utf8(&a), utf8(&missing), "--budget", "0.7"]);
    assert!(!ok && text.contains("missing.json"), "{text}");
}
