//! The remat index: `remat.index.json`, written last, describing a sharded checkpoint.
//!
//! ```json
//! {
//!   "format": "remat.sharded-checkpoint",
//!   "version": 1,
//!   "layout": "remat",            // naming of the data files: "remat" | "dcp" | "hf"
//!   "world_size": 3,
//!   "checksum": { "algorithm": "xxh3-64-blocks", "block_bytes": 16777216 },
//!   "files": [ { "name": "rank-00000-of-00003.safetensors", "rank": 0, "bytes": 4096 } ],
//!   "tensors": [
//!     { "name": "embed.weight", "dtype": "BF16", "shape": [50, 16], "placement": "shard(0)",
//!       "chunks": [ { "file": 0, "offsets": [0, 0], "sizes": [17, 16],
//!                     "byte_range": [128, 672], "checksum": "9f2c6b1e0a4d3c21" } ] }
//!   ]
//! }
//! ```
//!
//! - `files[i].name` is relative to the index's directory, a plain file name; `bytes` is
//!   the file's full length; `rank` the rank that owns it.
//! - Each data file is a safetensors file; a chunk of tensor `T` is the entry named `T`
//!   in its file, whose shape is the chunk's `sizes` (so every rank file loads on its own
//!   as that rank's local shards).
//! - `offsets`/`sizes` place the chunk in the global tensor of shape `shape`;
//!   `byte_range` is the chunk's absolute `[start, end)` in the file.
//! - `placement` is `shard(D)`, `replicate` (every rank holds an identical full copy,
//!   listed once per rank) or `whole` (the full tensor on one rank).
//! - `checksum`: the chunk is cut into blocks of `block_bytes`; each block is hashed with
//!   xxh3-64, and the little-endian concatenation of block digests is hashed again
//!   (16 lowercase hex digits).
//! - Chunks of one tensor are either identical boxes (replicas) or disjoint, and together
//!   cover the global tensor exactly. Empty chunks are not listed, with one exception: a
//!   tensor with no elements (a 0 in its shape) has exactly one chunk, the whole empty box
//!   (`offsets` all 0, `sizes` = `shape`, an empty `byte_range`), so that it still exists
//!   in the rank files and its shape can be read back from them alone.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::dtype::Dtype;
use crate::error::{ReshardError, Result};

