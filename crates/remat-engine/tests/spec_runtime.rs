//! Spec-driven training steps: recompute, offload and LoRA give the gradients of keeping
//! everything, bit for bit; recompute ops equal the forward's values bit for bit.

use std::sync::Arc;

use remat_engine::core::swap::HostStore;
use remat_engine::spec::models::StepEnv;
use remat_engine::spec::models::qwen3::{BlockKind, Qwen3};
use remat_engine::spec::run::lora::LoraConfig;
use remat_engine::spec::run::meter::Meter;
use remat_engine::spec::shipped::{QWEN3, QWEN3_MOE};
use remat_engine::spec::{BlockSpec, Mode, ModelConfig, Plan, Value, compile};

fn config(kind: BlockKind, overrides: &[&str]) -> ModelConfig {
    let mut c = ModelConfig::new("test")
        .set("vocab_size", Value::Int(48))
        .set("hidden_size", Value::Int(32))
        .set("num_attention_heads", Value::Int(4))
        .set("num_key_value_heads", Value::Int(2))
        .set("head_dim", Value::Int(8))
        .set("num_hidden_layers", Value::Int(3))
        .set("batch", Value::Int(2))
        .set("seq_len", Value::Int(8))
        .set("rms_norm_eps", Value::Float(1e-6))
        .set("rope_theta", Value::Float(10000.0));
    c = match kind {
        BlockKind::Dense => c.set("intermediate_size", Value::Int(40)),
        BlockKind::Moe => c
            .set("num_experts", Value::Int(4))
            .set("num_experts_per_tok", Value::Int(2))
            .set("moe_intermediate_size", Value::Int(24)),
    };
    for o in overrides {
        c.apply_override(o).unwrap();
    }
    c
}

fn tokens() -> (Vec<u32>, Vec<u32>) {
    let t: Vec<u32> = (0..16u32).map(|i| (i * 7 + 3) % 48).collect();
    let y: Vec<u32> = (0..16u32).map(|i| (i * 5 + 1) % 48).collect();
    (t, y)
}

fn spec_of(kind: BlockKind) -> BlockSpec {
    match kind {
        BlockKind::Dense => QWEN3.spec().unwrap(),
        BlockKind::Moe => QWEN3_MOE.spec().unwrap(),
    }
}

fn lora() -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.1,
        targets: ["q", "k", "v", "o", "up", "gate", "down"]
            .map(String::from)
            .to_vec(),
        seed: 7,
    }
}

fn run(
    model: &Qwen3,
    plan: &Plan,
) -> (
    remat_engine::spec::models::qwen3::Qwen3Grads,
    remat_engine::spec::models::StepStats,
) {
    run_at(model, plan, 0, &Meter::unbounded()).unwrap()
}

fn run_at(
    model: &Qwen3,
    plan: &Plan,
    step: u64,
    meter: &Arc<Meter>,
) -> Result<
    (
        remat_engine::spec::models::qwen3::Qwen3Grads,
        remat_engine::spec::models::StepStats,
    ),
    remat_engine::spec::run::RunError,
> {
    let (t, y) = tokens();
    let host = HostStore::in_memory();
    model.step(
        plan,
        &t,
        &y,
        StepEnv {
            host: &host,
            meter,
            step,
        },
    )
}

/// The shipped spec in `mode` against save-everything, bit for bit.
fn assert_exact(kind: BlockKind, mode: Mode, overrides: &[&str]) {
    let cfg = config(kind, overrides);
    let mut model = Qwen3::new(kind, &cfg, 11).unwrap();
    if mode == Mode::Lora {
        model = model.with_lora(lora(), true).unwrap();
    }
    let spec = spec_of(kind);
    let plan = compile(&spec, &cfg, mode).unwrap();
    let reference = compile(&spec.save_everything(), &cfg, mode).unwrap();
    let (g_spec, s_spec) = run(&model, &plan);
    let (g_ref, s_ref) = run(&model, &reference);
    assert_eq!(s_spec.loss.to_bits(), s_ref.loss.to_bits());
    assert!(s_spec.recomputed_ops > 0, "the spec recomputed nothing");
    assert_eq!(s_ref.recomputed_ops, 0);
    let diff = g_spec.bit_diff(&g_ref);
    assert!(
        diff.is_empty(),
        "{kind:?} {mode:?} {overrides:?}: gradients differ in {diff:?}"
    );
    assert!(!g_spec.named().is_empty());
    assert!(
        s_spec.activations.peak < s_ref.activations.peak,
        "spec peak {} vs save-all {}",
        s_spec.activations.peak,
        s_ref.activations.peak
    );
    assert!(
        s_spec.host_peak > 0,
        "the shipped spec offloads the residual stream"
    );
    // The meter shows the plan: per-layer saved bytes for every layer, one shared buffer set.
    assert_eq!(s_spec.activations.saved_peak, plan.saved_bytes());
    assert_eq!(s_ref.activations.saved_peak, reference.saved_bytes());
    assert_eq!(s_spec.activations.shared_peak, plan.shared_buffer_bytes());
    assert_eq!(s_ref.activations.shared_peak, 0);
    assert_eq!(s_spec.host_peak, plan.offloaded_bytes());
}

