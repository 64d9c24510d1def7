//! Reading a [`Qwen3`]'s weights from, and writing its gradients to, safetensors files
//! under Hugging Face names, so `remat train --block qwen3 --init` starts from a
//! Hugging Face checkpoint and `--dump-grads` can be checked against `transformers`.
//!
//! The model keeps its weights in Hugging Face's layout already (`nn.Linear` `[out, in]`),
//! so only names change: `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight`,
//! and per layer `model.layers.{i}.` + `input_layernorm.weight`,
//! `post_attention_layernorm.weight`, `self_attn.{q,k,v,o}_proj.weight`,
//! `self_attn.{q,k,v}_proj.bias`, `self_attn.{q,k}_norm.weight`, `mlp.{gate,up,down}_proj.weight`;
//! for the MoE block `mlp.gate.weight` (the router), `mlp.experts.{e}.{gate,up,down}_proj.weight`
//! (one tensor per expert, as released Qwen3-MoE checkpoints store them) and
//! `mlp.shared_expert.{gate,up,down}_proj.weight`.
//!
//! A gradient dump also records its step exactly as the GPT's does
//! ([`crate::models::gpt::hf`], through [`crate::models::hf_file`]): the batch, the loss, and the model as a Hugging Face config.

use std::collections::HashSet;
use std::path::Path;

use super::{BlockKind, Qwen3, Qwen3Dims, Qwen3Grads};
use crate::models::batch::Batch;
use crate::models::hf_file::{
    HfError, RawTensor, check_unused, finite_f32, parse, raw_f32, read_file, step_record_parts,
    write_raw,
};

/// Which of the model's buffers a file tensor is, and where in it.
#[derive(Debug, Clone, PartialEq)]
enum Source {
    Embed,
    FinalNorm,
    LmHead,
    /// A layer's parameter under the spec's name.
    Layer(usize, String),
}

/// One file tensor: its name and shape, and the elements `offset..offset + len` of a model
/// buffer it holds (a whole buffer, or one expert of a stacked `[experts, ...]` buffer).
#[derive(Debug, Clone)]
struct Binding {
    name: String,
    shape: Vec<usize>,
    source: Source,
    offset: usize,
}

impl Binding {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The Hugging Face name of a layer parameter (spec name `key`), `None` for the stacked
/// expert buffers, which [`bindings`] splits per expert.
fn layer_name(layer: usize, key: &str) -> Option<String> {
    let tail = match key {
        "input_layernorm" | "post_attention_layernorm" => format!("{key}.weight"),
        "q_proj" | "k_proj" | "v_proj" | "o_proj" | "q_norm" | "k_norm" => {
            format!("self_attn.{key}.weight")
        }
        "q_bias" | "k_bias" | "v_bias" => format!("self_attn.{}_proj.bias", &key[..1]),
        "gate_proj" | "up_proj" | "down_proj" => format!("mlp.{key}.weight"),
        "router" => "mlp.gate.weight".into(),
        "shared_gate_proj" | "shared_up_proj" | "shared_down_proj" => {
            format!("mlp.shared_expert.{}.weight", &key["shared_".len()..])
        }
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{tail}"))
}

/// Every file tensor of `model`, in a fixed order.
fn bindings(model: &Qwen3) -> Result<Vec<Binding>, HfError> {
    let whole = |name: &str, shape: &[usize], source: Source| Binding {
        name: name.into(),
        shape: shape.to_vec(),
        source,
        offset: 0,
    };
    let mut out = vec![
        whole(
            "model.embed_tokens.weight",
            &model.embed.shape,
            Source::Embed,
        ),
        whole(
            "model.norm.weight",
            &model.final_norm.shape,
            Source::FinalNorm,
        ),
        whole("lm_head.weight", &model.lm_head.shape, Source::LmHead),
    ];
    for (l, params) in model.layers.iter().enumerate() {
        for (key, act) in params {
            let source = Source::Layer(l, key.clone());
            if let Some(name) = layer_name(l, key) {
                out.push(whole(&name, &act.shape, source));
                continue;
            }
            let proj = match key.as_str() {
                "experts_gate" => "gate_proj",
                "experts_up" => "up_proj",
                "experts_down" => "down_proj",
                _ => {
                    return Err(HfError::Engine {
                        tensor: format!("layers.{l}.{key}"),
                        message: "no Hugging Face name is known for this parameter".into(),
                    });
                }
            };
            let (experts, per) = (act.shape[0], act.shape[1..].to_vec());
            let len: usize = per.iter().product();
            for e in 0..experts {
                out.push(Binding {
                    name: format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight"),
                    shape: per.clone(),
                    source: source.clone(),
                    offset: e * len,
                });
            }
        }
    }
    Ok(out)
}

fn param_mut<'m>(model: &'m mut Qwen3, source: &Source) -> Option<&'m mut Vec<f32>> {
    match source {
        Source::Embed => Some(&mut model.embed.data),
        Source::FinalNorm => Some(&mut model.final_norm.data),
        Source::LmHead => Some(&mut model.lm_head.data),
        Source::Layer(l, key) => model.layers.get_mut(*l)?.get_mut(key).map(|a| &mut a.data),
    }
}