/// File name of the index inside a checkpoint directory.
pub const INDEX_NAME: &str = "remat.index.json";
/// Value of the `format` field.
pub const FORMAT_TAG: &str = "remat.sharded-checkpoint";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Index {
    pub format: String,
    pub version: u32,
    pub layout: String,
    pub world_size: usize,
    pub checksum: ChecksumSpec,
    pub files: Vec<IndexFile>,
    pub tensors: Vec<IndexTensor>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChecksumSpec {
    pub algorithm: String,
    pub block_bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct IndexFile {
    pub name: String,
    pub rank: usize,
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct IndexTensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub placement: String,
    pub chunks: Vec<IndexChunk>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct IndexChunk {
    pub file: usize,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub byte_range: [u64; 2],
    pub checksum: String,
}

fn index_err(path: &Path, what: impl Into<String>) -> ReshardError {
    ReshardError::Index {
        path: path.into(),
        what: what.into(),
    }
}

/// Parses and checks an index: structure, references and arithmetic, not the data files.
pub fn parse_index(path: &Path, bytes: &[u8]) -> Result<Index> {
    let index: Index =
        serde_json::from_slice(bytes).map_err(|e| index_err(path, format!("invalid JSON: {e}")))?;
    if index.format != FORMAT_TAG || index.version != 1 {
        return Err(index_err(
            path,
            format!(
                "format `{}` version {} is not `{FORMAT_TAG}` version 1",
                index.format, index.version
            ),
        ));
    }
    if index.checksum.algorithm != crate::checksum::ALGORITHM || index.checksum.block_bytes == 0 {
        return Err(index_err(
            path,
            format!(
                "unsupported checksum `{}` with blocks of {} bytes",
                index.checksum.algorithm, index.checksum.block_bytes
            ),
        ));
    }
    if crate::checkpoint::Format::parse(&index.layout).is_none() {
        return Err(index_err(
            path,
            format!("unknown layout `{}` (remat, dcp or hf)", index.layout),
        ));
    }
    for f in &index.files {
        if f.name.is_empty() || f.name.contains(['/', '\\']) || f.name.starts_with('.') {
            return Err(index_err(
                path,
                format!("file name `{}` is not a plain file name", f.name),
            ));
        }
        if f.rank >= index.world_size {
            return Err(index_err(
                path,
                format!(
                    "file `{}` has rank {} but world_size is {}",
                    f.name, f.rank, index.world_size
                ),
            ));
        }
    }
    let mut names = std::collections::HashSet::new();
    for t in &index.tensors {
        if !names.insert(t.name.as_str()) {
            return Err(index_err(
                path,
                format!("tensor `{}` is listed twice", t.name),
            ));
        }
        check_tensor(path, &index, t)?;
    }
    Ok(index)
}

fn check_tensor(path: &Path, index: &Index, t: &IndexTensor) -> Result<()> {
    let tensor_err = |what: String| index_err(path, format!("tensor `{}`: {what}", t.name));
    let dtype = Dtype::from_name(&t.dtype)
        .ok_or_else(|| tensor_err(format!("unknown dtype `{}`", t.dtype)))?;
    crate::safetensors::tensor_bytes(path, &t.name, dtype, &t.shape)?;
    let placement = crate::checkpoint::Placement::parse(&t.placement)
        .ok_or_else(|| tensor_err(format!("unknown placement `{}`", t.placement)))?;
    if let crate::checkpoint::Placement::Shard(d) = placement
        && d >= t.shape.len()
    {
        return Err(tensor_err(format!(
            "placement `{}` but the tensor has {} dimensions (shape {:?})",
            t.placement,
            t.shape.len(),
            t.shape
        )));
    }
    for c in &t.chunks {
        if c.file >= index.files.len() {
            return Err(tensor_err(format!(
                "chunk refers to file {} of {}",
                c.file,
                index.files.len()
            )));
        }
        if c.offsets.len() != t.shape.len() || c.sizes.len() != t.shape.len() {
            return Err(tensor_err(format!(
                "chunk offsets {:?} / sizes {:?} do not match the {} dimensions of shape {:?}",
                c.offsets,
                c.sizes,
                t.shape.len(),
                t.shape
            )));
        }
        for d in 0..t.shape.len() {
            let end = c.offsets[d].checked_add(c.sizes[d]);
            if end.is_none_or(|e| e > t.shape[d]) {
                return Err(tensor_err(format!(
                    "chunk at offsets {:?} sizes {:?} leaves shape {:?}",
                    c.offsets, c.sizes, t.shape
                )));
            }
        }
        let [start, end] = c.byte_range;
        let need = crate::safetensors::tensor_bytes(path, &t.name, dtype, &c.sizes)?;
        if start > end || end - start != need {
            return Err(tensor_err(format!(
                "chunk byte_range [{start}, {end}) does not hold the {need} bytes of sizes {:?}",
                c.sizes
            )));
        }
        if crate::checksum::from_hex(&c.checksum).is_none() {
            return Err(tensor_err(format!(
                "checksum `{}` is not 16 hex digits",
                c.checksum
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> String {
        r#"{"format":"remat.sharded-checkpoint","version":1,"layout":"remat","world_size":2,
            "checksum":{"algorithm":"xxh3-64-blocks","block_bytes":16},
            "files":[{"name":"a.safetensors","rank":0,"bytes":100}],
            "tensors":[{"name":"w","dtype":"F32","shape":[4],"placement":"shard(0)",
              "chunks":[{"file":0,"offsets":[0],"sizes":[2],"byte_range":[8,16],"checksum":"0123456789abcdef"}]}]}"#
            .into()
    }

    fn err(text: &str) -> String {
        parse_index(Path::new("i.json"), text.as_bytes())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn accepts_a_valid_index_and_names_what_is_wrong_otherwise() {
        assert_eq!(
            parse_index(Path::new("i.json"), sample().as_bytes())
                .unwrap()
                .tensors
                .len(),
            1
        );
        assert!(err("{").contains("invalid JSON"));
        assert!(
            err(&sample().replace("\"file\":0", "\"file\":3"))
                .contains("tensor `w`: chunk refers to file 3")
        );
        assert!(err(&sample().replace("F32", "F33")).contains("unknown dtype `F33`"));
        assert!(err(&sample().replace("[8,16]", "[8,17]")).contains("byte_range"));
        assert!(err(&sample().replace("a.safetensors", "../a")).contains("not a plain file name"));
        assert!(err(&sample().replace("\"sizes\":[2]", "\"sizes\":[5]")).contains("leaves shape"));
        assert!(err(&sample().replace("shard(0)", "sharded")).contains("unknown placement"));
        assert!(
            err(&sample().replace("shard(0)", "shard(7)"))
                .contains("placement `shard(7)` but the tensor has 1 dimensions")
        );
        let scalar = sample().replace("\"shape\":[4]", "\"shape\":[]").replace(
            "\"offsets\":[0],\"sizes\":[2],\"byte_range\":[8,16]",
            "\"offsets\":[],\"sizes\":[],\"byte_range\":[8,12]",
        );
        assert!(err(&scalar).contains("placement `shard(0)` but the tensor has 0 dimensions"));
        assert!(
            parse_index(
                Path::new("i.json"),
                scalar.replace("shard(0)", "replicate").as_bytes()
            )
            .is_ok()
        );
        assert!(
            err(&sample().replace("\"layout\":\"remat\"", "\"layout\":\"weird\""))
                .contains("unknown layout `weird`")
        );
    }
}
