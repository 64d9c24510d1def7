//! Reading a [`Mamba`]'s weights from, and writing its gradients to, safetensors files under
//! Hugging Face `MambaForCausalLM` names, so `remat train --block mamba --init` starts from
//! a Hugging Face checkpoint and `--dump-grads` can be replayed in `transformers`
//! (`scripts/check_mamba_against_hf.py`).
//!
//! The weights are already in Hugging Face's layout (`nn.Linear` `[out, in]`, conv1d
//! `[Di, 1, K]`), so only names change: `backbone.embeddings.weight`,
//! `backbone.norm_f.weight`, `lm_head.weight`, and per layer `backbone.layers.{i}.` +
//! `norm.weight`, `mixer.{in_proj,x_proj,dt_proj,out_proj}.weight`,
//! `mixer.{in_proj,dt_proj,out_proj}.bias`, `mixer.conv1d.{weight,bias}`, `mixer.A_log`,
//! `mixer.D`. A gradient dump records its step (batch, loss, the model as a Hugging Face
//! config) as the Qwen3 and GPT dumps do.

use std::collections::HashSet;
use std::path::Path;

use super::{Mamba, MambaGrads};
use crate::models::batch::Batch;
use crate::models::hf_file::{
    HfError, RawTensor, check_unused, finite_f32, parse, raw_f32, read_file, step_record_parts,
    write_raw,
};

/// The Hugging Face name of layer `layer`'s parameter `key` (the spec's name).
fn layer_name(layer: usize, key: &str) -> Option<String> {
    let tail = match key {
        "norm" => "norm.weight".to_string(),
        "in_proj" | "x_proj" | "dt_proj" | "out_proj" => format!("mixer.{key}.weight"),
        "in_proj_bias" | "dt_proj_bias" | "out_proj_bias" => {
            format!("mixer.{}.bias", key.trim_end_matches("_bias"))
        }
        "conv1d_weight" => "mixer.conv1d.weight".into(),
        "conv1d_bias" => "mixer.conv1d.bias".into(),
        "A_log" | "D" => format!("mixer.{key}"),
        _ => return None,
    };
    Some(format!("backbone.layers.{layer}.{tail}"))
}

/// Which buffer a file tensor is.
#[derive(Debug, Clone, PartialEq)]
enum Source {
    Embed,
    FinalNorm,
    LmHead,
    Layer(usize, String),
}

/// Every file tensor of `model` (name, shape, buffer), in a fixed order.
fn bindings(model: &Mamba) -> Result<Vec<(String, Vec<usize>, Source)>, HfError> {
    let mut out = vec![
        (
            "backbone.embeddings.weight".to_string(),
            model.embed.shape.clone(),
            Source::Embed,
        ),
        (
            "backbone.norm_f.weight".to_string(),
            model.final_norm.shape.clone(),
            Source::FinalNorm,
        ),
        (
            "lm_head.weight".to_string(),
            model.lm_head.shape.clone(),
            Source::LmHead,
        ),
    ];
    for (l, params) in model.layers.iter().enumerate() {
        for (key, act) in params {
            let name = layer_name(l, key).ok_or_else(|| HfError::Engine {
                tensor: format!("layers.{l}.{key}"),
                message: "no Hugging Face name is known for this parameter".into(),
            })?;
            out.push((name, act.shape.clone(), Source::Layer(l, key.clone())));
        }
    }
    Ok(out)
}

fn param_mut<'m>(model: &'m mut Mamba, source: &Source) -> Option<&'m mut Vec<f32>> {
    match source {
        Source::Embed => Some(&mut model.embed.data),
        Source::FinalNorm => Some(&mut model.final_norm.data),
        Source::LmHead => Some(&mut model.lm_head.data),
        Source::Layer(l, key) => model.layers.get_mut(*l)?.get_mut(key).map(|a| &mut a.data),
    }
}

fn grad_of<'g>(grads: &'g MambaGrads, source: &Source) -> Option<&'g [f32]> {
    match source {
        Source::Embed => Some(&grads.embed),
        Source::FinalNorm => Some(&grads.final_norm),
        Source::LmHead => Some(&grads.lm_head),
        Source::Layer(l, key) => grads.layers.get(*l)?.get(key).map(Vec::as_slice),
    }
}

