//! Reading and writing a [`Gpt`]'s tensors as Hugging Face Llama/Qwen safetensors.
//!
//! Names are those of [`Gpt::params`]. Layouts in the file are Hugging Face's: the
//! embedding `[vocab, d_model]`, norms `[d_model]`, and every `nn.Linear` weight
//! (`*_proj.weight`, `lm_head.weight`) `[out, in]`; the engine keeps projections `[in, out]`,
//! so those are transposed on the way in and out. Files are written as f32; reading accepts
//! f32, f64, bf16 and f16. A file without `lm_head.weight` is read as a tied-embedding
//! model (Qwen's small checkpoints): the head is the embedding's transpose.
//!
//! A gradient dump ([`save_step`]) also records its step, so that another framework can
//! replay it: the batch as `remat.input_ids` and `remat.labels` (I64 `[batch, seq]`, labels
//! already shifted: label `t` is the target of position `t`; skipped targets are -100, as in
//! PyTorch; the loss is the mean cross-entropy over the other labels), and in the header's `__metadata__`
//! `remat.loss` (the step's loss), `remat.dropout` and `remat.hf_config` (the model as a
//! Hugging Face `LlamaConfig` JSON). Tensors under `remat.` are not parameters:
//! [`load_params`] skips them, so a dump still loads as parameters of the same shapes.
//! `scripts/check_against_hf.py` replays a dump in `transformers`' `LlamaForCausalLM`.

use std::collections::HashMap;
use std::path::Path;

use super::{Batch, Gpt, GptConfig};
use crate::core::tensor::Tensor;
pub use crate::models::hf_file::{HfError, RECORD_PREFIX, TORCH_IGNORE_INDEX, check_target};
use crate::models::hf_file::{
    RawTensor, check_unused, finite_f32, parse, raw_f32, read_file, step_record_parts, write_raw,
};

/// Whether the engine stores `name` transposed relative to Hugging Face (`nn.Linear`).
pub fn is_linear(name: &str) -> bool {
    name.ends_with("_proj.weight") || name == "lm_head.weight"
}

/// A tensor's shape in the file for the engine shape `shape`.
pub fn hf_shape(name: &str, shape: &[usize]) -> Vec<usize> {
    match shape {
        [a, b] if is_linear(name) => vec![*b, *a],
        _ => shape.to_vec(),
    }
}

/// `[rows, cols]` row-major to `[cols, rows]`.
fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    out
}

/// Overwrites the model's parameters with the tensors of `path` (all checked first: on
/// error no parameter has changed).
pub fn load_params(gpt: &Gpt, path: &Path) -> Result<(), HfError> {
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let mut staged = Vec::new();
    let mut used = std::collections::HashSet::new();
    for (name, t) in gpt.params() {
        let (source, tied) = match st.tensor(&name) {
            Ok(v) => (v, false),
            Err(_) if name == "lm_head.weight" => match st.tensor("model.embed_tokens.weight") {
                Ok(v) => (v, true),
                Err(_) => {
                    return Err(HfError::Missing {
                        path: path.into(),
                        tensor: name,
                    });
                }
            },
            Err(_) => {
                return Err(HfError::Missing {
                    path: path.into(),
                    tensor: name,
                });
            }
        };
        // A tied head reads the embedding `[vocab, d]`, which is the head's HF `[out, in]`.
        let expected = hf_shape(&name, t.shape());
        if source.shape() != expected.as_slice() {
            let tensor = if tied {
                "model.embed_tokens.weight (tied lm_head)".to_string()
            } else {
                name
            };
            return Err(HfError::Shape {
                path: path.into(),
                tensor,
                expected,
                found: source.shape().to_vec(),
            });
        }
        used.insert(if tied {
            "model.embed_tokens.weight".to_string()
        } else {
            name.clone()
        });
        let read_as = if tied {
            "model.embed_tokens.weight"
        } else {
            name.as_str()
        };
        let mut data = finite_f32(path, read_as, &source)?;
        if is_linear(&name) {
            data = transpose(&data, expected[0], expected[1]);
        }
        staged.push((name, t, data));
    }
    check_unused(
        path,
        &st,
        &used,
        "check --layers, --d-model, --heads and --kv-heads; the model has no biases",
    )?;
    for (name, t, data) in staged {
        let engine = |e: crate::EngineError| HfError::Engine {
            tensor: name.clone(),
            message: e.to_string(),
        };
        let mut w = t.write();
        w.as_mut_slice::<f32>()
            .map_err(engine)?
            .copy_from_slice(&data);
    }
    Ok(())
}

/// Writes `(name, tensor)` pairs (engine layout, f32) to `path` in Hugging Face layout:
/// to a temporary file, synced, then renamed, so a reader never sees a partial file.
pub fn save_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), HfError> {
    write_file(path, tensors, Vec::new(), None)
}

/// What a gradient dump records about the step that produced it (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct StepRecord<'a> {
    pub batch: &'a Batch,
    pub loss: f64,
    pub config: &'a GptConfig,
}

/// Writes a step's gradients (engine layout, f32) like [`save_tensors`], plus the step's
/// record: its batch as I64 tensors and its loss and model in the header's metadata.
pub fn save_step(
    path: &Path,
    grads: &[(String, Tensor)],
    record: &StepRecord<'_>,
) -> Result<(), HfError> {
    let (extra, metadata) = step_record_parts(
        record.batch,
        record.loss,
        record.config.dropout,
        hf_config_json(record.config),
    )?;
    write_file(path, grads, extra, Some(metadata))
}

