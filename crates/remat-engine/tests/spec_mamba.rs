//! The Mamba block through its spec: every plan (the shipped one, one that recomputes every
//! slot it can, keep-all) gives the same gradients bit for bit in full and LoRA modes, and
//! the meter's saved / shared / host bytes are the plan's predictions.

use remat_engine::core::swap::HostStore;
use remat_engine::spec::models::mamba::{Mamba, MambaDims, MambaGrads};
use remat_engine::spec::models::{StepEnv, StepStats};
use remat_engine::spec::run::lora::LoraConfig;
use remat_engine::spec::run::meter::Meter;
use remat_engine::spec::shipped::MAMBA;
use remat_engine::spec::types::RecomputePolicy;
use remat_engine::spec::{BlockSpec, Mode, ModelConfig, Plan, Value, compile};

fn config(overrides: &[&str]) -> ModelConfig {
    let mut c = ModelConfig::new("test")
        .set("vocab_size", Value::Int(40))
        .set("hidden_size", Value::Int(16))
        .set("intermediate_size", Value::Int(32))
        .set("expand", Value::Int(2))
        .set("state_size", Value::Int(4))
        .set("conv_kernel", Value::Int(3))
        .set("time_step_rank", Value::Int(2))
        .set("num_hidden_layers", Value::Int(3))
        .set("scan_chunk", Value::Int(3))
        .set("batch", Value::Int(2))
        .set("seq_len", Value::Int(8));
    for o in overrides {
        c.apply_override(o).unwrap();
    }
    c
}

fn lora() -> LoraConfig {
    LoraConfig {
        rank: 3,
        alpha: 6.0,
        dropout: 0.1,
        targets: ["in", "x", "out"].map(String::from).to_vec(),
        seed: 5,
    }
}

fn run(model: &Mamba, plan: &Plan) -> (MambaGrads, StepStats) {
    let t: Vec<u32> = (0..16u32).map(|i| (i * 7 + 3) % 40).collect();
    let y: Vec<u32> = (0..16u32).map(|i| (i * 5 + 1) % 40).collect();
    let host = HostStore::in_memory();
    let meter = Meter::unbounded();
    let env = StepEnv {
        host: &host,
        meter: &meter,
        step: 3,
    };
    model.step(plan, &t, &y, env).unwrap()
}

/// The shipped spec with every `lora_only` slot made `always`: full mode then rebuilds
/// everything but the chunk states' inputs' roots.
fn recompute_most(spec: &BlockSpec) -> BlockSpec {
    let mut s = spec.clone();
    for slot in &mut s.slots {
        if slot.recompute_policy == RecomputePolicy::LoraOnly {
            slot.recompute_policy = RecomputePolicy::Always;
        }
    }
    s.name = "mamba".into();
    s
}

fn assert_exact(mode: Mode, overrides: &[&str]) {
    let cfg = config(overrides);
    let mut model = Mamba::new(&cfg, 11).unwrap();
    if mode == Mode::Lora {
        model = model.with_lora(lora(), true).unwrap();
    }
    let spec = MAMBA.spec().unwrap();
    let reference = compile(&spec.save_everything(), &cfg, mode).unwrap();
    let (g_ref, s_ref) = run(&model, &reference);
    assert_eq!(s_ref.recomputed_ops, 0);
    assert!(!g_ref.named().is_empty());
    for (what, spec) in [
        ("shipped", spec.clone()),
        ("recompute-most", recompute_most(&spec)),
    ] {
        let plan = compile(&spec, &cfg, mode).unwrap();
        let (g, s) = run(&model, &plan);
        assert_eq!(s.loss.to_bits(), s_ref.loss.to_bits(), "{what}");
        assert!(s.recomputed_ops > 0, "{what}: recomputed nothing");
        let diff = g.bit_diff(&g_ref);
        assert!(
            diff.is_empty(),
            "{what} {mode:?} {overrides:?}: gradients differ in {diff:?}"
        );
        assert!(s.activations.peak < s_ref.activations.peak, "{what}");
        assert_eq!(s.activations.saved_peak, plan.saved_bytes(), "{what}");
        assert_eq!(
            s.activations.shared_peak,
            plan.shared_buffer_bytes(),
            "{what}"
        );
        assert_eq!(s.host_peak, plan.offloaded_bytes(), "{what}");
    }
    assert_eq!(s_ref.activations.saved_peak, reference.saved_bytes());
}

#[test]
fn full_steps_equal_keep_all() {
    assert_exact(Mode::Full, &[]);
    assert_exact(
        Mode::Full,
        &["use_bias=true", "use_conv_bias=false", "scan_chunk=8"],
    );
}

#[test]
fn lora_steps_equal_keep_all() {
    assert_exact(Mode::Lora, &[]);
    assert_exact(Mode::Lora, &["scan_chunk=1"]);
}

