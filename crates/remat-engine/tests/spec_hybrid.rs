//! Hybrid models (a block type per layer, each layer under its own block's spec): every
//! plan gives keep-all's gradients bit for bit in full and LoRA modes, and the meter
//! measures the bytes the per-type plans predict.

use remat_engine::core::swap::HostStore;
use remat_engine::spec::models::hybrid::{Hybrid, HybridGrads, block_config, layer_types};
use remat_engine::spec::models::{StepEnv, StepStats};
use remat_engine::spec::run::lora::LoraConfig;
use remat_engine::spec::run::meter::Meter;
use remat_engine::spec::shipped::ShippedBlock;
use remat_engine::spec::types::RecomputePolicy;
use remat_engine::spec::{BlockSpec, Mode, ModelConfig, Plan, Value, compile};

const CONFIG: &str = r#"
layer_types = "mamba qwen3 mamba qwen3-moe"
hidden_size = 16
vocab_size = 30
batch = 2
seq_len = 6

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

[qwen3-moe]
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 8
num_experts = 3
num_experts_per_tok = 2
moe_intermediate_size = 12
"#;

fn config() -> ModelConfig {
    ModelConfig::parse(CONFIG, "hybrid.toml").unwrap()
}

/// Plans for each block type of `model` from `spec_of(name)`.
fn plans(model: &Hybrid, mode: Mode, spec_of: &dyn Fn(&str) -> BlockSpec) -> Vec<Plan> {
    model
        .blocks
        .iter()
        .map(|b| compile(&spec_of(&b.name), &b.config, mode).unwrap())
        .collect()
}

fn shipped(name: &str) -> BlockSpec {
    ShippedBlock::by_name(name).unwrap().spec().unwrap()
}

fn recompute_most(name: &str) -> BlockSpec {
    let mut s = shipped(name);
    for slot in &mut s.slots {
        if slot.recompute_policy == RecomputePolicy::LoraOnly {
            slot.recompute_policy = RecomputePolicy::Always;
        }
    }
    s
}

fn run(model: &Hybrid, plans: &[Plan]) -> (HybridGrads, StepStats) {
    let t: Vec<u32> = (0..12u32).map(|i| (i * 7 + 3) % 30).collect();
    let y: Vec<u32> = (0..12u32).map(|i| (i * 5 + 1) % 30).collect();
    let host = HostStore::in_memory();
    let meter = Meter::unbounded();
    let env = StepEnv {
        host: &host,
        meter: &meter,
        step: 1,
    };
    model.step(plans, &t, &y, env).unwrap()
}

fn assert_exact(mode: Mode) {
    let mut model = Hybrid::new(&config(), 4).unwrap();
    assert_eq!(model.layer_block, vec![0, 1, 0, 2]);
    if mode == Mode::Lora {
        let targets = ["q", "k", "v", "o", "gate", "up", "down", "in", "x", "out"];
        let lora = LoraConfig {
            rank: 2,
            alpha: 4.0,
            dropout: 0.1,
            targets: targets.map(String::from).to_vec(),
            seed: 3,
        };
        model = model.with_lora(lora, true).unwrap();
        let adapters = &model.lora.as_ref().unwrap().1;
        assert!(adapters[0].contains_key("in") && !adapters[0].contains_key("q"));
        assert!(adapters[1].contains_key("q") && adapters[1].contains_key("down"));
    }
    let keep_all = plans(&model, mode, &|n| shipped(n).save_everything());
    let (g_ref, s_ref) = run(&model, &keep_all);
    assert_eq!(s_ref.recomputed_ops, 0);
    for (what, spec_of) in [
        ("shipped", &shipped as &dyn Fn(&str) -> BlockSpec),
        ("recompute-most", &recompute_most),
    ] {
        let p = plans(&model, mode, spec_of);
        let (g, s) = run(&model, &p);
        assert!(s.recomputed_ops > 0, "{what}");
        assert_eq!(s.loss.to_bits(), s_ref.loss.to_bits(), "{what}");
        let diff = g.bit_diff(&g_ref);
        assert!(
            diff.is_empty(),
            "{what} {mode:?}: gradients differ in {diff:?}"
        );
        let (saved, shared, host) = model.predicted(&p);
        assert_eq!(s.activations.saved_peak, saved, "{what}");
        assert_eq!(s.activations.shared_peak, shared, "{what}");
        assert_eq!(s.host_peak, host, "{what}");
        // At these toy sizes three types' shared buffers can outweigh what recomputing
        // everything saves; the shipped policy must still be below keep-all.
        if what == "shipped" {
            assert!(s.activations.peak < s_ref.activations.peak, "{what}");
        }
    }
}

#[test]
fn hybrid_full_steps_equal_keep_all() {
    assert_exact(Mode::Full);
}

#[test]
fn hybrid_lora_steps_equal_keep_all() {
    assert_exact(Mode::Lora);
}

/// Common keys reach every block; a block's table overrides them for that block only.
#[test]
fn each_block_gets_its_own_config() {
    let cfg = config();
    let mamba = block_config(&cfg, "mamba", 4);
    let dense = block_config(&cfg, "qwen3", 4);
    assert_eq!(mamba.get("intermediate_size"), Some(&Value::Int(32)));
    assert_eq!(dense.get("intermediate_size"), Some(&Value::Int(24)));
    assert_eq!(dense.get("hidden_size"), Some(&Value::Int(16)));
    assert_eq!(dense.get("num_hidden_layers"), Some(&Value::Int(4)));
    assert!(dense.get("state_size").is_none() && dense.get("layer_types").is_none());
}

#[test]
fn bad_layer_lists_name_the_field() {
    let mut cfg = config();
    cfg.apply_override("layer_types=mamba,attention").unwrap();
    let err = layer_types(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("layer_types") && err.contains("layer 1 names `attention`"),
        "{err}"
    );
    cfg.values.remove("layer_types");
    let err = Hybrid::new(&cfg, 0).unwrap_err().to_string();
    assert!(
        err.contains("layer_types") && err.contains("not set"),
        "{err}"
    );
    let mut cfg = config();
    cfg.apply_override("mamba.hidden_size=8").unwrap();
    cfg.apply_override("mamba.intermediate_size=16").unwrap();
    let err = Hybrid::new(&cfg, 0).unwrap_err().to_string();
    assert!(err.contains("mamba.hidden_size"), "{err}");
    // The plans must be one per block type, in order.
    let model = Hybrid::new(&config(), 0).unwrap();
    let mut p = plans(&model, Mode::Full, &shipped);
    p.swap(0, 1);
    let err = model.check_plans(&p).unwrap_err().to_string();
    assert!(
        err.contains("`mamba` layers") && err.contains("`qwen3`"),
        "{err}"
    );
}
