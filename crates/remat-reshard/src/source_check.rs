//! Source pieces checked against the checksums their index records, so corrupt input
//! fails instead of being copied and given fresh checksums.
//!
//! A piece that some written target chunk copies whole (the same box; the layouts agree,
//! as in a copy onto the same ranks) is checked for free: the executor hashes that chunk
//! as it writes it, with the same blocks, so its checksum must equal the piece's. Every
//! other piece read (split or joined by the resharding), and every replica of a piece
//! read (the executor copies one of them), is hashed before the copy, block by block in
//! parallel, with its pages handed back as they are passed; the copy then finds the
//! pieces it reads in the page cache.

use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::checkpoint::{Checkpoint, Piece, TensorInfo};
use crate::checksum::{BLOCK_BYTES, block_digest, combine};
use crate::error::{ReshardError, Result};
use crate::geometry::{Region, intersecting_pairs};
use crate::plan::Plan;

/// A written target chunk: plan file slot and chunk index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChunkRef {
    pub slot: usize,
    pub chunk: usize,
}

/// How the source pieces that writing some files reads get checked.
pub(crate) struct SourceChecks<'a> {
    /// Pieces whose bytes a written chunk holds exactly, with that chunk.
    pub via_output: Vec<(&'a TensorInfo, &'a Piece, ChunkRef)>,
    /// Pieces to hash.
    pub hashed: Vec<(&'a TensorInfo, &'a Piece)>,
}

/// Decides how to check the pieces that writing the files in `slots` reads.
pub(crate) fn plan_checks<'a>(
    ckpt: &'a Checkpoint,
    plan: &Plan,
    slots: &[usize],
) -> SourceChecks<'a> {
    let mut checks = SourceChecks {
        via_output: Vec::new(),
        hashed: Vec::new(),
    };
    let Some(block) = ckpt.checksum_block else {
        return checks;
    };
    // The written chunks of each tensor.
    let mut by_tensor: BTreeMap<usize, Vec<(ChunkRef, &Region)>> = BTreeMap::new();
    for &slot in slots {
        for (chunk, c) in plan.files[slot].chunks.iter().enumerate() {
            by_tensor
                .entry(c.tensor)
                .or_default()
                .push((ChunkRef { slot, chunk }, &c.region));
        }
    }
    for (tensor, chunks) in by_tensor {
        let t = &ckpt.tensors[tensor];
        let distinct = t.distinct_pieces();
        let src: Vec<&Region> = distinct.iter().map(|p| &p.region).collect();
        let dst: Vec<&Region> = chunks.iter().map(|c| c.1).collect();
        let mut whole: Vec<Option<ChunkRef>> = vec![None; distinct.len()];
        let mut read = vec![false; distinct.len()];
        for (i, j) in intersecting_pairs(&src, Some(&dst)) {
            read[i] = true;
            if chunks[j].1 == src[i] && block == BLOCK_BYTES {
                whole[i].get_or_insert(chunks[j].0);
            }
        }
        for (i, p) in distinct.iter().enumerate() {
            if !read[i] {
                continue;
            }
            if p.checksum.is_some() {
                match whole[i] {
                    Some(c) => checks.via_output.push((t, p, c)),
                    None => checks.hashed.push((t, p)),
                }
            }
            let replicas = t
                .pieces
                .iter()
                .filter(|q| q.checksum.is_some() && q.region == p.region && !std::ptr::eq(*q, *p));
            checks.hashed.extend(replicas.map(|q| (t, q)));
        }
    }
    checks
}

fn mismatch(ckpt: &Checkpoint, t: &TensorInfo, p: &Piece, actual: u64) -> ReshardError {
    ReshardError::Checksum {
        path: ckpt.files[p.file].path.clone(),
        tensor: t.name.clone(),
        offsets: p.region.offsets.clone(),
        expected: p.checksum.unwrap_or_default(),
        actual,
    }
}

/// Hashes the pieces to hash, in parallel; the first mismatch (in piece order) is the
/// error.
pub(crate) fn hash_pieces(ckpt: &Checkpoint, checks: &SourceChecks) -> Result<()> {
    let block = ckpt.checksum_block.unwrap_or(BLOCK_BYTES).max(1);
    checks
        .hashed
        .par_iter()
        .map(|&(t, p)| {
            let actual = piece_checksum(ckpt, p, block);
            match p.checksum {
                Some(expected) if expected != actual => Err(mismatch(ckpt, t, p, actual)),
                _ => Ok(()),
            }
        })
        .collect::<Vec<Result<()>>>()
        .into_iter()
        .collect()
}

/// The checksum of a piece's bytes in the map, blocks hashed in parallel, each block's
/// pages handed back once hashed.
fn piece_checksum(ckpt: &Checkpoint, p: &Piece, block: u64) -> u64 {
    let map = &ckpt.files[p.file].map;
    let blocks = p.len.div_ceil(block);
    if blocks == 1 {
        // A piece of one block (most small tensors): hashed in place, without a parallel
        // split or a page hand-back (it shares its pages with its neighbours, which the
        // copy reads next).
        let bytes = &map.bytes()[p.start as usize..(p.start + p.len) as usize];
        return combine(&[block_digest(bytes)]);
    }
    let digests: Vec<u64> = (0..blocks)
        .into_par_iter()
        .map(|k| {
            let start = p.start + k * block;
            let len = block.min(p.start + p.len - start);
            let d = block_digest(&map.bytes()[start as usize..(start + len) as usize]);
            map.release(start, len);
            d
        })
        .collect();
    combine(&digests)
}

/// Checks the pieces that written chunks hold exactly against the chunk checksums the
/// executor computed (`sums[slot][chunk]`).
pub(crate) fn check_via_output(
    ckpt: &Checkpoint,
    checks: &SourceChecks,
    sums: &[Option<Vec<u64>>],
) -> Result<()> {
    for &(t, p, c) in &checks.via_output {
        let actual = sums[c.slot].as_ref().and_then(|s| s.get(c.chunk)).copied();
        if let Some(actual) = actual
            && Some(actual) != p.checksum
        {
            return Err(mismatch(ckpt, t, p, actual));
        }
    }
    Ok(())
}
