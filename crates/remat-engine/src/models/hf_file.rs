//! Safetensors files of model tensors under Hugging Face names: the error type, reading
//! and checking tensors, and writing a file (with a gradient dump's step record) atomically.
//! Shared by the GPT ([`super::gpt::hf`]) and the spec-driven Qwen3 blocks
//! ([`crate::spec::models::qwen3::hf`]).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensorError, SafeTensors, tensor::TensorView};

use super::batch::Batch;
use crate::core::kernels::IGNORE_INDEX;
use crate::output_file;

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
    #[error("{path}: tensor {tensor} has a non-finite value {value} at element {index}")]
    NonFinite {
        path: PathBuf,
        tensor: String,
        index: usize,
        value: f32,
    },
    #[error(
        "{path}: {} tensor(s) the model does not have: {} (a checkpoint of a different model? {hint})",
        tensors.len(),
        tensors.join(", ")
    )]
    Unused {
        path: PathBuf,
        tensors: Vec<String>,
        /// What to check, in the terms of the command that built the model.
        hint: &'static str,
    },
    #[error(transparent)]
    Output(#[from] output_file::OutputFileError),
    #[error("tensor {tensor}: {message}")]
    Engine { tensor: String, message: String },
}

/// A sentence for each way a safetensors file can be malformed (the crate's own `Display`
/// is its `Debug` name). Its `InvalidOffset` names a tensor that is not reliably the one at
/// fault (an overlap involves two), so no tensor is named for it.
pub(crate) fn format_message(e: &SafeTensorError) -> String {
    use SafeTensorError as E;
    match e {
        E::InvalidHeader => "the header is not valid UTF-8".into(),
        E::InvalidHeaderStart => "the header does not start with '{'".into(),
        E::InvalidHeaderDeserialization => "the header is not a valid safetensors JSON index \
             (each tensor needs dtype, shape and data_offsets)"
            .into(),
        E::HeaderTooLarge => "the header length in the first 8 bytes is larger than the \
             safetensors limit of 100 MB"
            .into(),
        E::HeaderTooSmall => "the file is shorter than the 8 bytes of the header length".into(),
        E::InvalidHeaderLength => {
            "the header length in the first 8 bytes reaches past the end of the file".into()
        }
        E::TensorNotFound(name) => format!("tensor {name} is missing"),
        E::TensorInvalidInfo => "a tensor's byte range (data_offsets) does not match the size \
             of its shape and dtype"
            .into(),
        E::InvalidOffset(_) => "the tensors' data_offsets overlap or leave a gap: in file \
             order each tensor must start where the previous one ends"
            .into(),
        E::IoError(error) => error.to_string(),
        E::JsonError(error) => format!("the header JSON is invalid: {error}"),
        E::InvalidTensorView(dtype, shape, len) => {
            format!("{len} bytes cannot hold a {dtype:?} tensor of shape {shape:?}")
        }
        E::MetadataIncompleteBuffer => "the tensor data does not end where the file ends \
             (the file is truncated, or has bytes after the last tensor)"
            .into(),
        E::ValidationOverflow => "a tensor's shape is so large that its byte size overflows".into(),
    }
}

pub(crate) fn to_f32(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, HfError> {
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

/// The bytes of the safetensors file at `path`.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>, HfError> {
    fs::read(path).map_err(|error| HfError::Io {
        path: path.into(),
        error,
    })
}

/// The safetensors view of `bytes`, read from `path`.
pub(crate) fn parse<'b>(path: &Path, bytes: &'b [u8]) -> Result<SafeTensors<'b>, HfError> {
    SafeTensors::deserialize(bytes).map_err(|e| HfError::Format {
        path: path.into(),
        message: format_message(&e),
    })
}

/// [`to_f32`], refusing a NaN or infinite value (one makes every loss NaN from the first
/// step); errors name `tensor`.
pub(crate) fn finite_f32(
    path: &Path,
    tensor: &str,
    view: &TensorView<'_>,
) -> Result<Vec<f32>, HfError> {
    let data = to_f32(path, tensor, view)?;
    match data.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        Some((index, &value)) => Err(HfError::NonFinite {
            path: path.into(),
            tensor: tensor.into(),
            index,
            value,
        }),
        None => Ok(data),
    }
}

