//! The Qwen3 model's own checks: parameter counts, refused configs and LoRA settings.

use super::*;
use crate::spec::Value;
use crate::spec::shipped::{QWEN3, QWEN3_MOE};

fn config(kind: BlockKind, sets: &[&str]) -> ModelConfig {
    let shipped = match kind {
        BlockKind::Dense => &QWEN3,
        BlockKind::Moe => &QWEN3_MOE,
    };
    let mut c = shipped
        .config()
        .unwrap()
        .set("vocab_size", Value::Int(50))
        .set("num_hidden_layers", Value::Int(2));
    for s in sets {
        c.apply_override(s).unwrap();
    }
    c
}

fn targets() -> Vec<String> {
    ["q", "k", "v", "o", "gate", "up", "down"]
        .map(String::from)
        .to_vec()
}

/// The count the pool is charged before building is exactly what the model holds.
#[test]
fn param_count_matches_the_built_model() {
    for (kind, sets) in [
        (BlockKind::Dense, &["attention_bias=true"][..]),
        (BlockKind::Dense, &["use_qk_norm=false"]),
        (BlockKind::Moe, &["shared_expert_intermediate_size=16"]),
        (BlockKind::Moe, &[]),
    ] {
        let cfg = config(kind, sets);
        let lora = LoraConfig {
            rank: 3,
            alpha: 6.0,
            dropout: 0.0,
            targets: targets(),
            seed: 1,
        };
        let model = Qwen3::new(kind, &cfg, 0).unwrap();
        let count = model.dims.param_count(None).unwrap();
        assert_eq!(
            count,
            model.trainable(Mode::Full) as u64,
            "{kind:?} {sets:?}"
        );
        let model = model.with_lora(lora, false).unwrap();
        let with_lora = model
            .dims
            .param_count(Some((3, targets().as_slice())))
            .unwrap();
        assert_eq!(
            with_lora,
            (model.trainable(Mode::Full) + model.trainable(Mode::Lora)) as u64,
            "{kind:?} {sets:?}"
        );
    }
    let huge = Qwen3Dims::from_config(
        &config(
            BlockKind::Dense,
            &["hidden_size=4294967296", "intermediate_size=4294967296"],
        ),
        BlockKind::Dense,
    )
    .unwrap();
    assert!(huge.param_count(None).is_err());
}

/// Found by an audit: zero sizes panicked in kernels, a negative epsilon trained to NaN.
#[test]
fn zero_dims_and_bad_eps_are_refused() {
    for (set, key) in [
        ("num_hidden_layers=0", "num_hidden_layers"),
        ("vocab_size=0", "vocab_size"),
        ("seq_len=0", "seq_len"),
        ("batch=0", "batch"),
        ("hidden_size=0", "hidden_size"),
        ("num_attention_heads=0", "num_attention_heads"),
        ("num_key_value_heads=0", "num_key_value_heads"),
        ("head_dim=0", "head_dim"),
        ("intermediate_size=0", "intermediate_size"),
        ("rms_norm_eps=-1", "rms_norm_eps"),
        ("rms_norm_eps=0", "rms_norm_eps"),
    ] {
        let err = Qwen3Dims::from_config(&config(BlockKind::Dense, &[set]), BlockKind::Dense)
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{set}: {err}");
    }
    let err = Qwen3Dims::from_config(&config(BlockKind::Moe, &["num_experts=0"]), BlockKind::Moe)
        .unwrap_err()
        .to_string();
    assert!(err.contains("num_experts"), "{err}");
}

/// Found by an audit: alpha NaN or infinite was accepted and trained to a NaN loss.
#[test]
fn lora_alpha_must_be_finite_and_positive() {
    let model = Qwen3::new(BlockKind::Dense, &config(BlockKind::Dense, &[]), 0).unwrap();
    for alpha in [f32::NAN, f32::INFINITY, 0.0, -2.0] {
        let lora = LoraConfig {
            rank: 2,
            alpha,
            dropout: 0.0,
            targets: targets(),
            seed: 1,
        };
        let err = model
            .clone()
            .with_lora(lora, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("alpha"), "{alpha}: {err}");
    }
}
