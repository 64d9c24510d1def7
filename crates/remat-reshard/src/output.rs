//! Output directories: refusing to clobber, staging and swapping into place, the parts of
//! `--rank` runs and the indexes written last.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{Checkpoint, Format, HF_INDEX_NAME};
use crate::checksum::{ALGORITHM, BLOCK_BYTES, chunk_checksum, from_hex, to_hex};
use crate::error::{ReshardError, Result, io_err};
use crate::fsio::{parent_of, sync_dir, write_atomic};
use crate::index::{
    ChecksumSpec, FORMAT_TAG, INDEX_NAME, Index, IndexChunk, IndexFile, IndexTensor,
};
use crate::plan::Plan;

/// Refuses a destination that is, holds or lies inside the source: it would be read
/// while being replaced.
pub fn check_not_source(ckpt: &Checkpoint, dst: &Path) -> Result<()> {
    let src = absolute(&ckpt.root);
    let out = absolute(dst);
    if out.starts_with(&src) || src.starts_with(&out) {
        return Err(ReshardError::Target(format!(
            "output {} overlaps the source checkpoint {}",
            dst.display(),
            ckpt.root.display()
        )));
    }
    Ok(())
}

/// Canonical form of a path that may not exist yet: its nearest existing ancestor
/// canonicalized, the rest appended.
fn absolute(path: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut probe = path.to_path_buf();
    loop {
        if let Ok(c) = std::fs::canonicalize(&probe) {
            return rest
                .iter()
                .rev()
                .fold(c, |acc: PathBuf, part| acc.join(part));
        }
        match (probe.file_name().map(|n| n.to_owned()), probe.parent()) {
            (Some(name), Some(parent)) => {
                rest.push(name);
                probe = if parent.as_os_str().is_empty() {
                    PathBuf::from(".")
                } else {
                    parent.to_path_buf()
                };
            }
            _ => return path.to_path_buf(),
        }
    }
}

/// Refuses a destination that exists but is not a directory (a regular file, say): the
/// output is a directory, and replacing a file with one is not what `--force` means.
pub fn check_not_file(dst: &Path) -> Result<()> {
    match std::fs::metadata(dst) {
        Ok(m) if !m.is_dir() => Err(ReshardError::Target(format!(
            "{}: exists and is not a directory; the output is a directory of files: remove it or choose another path",
            dst.display()
        ))),
        _ => Ok(()),
    }
}

/// Refuses an existing non-empty destination unless overwriting.
pub fn check_free(dst: &Path, overwrite: bool) -> Result<()> {
    if overwrite || !dst.exists() {
        return Ok(());
    }
    let empty_dir = std::fs::read_dir(dst)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false);
    if empty_dir {
        Ok(())
    } else {
        Err(ReshardError::OutputExists { path: dst.into() })
    }
}

fn sibling(dst: &Path, suffix: &str) -> PathBuf {
    let name = dst
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    parent_of(dst).join(format!(".{name}.{suffix}"))
}

/// A fresh staging directory beside `dst`; a leftover from an interrupted run is removed.
pub fn staging_dir(dst: &Path) -> Result<PathBuf> {
    let parent = parent_of(dst);
    std::fs::create_dir_all(&parent).map_err(io_err(&parent))?;
    let staging = sibling(dst, "remat-staging");
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(io_err(&staging))?;
    }
    std::fs::create_dir(&staging).map_err(io_err(&staging))?;
    Ok(staging)
}

/// Renames the finished staging directory to `dst` (moving an old `dst` aside first), so
/// the output appears complete or not at all.
pub fn swap_into_place(staging: &Path, dst: &Path) -> Result<()> {
    let old = sibling(dst, "remat-old");
    if dst.exists() {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
        }
        std::fs::rename(dst, &old).map_err(io_err(dst))?;
    }
    std::fs::rename(staging, dst).map_err(io_err(dst))?;
    sync_dir(&parent_of(dst))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
    }
    Ok(())
}

/// Name a `--rank` run writes a file under until [`crate::exec::finalize`].
pub fn part_name(dst: &Path, name: &str) -> PathBuf {
    dst.join(format!("{name}.part"))
}

/// The manifest a `--rank` run writes last, certifying its files complete.
pub fn manifest_path(dst: &Path, rank: usize) -> PathBuf {
    dst.join(format!(".remat-part-{rank:05}.json"))
}

