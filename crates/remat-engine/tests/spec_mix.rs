//! Mixed per-model plans (keep, recompute or offload per layer and slot, chosen under a
//! budget from a measured profile): every chosen mix trains to keep-all's gradients bit for
//! bit, in full and LoRA modes, and its executed pool peak equals the predicted peak to the
//! byte, for Qwen3, Qwen3-MoE, Mamba and a hybrid model; budgets below the floor are refused.

use std::sync::Arc;

use remat_engine::core::swap::HostStore;
use remat_engine::spec::mix::{self, MixError, MixModel};
use remat_engine::spec::models::hybrid::Hybrid;
use remat_engine::spec::models::mamba::Mamba;
use remat_engine::spec::models::qwen3::{BlockKind, Qwen3};
use remat_engine::spec::models::{SpecGrads, StepEnv, StepStats};
use remat_engine::spec::run::lora::LoraConfig;
use remat_engine::spec::run::meter::Meter;
use remat_engine::spec::shipped::{MAMBA, QWEN3, QWEN3_MOE, ShippedBlock};
use remat_engine::spec::types::RecomputePolicy;
use remat_engine::spec::{BlockSpec, Mode, ModelConfig, Plan, Value};

const HYBRID: &str = r#"
layer_types = "mamba qwen3 mamba qwen3"
hidden_size = 16
vocab_size = 30
batch = 2
seq_len = 24

[mamba]
intermediate_size = 32
state_size = 4
conv_kernel = 3
time_step_rank = 2
scan_chunk = 4

[qwen3]
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 8
intermediate_size = 24
"#;

enum Model {
    Qwen3(Qwen3),
    Mamba(Mamba),
    Hybrid(Hybrid),
}

fn lora(targets: &[&str]) -> LoraConfig {
    LoraConfig {
        rank: 2,
        alpha: 4.0,
        dropout: 0.1,
        targets: targets.iter().map(|t| t.to_string()).collect(),
        seed: 3,
    }
}

const ATTENTION: &[&str] = &["q", "k", "v", "o", "gate", "up", "down"];
const MAMBA_TARGETS: &[&str] = &["in", "x", "out"];

/// A small model whose activations outweigh its weights (else the gradients held at the
/// end of the step set every peak and no mix could lower it).
fn small(shipped: &ShippedBlock, layers: i64) -> ModelConfig {
    let mut c = shipped
        .config()
        .unwrap()
        .set("vocab_size", Value::Int(30))
        .set("num_hidden_layers", Value::Int(layers))
        .set("batch", Value::Int(2))
        .set("seq_len", Value::Int(SEQ as i64))
        .set("hidden_size", Value::Int(16))
        .set("intermediate_size", Value::Int(32));
    let sets: &[&str] = if shipped.spec_file.contains("mamba") {
        &[
            "state_size=4",
            "conv_kernel=3",
            "time_step_rank=2",
            "scan_chunk=4",
        ]
    } else {
        &[
            "num_attention_heads=2",
            "num_key_value_heads=1",
            "head_dim=8",
            "moe_intermediate_size=12",
            "num_experts=3",
            "num_experts_per_tok=2",
        ]
    };
    for set in sets {
        if c.get(set.split('=').next().unwrap()).is_some() {
            c.apply_override(set).unwrap();
        }
    }
    c
}

const SEQ: u32 = 24;

impl Model {
    fn with_lora(self, mode: Mode) -> Self {
        if mode == Mode::Full {
            return self;
        }
        match self {
            Model::Qwen3(m) => Model::Qwen3(m.with_lora(lora(ATTENTION), true).unwrap()),
            Model::Mamba(m) => Model::Mamba(m.with_lora(lora(MAMBA_TARGETS), true).unwrap()),
            Model::Hybrid(m) => {
                let all: Vec<&str> = ATTENTION.iter().chain(MAMBA_TARGETS).copied().collect();
                Model::Hybrid(m.with_lora(lora(&all), true).unwrap())
            }
        }
    }

