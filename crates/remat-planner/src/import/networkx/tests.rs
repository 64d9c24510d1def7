use crate::import::{ImportOptions, parse};

const TRAIN: &str = r#"{"directed": true, "multigraph": false, "graph": {"name": "tiny"},
  "nodes": [
    {"name": "c1", "backward": false, "cost_cpu": 3, "cost_ram": 100, "id": 0},
    {"name": "Loss", "backward": true, "cost_cpu": 1, "cost_ram": 4, "id": 1},
    {"name": "c1_backward", "backward": true, "cost_cpu": 6, "cost_ram": 100, "id": 2}],
  "links": [{"source": 0, "target": 1}, {"source": 0, "target": 2}, {"source": 1, "target": 2}]}"#;

#[test]
fn training_schema() {
    let g = parse("t.json", TRAIN, ImportOptions::default()).unwrap();
    assert_eq!(g.name(), "tiny");
    assert_eq!(g.node(2).inputs, vec![0, 1]);
    assert!(g.has_backward());
    assert_eq!(g.time_unit_s(), 1e-6);
}

#[test]
fn layered_schema_is_sorted_topologically() {
    let text = r#"{"directed": true, "graph": {}, "nodes": [
        {"name": 0, "duration": 1, "out_cost": 5, "param_cost": 7},
        {"name": 1, "duration": 2, "out_cost": 6, "param_cost": 0},
        {"name": 2, "duration": 3, "out_cost": 7, "param_cost": 0}],
      "links": [{"0": 0, "1": 2}, {"0": 2, "1": 1}]}"#;
    let g = parse("r.json", text, ImportOptions::default()).unwrap();
    let names: Vec<_> = g.nodes().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["0", "2", "1"]);
    assert_eq!(g.static_bytes(), 7);
    let cyclic = text.replace(r#"{"0": 0, "1": 2}"#, r#"{"0": 1, "1": 2}"#);
    let err = parse("r.json", &cyclic, ImportOptions::default()).unwrap_err();
    assert!(err.to_string().contains("cycle"), "{err}");
}

/// Moccasin's layered files: node 1 is the sink, and `graph.order` is the schedule.
const LAYERED: &str = r#"{"directed": true, "graph": {"order": [0, 3, 2, 1]}, "nodes": [
    {"name": 0, "duration": 0, "out_cost": 5, "param_cost": 0},
    {"name": 1, "duration": 0, "out_cost": 6, "param_cost": 0},
    {"name": 2, "duration": 3, "out_cost": 7, "param_cost": 0},
    {"name": 3, "duration": 4, "out_cost": 8, "param_cost": 0}],
  "links": [{"0": 0, "1": 2}, {"0": 0, "1": 3}, {"0": 2, "1": 1}, {"0": 3, "1": 1}]}"#;

#[test]
fn layered_schema_follows_the_stated_order() {
    let g = parse("o.json", LAYERED, ImportOptions::default()).unwrap();
    let names: Vec<_> = g.nodes().iter().map(|n| n.name.as_str()).collect();
    // Kahn's smallest key first would give 0, 2, 3, 1.
    assert_eq!(names, ["0", "3", "2", "1"]);
    assert_eq!(g.node(3).inputs, vec![1, 2]);
    let unordered = LAYERED.replace(r#""order": [0, 3, 2, 1]"#, r#""name": "x""#);
    let g = parse("o.json", &unordered, ImportOptions::default()).unwrap();
    let names: Vec<_> = g.nodes().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["0", "2", "3", "1"]);
    let cases = [
        ("[0, 3, 1, 2]", "node 2 `2`", "not topological"),
        ("[0, 3, 2]", "leaves out node 1", "3 of 4"),
        ("[0, 3, 3, 2, 1]", "node 3 twice", "entries 1 and 2"),
        ("[0, 3, 2, 9]", "entry 3 names node 9", "does not exist"),
        ("\"0 3 2 1\"", "graph.order", "not an array"),
    ];
    for (order, who, what) in cases {
        let text = LAYERED.replace("[0, 3, 2, 1]", order);
        let err = parse("o.json", &text, ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("o.json") && err.contains(who) && err.contains(what),
            "{order}: {err}"
        );
    }
}