#[derive(Serialize, Deserialize)]
struct Manifest {
    fingerprint: String,
    rank: usize,
    files: Vec<ManifestFile>,
}

#[derive(Serialize, Deserialize)]
struct ManifestFile {
    name: String,
    bytes: u64,
    checksums: Vec<String>,
}

pub fn write_manifest(
    path: &Path,
    plan: &Plan,
    rank: usize,
    files: &[(usize, PathBuf)],
    sums: &[Option<Vec<u64>>],
) -> Result<()> {
    let manifest = Manifest {
        fingerprint: to_hex(plan.fingerprint),
        rank,
        files: files
            .iter()
            .map(|(slot, _)| ManifestFile {
                name: plan.files[*slot].name.clone(),
                bytes: plan.files[*slot].file_len(),
                checksums: sums[*slot].iter().flatten().map(|s| to_hex(*s)).collect(),
            })
            .collect(),
    };
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| ReshardError::Part {
        path: path.into(),
        what: e.to_string(),
    })?;
    write_atomic(path, &text)
}

/// Checks every rank's manifest and files against the plan; returns the chunk checksums.
pub fn check_parts(ckpt: &Checkpoint, plan: &Plan, dst: &Path) -> Result<Vec<Option<Vec<u64>>>> {
    let mut sums = vec![None; plan.files.len()];
    for rank in 0..plan.world_size {
        let path = manifest_path(dst, rank);
        let part_err = |what: String| ReshardError::Part {
            path: path.clone(),
            what,
        };
        let bytes = std::fs::read(&path)
            .map_err(|e| part_err(format!("rank {rank} has not finished its part ({e})")))?;
        let m: Manifest =
            serde_json::from_slice(&bytes).map_err(|e| part_err(format!("invalid JSON: {e}")))?;
        if m.fingerprint != to_hex(plan.fingerprint) || m.rank != rank {
            return Err(part_err(format!(
                "written by a different plan (rank {}, fingerprint {}; expected rank {rank}, fingerprint {}): rerun rank {rank} with the same source and options",
                m.rank,
                m.fingerprint,
                to_hex(plan.fingerprint)
            )));
        }
        for (slot, f) in plan
            .files
            .iter()
            .enumerate()
            .filter(|(_, f)| f.rank == rank)
        {
            let mf = m
                .files
                .iter()
                .find(|x| x.name == f.name)
                .ok_or_else(|| part_err(format!("does not list `{}`", f.name)))?;
            let checks: Option<Vec<u64>> = mf.checksums.iter().map(|s| from_hex(s)).collect();
            let checks = checks
                .filter(|c| c.len() == f.chunks.len())
                .ok_or_else(|| {
                    part_err(format!(
                        "checksums of `{}` do not match its {} chunks",
                        f.name,
                        f.chunks.len()
                    ))
                })?;
            check_part_file(ckpt, dst, f, &checks)?;
            sums[slot] = Some(checks);
        }
    }
    Ok(sums)
}

/// A part file (or, after an interrupted finalize, the final file) has the planned size
/// and header, and its chunks hash to the checksums its manifest lists: the index is
/// about to certify them.
fn check_part_file(
    ckpt: &Checkpoint,
    dst: &Path,
    f: &crate::plan::TargetFile,
    checks: &[u64],
) -> Result<()> {
    let part = part_name(dst, &f.name);
    let path = if part.exists() {
        part
    } else {
        dst.join(&f.name)
    };
    let bad = |what: String| ReshardError::Part {
        path: path.clone(),
        what,
    };
    let len = std::fs::metadata(&path)
        .map_err(|e| bad(e.to_string()))?
        .len();
    if len != f.file_len() {
        return Err(bad(format!(
            "is {len} bytes, the plan says {}",
            f.file_len()
        )));
    }
    let mut head = vec![0u8; f.header.len()];
    let file = std::fs::File::open(&path).map_err(io_err(&path))?;
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut head, 0).map_err(io_err(&path))?;
    if head != f.header {
        return Err(bad("header differs from the plan's".into()));
    }
    let map = crate::fsio::Map::open(&path)?;
    let header = f.header.len() as u64;
    let actual: Vec<u64> = f
        .chunks
        .par_iter()
        .map(|c| {
            let start = header + c.data_start;
            let bytes = &map.bytes()[start as usize..(start + c.len) as usize];
            let sum = chunk_checksum(bytes, BLOCK_BYTES);
            map.release(start, c.len);
            sum
        })
        .collect();
    for ((c, &want), got) in f.chunks.iter().zip(checks).zip(actual) {
        if want != got {
            return Err(bad(format!(
                "tensor `{}`: the chunk at offsets {:?} hashes to {}, the manifest says {}: the part changed after it was written; rerun rank {}",
                ckpt.tensors[c.tensor].name,
                c.region.offsets,
                to_hex(got),
                to_hex(want),
                f.rank
            )));
        }
    }
    Ok(())
}