/// The model as a Hugging Face `LlamaConfig` (the block is Llama's: RMSNorm, rotate-half
/// RoPE, SwiGLU, no biases, an untied head).
fn hf_config_json(c: &GptConfig) -> String {
    serde_json::json!({
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": c.vocab,
        "hidden_size": c.d_model,
        "intermediate_size": c.ffn_hidden,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim(),
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.norm_eps,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": false,
        "max_position_embeddings": 4096,
    })
    .to_string()
}

fn write_file(
    path: &Path,
    tensors: &[(String, Tensor)],
    mut extra: Vec<RawTensor>,
    metadata: Option<HashMap<String, String>>,
) -> Result<(), HfError> {
    let mut buffers = Vec::with_capacity(tensors.len() + extra.len());
    for (name, t) in tensors {
        let engine = |e: crate::EngineError| HfError::Engine {
            tensor: name.clone(),
            message: e.to_string(),
        };
        let mut data = t.to_vec::<f32>().map_err(engine)?;
        let shape = hf_shape(name, t.shape());
        if is_linear(name) && t.shape().len() == 2 {
            data = transpose(&data, t.shape()[0], t.shape()[1]);
        }
        buffers.push(raw_f32(name.clone(), shape, &data));
    }
    buffers.append(&mut extra);
    write_raw(path, buffers, metadata)
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::PathBuf;

    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("remat-hf-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn tiny(n_layers: usize) -> Gpt {
        let config = super::super::GptConfig {
            vocab: 5,
            d_model: 4,
            n_layers,
            n_heads: 2,
            n_kv_heads: 2,
            ffn_hidden: 4,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            dropout: 0.0,
            init_seed: 1,
        };
        Gpt::new(&crate::MemoryPool::unbounded(), config).unwrap()
    }

    /// A safetensors file from a raw JSON header and data bytes.
    fn raw(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn malformed_files_get_a_sentence_not_a_debug_name() {
        let dir = scratch("format");
        let path = dir.join("bad.safetensors");
        let gpt = tiny(1);
        let f32s = r#""dtype":"F32","shape":[4]"#;
        let cases: [(Vec<u8>, &str); 5] = [
            (
                [u64::MAX.to_le_bytes().as_slice(), b"{}"].concat(),
                "larger than the safetensors limit",
            ),
            (
                raw(
                    &format!(r#"{{"a":{{{f32s},"data_offsets":[0,12]}}}}"#),
                    &[0; 12],
                ),
                "does not match the size of its shape and dtype",
            ),
            (
                raw(
                    &format!(r#"{{"a":{{{f32s},"data_offsets":[0,16]}}}}"#),
                    &[0; 20],
                ),
                "the file is truncated, or has bytes after the last tensor",
            ),
            (
                raw(
                    &format!(
                        r#"{{"model.norm.weight":{{{f32s},"data_offsets":[8,24]}},"lm_head.weight":{{{f32s},"data_offsets":[0,16]}}}}"#
                    ),
                    &[0; 24],
                ),
                "overlap or leave a gap",
            ),
            (b"1234".to_vec(), "shorter than the 8 bytes"),
        ];
        for (bytes, needle) in cases {
            fs::write(&path, bytes).unwrap();
            let err = load_params(&gpt, &path).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
            for debug_name in [
                "HeaderTooLarge",
                "TensorInvalidInfo",
                "InvalidOffset",
                "Metadata",
            ] {
                assert!(!err.contains(debug_name), "{err}");
            }
            // The crate names lm_head for an overlap of model.norm; name neither.
            assert!(!err.contains("lm_head"), "{err}");
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn non_finite_weights_are_refused_naming_the_tensor() {
        let dir = scratch("nan");
        let path = dir.join("nan.safetensors");
        let src = tiny(1);
        for bad in [f32::NAN, f32::INFINITY] {
            src.final_norm.write().as_mut_slice::<f32>().unwrap()[2] = bad;
            save_tensors(&path, &src.params()).unwrap();
            let dst = tiny(1);
            let before = dst.final_norm.to_vec::<f32>().unwrap();
            let err = load_params(&dst, &path).unwrap_err();
            assert!(matches!(err, HfError::NonFinite { index: 2, .. }), "{err}");
            assert!(err.to_string().contains("model.norm.weight"), "{err}");
            assert_eq!(dst.final_norm.to_vec::<f32>().unwrap(), before);
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tensors_the_model_does_not_have_are_refused_naming_them() {
        let dir = scratch("extra");
        let path = dir.join("extra.safetensors");
        // A 2-layer checkpoint into a 1-layer model.
        save_tensors(&path, &tiny(2).params()).unwrap();
        let err = load_params(&tiny(1), &path).unwrap_err().to_string();
        assert!(
            err.contains("9 tensor(s)") && err.contains("model.layers.1.mlp.up_proj.weight"),
            "{err}"
        );
        // A bias the model does not have.
        let gpt = tiny(1);
        let mut named = gpt.params();
        named.push((
            "model.layers.0.self_attn.q_proj.bias".into(),
            gpt.final_norm.clone(),
        ));
        save_tensors(&path, &named).unwrap();
        let err = load_params(&gpt, &path).unwrap_err().to_string();
        assert!(
            err.contains("model.layers.0.self_attn.q_proj.bias"),
            "{err}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