#[test]
fn dense_full_step_equals_save_everything() {
    assert_exact(BlockKind::Dense, Mode::Full, &[]);
}

#[test]
fn dense_lora_step_equals_save_everything() {
    assert_exact(BlockKind::Dense, Mode::Lora, &[]);
}

#[test]
fn dense_without_qk_norm_with_bias() {
    assert_exact(
        BlockKind::Dense,
        Mode::Full,
        &["use_qk_norm=false", "attention_bias=true"],
    );
    assert_exact(
        BlockKind::Dense,
        Mode::Lora,
        &["use_qk_norm=false", "attention_bias=true"],
    );
}

#[test]
fn moe_steps_equal_save_everything() {
    assert_exact(BlockKind::Moe, Mode::Full, &[]);
    assert_exact(
        BlockKind::Moe,
        Mode::Lora,
        &["shared_expert_intermediate_size=16"],
    );
}

/// `remat spec derive`: the derived spec recomputes the whole block from its input and still
/// gives the save-everything gradients, in both modes and for both blocks.
#[test]
fn derived_spec_recomputes_everything_exactly() {
    for kind in [BlockKind::Dense, BlockKind::Moe] {
        let cfg = config(kind, &["attention_bias=true"]);
        let model = Qwen3::new(kind, &cfg, 5)
            .unwrap()
            .with_lora(lora(), true)
            .unwrap();
        let shipped = compile(&spec_of(kind), &cfg, Mode::Full).unwrap();
        let derived = model.derive_spec(&shipped).unwrap();
        // Round trip through TOML, as `remat spec derive` writes it.
        let derived = BlockSpec::from_toml(&derived.to_toml().unwrap(), "derived.toml").unwrap();
        for mode in [Mode::Full, Mode::Lora] {
            let plan = compile(&derived, &cfg, mode).unwrap();
            let reference = compile(&spec_of(kind).save_everything(), &cfg, mode).unwrap();
            let (g, s) = run(&model, &plan);
            let (g_ref, s_ref) = run(&model, &reference);
            assert_eq!(
                g.bit_diff(&g_ref),
                Vec::<String>::new(),
                "{kind:?} {mode:?}"
            );
            assert_eq!(s.loss.to_bits(), s_ref.loss.to_bits());
            // Only block inputs stay saved: full-block recompute.
            assert_eq!(
                s.activations.saved_peak,
                3 * 2 * 8 * 32 * 4,
                "{kind:?} {mode:?}"
            );
        }
    }
}

/// Each recompute op's output equals the forward's value bit for bit, in every layer.
#[test]
fn every_recomputed_slot_equals_the_forward_bit_for_bit() {
    for kind in [BlockKind::Dense, BlockKind::Moe] {
        for overrides in [&[][..], &["use_qk_norm=false", "attention_bias=true"][..]] {
            let cfg = config(kind, overrides);
            let model = Qwen3::new(kind, &cfg, 3)
                .unwrap()
                .with_lora(lora(), true)
                .unwrap();
            for mode in [Mode::Full, Mode::Lora] {
                let plan = compile(&spec_of(kind), &cfg, mode).unwrap();
                let checks = model.verify_recompute(&plan, &tokens().0).unwrap();
                assert!(checks.len() >= 3 * 4, "{kind:?} {mode:?}: {checks:?}");
                let bad: Vec<_> = checks.iter().filter(|c| !c.bit_equal).collect();
                assert!(bad.is_empty(), "{kind:?} {mode:?} {overrides:?}: {bad:?}");
            }
        }
    }
}