/// Full mode trains every weight; LoRA mode the adapters only, which change the loss.
#[test]
fn gradients_cover_every_weight_and_adapters_change_the_loss() {
    let cfg = config(&[]);
    let model = Mamba::new(&cfg, 2).unwrap();
    let spec = MAMBA.spec().unwrap();
    let (g, s) = run(&model, &compile(&spec, &cfg, Mode::Full).unwrap());
    for (l, layer) in g.layers.iter().enumerate() {
        for name in model.layers[l].keys() {
            let grad = layer
                .get(name)
                .unwrap_or_else(|| panic!("no gradient of {name}"));
            assert!(grad.iter().any(|v| *v != 0.0), "layer {l} {name}: all zero");
        }
    }
    let lora_model = model.clone().with_lora(lora(), true).unwrap();
    let (gl, sl) = run(&lora_model, &compile(&spec, &cfg, Mode::Lora).unwrap());
    assert!(gl.layers.iter().all(|l| l.is_empty()));
    assert_eq!(gl.adapters[0].len(), 3);
    assert_ne!(s.loss.to_bits(), sl.loss.to_bits());
}

/// A config whose sizes disagree is an error naming the keys, before anything is built.
#[test]
fn inconsistent_configs_name_the_field() {
    for (set, key) in [
        ("intermediate_size=30", "intermediate_size"),
        ("state_size=0", "state_size"),
        ("conv_kernel=0", "conv_kernel"),
        ("scan_chunk=0", "scan_chunk"),
        ("d_state=8", "d_state"),
        ("d_conv=5", "d_conv"),
        ("layer_norm_epsilon=-1", "layer_norm_epsilon"),
        ("time_step_rank=\"auto\"", "time_step_rank"),
    ] {
        let err = MambaDims::from_config(&config(&[set]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{set}: {err}");
    }
    // A spec compiled for another block is refused by the model.
    let cfg = config(&[]);
    let model = Mamba::new(&cfg, 0).unwrap();
    let mut spec = MAMBA.spec().unwrap();
    spec.name = "qwen3".into();
    let plan = compile(&spec, &cfg, Mode::Full).unwrap();
    let err = model.check_plan(&plan).unwrap_err().to_string();
    assert!(err.contains("qwen3"), "{err}");
}

#[test]
fn the_shipped_config_builds() {
    let cfg = MAMBA.config().unwrap().set("vocab_size", Value::Int(10));
    let dims = MambaDims::from_config(&cfg).unwrap();
    assert_eq!(dims.inner, 2 * dims.hidden);
    let plan = compile(&MAMBA.spec().unwrap(), &cfg, Mode::Full).unwrap();
    let states = plan.layers[0]
        .slots
        .iter()
        .find(|s| s.name == "scan_states")
        .unwrap();
    // [B, T/L, Di, N]: 4 x 64/16 x 256 x 16.
    assert_eq!(states.shape, vec![4, 4, 256, 16]);
}

/// `remat spec derive` on the recorded block: a spec replaying every op, which trains to
/// keep-all's gradients bit for bit.
#[test]
fn the_derived_spec_recomputes_everything_exactly() {
    let cfg = config(&[]);
    let model = Mamba::new(&cfg, 4).unwrap();
    let spec = MAMBA.spec().unwrap();
    let derived = model
        .derive_spec(&compile(&spec, &cfg, Mode::Full).unwrap())
        .unwrap();
    assert_eq!(derived.name, "mamba-derived");
    let derived = BlockSpec::parse(&derived.to_toml().unwrap(), "derived.toml").unwrap();
    let plan = compile(&derived, &cfg, Mode::Full).unwrap();
    let (g, s) = run(&model, &plan);
    let (g_ref, _) = run(
        &model,
        &compile(&spec.save_everything(), &cfg, Mode::Full).unwrap(),
    );
    assert!(s.recomputed_ops > 0);
    assert!(g.bit_diff(&g_ref).is_empty());
}

/// A spec that drops a slot the Mamba backward reads is refused before the step runs,
/// naming the layer, the slot and the spec; so is one whose parameter shape differs.
#[test]
fn a_spec_missing_what_backward_reads_is_refused() {
    let cfg = config(&[]);
    let model = Mamba::new(&cfg, 3).unwrap();
    let mut spec = MAMBA.spec().unwrap();
    spec.slots.retain(|s| s.name != "gated");
    let plan = compile(&spec, &cfg, Mode::Full).unwrap();
    let e = model.check_plan(&plan).unwrap_err().to_string();
    assert!(
        e.contains("layer 0") && e.contains("slot `gated`") && e.contains("`mamba`"),
        "{e}"
    );
    let wider = config(&["expand=3", "intermediate_size=48"]);
    let plan = compile(&MAMBA.spec().unwrap(), &wider, Mode::Full).unwrap();
    let e = model.check_plan(&plan).unwrap_err().to_string();
    assert!(e.contains("layer 0: parameter `in_proj`"), "{e}");
}