/// Tensors the model does not read mean the file is for another model (more layers,
/// biases): loading the rest would silently train something else. A dump's step record
/// (`remat.*`) is not a parameter.
pub(crate) fn check_unused(
    path: &Path,
    st: &SafeTensors<'_>,
    used: &std::collections::HashSet<String>,
    hint: &'static str,
) -> Result<(), HfError> {
    let mut unused: Vec<String> = st
        .names()
        .into_iter()
        .filter(|n| !used.contains(n.as_str()) && !n.starts_with(RECORD_PREFIX))
        .cloned()
        .collect();
    if unused.is_empty() {
        return Ok(());
    }
    unused.sort();
    Err(HfError::Unused {
        path: path.into(),
        tensors: unused,
        hint,
    })
}

/// `torch.nn.functional.cross_entropy`'s default `ignore_index`: how a dump writes the
/// engine's skipped targets ([`IGNORE_INDEX`]).
pub const TORCH_IGNORE_INDEX: i64 = -100;

/// Names under this prefix are a dump's step record, never parameters.
pub const RECORD_PREFIX: &str = "remat.";

/// A tensor ready to serialize: name, dtype, shape, little-endian bytes.
pub(crate) type RawTensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// `f32` values as a little-endian tensor named `name` of `shape`.
pub(crate) fn raw_f32(name: String, shape: Vec<usize>, data: &[f32]) -> RawTensor {
    let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    (name, Dtype::F32, shape, bytes)
}

/// The batch of `record` as I64 tensors and the step's metadata, with `hf_config` (JSON) as
/// the model's Hugging Face config.
pub(crate) fn step_record_parts(
    batch: &Batch,
    loss: f64,
    dropout: f32,
    hf_config: String,
) -> Result<(Vec<RawTensor>, HashMap<String, String>), HfError> {
    let b = batch;
    let ids = |name: &str, values: &[u32], ignored: i64| -> Result<RawTensor, HfError> {
        if values.len() != b.batch * b.seq {
            return Err(HfError::Engine {
                tensor: format!("{RECORD_PREFIX}{name}"),
                message: format!(
                    "the batch holds {} values, not batch {} x seq {}",
                    values.len(),
                    b.batch,
                    b.seq
                ),
            });
        }
        let bytes = values
            .iter()
            .map(|&v| {
                if v == IGNORE_INDEX {
                    ignored
                } else {
                    i64::from(v)
                }
            })
            .flat_map(i64::to_le_bytes)
            .collect();
        Ok((
            format!("{RECORD_PREFIX}{name}"),
            Dtype::I64,
            vec![b.batch, b.seq],
            bytes,
        ))
    };
    // A skipped target is PyTorch's `ignore_index` default (-100) in the file; inputs have
    // none (a marker there is kept as the value itself, which no vocabulary reaches).
    let extra = vec![
        ids("input_ids", &b.tokens, i64::from(IGNORE_INDEX))?,
        ids("labels", &b.targets, TORCH_IGNORE_INDEX)?,
    ];
    let metadata = HashMap::from([
        (format!("{RECORD_PREFIX}loss"), format!("{loss:?}")),
        (format!("{RECORD_PREFIX}dropout"), format!("{dropout:?}")),
        (format!("{RECORD_PREFIX}hf_config"), hf_config),
    ]);
    Ok((extra, metadata))
}

/// Serializes `buffers` with `metadata` and writes them atomically to `path`.
pub(crate) fn write_raw(
    path: &Path,
    buffers: Vec<RawTensor>,
    metadata: Option<HashMap<String, String>>,
) -> Result<(), HfError> {
    check_target(path)?;
    let views = buffers
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| HfError::Format {
                    path: path.into(),
                    message: e.to_string(),
                })
        })
        .collect::<Result<HashMap<_, _>, _>>()?;
    let encoded = safetensors::serialize(views, &metadata).map_err(|e| HfError::Format {
        path: path.into(),
        message: e.to_string(),
    })?;
    Ok(output_file::write_atomically(path, &encoded)?)
}

/// Refuses `path` as an output file (see [`crate::output_file::check_target`]). Call it
/// before the work that produces the file; every writer here calls it too.
pub fn check_target(path: &Path) -> Result<(), HfError> {
    Ok(output_file::check_target(path)?)
}