fn grad_of<'g>(grads: &'g Qwen3Grads, source: &Source) -> Option<&'g [f32]> {
    match source {
        Source::Embed => Some(&grads.embed),
        Source::FinalNorm => Some(&grads.final_norm),
        Source::LmHead => Some(&grads.lm_head),
        Source::Layer(l, key) => grads.layers.get(*l)?.get(key).map(Vec::as_slice),
    }
}

/// Overwrites the model's weights with the tensors of `path` (all checked first: on error
/// no weight has changed). Every weight must be in the file, with the model's shape, in
/// f32, f64, bf16 or f16, and finite; a tensor the model does not have is an error, except
/// a gradient dump's step record (`remat.*`).
pub fn load_params(model: &mut Qwen3, path: &Path) -> Result<(), HfError> {
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let mut staged = Vec::new();
    let mut used = HashSet::new();
    for b in bindings(model)? {
        let view = st.tensor(&b.name).map_err(|_| HfError::Missing {
            path: path.into(),
            tensor: b.name.clone(),
        })?;
        if view.shape() != b.shape.as_slice() {
            return Err(HfError::Shape {
                path: path.into(),
                tensor: b.name,
                expected: b.shape,
                found: view.shape().to_vec(),
            });
        }
        let data = finite_f32(path, &b.name, &view)?;
        used.insert(b.name.clone());
        staged.push((b, data));
    }
    check_unused(
        path,
        &st,
        &used,
        "check the block config (--block-config, --block-set): its sizes, \
         attention_bias (q, k and v only) and use_qk_norm",
    )?;
    for (b, data) in staged {
        let target = param_mut(model, &b.source).ok_or_else(|| HfError::Engine {
            tensor: b.name.clone(),
            message: "the model has no such buffer".into(),
        })?;
        target[b.offset..b.offset + b.len()].copy_from_slice(&data);
    }
    Ok(())
}

/// Writes the gradients of a full fine-tuning step under Hugging Face names, with the
/// step's record (`batch`, `loss`, and the model's Hugging Face config).
pub fn save_grads(
    path: &Path,
    model: &Qwen3,
    grads: &Qwen3Grads,
    batch: &Batch,
    loss: f64,
) -> Result<(), HfError> {
    let mut tensors: Vec<RawTensor> = Vec::new();
    for b in bindings(model)? {
        let grad = grad_of(grads, &b.source)
            .and_then(|g| g.get(b.offset..b.offset + b.len()))
            .ok_or_else(|| HfError::Engine {
                tensor: b.name.clone(),
                message: "the step has no gradient for this weight (LoRA trains adapters only)"
                    .into(),
            })?;
        tensors.push(raw_f32(b.name.clone(), b.shape.clone(), grad));
    }
    let (mut extra, metadata) = step_record_parts(batch, loss, 0.0, hf_config_json(model))?;
    tensors.append(&mut extra);
    write_raw(path, tensors, Some(metadata))
}