/// Builds the remat index of a written plan.
pub fn build_index(ckpt: &Checkpoint, plan: &Plan, sums: &[Option<Vec<u64>>]) -> Index {
    let files = plan
        .files
        .iter()
        .map(|f| IndexFile {
            name: f.name.clone(),
            rank: f.rank,
            bytes: f.file_len(),
        })
        .collect();
    // Chunks grouped by tensor in one pass over the files, in file then chunk order.
    let mut by_tensor: Vec<Vec<IndexChunk>> = vec![Vec::new(); ckpt.tensors.len()];
    for (slot, f) in plan.files.iter().enumerate() {
        for (ci, c) in f.chunks.iter().enumerate() {
            let start = f.header.len() as u64 + c.data_start;
            let sum = sums[slot]
                .as_ref()
                .and_then(|s| s.get(ci))
                .copied()
                .unwrap_or(0);
            by_tensor[c.tensor].push(IndexChunk {
                file: slot,
                offsets: c.region.offsets.clone(),
                sizes: c.region.sizes.clone(),
                byte_range: [start, start + c.len],
                checksum: to_hex(sum),
            });
        }
    }
    let tensors = plan
        .tensors
        .iter()
        .map(|tt| {
            let t = &ckpt.tensors[tt.tensor];
            let chunks = std::mem::take(&mut by_tensor[tt.tensor]);
            IndexTensor {
                name: t.name.clone(),
                dtype: t.dtype.name().into(),
                shape: t.shape.clone(),
                placement: tt.placement.to_string(),
                chunks,
            }
        })
        .collect();
    Index {
        format: FORMAT_TAG.into(),
        version: 1,
        layout: plan.format.name().into(),
        world_size: plan.world_size,
        checksum: ChecksumSpec {
            algorithm: ALGORITHM.into(),
            block_bytes: BLOCK_BYTES,
        },
        files,
        tensors,
    }
}

/// The index documents of a written plan, in the order they must be written: the
/// layout's own (Hugging Face multi-file) first, the remat index last.
pub fn index_documents(
    ckpt: &Checkpoint,
    plan: &Plan,
    sums: &[Option<Vec<u64>>],
) -> Result<Vec<(String, Vec<u8>)>> {
    let mut docs = Vec::new();
    if plan.format == Format::Hf && plan.world_size > 1 {
        let mut weight_map = serde_json::Map::new();
        for f in &plan.files {
            for c in &f.chunks {
                weight_map.insert(ckpt.tensors[c.tensor].name.clone(), f.name.clone().into());
            }
        }
        let total: u64 = plan.files.iter().map(|f| f.data_len).sum();
        let hf =
            serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        docs.push((HF_INDEX_NAME.to_string(), hf.to_string().into_bytes()));
    }
    let index = build_index(ckpt, plan, sums);
    let text = serde_json::to_vec_pretty(&index).map_err(|e| ReshardError::Index {
        path: INDEX_NAME.into(),
        what: e.to_string(),
    })?;
    docs.push((INDEX_NAME.to_string(), text));
    Ok(docs)
}

/// Writes the layout's own index (Hugging Face multi-file) and then the remat index, last.
pub fn write_indexes(
    ckpt: &Checkpoint,
    plan: &Plan,
    dir: &Path,
    sums: &[Option<Vec<u64>>],
) -> Result<()> {
    for (name, bytes) in index_documents(ckpt, plan, sums)? {
        write_atomic(&dir.join(name), &bytes)?;
    }
    Ok(())
}
