//! Spec compilation: shipped blocks, formats, conditions, sizing, ordering and every error.

use remat_engine::spec::shipped::{QWEN3, QWEN3_MOE};
use remat_engine::spec::{
    BlockSpec, Disposition, Mode, ModelConfig, Operand, Plan, RecomputePolicy, SlotSpec, SpecError,
    Value, compile,
};

fn config(pairs: &[(&str, Value)]) -> ModelConfig {
    pairs
        .iter()
        .fold(ModelConfig::new("test"), |c, (k, v)| c.set(*k, v.clone()))
}

fn int(i: i64) -> Value {
    Value::Int(i)
}

/// A toy block: x -> a = norm(x) (recomputed) -> b = linear(a) (lora_only) -> c = swiglu(b, b).
fn toy() -> BlockSpec {
    BlockSpec::new("toy")
        .dim("N", "n")
        .dim("D", "d")
        .input("x", &["N", "D"], false)
        .param("w", &["D"], None)
        .param("proj", &["D", "D"], None)
        .param("bias", &["D"], Some("use_bias"))
        .slot(SlotSpec::new("rstd", &["N"]))
        .slot(
            SlotSpec::new("a", &["N", "D"])
                .recompute(&["@input:x", "@param:w", "rstd"])
                .op("rmsnorm_apply"),
        )
        .slot(
            SlotSpec::new("b", &["N", "D"])
                .recompute(&["a", "@param:proj", "@param:bias?"])
                .op("linear")
                .policy(RecomputePolicy::LoraOnly)
                .lora(&["up"]),
        )
        .slot(
            SlotSpec::new("c", &["N", "D"])
                .recompute(&["b", "b"])
                .op("swiglu")
                .shares_with("a"),
        )
        .slot(SlotSpec::new("out", &["N", "D"]).save(false))
        .output("out")
}

fn toy_config() -> ModelConfig {
    config(&[
        ("n", int(8)),
        ("d", int(16)),
        ("num_layers", int(3)),
        ("use_bias", Value::Bool(false)),
    ])
}

fn slot<'a>(plan: &'a Plan, layer: usize, name: &str) -> &'a remat_engine::spec::SlotPlan {
    plan.layers[layer]
        .slots
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no slot {name}"))
}

fn step_ops(plan: &Plan, layer: usize) -> Vec<String> {
    plan.layers[layer]
        .steps
        .iter()
        .map(|s| s.op.clone())
        .collect()
}

fn err(spec: &BlockSpec, config: &ModelConfig) -> String {
    let e = compile(spec, config, Mode::Full).expect_err("compilation should fail");
    e.to_string()
}

#[test]
fn toy_bytes_are_those_computed_by_hand() {
    let full = compile(&toy(), &toy_config(), Mode::Full).unwrap();
    let row = 8 * 16 * 4; // one [N, D] f32 slot
    // Full: x (input) + rstd + b (lora_only -> saved) kept; a and c rebuilt.
    assert_eq!(full.layers[0].bytes.saved, (row + 8 * 4 + row) as u64);
    assert_eq!(full.layers[0].bytes.recomputed, (2 * row) as u64);
    assert_eq!(full.layers[0].bytes.offloaded, 0);
    assert_eq!(slot(&full, 0, "b").disposition, Disposition::Saved);
    assert_eq!(slot(&full, 0, "out").disposition, Disposition::Transient);
    // a and c share one buffer (shares_with), reused by all three layers.
    assert_eq!(full.shared_buffers.len(), 1);
    assert_eq!(full.shared_buffer_bytes(), row as u64);
    assert_eq!(full.device_bytes(), 3 * (2 * row + 32) as u64 + row as u64);
    assert_eq!(step_ops(&full, 0), ["rmsnorm_apply", "swiglu"]);

    let lora = compile(&toy(), &toy_config(), Mode::Lora).unwrap();
    assert_eq!(slot(&lora, 0, "b").disposition, Disposition::Recomputed);
    assert_eq!(lora.layers[1].bytes.saved, (row + 8 * 4) as u64);
    assert_eq!(lora.layers[1].bytes.recomputed, (3 * row) as u64);
    assert_eq!(step_ops(&lora, 2), ["rmsnorm_apply", "linear", "swiglu"]);
    // The absent optional bias is dropped from the operands.
    assert_eq!(lora.layers[0].steps[1].inputs[2], Operand::Absent);
    assert_eq!(lora.layers[0].steps[1].lora_targets, ["up"]);
}

