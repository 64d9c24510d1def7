//! A checkpoint on disk, in any of the layouts remat reads, as one model: global tensors
//! made of pieces that live in memory-mapped safetensors files.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::path::{Path, PathBuf};

use crate::dtype::Dtype;
use crate::error::{ReshardError, Result};
use crate::geometry::{Region, intersecting_pairs};
use crate::index::INDEX_NAME;
use crate::readers::{has_dcp_names, read_dcp, read_hf, read_remat};
use crate::safetensors::{MappedFile, volume};
use crate::target::Placement;

/// The on-disk layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// remat's own: `rank-0000R-of-0000M.safetensors` files plus `remat.index.json`.
    Remat,
    /// PyTorch DCP with Hugging Face storage: `shard-0000R-model-00001-of-00001.safetensors`
    /// with `DCP_SHARDING_INFO` metadata.
    Dcp,
    /// Hugging Face: `model.safetensors`, or `model-0000i-of-0000n.safetensors` with
    /// `model.safetensors.index.json`.
    Hf,
}

impl Format {
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "remat" => Some(Format::Remat),
            "dcp" => Some(Format::Dcp),
            "hf" => Some(Format::Hf),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Remat => "remat",
            Format::Dcp => "dcp",
            Format::Hf => "hf",
        }
    }
}

/// The `__metadata__` key PyTorch DCP stores piece offsets under.
pub const DCP_SHARDING_INFO: &str = "DCP_SHARDING_INFO";
/// Hugging Face's multi-file index.
pub const HF_INDEX_NAME: &str = "model.safetensors.index.json";
/// Hugging Face's single file.
pub const HF_SINGLE_NAME: &str = "model.safetensors";

/// A stored part of a global tensor.
#[derive(Clone, Debug)]
pub struct Piece {
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    pub region: Region,
    /// Absolute byte offset in the file.
    pub start: u64,
    pub len: u64,
    /// Checksum from the index, when the layout has one.
    pub checksum: Option<u64>,
}

/// A global tensor and where its pieces are.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// How the source placed it, when known or inferable.
    pub placement: Option<Placement>,
    pub pieces: Vec<Piece>,
}

impl TensorInfo {
    /// Bytes of the global tensor.
    pub fn nbytes(&self) -> u64 {
        self.dtype
            .bytes_for(self.shape.iter().product())
            .unwrap_or(0)
    }

    /// One piece per distinct non-empty box: replicas beyond the first are left out.
    pub fn distinct_pieces(&self) -> Vec<&Piece> {
        let mut seen = std::collections::HashSet::new();
        self.pieces
            .iter()
            .filter(|p| !p.region.is_empty() && seen.insert(&p.region))
            .collect()
    }
}

/// A checkpoint opened for reading.
pub struct Checkpoint {
    pub root: PathBuf,
    pub format: Format,
    pub world_size: usize,
    pub files: Vec<MappedFile>,
    /// Rank owning each file.
    pub file_ranks: Vec<usize>,
    /// Sorted by name.
    pub tensors: Vec<TensorInfo>,
    /// Checksum block size of the index, when there is one.
    pub checksum_block: Option<u64>,
    /// Files in the directory that the layout's reader left out, with why (a consolidated
    /// copy beside DCP shards, say). Callers should show them: nothing is dropped silently.
    pub skipped: Vec<SkippedFile>,
}

/// A file that a reader left out of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedFile {
    pub path: PathBuf,
    pub reason: String,
}

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

    /// Bytes of all global tensors.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::nbytes).sum()
    }

    /// Finds a tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    pub(crate) fn validate(&self) -> Result<()> {
        for t in &self.tensors {
            self.validate_tensor(t)?;
        }
        Ok(())
    }

    fn validate_tensor(&self, t: &TensorInfo) -> Result<()> {
        self.check_replicas(t)?;
        let total = volume(&t.shape).unwrap_or(u64::MAX);
        let distinct = t.distinct_pieces();
        let regions: Vec<&Region> = distinct.iter().map(|p| &p.region).collect();
        if let Some(&(i, j)) = intersecting_pairs(&regions, None).first() {
            let describe = |p: &Piece| {
                format!(
                    "offsets {:?} sizes {:?} in {}",
                    p.region.offsets,
                    p.region.sizes,
                    self.files[p.file].path.display()
                )
            };
            return Err(ReshardError::Overlap {
                tensor: t.name.clone(),
                first: describe(distinct[i]),
                second: describe(distinct[j]),
            });
        }
        let covered: u64 = regions.iter().map(|r| r.volume()).sum();
        if covered != total {
            return Err(ReshardError::Hole {
                tensor: t.name.clone(),
                shape: t.shape.clone(),
                covered,
                total,
            });
        }
        Ok(())
    }
}

impl Checkpoint {
    /// Pieces of one tensor with the same box are copies (replicas): the reader takes one
    /// of them, so they must agree. Their index checksums are compared where both have
    /// one (the data is checked against them when it is read); otherwise their bytes.
    fn check_replicas(&self, t: &TensorInfo) -> Result<()> {
        let mut first_of: HashMap<&Region, &Piece> = HashMap::new();
        for p in t.pieces.iter().filter(|p| !p.region.is_empty()) {
            match first_of.entry(&p.region) {
                Entry::Vacant(e) => {
                    e.insert(p);
                }
                Entry::Occupied(e) => self.compare_replicas(t, e.get(), p)?,
            }
        }
        Ok(())
    }

    fn compare_replicas(&self, t: &TensorInfo, a: &Piece, b: &Piece) -> Result<()> {
        let what = match (a.checksum, b.checksum) {
            (Some(x), Some(y)) => {
                (x != y).then(|| format!("their index checksums differ ({x:016x} and {y:016x})"))
            }
            _ => self
                .first_difference(a, b)
                .map(|k| format!("their bytes differ, first at byte {k} of the piece")),
        };
        match what {
            None => Ok(()),
            Some(what) => Err(ReshardError::ReplicaMismatch {
                tensor: t.name.clone(),
                region: format!("offsets {:?} sizes {:?}", a.region.offsets, a.region.sizes),
                files: format!(
                    "{} and {}",
                    self.files[a.file].path.display(),
                    self.files[b.file].path.display()
                ),
                what,
            }),
        }
    }

    /// The first byte at which two equally long pieces differ, compared in steps whose
    /// pages are handed back as they are passed, so memory stays bounded.
    fn first_difference(&self, a: &Piece, b: &Piece) -> Option<u64> {
        const STEP: u64 = 4 << 20;
        let (ma, mb) = (&self.files[a.file].map, &self.files[b.file].map);
        let len = a.len.min(b.len);
        let mut at = 0;
        while at < len {
            let n = STEP.min(len - at);
            let sa = &ma.bytes()[(a.start + at) as usize..(a.start + at + n) as usize];
            let sb = &mb.bytes()[(b.start + at) as usize..(b.start + at + n) as usize];
            let diff = (sa != sb).then(|| sa.iter().zip(sb).position(|(x, y)| x != y));
            ma.release(a.start + at, n);
            mb.release(b.start + at, n);
            if let Some(k) = diff.flatten() {
                return Some(at + k as u64);
            }
            at += n;
        }
        (a.len != b.len).then_some(len)
    }
}

pub(crate) fn unknown(path: &Path, what: &str) -> ReshardError {
    ReshardError::UnknownLayout {
        path: path.into(),
        what: what.into(),
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
