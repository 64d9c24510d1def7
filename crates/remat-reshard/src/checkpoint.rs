//! A checkpoint on disk, in any of the layouts remat reads, as one model: global tensors
//! made of pieces that live in memory-mapped safetensors files. Opening one (which layout a
//! path holds, and the reader for it) is [`crate::open`]'s.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::dtype::Dtype;
use crate::error::{ReshardError, Result};
use crate::geometry::{Region, intersecting_pairs};
use crate::safetensors::{MappedFile, volume};

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

/// How a tensor is laid over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Split dimension D in PyTorch's chunks of `ceil(n/M)`.
    Shard(usize),
    /// A full copy on every rank.
    Replicate,
    /// The full tensor on one rank.
    Whole,
}

impl Placement {
    /// Parses `shard(D)` / `shard:D`, `replicate`, `whole`.
    pub fn parse(s: &str) -> Option<Placement> {
        match s {
            "replicate" => Some(Placement::Replicate),
            "whole" => Some(Placement::Whole),
            _ => {
                let d = s
                    .strip_prefix("shard(")
                    .and_then(|r| r.strip_suffix(')'))
                    .or_else(|| s.strip_prefix("shard:"))?;
                d.parse().ok().map(Placement::Shard)
            }
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "shard({d})"),
            Placement::Replicate => f.write_str("replicate"),
            Placement::Whole => f.write_str("whole"),
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
