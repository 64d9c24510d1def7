//! `verify`: do two layouts hold the same global tensors? Streams through both maps
//! comparing matching runs in place, so memory stays bounded; names the first difference.

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;
use xxhash_rust::xxh3::Xxh3;

use crate::checkpoint::{Checkpoint, Piece, TensorInfo};
use crate::checksum::combine;
use crate::error::Result;
use crate::fsio::Map;
use crate::geometry::{Region, for_each_run, intersecting_pairs, strided_copy};

/// Bytes compared or hashed between two looks at how far a walk has come.
const STEP: usize = 1 << 20;
/// Source pages behind a walk are handed back once this many bytes have piled up.
const RELEASE_EVERY: u64 = 4 << 20;
const PAGE: u64 = 4096;

/// A forward walk through one map that hands the pages behind it back every few MiB,
/// so the bytes a walk keeps mapped stay bounded however long the run or chunk it
/// reads; it counts the most it ever held (the span from the last release point to the
/// furthest byte reached).
struct Walk<'m> {
    map: &'m Map,
    from: u64,
    peak: u64,
}

impl<'m> Walk<'m> {
    fn new(map: &'m Map, start: u64) -> Walk<'m> {
        Walk {
            map,
            from: start / PAGE * PAGE,
            peak: 0,
        }
    }

    /// Everything before `upto` has been read.
    fn reached(&mut self, upto: u64) {
        self.peak = self.peak.max(upto.saturating_sub(self.from));
        let cut = upto / PAGE * PAGE;
        if cut >= self.from + RELEASE_EVERY {
            self.map.release(self.from, cut - self.from);
            self.from = cut;
        }
    }

    /// Hands back everything up to `end` and returns the peak held.
    fn finish(self, end: u64) -> u64 {
        if end > self.from {
            self.map.release(self.from, end - self.from);
        }
        self.peak
    }
}

/// The first difference found (tensors in name order, elements in row-major order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Difference {
    pub tensor: String,
    /// Global index of the first differing element, when contents differ.
    pub element: Option<Vec<u64>>,
    pub detail: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.element {
            Some(e) => write!(
                f,
                "tensor `{}` differs first at element {e:?}: {}",
                self.tensor, self.detail
            ),
            None => write!(f, "tensor `{}`: {}", self.tensor, self.detail),
        }
    }
}

/// Outcome of a verification.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub tensors: usize,
    pub bytes_compared: u64,
    pub chunks_checksummed: usize,
    pub difference: Option<Difference>,
    /// The most mapped bytes any one comparison or checksum kept resident at once (both
    /// sides together): the working set, bounded whatever the tensor sizes.
    pub peak_held_bytes: u64,
}