    /// The spec and config of each block type, and each layer's type.
    fn blocks(&self) -> (Vec<(BlockSpec, ModelConfig)>, Vec<usize>) {
        match self {
            Model::Qwen3(m) => {
                let spec = match m.kind {
                    BlockKind::Dense => QWEN3.spec(),
                    BlockKind::Moe => QWEN3_MOE.spec(),
                };
                (
                    vec![(spec.unwrap(), m.config.clone())],
                    vec![0; m.dims.layers],
                )
            }
            Model::Mamba(m) => (
                vec![(MAMBA.spec().unwrap(), m.config.clone())],
                vec![0; m.dims.layers],
            ),
            Model::Hybrid(m) => (
                m.blocks
                    .iter()
                    .map(|b| {
                        let spec = ShippedBlock::by_name(&b.name).unwrap().spec().unwrap();
                        (spec, b.config.clone())
                    })
                    .collect(),
                m.layer_block.clone(),
            ),
        }
    }

    fn step(&self, plans: &[Plan], meter: &Arc<Meter>) -> (SpecGrads, StepStats) {
        let t: Vec<u32> = (0..2 * SEQ).map(|i| (i * 7 + 3) % 30).collect();
        let y: Vec<u32> = (0..2 * SEQ).map(|i| (i * 5 + 1) % 30).collect();
        let host = HostStore::in_memory();
        let env = StepEnv {
            host: &host,
            meter,
            step: 1,
        };
        match self {
            Model::Qwen3(m) => m.step(&plans[0], &t, &y, env),
            Model::Mamba(m) => m.step(&plans[0], &t, &y, env),
            Model::Hybrid(m) => m.step(plans, &t, &y, env),
        }
        .unwrap()
    }
}

fn mix_model(model: &Model, mode: Mode) -> MixModel {
    let (blocks, layer_block) = model.blocks();
    MixModel::new(&blocks, layer_block, mode).unwrap()
}

/// Keep-all plans: every layer saves everything.
fn keep_all(mix: &MixModel) -> Vec<Plan> {
    let keep: Vec<_> = mix
        .layer_block
        .iter()
        .map(|&b| remat_engine::spec::LayerChoice::keep_all(&mix.blocks[b].resolved))
        .collect();
    mix.plans(&keep).unwrap()
}

fn check(model: Model, mode: Mode, what: &str) {
    let model = model.with_lora(mode);
    let mix = mix_model(&model, mode);
    let mut run = |plans: &[Plan], meter: &Arc<Meter>| -> Result<(), MixError> {
        model.step(plans, meter);
        Ok(())
    };
    let profile = mix::profile(&mix, 1, &mut run).unwrap();
    let (g_ref, s_ref) = model.step(&keep_all(&mix), &Meter::unbounded());
    let keep_peak = s_ref.activations.peak;
    let floor = mix::floor(&profile);
    assert!(
        floor < keep_peak,
        "{what} {mode:?}: floor {floor} vs keep-all {keep_peak}"
    );
    let mut distinct = std::collections::HashSet::new();
    let span = keep_peak - floor;
    for budget in [
        keep_peak,
        floor + span * 3 / 4,
        floor + span / 2,
        floor + span / 4,
        floor + span / 10,
        floor,
    ] {
        let chosen = mix::solve(&mix, &profile, budget).unwrap();
        assert!(chosen.peak <= budget, "{what} {mode:?} at {budget}");
        let choices: Vec<_> = chosen.layers.iter().map(|l| l.choice.clone()).collect();
        distinct.insert(format!("{choices:?}"));
        let plans = mix.plans(&choices).unwrap();
        let (g, s) = model.step(&plans, &Meter::unbounded());
        assert_eq!(
            s.activations.peak, chosen.peak,
            "{what} {mode:?} at budget {budget}: executed peak vs predicted"
        );
        assert_eq!(s.loss.to_bits(), s_ref.loss.to_bits(), "{what} {mode:?}");
        let diff = g.bit_diff(&g_ref);
        assert!(
            diff.is_empty(),
            "{what} {mode:?} at {budget}: gradients differ in {diff:?}"
        );
    }
    assert!(
        distinct.len() >= 3,
        "{what} {mode:?}: only {} mixes",
        distinct.len()
    );
    let err = mix::solve(&mix, &profile, floor - 1).unwrap_err();
    assert!(matches!(err, MixError::BelowFloor { floor: f, .. } if f == floor));
    let text = err.to_string();
    assert!(
        text.contains("--memory-budget") && text.contains(&floor.to_string()),
        "{text}"
    );
}

