//! `remat plan` end to end on a small graph in remat's schema.

mod common;
use common::remat_text as remat;

use std::path::{Path, PathBuf};

/// An 8-layer training chain, 1 MiB activations, written in remat's JSON schema.
fn write_graph(dir: &Path) -> PathBuf {
    common::write_chain(dir, "mlp8", 8, 10, 0)
}

#[test]
fn plans_writes_a_valid_plan_and_plots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let out = dir.path().join("plan.json");
    let svg = dir.path().join("t.svg");
    let png = dir.path().join("t.png");
    let g = graph.to_str().expect("utf-8 path");
    let (ok, text) = remat(&[
        "plan",
        g,
        "--budget",
        "0.7",
        "--strategy",
        "mutwo",
        "--out",
        out.to_str().expect("utf-8 path"),
        "--plot",
        svg.to_str().expect("utf-8 path"),
    ]);
    assert!(ok, "{text}");
    assert!(
        text.contains("time overhead") && text.contains("recomputed"),
        "{text}"
    );
    let plan = remat_planner::Plan::from_json(&std::fs::read_to_string(&out).expect("plan"))
        .expect("plan parses");
    let graph_ir = remat_planner::import::load(&graph, Default::default()).expect("graph");
    let report = remat_planner::simulate(&graph_ir, &plan).expect("plan validates");
    assert!(report.peak_bytes <= plan.budget_bytes);
    assert!(report.recompute_time > 0.0);
    assert!(
        std::fs::read_to_string(&svg)
            .expect("svg")
            .contains("<polyline")
    );
    let (ok, text) = remat(&[
        "plan",
        g,
        "--budget",
        "0.7",
        "--plot",
        png.to_str().expect("utf-8"),
    ]);
    assert!(ok, "{text}");
    assert_eq!(&std::fs::read(&png).expect("png")[1..4], b"PNG");
}

#[test]
fn compare_prints_one_row_per_strategy_and_budget() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let g = graph.to_str().expect("utf-8 path");
    let (ok, text) = remat(&["plan", g, "--budget", "0.9,6MiB", "--compare"]);
    assert!(ok, "{text}");
    for name in ["store-all", "sqrt", "chen-greedy", "mutwo"] {
        assert_eq!(
            text.matches(&format!("| {name} ")).count(),
            2,
            "{name}: {text}"
        );
    }
}

#[test]
fn a_budget_under_the_floor_names_the_floor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    // The floor: a backward op's output plus its two 1 MiB inputs, 3 MiB.
    let (ok, text) = remat(&["plan", graph.to_str().expect("utf-8"), "--budget", "1MiB"]);
    assert!(!ok);
    assert!(
        text.contains("budget 1.00 MiB is below the graph's memory floor 3.00 MiB"),
        "{text}"
    );
}

#[test]
fn the_default_prints_a_bound_the_gap_and_the_order_under_a_time_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let g = graph.to_str().expect("utf-8");
    let (ok, text) = remat(&["plan", g, "--budget", "0.6", "--time-limit", "0.5"]);
    assert!(ok, "{text}");
    assert!(
        text.contains("lower bound") && text.contains("slower than the optimum"),
        "{text}"
    );
    assert!(text.contains("order         "), "{text}");
    let (ok, text) = remat(&["plan", g, "--budget", "0.6", "--time-limit", "0"]);
    assert!(!ok && text.contains("--time-limit 0"), "{text}");
    let (ok, text) = remat(&[
        "plan",
        g,
        "--budget",
        "0.6",
        "--strategy",
        "anytime",
        "--time-limit",
        "0.2",
    ]);
    assert!(ok && text.contains("strategy      "), "{text}");
}

#[test]
fn bad_graph_names_the_node_and_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let text = std::fs::read_to_string(&graph).expect("graph").replacen(
        "\"compute_time\": 20",
        "\"compute_time\": -20",
        1,
    );
    std::fs::write(&graph, text).expect("rewrites the graph");
    let (ok, text) = remat(&["plan", graph.to_str().expect("utf-8"), "--budget", "0.7"]);
    assert!(!ok);
    assert!(
        text.contains("fc7_backward") && text.contains("compute_time"),
        "{text}"
    );
}