/// Compares `a` and `b` tensor by tensor and checks the chunk checksums either records.
/// `progress` receives bytes compared.
pub fn verify(
    a: &Checkpoint,
    b: &Checkpoint,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<VerifyReport> {
    let mut report = VerifyReport {
        tensors: a.tensors.len(),
        ..Default::default()
    };
    if let Some(d) = compare_names(a, b) {
        report.difference = Some(d);
        return Ok(report);
    }
    let held = AtomicU64::new(0);
    let results: Vec<(u64, usize, Option<Difference>)> = a
        .tensors
        .par_iter()
        .zip(&b.tensors)
        .map(|(ta, tb)| {
            let (bytes, diff) = compare_tensor(a, ta, b, tb, &held);
            if let Some(p) = progress {
                p(bytes);
            }
            let (n1, d1) = check_sums(a, ta, &held);
            let (n2, d2) = check_sums(b, tb, &held);
            (bytes, n1 + n2, diff.or(d1).or(d2))
        })
        .collect();
    report.peak_held_bytes = held.load(Ordering::Relaxed);
    for (bytes, sums, diff) in results {
        report.bytes_compared += bytes;
        report.chunks_checksummed += sums;
        if report.difference.is_none() {
            report.difference = diff;
        }
    }
    Ok(report)
}

fn compare_names(a: &Checkpoint, b: &Checkpoint) -> Option<Difference> {
    let mut i = 0;
    let mut j = 0;
    loop {
        let (ta, tb) = (a.tensors.get(i), b.tensors.get(j));
        let (name, side) = match (ta, tb) {
            (None, None) => break,
            (Some(x), Some(y)) if x.name == y.name => {
                if x.dtype != y.dtype || x.shape != y.shape {
                    let detail = format!(
                        "{} {:?} in A, {} {:?} in B",
                        x.dtype, x.shape, y.dtype, y.shape
                    );
                    return Some(Difference {
                        tensor: x.name.clone(),
                        element: None,
                        detail,
                    });
                }
                i += 1;
                j += 1;
                continue;
            }
            (Some(x), Some(y)) if x.name < y.name => (&x.name, "A"),
            (Some(x), None) => (&x.name, "A"),
            (_, Some(y)) => (&y.name, "B"),
        };
        return Some(Difference {
            tensor: name.clone(),
            element: None,
            detail: format!("present only in {side}"),
        });
    }
    None
}

/// Compares every piece of A (replicas too) with B's distinct pieces, then B's extra
/// replicas with A's distinct pieces.
fn compare_tensor(
    a: &Checkpoint,
    ta: &TensorInfo,
    b: &Checkpoint,
    tb: &TensorInfo,
    held: &AtomicU64,
) -> (u64, Option<Difference>) {
    let a_all: Vec<&Piece> = ta.pieces.iter().filter(|p| !p.region.is_empty()).collect();
    let b_distinct = tb.distinct_pieces();
    let (bytes, first) = compare_sides(
        Side {
            ckpt: a,
            pieces: &a_all,
            label: "A",
        },
        Side {
            ckpt: b,
            pieces: &b_distinct,
            label: "B",
        },
        ta,
        held,
    );
    let b_extra: Vec<&Piece> = tb
        .pieces
        .iter()
        .filter(|p| !p.region.is_empty() && !b_distinct.iter().any(|d| std::ptr::eq(*d, *p)))
        .collect();
    let a_distinct = ta.distinct_pieces();
    let (more, second) = compare_sides(
        Side {
            ckpt: b,
            pieces: &b_extra,
            label: "B",
        },
        Side {
            ckpt: a,
            pieces: &a_distinct,
            label: "A",
        },
        ta,
        held,
    );
    let best = match (first, second) {
        (Some(x), Some(y)) => Some(if y.0 < x.0 { y } else { x }),
        (x, y) => x.or(y),
    };
    let diff = best.map(|(_, element, detail)| Difference {
        tensor: ta.name.clone(),
        element: Some(element),
        detail,
    });
    (bytes + more, diff)
}

struct Side<'a> {
    ckpt: &'a Checkpoint,
    pieces: &'a [&'a Piece],
    label: &'static str,
}

type Found = (u64, Vec<u64>, String);