#[test]
fn qwen3_mixes_are_exact_in_both_modes() {
    for mode in [Mode::Full, Mode::Lora] {
        let model = Qwen3::new(BlockKind::Dense, &small(&QWEN3, 3), 1).unwrap();
        check(Model::Qwen3(model), mode, "qwen3");
    }
}

#[test]
fn qwen3_moe_mixes_are_exact() {
    let model = Qwen3::new(BlockKind::Moe, &small(&QWEN3_MOE, 2), 1).unwrap();
    check(Model::Qwen3(model), Mode::Full, "qwen3-moe");
}

#[test]
fn mamba_mixes_are_exact_in_both_modes() {
    for mode in [Mode::Full, Mode::Lora] {
        let model = Mamba::new(&small(&MAMBA, 3), 1).unwrap();
        check(Model::Mamba(model), mode, "mamba");
    }
}

#[test]
fn hybrid_mixes_are_exact_in_both_modes() {
    for mode in [Mode::Full, Mode::Lora] {
        let config = ModelConfig::parse(HYBRID, "hybrid.toml").unwrap();
        let model = Hybrid::new(&config, 4).unwrap();
        check(Model::Hybrid(model), mode, "hybrid");
    }
}

/// A `never` slot is never rebuilt, a `lora_only` one only in LoRA mode.
#[test]
fn units_respect_each_slots_policy() {
    let config = small(&QWEN3, 2);
    let mut spec = QWEN3.spec().unwrap();
    spec.slots
        .iter_mut()
        .filter(|s| s.name == "act")
        .for_each(|s| s.recompute_policy = RecomputePolicy::Never);
    for mode in [Mode::Full, Mode::Lora] {
        let mix = MixModel::new(&[(spec.clone(), config.clone())], vec![0, 0], mode).unwrap();
        let (classes, _) = mix.classes().unwrap();
        let resolved = &mix.blocks[0].resolved;
        let names: Vec<&str> = classes[0]
            .units
            .iter()
            .flatten()
            .map(|&r| resolved.recipes[r].key.as_str())
            .collect();
        assert!(!names.contains(&"act"), "{names:?}");
        assert_eq!(names.contains(&"qkv"), mode == Mode::Lora, "{names:?}");
        assert_eq!(names.contains(&"gate"), mode == Mode::Lora, "{names:?}");
        assert!(names.contains(&"ln1") && names.contains(&"q"), "{names:?}");
    }
}