/// Overwrites the model's weights with the tensors of `path` (all checked first: on error
/// no weight has changed). Every weight must be there with the model's shape, finite; a
/// tensor the model does not have is an error, except a gradient dump's step record.
pub fn load_params(model: &mut Mamba, path: &Path) -> Result<(), HfError> {
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let mut staged = Vec::new();
    let mut used = HashSet::new();
    for (name, shape, source) in bindings(model)? {
        let view = st.tensor(&name).map_err(|_| HfError::Missing {
            path: path.into(),
            tensor: name.clone(),
        })?;
        if view.shape() != shape.as_slice() {
            return Err(HfError::Shape {
                path: path.into(),
                tensor: name,
                expected: shape,
                found: view.shape().to_vec(),
            });
        }
        let data = finite_f32(path, &name, &view)?;
        used.insert(name.clone());
        staged.push((name, source, data));
    }
    check_unused(
        path,
        &st,
        &used,
        "check the block config (--block-config, --block-set): its sizes, use_bias and use_conv_bias",
    )?;
    for (name, source, data) in staged {
        let target = param_mut(model, &source).ok_or_else(|| HfError::Engine {
            tensor: name.clone(),
            message: "the model has no such buffer".into(),
        })?;
        target.copy_from_slice(&data);
    }
    Ok(())
}

/// Writes the gradients of a full fine-tuning step under Hugging Face names, with the
/// step's record (`batch`, `loss`, and the model's Hugging Face config).
pub fn save_grads(
    path: &Path,
    model: &Mamba,
    grads: &MambaGrads,
    batch: &Batch,
    loss: f64,
) -> Result<(), HfError> {
    let mut tensors: Vec<RawTensor> = Vec::new();
    for (name, shape, source) in bindings(model)? {
        let grad = grad_of(grads, &source).ok_or_else(|| HfError::Engine {
            tensor: name.clone(),
            message: "the step has no gradient for this weight (LoRA trains adapters only)".into(),
        })?;
        tensors.push(raw_f32(name, shape, grad));
    }
    let (mut extra, metadata) = step_record_parts(batch, loss, 0.0, hf_config_json(model))?;
    tensors.append(&mut extra);
    write_raw(path, tensors, Some(metadata))
}

/// The model as a Hugging Face `MambaConfig` (untied LM head; the scan's chunk length,
/// which changes no value, recorded as `remat_scan_chunk`).
fn hf_config_json(model: &Mamba) -> String {
    let d = &model.dims;
    serde_json::json!({
        "model_type": "mamba",
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "intermediate_size": d.inner,
        "expand": d.inner / d.hidden.max(1),
        "state_size": d.state,
        "conv_kernel": d.conv,
        "time_step_rank": d.dt_rank,
        "num_hidden_layers": d.layers,
        "layer_norm_epsilon": d.eps,
        "use_bias": d.bias,
        "use_conv_bias": d.conv_bias,
        "hidden_act": "silu",
        "residual_in_fp32": true,
        "tie_word_embeddings": false,
        "remat_scan_chunk": d.chunk,
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{ModelConfig, Value};

    fn model(seed: u64, bias: bool) -> Mamba {
        let mut cfg = ModelConfig::default();
        for (k, v) in [
            ("vocab_size", 7),
            ("hidden_size", 4),
            ("intermediate_size", 8),
            ("state_size", 3),
            ("conv_kernel", 2),
            ("time_step_rank", 2),
            ("num_hidden_layers", 2),
            ("scan_chunk", 2),
            ("batch", 1),
            ("seq_len", 3),
        ] {
            cfg = cfg.set(k, Value::Int(v));
        }
        Mamba::new(&cfg.set("use_bias", Value::Bool(bias)), seed).unwrap()
    }

    fn write(m: &Mamba, path: &Path) {
        let tensors = bindings(m)
            .unwrap()
            .into_iter()
            .map(|(name, shape, source)| {
                let data = match &source {
                    Source::Embed => &m.embed.data,
                    Source::FinalNorm => &m.final_norm.data,
                    Source::LmHead => &m.lm_head.data,
                    Source::Layer(l, k) => &m.layers[*l][k].data,
                };
                raw_f32(name, shape, data)
            })
            .collect();
        write_raw(path, tensors, None).unwrap();
    }

    #[test]
    fn weights_round_trip_and_a_mismatched_file_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let a = model(1, false);
        let names: HashSet<_> = bindings(&a).unwrap().into_iter().map(|b| b.0).collect();
        assert!(names.contains("backbone.layers.1.mixer.conv1d.bias"));
        assert!(names.contains("backbone.layers.0.mixer.A_log"));
        let path = dir.path().join("a.safetensors");
        write(&a, &path);
        let mut b = model(2, false);
        load_params(&mut b, &path).unwrap();
        for (la, lb) in a.layers.iter().zip(&b.layers) {
            for (k, v) in la {
                assert_eq!(v.data, lb[k].data, "{k}");
            }
        }
        // A model with projection biases misses them in the file: refused, named, unchanged.
        let mut c = model(3, true);
        let before = c.layers[0]["in_proj"].data.clone();
        let err = load_params(&mut c, &path).unwrap_err().to_string();
        assert!(err.contains("backbone.layers.0.mixer."), "{err}");
        assert_eq!(c.layers[0]["in_proj"].data, before);
    }
}
