//! `--init` / `--dump-grads` file format: Hugging Face names, `[out, in]` Linear layouts.

use remat_engine::MemoryPool;
use std::sync::Arc;

use remat_engine::core::kernels::IGNORE_INDEX;
use remat_engine::models::gpt::hf::{
    HfError, StepRecord, hf_shape, load_params, save_step, save_tensors,
};
use remat_engine::models::gpt::{Batch, Gpt, GptConfig};
use safetensors::SafeTensors;

fn config(seed: u64) -> GptConfig {
    GptConfig {
        vocab: 11,
        d_model: 8,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        ffn_hidden: 12,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        dropout: 0.0,
        init_seed: seed,
    }
}

#[test]
fn save_then_load_round_trips_in_hf_layout() {
    let tmp = tempdir("roundtrip");
    let dir = tmp.path().to_path_buf();
    let path = dir.join("params.safetensors");
    let pool = MemoryPool::unbounded();
    let a = Gpt::new(&pool, config(1)).unwrap();
    save_tensors(&path, &a.params()).unwrap();

    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    // k_proj: engine [d_model, kv_heads*head_dim] = [8, 4] -> HF [4, 8].
    assert_eq!(
        st.tensor("model.layers.1.self_attn.k_proj.weight")
            .unwrap()
            .shape(),
        &[4, 8]
    );
    assert_eq!(
        st.tensor("model.layers.0.mlp.down_proj.weight")
            .unwrap()
            .shape(),
        &[8, 12]
    );
    assert_eq!(
        st.tensor("model.embed_tokens.weight").unwrap().shape(),
        &[11, 8]
    );
    assert_eq!(st.tensor("lm_head.weight").unwrap().shape(), &[11, 8]);
    // Element (out=o, in=i) of HF k_proj is engine element [i, o].
    let k = a.blocks[1].k_proj.to_vec::<f32>().unwrap();
    let hf = st.tensor("model.layers.1.self_attn.k_proj.weight").unwrap();
    let v = |o: usize, i: usize| {
        f32::from_le_bytes(hf.data()[4 * (o * 8 + i)..][..4].try_into().unwrap())
    };
    assert_eq!(v(3, 5), k[5 * 4 + 3]);

    let b = Gpt::new(&pool, config(2)).unwrap();
    assert_ne!(
        a.params()[3].1.to_vec::<f32>().unwrap(),
        b.params()[3].1.to_vec::<f32>().unwrap()
    );
    load_params(&b, &path).unwrap();
    for ((name, x), (_, y)) in a.params().iter().zip(b.params()) {
        assert_eq!(
            x.to_vec::<f32>().unwrap(),
            y.to_vec::<f32>().unwrap(),
            "{name}"
        );
    }
    assert!(!dir.join("params.safetensors.tmp").exists());
}

#[test]
fn wrong_shapes_and_missing_tensors_are_named() {
    let tmp = tempdir("errors");
    let dir = tmp.path().to_path_buf();
    let path = dir.join("small.safetensors");
    let pool = MemoryPool::unbounded();
    let small = Gpt::new(&pool, config(1)).unwrap();
    save_tensors(&path, &small.params()).unwrap();
    let wider = Gpt::new(
        &pool,
        GptConfig {
            ffn_hidden: 16,
            ..config(1)
        },
    )
    .unwrap();
    let err = load_params(&wider, &path).unwrap_err();
    assert!(matches!(err, HfError::Shape { .. }), "{err}");
    assert!(
        err.to_string().contains(
            "model.layers.0.mlp.gate_proj.weight has shape [12, 8], the model needs [16, 8]"
        ),
        "{err}"
    );

    let partial: Vec<_> = small
        .params()
        .into_iter()
        .filter(|(n, _)| n != "model.norm.weight")
        .collect();
    save_tensors(&path, &partial).unwrap();
    let err = load_params(&small, &path).unwrap_err();
    assert!(
        err.to_string()
            .contains("tensor model.norm.weight is missing"),
        "{err}"
    );

    std::fs::write(&path, b"not a safetensors file").unwrap();
    assert!(matches!(
        load_params(&small, &path).unwrap_err(),
        HfError::Format { .. }
    ));
    assert_eq!(hf_shape("model.norm.weight", &[8]), vec![8]);
}

