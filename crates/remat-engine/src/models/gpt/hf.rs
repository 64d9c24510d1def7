//! Reading and writing a [`Gpt`]'s tensors as Hugging Face Llama/Qwen safetensors.
//!
//! Names are those of [`Gpt::params`]. Layouts in the file are Hugging Face's: the
//! embedding `[vocab, d_model]`, norms `[d_model]`, and every `nn.Linear` weight
//! (`*_proj.weight`, `lm_head.weight`) `[out, in]`; the engine keeps projections `[in, out]`,
//! so those are transposed on the way in and out. Files are written as f32; reading accepts
//! f32, f64, bf16 and f16. A file without `lm_head.weight` is read as a tied-embedding
//! model (Qwen's small checkpoints): the head is the embedding's transpose.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use super::Gpt;
use crate::tensor::Tensor;

/// What can go wrong reading or writing a safetensors file; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// The OS error is part of the message and deliberately not a `source()`: reporters
    /// that print the cause chain (anyhow's `{:#}`) would show it twice.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: not a valid safetensors file: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{path}: tensor {tensor} is missing")]
    Missing { path: PathBuf, tensor: String },
    #[error(
        "{path}: tensor {tensor} has shape {found:?}, the model needs {expected:?} (Hugging Face layout)"
    )]
    Shape {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{path}: tensor {tensor} has dtype {dtype}, expected f32, f64, bf16 or f16")]
    DType {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("tensor {tensor}: {message}")]
    Engine { tensor: String, message: String },
}

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

fn to_f32(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, HfError> {
    let bytes = view.data();
    let chunks = |n: usize| bytes.chunks_exact(n);
    Ok(match view.dtype() {
        Dtype::F32 => chunks(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F64 => chunks(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f32)
            .collect(),
        Dtype::BF16 => chunks(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => chunks(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(HfError::DType {
                path: path.into(),
                tensor: name.into(),
                dtype: format!("{other:?}"),
            });
        }
    })
}

/// Overwrites the model's parameters with the tensors of `path` (all checked first: on
/// error no parameter has changed).
pub fn load_params(gpt: &Gpt, path: &Path) -> Result<(), HfError> {
    let bytes = fs::read(path).map_err(|error| HfError::Io {
        path: path.into(),
        error,
    })?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| HfError::Format {
        path: path.into(),
        message: e.to_string(),
    })?;
    let mut staged = Vec::new();
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
        let mut data = to_f32(path, &name, &source)?;
        if is_linear(&name) {
            data = transpose(&data, expected[0], expected[1]);
        }
        staged.push((name, t, data));
    }
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
    let mut buffers = Vec::with_capacity(tensors.len());
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
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        buffers.push((name.clone(), shape, bytes));
    }
    let views = buffers
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| HfError::Format {
                    path: path.into(),
                    message: e.to_string(),
                })
        })
        .collect::<Result<HashMap<_, _>, _>>()?;
    let encoded = safetensors::serialize(views, &None).map_err(|e| HfError::Format {
        path: path.into(),
        message: e.to_string(),
    })?;
    write_atomically(path, &encoded)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), HfError> {
    let io = |error| HfError::Io {
        path: path.into(),
        error,
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = fs::File::create(&tmp).map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    drop(f);
    fs::rename(&tmp, path).map_err(io)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // Persist the rename itself; some filesystems refuse to sync a directory.
        let _ = fs::File::open(dir).and_then(|d| d.sync_all());
    }
    Ok(())
}
