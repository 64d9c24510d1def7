//! Readers of the three layouts, each gathering pieces into global tensors.
//!
//! Why one file of ~610 lines: the three layouts' readers fill one `Builder` and share its
//! checks (every piece indexed, foreign files skipped and reported); the tests are already
//! in `readers/tests.rs`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::checkpoint::{
    Checkpoint, DCP_SHARDING_INFO, Format, HF_INDEX_NAME, HF_SINGLE_NAME, Piece, Placement,
    SkippedFile, TensorInfo, unknown,
};
use crate::dtype::Dtype;
use crate::error::{ReshardError, Result, io_err};
use crate::geometry::Region;
use crate::index::{INDEX_NAME, parse_index};
use crate::safetensors::{Entry, MappedFile, tensor_bytes};

/// Accumulates pieces into global tensors while files are read.
struct Builder {
    files: Vec<MappedFile>,
    ranks: Vec<usize>,
    tensors: BTreeMap<String, TensorInfo>,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            files: Vec::new(),
            ranks: Vec::new(),
            tensors: BTreeMap::new(),
        }
    }

    fn open_file(&mut self, path: &Path, rank: usize) -> Result<usize> {
        self.files.push(MappedFile::open(path)?);
        self.ranks.push(rank);
        Ok(self.files.len() - 1)
    }

    /// Adds `entry` of `file` as the piece of its tensor at `offsets`.
    fn add(
        &mut self,
        file: usize,
        entry: &Entry,
        offsets: Vec<u64>,
        checksum: Option<u64>,
    ) -> Result<()> {
        let f = &self.files[file];
        let path = f.path.clone();
        if offsets.len() != entry.shape.len() {
            return Err(ReshardError::BadTensor {
                path,
                tensor: entry.name.clone(),
                what: format!(
                    "offsets {offsets:?} do not match the {} dimensions of shape {:?}",
                    entry.shape.len(),
                    entry.shape
                ),
            });
        }
        let piece = Piece {
            file,
            start: f.header.data_start + entry.start,
            len: entry.end - entry.start,
            region: Region {
                offsets,
                sizes: entry.shape.clone(),
            },
            checksum,
        };
        let tensor = self
            .tensors
            .entry(entry.name.clone())
            .or_insert_with(|| TensorInfo {
                name: entry.name.clone(),
                dtype: entry.dtype,
                shape: Vec::new(),
                placement: None,
                pieces: Vec::new(),
            });
        if let Some(first) = tensor.pieces.first() {
            if tensor.dtype != entry.dtype {
                return Err(ReshardError::DtypeMismatch {
                    tensor: entry.name.clone(),
                    first: tensor.dtype.name().into(),
                    first_file: self.files[first.file].path.clone(),
                    second: entry.dtype.name().into(),
                    second_file: path,
                });
            }
            if first.region.offsets.len() != piece.region.offsets.len() {
                return Err(ReshardError::BadTensor {
                    path,
                    tensor: entry.name.clone(),
                    what: format!(
                        "has {} dimensions here but {} in {}",
                        piece.region.offsets.len(),
                        first.region.offsets.len(),
                        self.files[first.file].path.display()
                    ),
                });
            }
        }
        tensor.pieces.push(piece);
        Ok(())
    }

    /// Global shapes from the pieces (DCP does not record them), checked for overflow.
    fn infer_shapes(&mut self) -> Result<()> {
        for t in self.tensors.values_mut() {
            let ndim = t.pieces[0].region.offsets.len();
            let mut shape = vec![0u64; ndim];
            for p in &t.pieces {
                for (d, s) in shape.iter_mut().enumerate() {
                    let end = p.region.offsets[d].checked_add(p.region.sizes[d]);
                    let Some(end) = end else {
                        return Err(ReshardError::BadTensor {
                            path: self.files[p.file].path.clone(),
                            tensor: t.name.clone(),
                            what: format!("offsets {:?} overflow", p.region.offsets),
                        });
                    };
                    *s = (*s).max(end);
                }
            }
            tensor_bytes(&self.files[t.pieces[0].file].path, &t.name, t.dtype, &shape)?;
            t.shape = shape;
        }
        Ok(())
    }

    fn finish(
        self,
        root: &Path,
        format: Format,
        world_size: usize,
        checksum_block: Option<u64>,
    ) -> Checkpoint {
        Checkpoint {
            root: root.into(),
            format,
            world_size,
            files: self.files,
            file_ranks: self.ranks,
            tensors: self.tensors.into_values().collect(),
            checksum_block,
            skipped: Vec::new(),
        }
    }
}