#[test]
fn a_bad_plot_name_writes_no_plan_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let out = dir.path().join("p.json");
    let (ok, text) = remat(&[
        "plan",
        graph.to_str().expect("utf-8"),
        "--budget",
        "0.7",
        "--out",
        out.to_str().expect("utf-8"),
        "--plot",
        dir.path().join("x.jpg").to_str().expect("utf-8"),
    ]);
    assert!(
        !ok && text.contains("x.jpg") && text.contains(".svg or .png"),
        "{text}"
    );
    assert!(!out.exists(), "partial output: {text}");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .expect("lists")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn compare_refuses_flags_it_would_ignore() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let g = graph.to_str().expect("utf-8");
    for extra in [
        ["--strategy", "mutwo"],
        ["--out", "p.json"],
        ["--plot", "t.svg"],
    ] {
        let mut args = vec!["plan", g, "--budget", "0.7", "--compare"];
        args.extend(extra);
        let (ok, text) = remat(&args);
        assert!(!ok && text.contains(extra[0]), "{extra:?}: {text}");
    }
}

#[test]
fn compare_marks_strategies_without_a_plan_as_na_with_a_footnote() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    // 3 MiB is above the floor (2 MiB + the loss) but below what store-all needs.
    let (ok, text) = remat(&[
        "plan",
        graph.to_str().expect("utf-8"),
        "--budget",
        "3MiB",
        "--compare",
    ]);
    assert!(ok, "{text}");
    let store_all = text
        .lines()
        .find(|l| l.contains("| store-all "))
        .expect("a store-all row");
    assert!(store_all.contains("n/a [1]"), "{store_all}");
    assert!(
        text.contains("[1] store-all: over budget: its smallest peak is"),
        "{text}"
    );
}

#[test]
fn budgets_and_bandwidths_take_scientific_notation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_graph(dir.path());
    let (ok, text) = remat(&[
        "plan",
        graph.to_str().expect("utf-8"),
        "--budget",
        "1e8",
        "--bandwidth",
        "1e9",
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("budget 95.37 MiB"), "{text}");
}

#[test]
fn a_directory_of_graphs_is_refused_with_its_graph_files_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_graph(dir.path());
    std::fs::write(dir.path().join("notes.txt"), "not a graph").expect("writes");
    let d = dir.path().to_str().expect("utf-8 path");
    let (ok, text) = remat(&["plan", d, "--budget", "0.7"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("is a directory, not a graph file")
            && text.contains("mlp8.json")
            && !text.contains("notes.txt"),
        "{text}"
    );
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    let (ok, text) = remat(&["plan", empty.to_str().expect("utf-8"), "--budget", "0.7"]);
    assert!(
        !ok && text.contains("is a directory") && !text.contains("pass one"),
        "{text}"
    );
}

/// `a` (pinned, 10 B) is read by `b` and by `d`, three operations later: without swaps it
/// stays on the device across `c` (20 B, from `b`, 20 B), so the recompute floor is 50 B
/// against today's 40 B.
fn write_pinned_graph(dir: &Path) -> PathBuf {
    let path = dir.join("pinned.json");
    let text = r#"{"format": "remat-graph", "version": 1, "name": "pinned", "static_bytes": 0, "time_unit_s": 1e-6, "nodes": [
        {"name": "a", "phase": "forward", "compute_time": 1, "output_bytes": 10, "inputs": [], "pinned": true},
        {"name": "b", "phase": "forward", "compute_time": 1, "output_bytes": 20, "inputs": [0]},
        {"name": "c", "phase": "forward", "compute_time": 1, "output_bytes": 20, "inputs": [1]},
        {"name": "d", "phase": "backward", "compute_time": 1, "output_bytes": 1, "inputs": [2, 0]}
    ]}"#;
    std::fs::write(&path, text).expect("write graph");
    path
}