/// A spec that drifted from the forward code, or that drops a slot backward reads, is an
/// error naming the layer and slot, never a wrong gradient.
#[test]
fn drift_and_missing_slots_are_errors() {
    let cfg = config(BlockKind::Dense, &[]);
    let model = Qwen3::new(BlockKind::Dense, &cfg, 3).unwrap();
    let (t, y) = tokens();
    let step = |spec: &BlockSpec| {
        let plan = compile(spec, &cfg, Mode::Lora).unwrap();
        let model = model.clone().with_lora(lora(), true).unwrap();
        let env = StepEnv {
            host: &HostStore::in_memory(),
            meter: &Meter::unbounded(),
            step: 0,
        };
        model.step(&plan, &t, &y, env).unwrap_err().to_string()
    };
    // The attention replay says it reads k where the forward read q.
    let mut drift = QWEN3.spec().unwrap();
    let attn = drift.slots.iter_mut().find(|s| s.name == "attn").unwrap();
    attn.recompute_from = vec!["k".into(), "k".into(), "v".into()];
    let e = step(&drift);
    assert!(e.contains("drifted") && e.contains("`attn`"), "{e}");
    // LoRA targets that disagree with the forward's adapters.
    let mut lora_drift = QWEN3.spec().unwrap();
    let gate = lora_drift
        .slots
        .iter_mut()
        .find(|s| s.name == "gate")
        .unwrap();
    gate.lora_targets = vec!["up".into()];
    let e = step(&lora_drift);
    assert!(
        e.contains("drifted") && e.contains("`gate`") && e.contains("LoRA"),
        "{e}"
    );
    // Backward reads `act`, which this spec marks forward-only.
    let mut missing = QWEN3.spec().unwrap();
    let act = missing.slots.iter_mut().find(|s| s.name == "act").unwrap();
    *act = remat_engine::spec::SlotSpec::new("act", &["B", "T", "F"]).save(false);
    let e = step(&missing);
    assert!(e.contains("slot `act`") && e.contains("transient"), "{e}");
}

/// LoRA dropout draws a fresh mask every step, and the step's recompute re-applies that
/// step's mask: the gradients of two steps on the same batch differ, and each step still
/// equals save-everything bit for bit.
#[test]
fn lora_dropout_draws_a_fresh_mask_each_step() {
    let cfg = config(BlockKind::Dense, &[]);
    let model = Qwen3::new(BlockKind::Dense, &cfg, 11)
        .unwrap()
        .with_lora(lora(), true)
        .unwrap();
    let spec = spec_of(BlockKind::Dense);
    let plan = compile(&spec, &cfg, Mode::Lora).unwrap();
    let reference = compile(&spec.save_everything(), &cfg, Mode::Lora).unwrap();
    let meter = Meter::unbounded();
    let (g0, s0) = run_at(&model, &plan, 0, &meter).unwrap();
    let (g1, s1) = run_at(&model, &plan, 1, &meter).unwrap();
    assert_ne!(
        s0.loss.to_bits(),
        s1.loss.to_bits(),
        "same mask in steps 0 and 1"
    );
    assert!(!g0.bit_diff(&g1).is_empty());
    let (r1, _) = run_at(&model, &reference, 1, &meter).unwrap();
    assert_eq!(g1.bit_diff(&r1), Vec::<String>::new());
    // The same step number redraws the same mask (a step can be replayed).
    let (again, _) = run_at(&model, &plan, 1, &meter).unwrap();
    assert_eq!(g1.bit_diff(&again), Vec::<String>::new());
}

/// A custom recompute op that computes something else than the forward (here `ln2`
/// rebuilt from the block input instead of `h`) is a drift error naming layer and slot,
/// never a silently different loss.
#[test]
fn a_wrong_custom_recompute_op_is_a_drift_error() {
    let cfg = config(BlockKind::Dense, &[]);
    let model = Qwen3::new(BlockKind::Dense, &cfg, 3).unwrap();
    let mut spec = spec_of(BlockKind::Dense);
    let ln2 = spec.slots.iter_mut().find(|s| s.name == "ln2").unwrap();
    ln2.recompute_from[0] = "@input:x".into();
    let plan = compile(&spec, &cfg, Mode::Full).unwrap();
    let e = run_at(&model, &plan, 0, &Meter::unbounded()).unwrap_err();
    match &e {
        remat_engine::spec::run::RunError::Drift { layer, slot, .. } => {
            assert_eq!((*layer, slot.as_str()), (2, "ln2"), "{e}");
        }
        other => panic!("expected a drift error, got {other}"),
    }
    assert!(e.to_string().contains("rebuilt different values"), "{e}");
}