#[test]
fn offload_marks_host_bytes_and_prefetches() {
    let mut spec = toy();
    spec.inputs[0].offload = true;
    spec.slots[0] = spec.slots[0].clone().offload(true);
    let plan = compile(&spec, &toy_config(), Mode::Full).unwrap();
    for layer in &plan.layers {
        assert_eq!(layer.bytes.offloaded, (8 * 16 * 4 + 8 * 4) as u64);
        assert_eq!(
            layer.prefetch.len(),
            2,
            "layer {} prefetches x and rstd",
            layer.layer
        );
    }
    let mut both = toy();
    both.slots[1] = both.slots[1].clone().offload(true);
    assert!(err(&both, &toy_config()).contains("both `offload` and `recompute`"));
}

#[test]
fn steps_are_sorted_topologically_whatever_the_declaration_order() {
    let mut spec = toy();
    spec.slots.reverse();
    let plan = compile(&spec, &toy_config(), Mode::Lora).unwrap();
    assert_eq!(step_ops(&plan, 0), ["rmsnorm_apply", "linear", "swiglu"]);
}

#[test]
fn conditions_see_the_config_and_the_layer() {
    let mut spec = toy();
    spec.slots[3] = spec.slots[3].clone().when("layer % 2 == 0 && !use_bias");
    let plan = compile(&spec, &toy_config(), Mode::Full).unwrap();
    assert_eq!(slot(&plan, 0, "c").disposition, Disposition::Recomputed);
    assert_eq!(slot(&plan, 1, "c").disposition, Disposition::Absent);
    assert_eq!(slot(&plan, 2, "c").disposition, Disposition::Recomputed);
    assert_eq!(step_ops(&plan, 1), ["rmsnorm_apply"]);
    let with_bias = toy_config().set("use_bias", Value::Bool(true));
    let plan = compile(&spec, &with_bias, Mode::Lora).unwrap();
    assert_eq!(slot(&plan, 0, "c").disposition, Disposition::Absent);
    assert_eq!(plan.layers[0].steps[1].inputs[2], Operand::Param(2));
}

#[test]
fn alternatives_pick_the_first_present_operand() {
    let mut spec = toy();
    spec.slots[3].recompute_from = vec!["missing_one|b".into(), "b".into()];
    spec.slots
        .push(SlotSpec::new("missing_one", &["N", "D"]).when("use_bias"));
    let plan = compile(&spec, &toy_config(), Mode::Full).unwrap();
    let swiglu = plan.layers[0]
        .steps
        .iter()
        .find(|s| s.op == "swiglu")
        .unwrap();
    assert_eq!(swiglu.inputs[0], Operand::Slot(2));
}

#[test]
fn unneeded_forward_only_rebuilds_are_pruned() {
    // `a` is not read by backward (save = false): rebuilt only while `b` is.
    let mut spec = toy();
    spec.slots[1].save = false;
    let full = compile(&spec, &toy_config(), Mode::Full).unwrap();
    assert_eq!(slot(&full, 0, "a").disposition, Disposition::Transient);
    let lora = compile(&spec, &toy_config(), Mode::Lora).unwrap();
    assert_eq!(slot(&lora, 0, "a").disposition, Disposition::Recomputed);
}

#[test]
fn groups_merge_into_one_step_and_drop_absent_outputs() {
    let spec = BlockSpec::new("g")
        .dim("N", "n")
        .input("x", &["N"], false)
        .param("w", &["N"], None)
        .slot(
            SlotSpec::new("y", &["N"])
                .recompute(&["@input:x", "@param:w"])
                .op("rmsnorm")
                .attr("eps", Value::Float(1e-6))
                .group("norm", &["y", "r"]),
        )
        .slot(
            SlotSpec::new("r", &["N"])
                .recompute(&[])
                .group("norm", &[])
                .when("keep_r"),
        );
    let cfg = config(&[
        ("n", int(4)),
        ("num_layers", int(1)),
        ("keep_r", Value::Bool(true)),
    ]);
    let plan = compile(&spec, &cfg, Mode::Full).unwrap();
    assert_eq!(plan.layers[0].steps.len(), 1);
    assert_eq!(plan.layers[0].steps[0].outputs, [Some(0), Some(1)]);
    let cfg = cfg.set("keep_r", Value::Bool(false));
    let plan = compile(&spec, &cfg, Mode::Full).unwrap();
    assert_eq!(plan.layers[0].steps[0].outputs, [Some(0), None]);

    let mut conflict = spec.clone();
    conflict.slots[1].recompute_op = Some("linear".into());
    let e = err(&conflict, &cfg);
    assert!(
        e.contains("group `norm` conflicts") && e.contains("recompute_op"),
        "{e}"
    );
}