/// The model as a Hugging Face config: `qwen3` (QK-norm, optional attention bias),
/// `qwen2` (bias, no QK-norm) or `llama` (neither) for the dense block; `qwen3_moe` for
/// the MoE block (a shared expert, which Qwen3-MoE lacks, is flagged in the config).
fn hf_config_json(model: &Qwen3) -> String {
    let d: &Qwen3Dims = &model.dims;
    let mut c = serde_json::json!({
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "rope_theta": d.theta,
        "rms_norm_eps": d.eps,
        "attention_bias": d.bias,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "max_position_embeddings": d.seq.max(1),
    });
    if d.qk_norm && d.bias {
        // transformers' Qwen3 with `attention_bias` also biases o_proj; this block biases
        // q, k and v only (Qwen2's choice), so no transformers model computes it.
        c["remat_attention_bias"] =
            "q, k and v only, with QK-norm (no transformers model matches)".into();
    }
    let model_type = match model.kind {
        BlockKind::Dense => {
            c["intermediate_size"] = d.intermediate.into();
            match (d.qk_norm, d.bias) {
                (true, _) => "qwen3",
                (false, true) => "qwen2",
                (false, false) => "llama",
            }
        }
        BlockKind::Moe => {
            c["num_experts"] = d.experts.into();
            c["num_experts_per_tok"] = d.top_k.into();
            c["moe_intermediate_size"] = d.moe_intermediate.into();
            c["intermediate_size"] = d.moe_intermediate.into();
            c["norm_topk_prob"] = d.norm_topk.into();
            c["decoder_sparse_step"] = 1.into();
            c["mlp_only_layers"] = serde_json::json!([]);
            c["output_router_logits"] = false.into();
            if d.shared_intermediate > 0 {
                // Qwen2-MoE gates its shared expert with a sigmoid; this one is added as
                // is, so no `transformers` model computes it: say so instead of a type.
                c["shared_expert_intermediate_size"] = d.shared_intermediate.into();
                c["remat_shared_expert"] = "ungated (no transformers model matches)".into();
            }
            "qwen3_moe"
        }
    };
    c["model_type"] = model_type.into();
    c.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{ModelConfig, Value};

    fn model(kind: BlockKind, seed: u64) -> Qwen3 {
        let mut cfg = ModelConfig::default();
        for (k, v) in [
            ("vocab_size", 7),
            ("hidden_size", 8),
            ("num_attention_heads", 2),
            ("num_key_value_heads", 1),
            ("head_dim", 4),
            ("intermediate_size", 12),
            ("num_hidden_layers", 2),
            ("num_experts", 3),
            ("num_experts_per_tok", 2),
            ("moe_intermediate_size", 5),
            ("batch", 2),
            ("seq_len", 3),
        ] {
            cfg = cfg.set(k, Value::Int(v));
        }
        Qwen3::new(kind, &cfg, seed).unwrap()
    }

    #[test]
    fn names_cover_every_weight_once() {
        for kind in [BlockKind::Dense, BlockKind::Moe] {
            let m = model(kind, 1);
            let b = bindings(&m).unwrap();
            let names: HashSet<_> = b.iter().map(|b| b.name.clone()).collect();
            assert_eq!(names.len(), b.len(), "{kind:?}: a name is used twice");
            let bound: usize = b.iter().map(Binding::len).sum();
            let total: usize = m.embed.data.len()
                + m.final_norm.data.len()
                + m.lm_head.data.len()
                + m.layers
                    .iter()
                    .flat_map(|l| l.values())
                    .map(|a| a.data.len())
                    .sum::<usize>();
            assert_eq!(
                bound, total,
                "{kind:?}: every element is in exactly one tensor"
            );
        }
        let moe = bindings(&model(BlockKind::Moe, 1)).unwrap();
        let e2 = moe
            .iter()
            .find(|b| b.name == "model.layers.1.mlp.experts.2.down_proj.weight")
            .unwrap();
        assert_eq!((e2.shape.as_slice(), e2.offset), (&[8, 5][..], 2 * 40));
        assert!(
            moe.iter()
                .any(|b| b.name == "model.layers.0.mlp.gate.weight")
        );
    }

    #[test]
    fn weights_round_trip_through_a_file_and_bad_files_change_nothing() {
        let dir = tempfile::tempdir().unwrap();
        for kind in [BlockKind::Dense, BlockKind::Moe] {
            let a = model(kind, 1);
            let path = dir.path().join(format!("{kind:?}.safetensors"));
            let tensors = bindings(&a)
                .unwrap()
                .into_iter()
                .map(|b| {
                    let src = match &b.source {
                        Source::Embed => &a.embed.data,
                        Source::FinalNorm => &a.final_norm.data,
                        Source::LmHead => &a.lm_head.data,
                        Source::Layer(l, k) => &a.layers[*l][k].data,
                    };
                    raw_f32(
                        b.name.clone(),
                        b.shape.clone(),
                        &src[b.offset..b.offset + b.len()],
                    )
                })
                .collect();
            write_raw(&path, tensors, None).unwrap();
            let mut b = model(kind, 2);
            assert_ne!(a.layers[1]["q_proj"].data, b.layers[1]["q_proj"].data);
            load_params(&mut b, &path).unwrap();
            assert_eq!(a.embed.data, b.embed.data);
            for (la, lb) in a.layers.iter().zip(&b.layers) {
                for (k, v) in la {
                    assert_eq!(v.data, lb[k].data, "{kind:?} {k}");
                }
            }
            // A file of the other block kind is refused, naming a tensor, and leaves the
            // model as it was.
            let other = if kind == BlockKind::Dense {
                BlockKind::Moe
            } else {
                BlockKind::Dense
            };
            let mut c = model(other, 3);
            let before = c.layers[0]["q_proj"].data.clone();
            let err = load_params(&mut c, &path).unwrap_err().to_string();
            assert!(err.contains("model.layers.0.mlp"), "{err}");
            assert_eq!(c.layers[0]["q_proj"].data, before);
        }
    }
}