/// Declared shapes are checked against what the run produces; dtypes the runtime cannot
/// run are rejected before any step.
#[test]
fn declared_shapes_and_dtypes_are_checked() {
    use remat_engine::spec::run::RunError;
    let cfg = config(BlockKind::Dense, &[]);
    let model = Qwen3::new(BlockKind::Dense, &cfg, 3).unwrap();
    let mut spec = spec_of(BlockKind::Dense);
    let act = spec.slots.iter_mut().find(|s| s.name == "act").unwrap();
    act.shape = vec!["B".into(), "T".into(), "D".into()];
    let plan = compile(&spec, &cfg, Mode::Full).unwrap();
    let e = run_at(&model, &plan, 0, &Meter::unbounded()).unwrap_err();
    match &e {
        RunError::ShapeMismatch {
            layer,
            slot,
            declared,
            actual,
            ..
        } => {
            assert_eq!((*layer, slot.as_str()), (0, "act"));
            assert_eq!(
                (declared.clone(), actual.clone()),
                (vec![2, 8, 32], vec![2, 8, 40])
            );
        }
        other => panic!("expected a shape mismatch, got {other}"),
    }
    let mut spec = spec_of(BlockKind::Dense);
    let gate = spec.slots.iter_mut().find(|s| s.name == "gate").unwrap();
    gate.dtype = remat_engine::spec::Dtype::Bf16;
    let plan = compile(&spec, &cfg, Mode::Full).unwrap();
    let e = model.check_plan(&plan).unwrap_err();
    assert!(
        matches!(&e, RunError::UnsupportedDtype { owner, dtype: "bf16", .. } if owner == "slot `gate`"),
        "{e}"
    );
    let meter = Meter::unbounded();
    assert!(run_at(&model, &plan, 0, &meter).is_err());
    assert_eq!(
        meter.pool().stats().allocations,
        0,
        "rejected after allocating"
    );
}

/// The memory pool measures the runtime's buffers: a budget between the shipped spec's
/// measured peak and save-everything's lets the spec train and makes save-everything fail
/// with the engine's out-of-memory error.
#[test]
fn the_pool_budget_separates_the_spec_from_save_everything() {
    use remat_engine::spec::run::RunError;
    let cfg = config(BlockKind::Dense, &[]);
    let model = Qwen3::new(BlockKind::Dense, &cfg, 3).unwrap();
    let spec = spec_of(BlockKind::Dense);
    let plan = compile(&spec, &cfg, Mode::Full).unwrap();
    let reference = compile(&spec.save_everything(), &cfg, Mode::Full).unwrap();
    let (_, s_spec) = run(&model, &plan);
    let (_, s_ref) = run(&model, &reference);
    assert!(s_spec.activations.peak < s_ref.activations.peak);
    let budget = s_spec.activations.peak;
    let bounded = || Meter::new(remat_engine::MemoryPool::with_budget(budget));
    let (_, fits) = run_at(&model, &plan, 0, &bounded()).unwrap();
    assert_eq!(fits.activations.peak, budget);
    let e = run_at(&model, &reference, 0, &bounded()).unwrap_err();
    assert!(
        matches!(
            e,
            RunError::Memory(remat_engine::EngineError::OutOfMemory { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("layer"), "{e}");
    // Once the step failed, every buffer it held went back to the pool.
    let meter = bounded();
    assert!(run_at(&model, &reference, 0, &meter).is_err());
    assert_eq!(meter.pool().live(), 0);
}

/// A spec names its block exactly: a MoE spec is not a dense one (no prefix match), and a
/// plan of another block is refused before the step allocates anything.
#[test]
fn specs_name_their_block_exactly() {
    assert_eq!(BlockKind::of_spec("qwen3"), Some(BlockKind::Dense));
    assert_eq!(BlockKind::of_spec("qwen3-moe"), Some(BlockKind::Moe));
    assert_eq!(
        BlockKind::of_spec("qwen3-moe-derived"),
        Some(BlockKind::Moe)
    );
    assert_eq!(BlockKind::of_spec("qwen3-save-all"), Some(BlockKind::Dense));
    assert_eq!(BlockKind::of_spec("qwen3x"), None);
    assert_eq!(BlockKind::of_spec("qwen3-moe2"), None);
    let cfg = config(BlockKind::Moe, &[]).set("intermediate_size", Value::Int(40));
    let dense = Qwen3::new(BlockKind::Dense, &cfg, 3).unwrap();
    let moe_plan = compile(&spec_of(BlockKind::Moe), &cfg, Mode::Full).unwrap();
    let e = dense.check_plan(&moe_plan).unwrap_err().to_string();
    assert!(
        e.contains("qwen3-moe") && e.contains("stacks `qwen3`"),
        "{e}"
    );
    // A renamed spec whose parameters do not match the model is caught before the step.
    let mut renamed = spec_of(BlockKind::Moe);
    renamed.name = "qwen3".into();
    let plan = compile(&renamed, &cfg, Mode::Full).unwrap();
    let e = dense.check_plan(&plan).unwrap_err().to_string();
    assert!(e.contains("parameter `router`"), "{e}");
}