#[test]
fn toml_json_and_builder_describe_the_same_spec() {
    let toml_text = toy().to_toml().unwrap();
    let from_toml = BlockSpec::from_toml(&toml_text, "toy.toml").unwrap();
    assert_eq!(from_toml, toy());
    let json_text = toy().to_json().unwrap();
    assert_eq!(BlockSpec::from_json(&json_text, "toy.json").unwrap(), toy());
    for block in [QWEN3, QWEN3_MOE] {
        let spec = block.spec().unwrap();
        let back = BlockSpec::parse(&spec.to_json().unwrap(), "x.json").unwrap();
        assert_eq!(back, spec, "{} survives a JSON round trip", block.name);
    }
    let e = BlockSpec::from_toml(
        "name = \"t\"\n[[slots]]\nname = \"a\"\nshape = [\"N\"]\nsave = 3\n",
        "bad.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("bad.toml") && e.contains("TOML"), "{e}");
    let e = BlockSpec::from_toml(
        "name = \"t\"\n[[slots]]\nname = \"a\"\nshape = [\"N\"]\nrecompute_fro = []\n",
        "typo.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("recompute_fro"), "{e}");
}

fn shipped_plan(
    block: remat_engine::spec::shipped::ShippedBlock,
    mode: Mode,
    overrides: &[&str],
) -> Plan {
    let mut cfg = block.config().unwrap();
    for o in overrides {
        cfg.apply_override(o).unwrap();
    }
    compile(&block.spec().unwrap(), &cfg, mode).unwrap()
}

#[test]
fn shipped_dense_block_follows_qk_norm_and_bias() {
    let on = shipped_plan(QWEN3, Mode::Full, &[]);
    assert!(step_ops(&on, 0).contains(&"head_rmsnorm_apply".to_string()));
    assert_eq!(slot(&on, 0, "q_lin").disposition, Disposition::Saved);
    assert_eq!(slot(&on, 0, "h").disposition, Disposition::Offloaded);
    let off = shipped_plan(
        QWEN3,
        Mode::Lora,
        &["use_qk_norm=false", "attention_bias=true"],
    );
    assert!(!step_ops(&off, 0).contains(&"head_rmsnorm_apply".to_string()));
    assert_eq!(slot(&off, 0, "q_normed").disposition, Disposition::Absent);
    let qkv = off.layers[0]
        .steps
        .iter()
        .find(|s| s.op == "qkv_proj")
        .unwrap();
    assert!(
        qkv.inputs[4..]
            .iter()
            .all(|o| matches!(o, Operand::Param(_)))
    );
    let rope = off.layers[0].steps.iter().find(|s| s.op == "rope").unwrap();
    assert_eq!(rope.inputs[0], Operand::Slot(2), "rope falls back to q_lin");
    // LoRA rebuilds more than full fine-tuning and saves less.
    let full = shipped_plan(QWEN3, Mode::Full, &[]);
    let lora = shipped_plan(QWEN3, Mode::Lora, &[]);
    assert!(lora.saved_bytes() < full.saved_bytes());
    assert!(lora.recomputed_bytes() > full.recomputed_bytes());
}

#[test]
fn shipped_moe_block_compiles_with_and_without_shared_expert() {
    for mode in [Mode::Full, Mode::Lora] {
        let plain = shipped_plan(QWEN3_MOE, mode, &[]);
        assert_eq!(
            slot(&plain, 0, "shared_act").disposition,
            Disposition::Absent
        );
        let shared = shipped_plan(QWEN3_MOE, mode, &["shared_expert_intermediate_size=64"]);
        assert_ne!(
            slot(&shared, 0, "shared_act").disposition,
            Disposition::Absent
        );
        assert_eq!(slot(&shared, 0, "topk_experts").bytes, 4 * 64 * 2 * 4);
    }
}

#[test]
fn errors_name_the_slot_and_the_cause() {
    let cfg = toy_config();
    let with = |edit: &dyn Fn(&mut BlockSpec)| {
        let mut s = toy();
        edit(&mut s);
        err(&s, &cfg)
    };
    let e = with(&|s| s.slots[2].recompute_from[0] = "nope".into());
    assert!(
        e.contains("slot `b`") && e.contains("unknown slot `nope`"),
        "{e}"
    );
    let e = with(&|s| s.slots[2].recompute_from[1] = "@param:nope".into());
    assert!(
        e.contains("slot `b`") && e.contains("unknown parameter `@param:nope`"),
        "{e}"
    );
    let e = with(&|s| s.slots[1].recompute_from[0] = "@input:y".into());
    assert!(e.contains("unknown block input `@input:y`"), "{e}");
    let e = with(&|s| s.slots[1].recompute_from[0] = "@weird:y".into());
    assert!(e.contains("bad reference `@weird:y`"), "{e}");
    let e = with(&|s| s.slots[1].recompute_op = Some("conv".into()));
    assert!(
        e.contains("slot `a`") && e.contains("unknown recompute op `conv`"),
        "{e}"
    );
    let e = with(&|s| s.slots[1].recompute_from.pop().map(|_| ()).unwrap_or(()));
    assert!(e.contains("op `rmsnorm_apply` takes operands"), "{e}");
    let e = with(&|s| s.slots[2].when = Some("use_bias &&".into()));
    assert!(
        e.contains("slot `b`") && e.contains("bad condition `use_bias &&`"),
        "{e}"
    );
    let e = with(&|s| s.slots[2].when = Some("no_such_key".into()));
    assert!(e.contains("unknown identifier `no_such_key`"), "{e}");
    let e = with(&|s| s.slots.push(SlotSpec::new("a", &["N"])));
    assert!(e.contains("slot `a` is declared twice"), "{e}");
    let e = with(&|s| s.slots[3].aliases.push("b".into()));
    assert!(e.contains("name `b`"), "{e}");
    let e = with(&|s| s.slots[2].lora_targets = vec!["qkv".into()]);
    assert!(e.contains("LoRA target `qkv`"), "{e}");
    let e = with(&|s| s.slots[0].shape = vec!["N*Q".into()]);
    assert!(e.contains("slot `rstd`") && e.contains("`Q`"), "{e}");
    let e = with(&|s| s.slots[3].shares_with = Some("ghost".into()));
    assert!(e.contains("unknown slot `ghost` in shares_with"), "{e}");
    let lora_err = |spec_edit: &dyn Fn(&mut BlockSpec)| {
        let mut s = toy();
        spec_edit(&mut s);
        compile(&s, &cfg, Mode::Lora).unwrap_err().to_string()
    };
    // Cycle (b is rebuilt only under LoRA): a needs c, c needs b, b needs a.
    let e = lora_err(&|s| s.slots[1].recompute_from[2] = "c".into());
    assert!(e.contains("recompute cycle"), "{e}");
    assert!(
        ["a -> b -> c", "b -> c -> a", "c -> a -> b"]
            .iter()
            .any(|c| e.contains(c)),
        "{e}"
    );
    // The same cycle is an error under full fine-tuning too, where `b` is saved.
    let mut cyclic = toy();
    cyclic.slots[1].recompute_from[2] = "c".into();
    let e = compile(&cyclic, &cfg, Mode::Full).unwrap_err().to_string();
    assert!(e.contains("recompute cycle"), "{e}");
    // Two producers: `b` also listed as an output of `c`'s op.
    let e = with(&|s| {
        s.slots[3] = SlotSpec::new("c", &["N", "D"])
            .recompute(&["a", "@param:w"])
            .op("rmsnorm")
            .attr("eps", Value::Float(1e-6));
        s.slots[3].recompute_outputs = vec!["c".into(), "b".into()];
    });
    assert!(e.contains("slot `b` has two producers"), "{e}");
    // Missing required dependency: an absent parameter without `?`...
    let e = lora_err(&|s| s.slots[2].recompute_from[2] = "@param:bias".into());
    assert!(
        e.contains("slot `b` needs `@param:bias`") && e.contains("absent"),
        "{e}"
    );
    // ...and a forward-only slot.
    let e = with(&|s| s.slots[3].recompute_from[1] = "out".into());
    assert!(
        e.contains("slot `c` needs `out`") && e.contains("neither saved"),
        "{e}"
    );
    let e = err(&toy(), &config(&[("n", int(8))]));
    assert!(e.contains("layer count"), "{e}");
}

#[test]
fn compile_errors_are_typed() {
    let mut s = toy();
    s.slots[1].recompute_op = Some("conv".into());
    assert!(matches!(
        compile(&s, &toy_config(), Mode::Full),
        Err(SpecError::UnknownOp { .. })
    ));
}

/// A Hugging Face config.json has no batch or sequence length: the error says how to add them.
#[test]
fn a_config_without_batch_says_how_to_set_it() {
    let spec = remat_engine::spec::shipped::QWEN3.spec().unwrap();
    let hf = ModelConfig::parse(
        r#"{"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64}"#,
        "config.json",
    )
    .unwrap();
    let e = compile(&spec, &hf, Mode::Full).unwrap_err().to_string();
    assert!(e.contains("--set batch=N --set seq_len=N"), "{e}");
}
