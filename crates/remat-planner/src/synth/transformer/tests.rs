use super::*;

#[test]
fn node_counts_are_those_of_real_traces() {
    for layers in [1, 2, 8, 32] {
        let p = TransformerParams::gpt(layers);
        let g = transformer(&p).unwrap();
        assert_eq!(g.len(), p.node_count(), "{layers} layers");
    }
    // The exported 8- and 32-layer GPTs of the issue: 1,024 and 3,952 nodes.
    assert!((950..1100).contains(&TransformerParams::gpt(8).node_count()));
    assert!((3800..4100).contains(&TransformerParams::gpt(32).node_count()));
    let big = TransformerParams::gpt(81);
    assert!((9_500..=10_000).contains(&big.node_count()));
}

fn find(g: &Graph, name: &str) -> NodeId {
    g.nodes()
        .iter()
        .position(|n| n.name == name)
        .unwrap_or_else(|| panic!("no node {name}"))
}
fn reads(g: &Graph, node: &str, input: &str) -> bool {
    g.node(find(g, node)).inputs.contains(&find(g, input))
}

#[test]
fn backward_ops_read_what_real_ones_read() {
    let g = transformer(&TransformerParams::gpt(2)).unwrap();
    // A matmul's backward reads its input activation (through the view, its owner too)
    // and the gradient buffer it writes, not its own output.
    assert!(reads(&g, "bwd:l1.q_proj", "l1.attn_norm.flatten"));
    assert!(reads(&g, "bwd:l1.q_proj", "l1.attn_norm.scale"));
    assert!(reads(&g, "bwd:l1.q_proj", "grad:l1.q_proj.weight"));
    assert!(!reads(&g, "bwd:l1.q_proj", "l1.q_proj"));
    // Softmax and rsqrt read their output; SiLU its input; products both factors.
    assert!(reads(&g, "bwd:l0.softmax", "l0.softmax"));
    assert!(!reads(&g, "bwd:l0.softmax", "l0.causal_mask"));
    assert!(reads(&g, "bwd:l0.attn_norm.rsqrt", "l0.attn_norm.rsqrt"));
    assert!(reads(&g, "bwd:l0.silu", "l0.gate_proj"));
    assert!(reads(&g, "bwd:l0.swiglu", "l0.silu") && reads(&g, "bwd:l0.swiglu", "l0.up_proj"));
    assert!(reads(&g, "bwd:l0.scores", "l0.q.rope.add"));
    assert!(reads(&g, "bwd:l0.attn_v", "l0.softmax"));
    // The residual stream is read by the norm's square, its product and the add: its
    // gradient sums three contributions (the add's is a view of the gradient after it,
    // whose owner is read too).
    for from in [
        "bwd:l0.mlp_norm.pow",
        "bwd:l0.mlp_norm.mul",
        "bwd:l0.mlp_residual",
    ] {
        assert!(reads(&g, "grad-acc:l0.attn_residual", from), "{from}");
    }
    let acc = find(&g, "grad-acc:l0.attn_residual");
    assert_eq!(g.node(acc).inputs.len(), 4, "{:?}", g.node(acc).inputs);
    assert!(reads(&g, "grad-acc:l0.attn_norm.flatten", "bwd:l0.k_proj"));
    // The add passes its gradient through as a view: no time, no bytes.
    let pass = g.node(find(&g, "bwd:l0.attn_residual"));
    assert_eq!((pass.compute_time, pass.output_bytes), (0.0, 0));
    let end = find(&g, "end:step");
    assert_eq!(end, g.len() - 1);
    assert_eq!(g.node(end).inputs.len(), 9 * 2 + 3);
    assert!(g.node(end).inputs.iter().all(|&b| g.is_pinned(b)));
    assert!(g.is_pinned(find(&g, "tokens")));
    assert_eq!(g.pinned().count(), 9 * 2 + 3 + 1);
}