#[test]
fn a_file_without_lm_head_is_read_as_tied_embeddings() {
    let tmp = tempdir("tied");
    let dir = tmp.path().to_path_buf();
    let path = dir.join("tied.safetensors");
    let pool = MemoryPool::unbounded();
    let a = Gpt::new(&pool, config(1)).unwrap();
    let no_head: Vec<_> = a
        .params()
        .into_iter()
        .filter(|(n, _)| n != "lm_head.weight")
        .collect();
    save_tensors(&path, &no_head).unwrap();
    let b = Gpt::new(&pool, config(2)).unwrap();
    load_params(&b, &path).unwrap();
    let (e, h) = (
        a.embed.to_vec::<f32>().unwrap(),
        b.lm_head.to_vec::<f32>().unwrap(),
    );
    // Head [d, vocab] = embedding [vocab, d] transposed.
    assert_eq!(h[3 * 11 + 7], e[7 * 8 + 3]);
}

/// A dump records its step: the batch (skipped targets as PyTorch's -100), the loss and the
/// model as a Hugging Face config; and it still loads as parameters.
#[test]
fn a_gradient_dump_records_its_batch_loss_and_model() {
    let tmp = tempdir("step");
    let dir = tmp.path().to_path_buf();
    let path = dir.join("grads.safetensors");
    let pool = MemoryPool::unbounded();
    let a = Gpt::new(&pool, config(1)).unwrap();
    let batch = Batch {
        tokens: Arc::from(vec![1u32, 2, 3, 4, 5, 6]),
        targets: Arc::from(vec![IGNORE_INDEX, 3, 4, IGNORE_INDEX, 10, 0]),
        batch: 2,
        seq: 3,
    };
    let record = StepRecord {
        batch: &batch,
        loss: 2.25,
        config: &a.config,
    };
    save_step(&path, &a.params(), &record).unwrap();

    let bytes = std::fs::read(&path).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().as_ref().unwrap();
    assert_eq!(meta["remat.loss"], "2.25");
    assert_eq!(meta["remat.dropout"], "0.0");
    let hf: serde_json::Value = serde_json::from_str(&meta["remat.hf_config"]).unwrap();
    assert_eq!(hf["vocab_size"], 11);
    assert_eq!(hf["hidden_size"], 8);
    assert_eq!(hf["num_key_value_heads"], 1);
    assert_eq!(hf["intermediate_size"], 12);
    assert_eq!(hf["tie_word_embeddings"], false);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| {
        let t = st.tensor(name).unwrap();
        assert_eq!(
            (t.dtype(), t.shape()),
            (safetensors::Dtype::I64, &[2, 3][..])
        );
        t.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect::<Vec<_>>()
    };
    assert_eq!(ints("remat.input_ids"), [1, 2, 3, 4, 5, 6]);
    assert_eq!(ints("remat.labels"), [-100, 3, 4, -100, 10, 0]);

    // The step record is not a parameter: the dump loads as one model's parameters.
    let b = Gpt::new(&pool, config(2)).unwrap();
    load_params(&b, &path).unwrap();
    assert_eq!(
        a.params()[0].1.to_vec::<f32>().unwrap(),
        b.params()[0].1.to_vec::<f32>().unwrap()
    );

    // A batch whose buffers disagree with its shape is refused before anything is written.
    let bad = Batch {
        batch: 3,
        ..batch.clone()
    };
    let err = save_step(
        &dir.join("bad.safetensors"),
        &a.params(),
        &StepRecord {
            batch: &bad,
            ..record
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("remat.input_ids"), "{err}");
    assert!(!dir.join("bad.safetensors").exists());
}

/// A fresh directory, removed with everything in it when the returned guard drops.
fn tempdir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("remat-gpt-hf-{name}-"))
        .tempdir()
        .unwrap()
}