/// Compares each `dst` piece with the `src` pieces overlapping it, run by run, straight
/// from the two maps. Returns bytes compared and the lowest differing element.
fn compare_sides(dst: Side, src: Side, t: &TensorInfo, held: &AtomicU64) -> (u64, Option<Found>) {
    let dr: Vec<&Region> = dst.pieces.iter().map(|p| &p.region).collect();
    let sr: Vec<&Region> = src.pieces.iter().map(|p| &p.region).collect();
    let bits = t.dtype.bits();
    let mut bytes = 0;
    let mut best: Option<Found> = None;
    for (i, j) in intersecting_pairs(&sr, Some(&dr)) {
        let (s, d) = (src.pieces[i], dst.pieces[j]);
        let Some(inter) = s.region.intersect(&d.region) else {
            continue;
        };
        let (sf, df) = (&src.ckpt.files[s.file], &dst.ckpt.files[d.file]);
        let copy = match strided_copy(
            (s.file, &s.region, s.start),
            (&d.region, d.start),
            &inter,
            bits,
        ) {
            Ok(c) => c,
            Err(what) => {
                let idx = inter.offsets.clone();
                let found = (
                    linear(&t.shape, &idx),
                    idx,
                    format!("cannot compare: {what}"),
                );
                best = Some(best.map_or(found.clone(), |b| if found.0 < b.0 { found } else { b }));
                continue;
            }
        };
        let (sb, db) = (sf.map.bytes(), df.map.bytes());
        let run = copy.run as usize;
        let mut walk_s = Walk::new(&sf.map, copy.src_start);
        let mut walk_d = Walk::new(&df.map, copy.dst_start);
        for_each_run(&copy, |so, doff| {
            let (so, doff) = (so as usize, doff as usize);
            let mut first = None;
            for at in (0..run).step_by(STEP) {
                let n = STEP.min(run - at);
                let (x, y) = (&sb[so + at..so + at + n], &db[doff + at..doff + at + n]);
                walk_s.reached((so + at + n) as u64);
                walk_d.reached((doff + at + n) as u64);
                if x != y {
                    first = x.iter().zip(y).position(|(p, q)| p != q).map(|k| at + k);
                    break;
                }
            }
            let Some(k) = first else {
                return;
            };
            let (x, y) = (&sb[so..so + run], &db[doff..doff + run]);
            let (doff, k) = (doff as u64, k as u64);
            let elem = (doff + k - d.start) * 8 / bits;
            let index = unravel(elem, &d.region);
            let lin = linear(&t.shape, &index);
            if best.as_ref().is_none_or(|b| lin < b.0) {
                let detail = format!(
                    "byte {:#04x} in {} ({}) vs {:#04x} in {} ({})",
                    y[k as usize],
                    dst.label,
                    df.path.display(),
                    x[k as usize],
                    src.label,
                    sf.path.display()
                );
                best = Some((lin, index, detail));
            }
        });
        bytes += copy.bytes();
        let peak = walk_s.finish(copy.src_start + copy.src_span()) + walk_d.finish(copy.dst_end());
        held.fetch_max(peak, Ordering::Relaxed);
    }
    (bytes, best)
}

/// Global index of element `elem` (row-major) of a piece.
fn unravel(mut elem: u64, region: &Region) -> Vec<u64> {
    let mut index = vec![0; region.sizes.len()];
    for d in (0..region.sizes.len()).rev() {
        let n = region.sizes[d].max(1);
        index[d] = region.offsets[d] + elem % n;
        elem /= n;
    }
    index
}

/// Row-major linear index of a global element.
fn linear(shape: &[u64], index: &[u64]) -> u64 {
    shape.iter().zip(index).fold(0u64, |acc, (&n, &i)| {
        acc.saturating_mul(n).saturating_add(i)
    })
}

/// The two-level checksum of `len` bytes at `start`, hashed block by block in steps, the
/// pages behind handed back as it goes.
fn streamed_checksum(map: &Map, start: u64, len: u64, block: u64, held: &AtomicU64) -> u64 {
    let bytes = &map.bytes()[start as usize..(start + len) as usize];
    let mut walk = Walk::new(map, start);
    let mut digests = Vec::new();
    for (b, block_bytes) in bytes.chunks(block.max(1) as usize).enumerate() {
        let mut state = Xxh3::new();
        for (i, piece) in block_bytes.chunks(STEP).enumerate() {
            state.update(piece);
            let done = b as u64 * block + (i * STEP + piece.len()) as u64;
            walk.reached(start + done);
        }
        digests.push(state.digest());
    }
    held.fetch_max(walk.finish(start + len), Ordering::Relaxed);
    combine(&digests)
}

/// Checks the recorded checksums of a tensor's chunks.
fn check_sums(ckpt: &Checkpoint, t: &TensorInfo, held: &AtomicU64) -> (usize, Option<Difference>) {
    let Some(block) = ckpt.checksum_block else {
        return (0, None);
    };
    let mut checked = 0;
    for p in &t.pieces {
        let Some(expected) = p.checksum else { continue };
        let f = &ckpt.files[p.file];
        let actual = streamed_checksum(&f.map, p.start, p.len, block, held);
        checked += 1;
        if actual != expected {
            let detail = format!(
                "checksum mismatch for the chunk at offsets {:?} in {}: the index says {expected:016x}, the data hashes to {actual:016x}",
                p.region.offsets,
                f.path.display()
            );
            return (
                checked,
                Some(Difference {
                    tensor: t.name.clone(),
                    element: None,
                    detail,
                }),
            );
        }
    }
    (checked, None)
}
