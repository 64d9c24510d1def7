//! `remat bench plan --graphs DIR`: graphs are all loaded before benching, and `--only`
//! must match something. Only the failing paths run here (a full bench is not a test).

mod common;
use common::remat_text as remat;

const GOOD: &str = r#"{"format": "remat-graph", "version": 1, "name": "good", "nodes": [
  {"name": "f0", "phase": "forward", "compute_time": 1, "output_bytes": 100, "inputs": []},
  {"name": "loss", "phase": "backward", "compute_time": 1, "output_bytes": 4, "inputs": [0]},
  {"name": "b0", "phase": "backward", "compute_time": 2, "output_bytes": 100, "inputs": [0, 1]}]}"#;

#[test]
fn a_bad_graph_is_reported_before_any_graph_is_benched() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("a-good.json"), GOOD).expect("writes");
    let bad = GOOD.replace("\"compute_time\": 2", "\"compute_time\": -2");
    std::fs::write(dir.path().join("b-bad.json"), bad).expect("writes");
    let (ok, text) = remat(&[
        "bench",
        "plan",
        "--graphs",
        dir.path().to_str().expect("utf-8"),
    ]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("b-bad.json") && text.contains("compute_time"),
        "{text}"
    );
    assert!(
        !text.contains("good: 3 nodes"),
        "benched before validating: {text}"
    );
}

#[test]
fn only_matching_nothing_lists_the_graphs() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("a-good.json"), GOOD).expect("writes");
    let (ok, text) = remat(&[
        "bench",
        "plan",
        "--graphs",
        dir.path().to_str().expect("utf-8"),
        "--only",
        "vgg",
    ]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("--only vgg") && text.contains("a-good.json"),
        "{text}"
    );
}

/// The scale section's worker, run as the section runs it: one solve of a generated graph,
/// printed as one result line; a budget under the floor is an "over" line with the peak.
#[test]
fn the_scale_worker_solves_one_generated_graph() {
    let (ok, text) = remat(&[
        "bench",
        "plan",
        "--scale-worker",
        "layered:40:1|100000000|evict",
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("remat-scale-result ok 0 "), "{text}");
    let (ok, text) = remat(&["bench", "plan", "--scale-worker", "layered:40:1|10|mutwo"]);
    assert!(ok, "{text}");
    assert!(text.contains("remat-scale-result over "), "{text}");
    let (ok, text) = remat(&["bench", "plan", "--scale-worker", "ring:3|10|mutwo"]);
    assert!(!ok && text.contains("ring:3"), "{text}");
}

/// A solve still running at --scale-cap is stopped and reported as such, and the table
/// still comes out.
#[test]
fn the_scale_section_stops_solves_at_the_cap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, text) = remat(&[
        "bench",
        "plan",
        "--scale-only",
        "--scale-max-nodes",
        "300",
        "--scale-cap",
        "0.001",
        "--graphs",
        dir.path().to_str().expect("utf-8"),
    ]);
    assert!(ok, "{text}");
    assert!(
        text.contains("layered n=250") && text.contains("stopped"),
        "{text}"
    );
    assert!(
        !text.contains("transformer"),
        "over --scale-max-nodes: {text}"
    );
    let (ok, text) = remat(&["bench", "plan", "--scale-only", "--scale-cap", "0"]);
    assert!(!ok && text.contains("--scale-cap"), "{text}");
}