#[test]
fn links_may_be_called_edges_as_networkx_3_4_writes_them() {
    let edges = TRAIN.replace("\"links\"", "\"edges\"");
    let g = parse("t.json", &edges, ImportOptions::default()).unwrap();
    assert_eq!(g.node(2).inputs, vec![0, 1]);
    let both = TRAIN.replace("\"links\"", "\"edges\": [], \"links\"");
    let err = parse("t.json", &both, ImportOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("both `links` and `edges`"),
        "{err}"
    );
    let neither = TRAIN.replace("\"links\"", "\"arcs\"");
    let err = parse("t.json", &neither, ImportOptions::default()).unwrap_err();
    assert!(err.to_string().contains("\"links\" or \"edges\""), "{err}");
    let not_array = TRAIN.replace("\"links\": [", "\"edges\": 3, \"unused\": [");
    let err = parse("t.json", &not_array, ImportOptions::default()).unwrap_err();
    assert!(err.to_string().contains("`edges` is not an array"), "{err}");
}

#[test]
fn an_undirected_graph_is_refused() {
    let undirected = TRAIN.replace("\"directed\": true", "\"directed\": false");
    let err = parse("t.json", &undirected, ImportOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("t.json") && err.to_string().contains("undirected"),
        "{err}"
    );
}

#[test]
fn parameter_bytes_past_u64_max_name_the_node_and_field() {
    let text = r#"{"directed": true, "graph": {}, "nodes": [
        {"name": 0, "duration": 1, "out_cost": 5, "param_cost": 9223372036854775808},
        {"name": 1, "duration": 2, "out_cost": 6, "param_cost": 9223372036854775808},
        {"name": 2, "duration": 3, "out_cost": 7, "param_cost": 100}],
      "links": [{"0": 0, "1": 1}, {"0": 1, "1": 2}]}"#;
    let err = parse("big.json", text, ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("big.json") && err.contains("node 1") && err.contains("param_cost"),
        "{err}"
    );
}

#[test]
fn a_cycle_in_a_training_graph_is_named_before_the_order() {
    // 1 -> 2 exists; adding 2 -> 1 closes the cycle Loss -> c1_backward -> Loss.
    let cyclic = TRAIN.replace(
        r#"{"source": 0, "target": 2}"#,
        r#"{"source": 0, "target": 2}, {"source": 2, "target": 1}"#,
    );
    let err = parse("c.json", &cyclic, ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("cycle"), "{err}");
    assert!(err.contains("Loss") && err.contains("c1_backward"), "{err}");
    assert!(!err.contains("c1`"), "c1 is not on the cycle: {err}");
}

#[test]
fn string_ids_use_the_file_order_when_unambiguous() {
    let named = TRAIN
        .replace(r#""id": 0"#, r#""id": "a""#)
        .replace(r#""id": 1"#, r#""id": "b""#)
        .replace(r#""id": 2"#, r#""id": "c""#)
        .replace(r#""source": 0"#, r#""source": "a""#)
        .replace(r#""source": 1"#, r#""source": "b""#)
        .replace(r#""target": 1"#, r#""target": "b""#)
        .replace(r#""target": 2"#, r#""target": "c""#);
    let g = parse("s.json", &named, ImportOptions::default()).unwrap();
    assert_eq!(g.node(2).name, "c1_backward");
    assert_eq!(g.node(2).inputs, vec![0, 1]);
    // A mix of integer and string ids is ambiguous.
    let mixed = TRAIN
        .replace(r#""id": 2"#, r#""id": "c""#)
        .replace(r#""target": 2"#, r#""target": "c""#);
    let err = parse("m.json", &mixed, ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("c1_backward") && err.contains("integer"),
        "{err}"
    );
}

#[test]
fn errors_name_node_and_field() {
    let cases = [
        (
            r#""cost_cpu": 6"#,
            r#""cost_cpu": -6"#,
            "c1_backward",
            "cost_cpu",
        ),
        (
            r#"{"source": 1, "target": 2}"#,
            r#"{"source": 1, "target": 9}"#,
            "link 2",
            "9",
        ),
        (
            r#"{"source": 1, "target": 2}"#,
            r#"{"source": 2, "target": 1}"#,
            "Loss",
            "not topological",
        ),
        (r#""cost_ram": 4,"#, "", "Loss", "cost_ram"),
        // Schema chosen per file: a node without `cost_cpu` is told `cost_cpu`, not
        // the layered schema's `duration`.
        (r#""cost_cpu": 3, "#, "", "c1", "field `cost_cpu`: missing"),
    ];
    for (from, to, who, what) in cases {
        let err = parse(
            "bad.json",
            &TRAIN.replace(from, to),
            ImportOptions::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("bad.json") && err.contains(who) && err.contains(what),
            "{err}"
        );
    }
}