#[test]
fn recompute_only_refuses_a_budget_under_the_recompute_floor_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_pinned_graph(dir.path());
    let g = graph.to_str().expect("utf-8 path");
    let (ok, text) = remat(&["plan", g, "--budget", "45", "--recompute-only"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("floor 40 B, recompute floor 50 B (exact)"),
        "{text}"
    );
    assert!(
        text.contains("budget 45 B is below the graph's recompute floor 50 B"),
        "{text}"
    );
    // Swaps allowed: not refused up front, with a note that every plan there swaps.
    let (_, text) = remat(&["plan", g, "--budget", "45"]);
    assert!(text.contains("below the recompute floor 50 B"), "{text}");
    assert!(!text.contains("is below the graph's"), "{text}");
    // At the recompute floor a plan without swaps is found.
    let (ok, text) = remat(&["plan", g, "--budget", "50", "--recompute-only"]);
    assert!(ok, "{text}");
    assert!(text.contains("swapped 0 B"), "{text}");
}

/// `x` (50 B) is held across `z` (100 B) by its forward reader `w`: the eager floor (at `z`,
/// 160 B) is above the memory floor (at the loss, 111 B).
fn write_training_graph(dir: &Path) -> PathBuf {
    let path = dir.join("skip.json");
    let text = r#"{"format": "remat-graph", "version": 1, "name": "skip", "static_bytes": 0, "time_unit_s": 1e-6, "nodes": [
        {"name": "x", "phase": "forward", "compute_time": 1, "output_bytes": 50, "inputs": []},
        {"name": "y", "phase": "forward", "compute_time": 1, "output_bytes": 10, "inputs": []},
        {"name": "z", "phase": "forward", "compute_time": 1, "output_bytes": 100, "inputs": [1]},
        {"name": "w", "phase": "forward", "compute_time": 1, "output_bytes": 10, "inputs": [0]},
        {"name": "loss", "phase": "backward", "compute_time": 1, "output_bytes": 1, "inputs": [2, 3]},
        {"name": "gx", "phase": "backward", "compute_time": 1, "output_bytes": 5, "inputs": [0, 4]}
    ]}"#;
    std::fs::write(&path, text).expect("write graph");
    path
}

#[test]
fn order_eager_plans_in_the_eager_form_and_refuses_under_its_floor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let graph = write_training_graph(dir.path());
    let g = graph.to_str().expect("utf-8 path");
    let out = dir.path().join("plan.json");
    let o = out.to_str().expect("utf-8 path");
    let (ok, text) = remat(&[
        "plan",
        g,
        "--budget",
        "160",
        "--order",
        "eager",
        "--bandwidth",
        "1e3",
        "--out",
        o,
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("eager floor 160 B"), "{text}");
    assert!(text.contains("order         eager:"), "{text}");
    let plan = remat_planner::Plan::from_json(&std::fs::read_to_string(&out).expect("plan"))
        .expect("plan parses");
    assert_eq!(plan.order, remat_planner::PlanOrder::Eager);
    // The plan checks as eager against the graph as the file states it (the plan says
    // its order; the simulator checks the form's rules for it).
    let graph_ir = remat_planner::import::load(&graph, Default::default()).expect("graph");
    let report = remat_planner::simulate(&graph_ir, &plan).expect("an eager plan");
    assert!(report.peak_bytes <= 160);
    remat_planner::eager::check(&graph_ir, &plan.steps).expect("eager");
    // Under the eager floor (but above the memory floor): refused, naming it.
    let (ok, text) = remat(&["plan", g, "--budget", "150", "--order", "eager"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("below the graph's eager floor 160 B"),
        "{text}"
    );
    // The same budget in node order plans.
    let (ok, text) = remat(&["plan", g, "--budget", "150", "--order", "node"]);
    assert!(ok, "{text}");
    assert!(!text.contains("eager"), "{text}");
    let (ok, text) = remat(&["plan", g, "--budget", "160", "--order", "zigzag"]);
    assert!(
        !ok && text.contains("--order zigzag") && text.contains("eager"),
        "{text}"
    );
}