#[test]
fn sizes_and_times_follow_the_shape() {
    let p = TransformerParams::gpt(1);
    let g = transformer(&p).unwrap();
    let node = |name: &str| g.node(find(&g, name)).clone();
    let (b, s, d, h) = (8u64, 1024u64, 512u64, 8u64);
    assert_eq!(node("l0.softmax").output_bytes, b * h * s * s * 2);
    assert_eq!(node("l0.q_proj").output_bytes, b * s * d * 2);
    assert_eq!(node("l0.up_proj").output_bytes, b * s * 1408 * 2);
    assert_eq!(node("grad:l0.up_proj.weight").output_bytes, d * 1408 * 2);
    assert_eq!(node("bwd:l0.swiglu").output_bytes, 2 * b * s * 1408 * 2);
    // Views are free; matmuls are FLOP-bound, so their times scale with FLOPs.
    for view in ["l0.q.transpose", "l0.attn_norm.flatten", "l0.q.rope.slice1"] {
        assert_eq!((node(view).compute_time, node(view).output_bytes), (0.0, 0));
    }
    let ratio = node("l0.up_proj").compute_time / node("l0.q_proj").compute_time;
    assert!((ratio - 1408.0 / 512.0).abs() < 1e-9, "{ratio}");
    let back = node("bwd:l0.q_proj").compute_time / node("l0.q_proj").compute_time;
    assert!((back - 2.0).abs() < 1e-9, "{back}");
    // 2 * tokens * d * d FLOPs at 200 TFLOP/s, in microseconds.
    let expected = 2.0 * (b * s * d * d) as f64 / 200e12 * 1e6;
    assert!((node("l0.q_proj").compute_time - expected).abs() < 1e-12);
    // Elementwise ops cost their traffic: softmax reads and writes the scores.
    let traffic = 2.0 * (b * h * s * s * 2) as f64 / 1.5e12 * 1e6;
    assert!((node("l0.softmax").compute_time - traffic).abs() < 1e-9);
    // Weights plus two fp32 moments are static.
    let weights = 2 * (8192 * d) + 4 * d * d + 3 * d * 1408 + 3 * d;
    assert_eq!(g.static_bytes(), weights * 2 + weights * 8);
}

#[test]
fn deterministic_and_scaling_with_the_parameters() {
    let p = TransformerParams::gpt(4);
    let g = transformer(&p).unwrap();
    assert_eq!(g, transformer(&p).unwrap());
    assert!(g.memory_floor() < g.store_all_peak());
    // Doubling the sequence quadruples the attention scores; more layers keep more.
    let long = transformer(&TransformerParams { seq: 2048, ..p }).unwrap();
    let scores = |g: &Graph| g.node(find(g, "l0.scores")).output_bytes;
    assert_eq!(scores(&long), 4 * scores(&g));
    let deep = transformer(&TransformerParams::gpt(8)).unwrap();
    let activations = |g: &Graph| g.store_all_peak() - g.static_bytes();
    assert!(activations(&deep) > activations(&g) * 3 / 2);
    let floor = |g: &Graph| g.memory_floor() as f64 / g.store_all_peak() as f64;
    assert!(
        floor(&deep) < 0.3
            && floor(&transformer(&TransformerParams::gpt(32)).unwrap()) < floor(&deep)
    );
    assert!(deep.base_time() > g.base_time() * 3.0 / 2.0);
}

#[test]
fn bad_shapes_are_named() {
    let p = TransformerParams::gpt(2);
    let err = transformer(&TransformerParams { heads: 0, ..p }).unwrap_err();
    assert!(err.to_string().contains("`heads`"), "{err}");
    let err = transformer(&TransformerParams {
        d_model: 520,
        heads: 8,
        ..p
    })
    .unwrap_err();
    assert!(err.to_string().contains("`d_model`") && err.to_string().contains("520"));
    let err = transformer(&TransformerParams {
        flops_per_s: f64::NAN,
        ..p
    })
    .unwrap_err();
    assert!(err.to_string().contains("`flops_per_s`"), "{err}");
}
