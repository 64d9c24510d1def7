use super::*;

fn tiny() -> GptConfig {
    GptConfig {
        vocab: 13,
        d_model: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        ffn_hidden: 24,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        dropout: 0.0,
        init_seed: 7,
    }
}

#[test]
fn param_count_matches_the_tensors() {
    let pool = MemoryPool::unbounded();
    let gpt = Gpt::new(&pool, tiny()).unwrap();
    let total: usize = gpt.params().iter().map(|(_, t)| t.numel()).sum();
    assert_eq!(total, tiny().param_count());
    assert_eq!(
        pool.stats().category(Category::Parameters).live,
        4 * total as u64
    );
    let names: Vec<String> = gpt.params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names[0], "model.embed_tokens.weight");
    assert_eq!(names[2], "model.layers.0.self_attn.q_proj.weight");
    assert_eq!(names.last().unwrap(), "lm_head.weight");
}

#[test]
fn invalid_configs_name_the_field() {
    let bad = GptConfig {
        n_kv_heads: 3,
        ..tiny()
    };
    assert!(
        bad.validate()
            .unwrap_err()
            .to_string()
            .contains("n_kv_heads 3 must divide n_heads 4")
    );
    let bad = GptConfig {
        d_model: 18,
        ..tiny()
    };
    assert!(
        bad.validate()
            .unwrap_err()
            .to_string()
            .contains("n_heads 4 must divide d_model 18")
    );
    let bad = GptConfig {
        dropout: 1.0,
        ..tiny()
    };
    assert!(bad.validate().is_err());
}

#[test]
fn checkpointing_parses_and_prints() {
    for s in [
        "store-all",
        "recompute-all",
        "every:3",
        "depth:2",
        "sqrt",
        "per-block",
        "blocks:2",
        "sqrt-blocks",
    ] {
        assert_eq!(s.parse::<Checkpointing>().unwrap().to_string(), s);
    }
    let err = "weekly".parse::<Checkpointing>().unwrap_err().to_string();
    assert!(err.contains("weekly") && err.contains("per-block"), "{err}");
    assert_eq!(Checkpointing::SqrtBlocks.blocks_per_segment(8), Some(3));
    assert_eq!(Checkpointing::PerBlock.blocks_per_segment(8), Some(1));
}

#[test]
fn initial_loss_is_near_log_vocab() {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let gpt = Gpt::new(&pool, tiny()).unwrap();
    let n = 2 * 5;
    let batch = Batch {
        tokens: (0..n as u32).map(|i| i % 13).collect(),
        targets: (0..n as u32).map(|i| (i * 7) % 13).collect(),
        batch: 2,
        seq: 5,
    };
    let out = gpt
        .forward_backward(&ctx, &batch, Checkpointing::Graph(Policy::StoreAll), 0)
        .unwrap();
    assert!((out.loss - (13f64).ln()).abs() < 0.05, "loss {}", out.loss);
    assert!(out.grads.iter().all(Option::is_some));
}

#[test]
fn huge_models_are_errors_naming_the_sizes_not_aborts() {
    // Overflowing parameter counts.
    for cfg in [
        GptConfig {
            d_model: 1 << 62,
            n_heads: 2,
            n_kv_heads: 2,
            ..tiny()
        },
        GptConfig {
            n_layers: 1 << 60,
            ..tiny()
        },
        GptConfig {
            ffn_hidden: 1 << 62,
            ..tiny()
        },
        GptConfig {
            vocab: 1 << 62,
            ..tiny()
        },
    ] {
        let err = Gpt::new(&MemoryPool::unbounded(), cfg)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("more parameter bytes than a process can address"),
            "{err}"
        );
    }
    // Representable but far over a budget: the pool's error before any weight is built.
    let cfg = GptConfig {
        d_model: 1 << 20,
        n_heads: 2,
        n_kv_heads: 2,
        ..tiny()
    };
    let pool = MemoryPool::with_budget(1 << 20);
    let err = Gpt::new(&pool, cfg.clone()).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory { .. }), "{err}");
    assert!(err.to_string().contains("node parameters"), "{err}");
    assert_eq!(pool.stats().peak, 0);
    // Without a budget, more than the machine can map: a typed error, not an abort.
    let cfg = GptConfig {
        vocab: 1 << 40,
        d_model: 1 << 12,
        n_heads: 2,
        n_kv_heads: 2,
        ..tiny()
    };
    let err = Gpt::new(&MemoryPool::unbounded(), cfg)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cannot allocate") && err.contains("model.embed_tokens.weight"),
        "{err}"
    );
}
