//! Opening a checkpoint: which layout a path holds ([`detect`]), and the reader of that
//! layout that makes it one [`Checkpoint`]. Apart from the model in
//! [`crate::checkpoint`], so the model imports no reader and the readers import the model.

use std::path::Path;

use crate::checkpoint::{Checkpoint, Format, HF_INDEX_NAME, HF_SINGLE_NAME, unknown};
use crate::error::Result;
use crate::index::INDEX_NAME;
use crate::readers::{has_dcp_names, read_dcp, read_hf, read_remat};

impl Checkpoint {
    /// Opens `path` (a directory, or a single safetensors file), detecting the layout
    /// unless `format` is given, and validates it entirely before returning.
    pub fn open(path: &Path, format: Option<Format>) -> Result<Checkpoint> {
        let ckpt = Checkpoint::open_unvalidated(path, format)?;
        ckpt.validate()?;
        Ok(ckpt)
    }

    /// Opens without the checks that read data (replicas compared byte by byte): a remote
    /// checkpoint's data is fetched after opening, then [`Self::validate`] runs.
    pub(crate) fn open_unvalidated(path: &Path, format: Option<Format>) -> Result<Checkpoint> {
        let format = match format {
            Some(f) => f,
            None => detect(path)?,
        };
        match format {
            Format::Remat => read_remat(path),
            Format::Dcp => read_dcp(path),
            Format::Hf => read_hf(path),
        }
    }
}

/// Picks the layout of `path` from the files it holds.
pub fn detect(path: &Path) -> Result<Format> {
    if path.is_file() {
        return Ok(Format::Hf);
    }
    if !path.is_dir() {
        return Err(unknown(path, "no such file or directory"));
    }
    if path.join(INDEX_NAME).is_file() {
        return Ok(Format::Remat);
    }
    if path.join(HF_INDEX_NAME).is_file() || path.join(HF_SINGLE_NAME).is_file() {
        return Ok(Format::Hf);
    }
    if has_dcp_names(path)? {
        return Ok(Format::Dcp);
    }
    if is_torch_save_dcp(path)? {
        return Err(unknown(
            path,
            "this is a PyTorch distributed checkpoint in torch's own format (a pickled .metadata with torch.save-based *.distcp files), which remat recognises but does not read: save it with Hugging Face storage (torch.distributed.checkpoint's HuggingFaceStorageWriter: shard-N-model-i-of-n.safetensors), or as remat's or Hugging Face's safetensors layouts",
        ));
    }
    let mut what = String::from(
        "found no remat.index.json, model.safetensors(.index.json) or shard-*-model-*-of-*.safetensors",
    );
    let inner = checkpoint_subdirs(path);
    if !inner.is_empty() {
        what.push_str(&format!(
            "; the checkpoints are one level down: {} (pass one of them)",
            inner.join(", ")
        ));
    }
    Err(unknown(path, &what))
}

/// Subdirectories of `dir` (sorted, at most [`SUBDIR_HINTS`]) that hold a layout
/// [`detect`] reads, for the hint when `dir` itself is their parent. Unreadable entries are
/// passed over: this only adds to an error already being reported.
fn checkpoint_subdirs(dir: &Path) -> Vec<String> {
    const SUBDIR_HINTS: usize = 5;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<String> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .filter(|p| {
            p.join(INDEX_NAME).is_file()
                || p.join(HF_INDEX_NAME).is_file()
                || p.join(HF_SINGLE_NAME).is_file()
                || has_dcp_names(p).unwrap_or(false)
        })
        .map(|p| format!("{}/", p.display()))
        .collect();
    found.sort();
    if found.len() > SUBDIR_HINTS {
        let more = found.len() - SUBDIR_HINTS;
        found.truncate(SUBDIR_HINTS);
        found.push(format!("and {more} more"));
    }
    found
}

/// Whether `dir` holds PyTorch DCP's default format: a `.metadata` file or `*.distcp`
/// files (`__0_0.distcp`, ...).
fn is_torch_save_dcp(dir: &Path) -> Result<bool> {
    if dir.join(".metadata").is_file() {
        return Ok(true);
    }
    for entry in std::fs::read_dir(dir).map_err(crate::error::io_err(dir))? {
        let entry = entry.map_err(crate::error::io_err(dir))?;
        if entry.file_name().to_string_lossy().ends_with(".distcp") {
            return Ok(true);
        }
    }
    Ok(false)
}
