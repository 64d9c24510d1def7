//! `remat plan` output paths and budget parsing, end to end: errors come before planning,
//! name the user's path, and leave nothing behind.

mod common;
use common::remat_text as remat;

use std::path::{Path, PathBuf};

/// A 4-layer training chain in remat's schema.
fn write_graph(dir: &Path) -> PathBuf {
    let text = r#"{"format": "remat-graph", "version": 1, "name": "c4", "nodes": [
      {"name": "f0", "phase": "forward", "compute_time": 1, "output_bytes": 100, "inputs": []},
      {"name": "f1", "phase": "forward", "compute_time": 1, "output_bytes": 100, "inputs": [0]},
      {"name": "loss", "phase": "backward", "compute_time": 1, "output_bytes": 4, "inputs": [1]},
      {"name": "b1", "phase": "backward", "compute_time": 2, "output_bytes": 100, "inputs": [0, 2]},
      {"name": "b0", "phase": "backward", "compute_time": 2, "output_bytes": 100, "inputs": [3]}]}"#;
    let path = dir.join("c4.json");
    std::fs::write(&path, text).expect("writes the graph");
    path
}

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("lists")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    names.sort();
    names
}

#[test]
fn the_same_path_for_out_and_plot_is_refused_before_planning() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let same = dir.path().join("same.svg");
    let dotted = dir.path().join(".").join("same.svg");
    let (ok, text) = remat(&[
        "plan",
        graph.to_str().expect("utf-8"),
        "--budget",
        "0.9",
        "--out",
        same.to_str().expect("utf-8"),
        "--plot",
        dotted.to_str().expect("utf-8"),
    ]);
    assert!(!ok && text.contains("same file"), "{text}");
    assert!(!text.contains("strategy "), "planned first: {text}");
    assert_eq!(listing(dir.path()), ["c4.json"], "{text}");
}

#[test]
fn bad_output_paths_are_named_before_planning() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let g = graph.to_str().expect("utf-8");
    let missing = dir.path().join("nonexistent").join("x.svg");
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).expect("mkdir");
    let trailing = format!("{}/", dir.path().join("p.json").display());
    let cases: [(&str, String, &str); 4] = [
        ("--plot", missing.display().to_string(), "does not exist"),
        ("--out", sub.display().to_string(), "is a directory"),
        ("--out", trailing.clone(), "ends with `/`"),
        ("--out", "/dev/null".to_string(), "not a regular file"),
    ];
    for (flag, path, what) in cases {
        let (ok, text) = remat(&["plan", g, "--budget", "0.9", flag, &path]);
        assert!(!ok && text.contains(what), "{path}: {text}");
        assert!(text.contains(path.trim_end_matches('/')), "{path}: {text}");
        assert!(!text.contains(".tmp:"), "names a temporary: {text}");
        assert!(!text.contains("strategy "), "planned first: {text}");
    }
    assert_eq!(listing(dir.path()), ["c4.json", "sub"]);
    assert!(listing(&sub).is_empty());
}

#[test]
fn outputs_replace_regular_files_and_leave_no_temporaries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let out = dir.path().join("p.json");
    std::fs::write(&out, "old").expect("writes");
    let svg = dir.path().join("t.svg");
    let (ok, text) = remat(&[
        "plan",
        graph.to_str().expect("utf-8"),
        "--budget",
        "1.0",
        "--out",
        out.to_str().expect("utf-8"),
        "--plot",
        svg.to_str().expect("utf-8"),
    ]);
    assert!(ok, "{text}");
    assert!(
        std::fs::read_to_string(&out)
            .expect("plan")
            .contains("steps")
    );
    assert_eq!(listing(dir.path()), ["c4.json", "p.json", "t.svg"]);
}

#[test]
fn unparsable_budgets_name_the_value() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let g = graph.to_str().expect("utf-8");
    for (budget, what) in [
        ("abc", "--budget abc: not a size"),
        ("NaN", "--budget NaN: not a size"),
        ("0.5,", "empty value"),
        ("1e-5", "0 bytes"),
        ("0.00000000001", "less than one byte"),
    ] {
        let (ok, text) = remat(&["plan", g, "--budget", budget]);
        assert!(!ok && text.contains(what), "{budget}: {text}");
        assert!(!text.contains("empty string"), "{budget}: {text}");
    }
    let (ok, text) = remat(&["plan", g, "--budget", "0.9", "--bandwidth", "0.4"]);
    assert!(!ok && text.contains("bytes per second"), "{text}");
}

#[test]
fn a_graph_of_empty_tensors_prints_no_nan() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let text = std::fs::read_to_string(&graph)
        .expect("reads")
        .replace("\"output_bytes\": 100", "\"output_bytes\": 0")
        .replace("\"output_bytes\": 4", "\"output_bytes\": 0");
    std::fs::write(&graph, text).expect("writes");
    let g = graph.to_str().expect("utf-8");
    let (ok, text) = remat(&["plan", g, "--budget", "1KiB", "--strategy", "store-all"]);
    assert!(ok && !text.contains("NaN"), "{text}");
    let (ok, text) = remat(&["plan", g, "--budget", "1KiB", "--compare"]);
    assert!(ok && !text.contains("NaN"), "{text}");
}