/// How a layout without placements most likely placed a tensor: the one dimension along
/// which its pieces differ is sharded; identical pieces are replicas.
fn infer_placement(t: &TensorInfo, single: Placement) -> Placement {
    let first = &t.pieces[0].region;
    let differing: Vec<usize> = (0..first.offsets.len())
        .filter(|&d| {
            t.pieces.iter().any(|p| {
                p.region.offsets[d] != first.offsets[d] || p.region.sizes[d] != first.sizes[d]
            })
        })
        .collect();
    match differing.first() {
        Some(&d) => Placement::Shard(d),
        None if t.pieces.len() == 1 => single,
        None => Placement::Replicate,
    }
}

pub(crate) fn read_remat(root: &Path) -> Result<Checkpoint> {
    let index_path = root.join(INDEX_NAME);
    let bytes = std::fs::read(&index_path).map_err(io_err(&index_path))?;
    let index = parse_index(&index_path, &bytes)?;
    let format = Format::parse(&index.layout).ok_or_else(|| ReshardError::Index {
        path: index_path.clone(),
        what: format!("unknown layout `{}`", index.layout),
    })?;
    let mut b = Builder::new();
    for f in &index.files {
        let id = b.open_file(&root.join(&f.name), f.rank)?;
        let actual = b.files[id].header.file_len;
        if actual != f.bytes {
            return Err(ReshardError::Index {
                path: index_path.clone(),
                what: format!(
                    "file `{}` is {actual} bytes, the index says {}",
                    f.name, f.bytes
                ),
            });
        }
    }
    for t in &index.tensors {
        for c in &t.chunks {
            let file = &b.files[c.file];
            let bad = |what: String| ReshardError::BadTensor {
                path: file.path.clone(),
                tensor: t.name.clone(),
                what,
            };
            let entry = file.header.entry(&t.name).ok_or_else(|| {
                bad("the index lists a chunk here but the file has no such tensor".into())
            })?;
            let range = [
                file.header.data_start + entry.start,
                file.header.data_start + entry.end,
            ];
            if entry.dtype.name() != t.dtype || entry.shape != c.sizes || range != c.byte_range {
                return Err(bad(format!(
                    "file holds {} {:?} at bytes {range:?}, the index says {} {:?} at {:?}",
                    entry.dtype, entry.shape, t.dtype, c.sizes, c.byte_range
                )));
            }
            let entry = entry.clone();
            b.add(
                c.file,
                &entry,
                c.offsets.clone(),
                crate::checksum::from_hex(&c.checksum),
            )?;
        }
        let info = b
            .tensors
            .entry(t.name.clone())
            .or_insert_with(|| TensorInfo {
                name: t.name.clone(),
                dtype: Dtype::from_name(&t.dtype).unwrap_or(Dtype::U8),
                shape: Vec::new(),
                placement: None,
                pieces: Vec::new(),
            });
        info.shape = t.shape.clone();
        info.placement = Placement::parse(&t.placement);
    }
    check_all_indexed(&index, &b)?;
    Ok(b.finish(
        root,
        format,
        index.world_size,
        Some(index.checksum.block_bytes),
    ))
}