/// Tuning by measurement: every candidate of the budget ladder fits the budget and differs
/// from the others, the first is the exact least-predicted mix, and the chosen one runs at
/// its predicted peak with keep-all's gradients. Without rounds nothing is measured.
#[test]
fn tuned_mixes_fit_and_stay_exact() {
    let model = Model::Qwen3(Qwen3::new(BlockKind::Dense, &small(&QWEN3, 3), 1).unwrap());
    let mix = mix_model(&model, Mode::Full);
    let mut run = |plans: &[Plan], meter: &Arc<Meter>| -> Result<(), MixError> {
        model.step(plans, meter);
        Ok(())
    };
    let profile = mix::profile(&mix, 1, &mut run).unwrap();
    let (g_ref, s_ref) = model.step(&keep_all(&mix), &Meter::unbounded());
    let floor = mix::floor(&profile);
    let budget = floor + (s_ref.activations.peak - floor) * 9 / 10;
    let untimed = mix::tune(&mix, &profile, budget, 0, &mut run).unwrap();
    assert_eq!(untimed.chosen, 0);
    assert!(untimed.tried.iter().all(|t| t.seconds.is_none()));
    let exact = mix::solve(&mix, &profile, budget).unwrap();
    assert_eq!(untimed.mix().seconds, exact.seconds);
    let tuned = mix::tune(&mix, &profile, budget, 2, &mut run).unwrap();
    assert!(tuned.tried.len() >= 2, "{} candidates", tuned.tried.len());
    let mut seen = std::collections::HashSet::new();
    for t in &tuned.tried {
        assert!(t.mix.peak <= t.budget && t.budget <= budget);
        assert!(t.seconds.is_some_and(|s| s > 0.0));
        let choices: Vec<_> = t.mix.layers.iter().map(|l| l.choice.clone()).collect();
        assert!(seen.insert(format!("{choices:?}")), "a repeated candidate");
    }
    let best = tuned.tried[tuned.chosen].seconds.unwrap();
    assert!(tuned.tried.iter().all(|t| t.seconds.unwrap() >= best));
    let choices: Vec<_> = tuned
        .mix()
        .layers
        .iter()
        .map(|l| l.choice.clone())
        .collect();
    let (g, s) = model.step(&mix.plans(&choices).unwrap(), &Meter::unbounded());
    assert_eq!(s.activations.peak, tuned.mix().peak);
    assert!(g.bit_diff(&g_ref).is_empty());
}

/// A block with more rebuildable recipes than the profile measures one by one (above
/// `MAX_UNITS`, or a smaller `with_max_units`; here the derived Mamba spec, which replays
/// every op, with 4) is mixed with neighbouring recipes joined into units, and its mixes
/// stay exact: predicted peak executed to the byte, keep-all's gradients.
#[test]
fn a_block_with_many_recipes_mixes_at_a_coarser_grain() {
    let config = small(&MAMBA, 2);
    let mamba = Mamba::new(&config, 4).unwrap();
    let shipped = remat_engine::spec::compile(&MAMBA.spec().unwrap(), &config, Mode::Full);
    let derived = mamba.derive_spec(&shipped.unwrap()).unwrap();
    let model = Model::Mamba(mamba);
    let blocks = [(derived, config)];
    let fine = MixModel::new(&blocks, vec![0; 2], Mode::Full).unwrap();
    let recipes = fine.classes().unwrap().0[0].units.len();
    assert!(
        recipes > 4 && recipes <= mix::MAX_UNITS,
        "{recipes} recipes"
    );
    let mix = fine.with_max_units(4).unwrap();
    let (classes, _) = mix.classes().unwrap();
    assert_eq!(classes[0].units.len(), 4);
    assert_eq!(
        classes[0].units.iter().map(Vec::len).sum::<usize>(),
        recipes
    );
    let refused = MixModel::new(&blocks, vec![0; 2], Mode::Full)
        .unwrap()
        .with_max_units(13);
    assert!(refused.unwrap_err().to_string().contains("1 to 12, not 13"));
    let mut run = |plans: &[Plan], meter: &Arc<Meter>| -> Result<(), MixError> {
        model.step(plans, meter);
        Ok(())
    };
    let profile = mix::profile(&mix, 1, &mut run).unwrap();
    let (g_ref, s_ref) = model.step(&keep_all(&mix), &Meter::unbounded());
    let floor = mix::floor(&profile);
    assert!(floor < s_ref.activations.peak);
    for budget in [floor, (floor + s_ref.activations.peak) / 2] {
        let chosen = mix::solve(&mix, &profile, budget).unwrap();
        let choices: Vec<_> = chosen.layers.iter().map(|l| l.choice.clone()).collect();
        let (g, s) = model.step(&mix.plans(&choices).unwrap(), &Meter::unbounded());
        assert_eq!(s.activations.peak, chosen.peak, "at {budget}");
        assert!(g.bit_diff(&g_ref).is_empty(), "at {budget}");
    }
}