/// Every tensor a rank file holds is a chunk the index lists in that file: one it does
/// not list would vanish from the output (a stale index, or a file changed after it).
fn check_all_indexed(index: &crate::index::Index, b: &Builder) -> Result<()> {
    let mut listed: Vec<std::collections::HashSet<&str>> = vec![Default::default(); b.files.len()];
    for t in &index.tensors {
        for c in &t.chunks {
            listed[c.file].insert(t.name.as_str());
        }
    }
    for (file, names) in b.files.iter().zip(&listed) {
        if let Some(e) = file
            .header
            .entries
            .iter()
            .find(|e| !names.contains(e.name.as_str()))
        {
            return Err(ReshardError::BadTensor {
                path: file.path.clone(),
                tensor: e.name.clone(),
                what: format!(
                    "the file holds this tensor but {INDEX_NAME} lists no chunk of it here, so it would be left out: the index is stale or the file was changed after it"
                ),
            });
        }
    }
    Ok(())
}

/// `(rank, path)` of every `*.safetensors` file in a DCP directory, sorted by rank then
/// name. PyTorch's Hugging Face storage reader reads every such file, whatever its name,
/// so this does too: a `shard-R-model-i-of-n` name gives the rank (1-based, as PyTorch
/// writes it, or 0-based when some file is `shard-00000-...`); other files take the ranks
/// after the highest named one, in name order.
pub(crate) fn dcp_files(dir: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut found: Vec<(Option<usize>, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.ends_with(".safetensors") && !name.starts_with('.') && path.is_file() {
            found.push((parse_dcp_name(&name), path));
        }
    }
    found.sort_by(|a, b| a.1.cmp(&b.1));
    let zero_based = found.iter().any(|(n, _)| *n == Some(0));
    let named = |n: usize| if zero_based { n } else { n - 1 };
    let mut next = found
        .iter()
        .filter_map(|(n, _)| n.map(|n| named(n) + 1))
        .max()
        .unwrap_or(0);
    let mut out: Vec<(usize, PathBuf)> = found
        .into_iter()
        .map(|(n, path)| match n {
            Some(n) => (named(n), path),
            None => {
                next += 1;
                (next - 1, path)
            }
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Whether `dir` holds a file named the way PyTorch's DCP names its shards.
pub(crate) fn has_dcp_names(dir: &Path) -> Result<bool> {
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        if parse_dcp_name(&entry.file_name().to_string_lossy()).is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The shard number of a DCP file name `shard-N-model-i-of-n.safetensors`, as written.
fn parse_dcp_name(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("shard-")?.strip_suffix(".safetensors")?;
    let (shard, rest) = rest.split_once("-model-")?;
    let (i, n) = rest.split_once("-of-")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit());
    if !(digits(shard) && digits(i) && digits(n)) {
        return None;
    }
    shard.parse::<usize>().ok()
}

/// One tensor's entry in `DCP_SHARDING_INFO`.
#[derive(serde::Deserialize)]
struct ShardingInfo {
    saved_offsets: Vec<u64>,
}

/// `DCP_SHARDING_INFO` of one file: tensor name to saved offsets, or `None` when the file
/// has no sharding info at all.
fn dcp_offsets(file: &MappedFile) -> Result<Option<HashMap<String, ShardingInfo>>> {
    let Some(text) = file.header.metadata.get(DCP_SHARDING_INFO) else {
        return Ok(None);
    };
    serde_json::from_str(text)
        .map(Some)
        .map_err(|e| ReshardError::HeaderJson {
            path: file.path.clone(),
            message: format!("{DCP_SHARDING_INFO}: {e}"),
        })
}

pub(crate) fn read_dcp(root: &Path) -> Result<Checkpoint> {
    let files = dcp_files(root)?;
    if files.is_empty() {
        return Err(unknown(root, "no *.safetensors files"));
    }
    let mut opened = Vec::with_capacity(files.len());
    for (rank, path) in files {
        let file = MappedFile::open(&path)?;
        let offsets = dcp_offsets(&file)?;
        opened.push((rank, file, offsets));
    }
    let (opened, skipped) = drop_foreign_files(opened);
    let mut b = Builder::new();
    let mut world = 0;
    for (rank, file, offsets) in opened {
        world = world.max(rank + 1);
        let path = file.path.clone();
        b.files.push(file);
        b.ranks.push(rank);
        let id = b.files.len() - 1;
        let entries = b.files[id].header.entries.clone();
        for e in &entries {
            // Like PyTorch's reader: a file without sharding info holds whole tensors at
            // the origin; a file with it must place every tensor it holds.
            let off = match &offsets {
                None => vec![0; e.shape.len()],
                Some(map) => map.get(&e.name).map(|i| i.saved_offsets.clone()).ok_or_else(|| {
                    ReshardError::BadTensor {
                        path: path.clone(),
                        tensor: e.name.clone(),
                        what: format!(
                            "the file has {DCP_SHARDING_INFO} but it does not list this tensor, so where its piece lies in the global tensor is unknown"
                        ),
                    }
                })?,
            };
            b.add(id, e, off, None)?;
        }
    }
    b.infer_shapes()?;
    for t in b.tensors.values_mut() {
        // DCP writes a replicated tensor once, from one rank.
        t.placement = Some(infer_placement(t, Placement::Replicate));
    }
    let mut ckpt = b.finish(root, Format::Dcp, world, None);
    ckpt.skipped = skipped;
    Ok(ckpt)
}

/// A DCP file opened for reading: its rank, the mapped file and its sharding info.
type OpenedDcpFile = (usize, MappedFile, Option<HashMap<String, ShardingInfo>>);

/// Splits off redundant copies kept beside DCP shards: a file with a name other than
/// `shard-*`, no `DCP_SHARDING_INFO`, and only tensors that the `shard-*` files hold (a
/// consolidated original such as `full.safetensors`, say). Read as whole tensors at the
/// origin, as PyTorch's reader would, it could only collide with the real pieces. It is
/// left out and reported, never dropped silently. Any other file is read: one holding a
/// tensor the shards lack is a piece of the checkpoint, and one that partly collides is an
/// overlap error naming both files.
fn drop_foreign_files(opened: Vec<OpenedDcpFile>) -> (Vec<OpenedDcpFile>, Vec<SkippedFile>) {
    let is_shard_name = |f: &MappedFile| {
        f.path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_dcp_name)
            .is_some()
    };
    let in_shards: std::collections::HashSet<&str> = opened
        .iter()
        .filter(|(_, f, _)| is_shard_name(f))
        .flat_map(|(_, f, _)| f.header.entries.iter().map(|e| e.name.as_str()))
        .collect();
    let redundant: Vec<bool> = opened
        .iter()
        .map(|(_, f, info)| {
            info.is_none()
                && !is_shard_name(f)
                && !f.header.entries.is_empty()
                && f.header
                    .entries
                    .iter()
                    .all(|e| in_shards.contains(e.name.as_str()))
        })
        .collect();
    let mut kept = Vec::new();
    let mut skipped = Vec::new();
    for (item, redundant) in opened.into_iter().zip(redundant) {
        if redundant {
            skipped.push(SkippedFile {
                path: item.1.path.clone(),
                reason: format!(
                    "not a DCP shard (no {DCP_SHARDING_INFO}, not named shard-N-model-i-of-n) and every tensor it holds is in the shard files: a copy kept beside them"
                ),
            });
        } else {
            kept.push(item);
        }
    }
    (kept, skipped)
}

pub(crate) fn read_hf(path: &Path) -> Result<Checkpoint> {
    let mut b = Builder::new();
    let (root, names): (PathBuf, Vec<String>) = if path.is_file() {
        let parent = crate::fsio::parent_of(path);
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        (parent, vec![name])
    } else if path.join(HF_INDEX_NAME).is_file() {
        (path.into(), hf_index_files(&path.join(HF_INDEX_NAME))?)
    } else {
        (path.into(), vec![HF_SINGLE_NAME.into()])
    };
    let skipped = if path.is_dir() {
        unlisted_hf_files(path, &names)?
    } else {
        Vec::new()
    };
    for (rank, name) in names.iter().enumerate() {
        let id = b.open_file(&root.join(name), rank)?;
        let entries = b.files[id].header.entries.clone();
        for e in &entries {
            b.add(id, e, vec![0; e.shape.len()], None)?;
        }
    }
    if path.is_dir() && path.join(HF_INDEX_NAME).is_file() {
        check_weight_map(&path.join(HF_INDEX_NAME), &b)?;
    }
    b.infer_shapes()?;
    for t in b.tensors.values_mut() {
        t.placement = Some(infer_placement(t, Placement::Whole));
    }
    let mut ckpt = b.finish(path, Format::Hf, names.len(), None);
    ckpt.skipped = skipped;
    Ok(ckpt)
}

/// The `*.safetensors` files of a Hugging Face directory that are not part of the
/// checkpoint (not named by the index, or not `model.safetensors` without one). Hugging
/// Face's loaders read only those files, so these are left out as well, but reported
/// with the tensors they hold, like the DCP reader's skipped files: never dropped
/// silently.
fn unlisted_hf_files(dir: &Path, names: &[String]) -> Result<Vec<SkippedFile>> {
    let mut skipped = Vec::new();
    let mut entries: Vec<PathBuf> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors")
            && !name.starts_with('.')
            && !names.contains(&name)
            && entry.path().is_file()
        {
            entries.push(entry.path());
        }
    }
    entries.sort();
    for path in entries {
        let held = match MappedFile::open(&path) {
            Ok(f) => {
                let n = f.header.entries.len();
                let shown: Vec<&str> = f
                    .header
                    .entries
                    .iter()
                    .take(5)
                    .map(|e| e.name.as_str())
                    .collect();
                let more = if n > shown.len() { ", ..." } else { "" };
                format!("it holds {n} tensors ({}{more})", shown.join(", "))
            }
            Err(e) => format!("it is not a readable safetensors file ({e})"),
        };
        let by = if dir.join(HF_INDEX_NAME).is_file() {
            format!("not named in {HF_INDEX_NAME}'s weight_map")
        } else {
            format!("not {HF_SINGLE_NAME}, and there is no {HF_INDEX_NAME}")
        };
        skipped.push(SkippedFile {
            path,
            reason: format!(
                "{by}, so not part of the checkpoint (Hugging Face loads only those files); {held}"
            ),
        });
    }
    Ok(skipped)
}

/// Every tensor the `weight_map` lists is in the file it names, and in no other.
fn check_weight_map(index_path: &Path, b: &Builder) -> Result<()> {
    let bytes = std::fs::read(index_path).map_err(io_err(index_path))?;
    let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let Some(map) = value.get("weight_map").and_then(|m| m.as_object()) else {
        return Ok(());
    };
    for (tensor, file) in map {
        let file = file.as_str().unwrap_or_default();
        let holders: Vec<&Path> = b
            .tensors
            .get(tensor)
            .map(|t| {
                t.pieces
                    .iter()
                    .map(|p| b.files[p.file].path.as_path())
                    .collect()
            })
            .unwrap_or_default();
        let in_named = holders
            .iter()
            .any(|p| p.file_name().is_some_and(|n| n == file));
        if !in_named || holders.len() != 1 {
            return Err(ReshardError::Index {
                path: index_path.into(),
                what: format!(
                    "tensor `{tensor}` is mapped to `{file}` but is stored in {holders:?}"
                ),
            });
        }
    }
    Ok(())
}

/// Distinct file names of an HF `weight_map`, in order of first appearance.
fn hf_index_files(index_path: &Path) -> Result<Vec<String>> {
    let bytes = std::fs::read(index_path).map_err(io_err(index_path))?;
    let bad = |what: String| ReshardError::Index {
        path: index_path.into(),
        what,
    };
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    if map.is_empty() {
        return Err(bad(
            "`weight_map` lists no tensors, so the checkpoint would be empty".into(),
        ));
    }
    let mut names: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("tensor `{tensor}` maps to a non-string")))?;
        if file.contains(['/', '\\']) || file.starts_with('.') {
            return Err(bad(format!(
                "tensor `{tensor}` maps to `{file}`, not a plain file name"
            )));
        }
        if !names.iter().any(|n| n == file) {
            names.push(file.into());
        }
    }
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests;
