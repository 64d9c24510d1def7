//! The plan: every target file's header and the strided copies that fill its data.

use std::collections::BTreeMap;

use crate::checkpoint::{Checkpoint, DCP_SHARDING_INFO, Format, HF_SINGLE_NAME};
use crate::error::{ReshardError, Result};
use crate::geometry::{Region, StridedCopy, intersecting_pairs, strided_copy};
use crate::safetensors::{Entry, encode_header};
use crate::target::{TargetSpec, TargetTensor, resolve};

/// A chunk placed in a target file.
#[derive(Clone, Debug)]
pub struct PlannedChunk {
    /// Index into the source checkpoint's tensors.
    pub tensor: usize,
    pub region: Region,
    /// Offset in the file's data section.
    pub data_start: u64,
    pub len: u64,
}

/// One file to write.
#[derive(Clone, Debug)]
pub struct TargetFile {
    pub rank: usize,
    pub name: String,
    pub chunks: Vec<PlannedChunk>,
    /// Encoded header, length prefix included.
    pub header: Vec<u8>,
    pub data_len: u64,
    /// Sorted by destination offset (relative to the data section).
    pub copies: Vec<StridedCopy>,
}

impl TargetFile {
    pub fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.data_len
    }
}

/// The whole plan.
#[derive(Clone, Debug)]
pub struct Plan {
    pub world_size: usize,
    pub format: Format,
    pub tensors: Vec<TargetTensor>,
    pub files: Vec<TargetFile>,
    /// Identifies the plan, so parts written by separate `--rank` runs can be checked to
    /// come from the same one.
    pub fingerprint: u64,
}

/// Plans the resharding of `ckpt` into `spec`.
pub fn plan(ckpt: &Checkpoint, spec: &TargetSpec) -> Result<Plan> {
    let tensors = resolve(ckpt, spec)?;
    let m = spec.world_size;
    let mut files: Vec<TargetFile> = (0..m)
        .map(|rank| TargetFile {
            rank,
            name: file_name(spec.format, rank, m),
            chunks: Vec::new(),
            header: Vec::new(),
            data_len: 0,
            copies: Vec::new(),
        })
        .collect();
    for tt in &tensors {
        let t = &ckpt.tensors[tt.tensor];
        for c in &tt.chunks {
            let f = &mut files[c.rank];
            let len = t
                .dtype
                .bytes_for(c.region.volume())
                .ok_or_else(|| ReshardError::Plan {
                    tensor: t.name.clone(),
                    what: format!(
                        "chunk of sizes {:?} does not fill whole bytes of {}",
                        c.region.sizes, t.dtype
                    ),
                })?;
            f.chunks.push(PlannedChunk {
                tensor: tt.tensor,
                region: c.region.clone(),
                data_start: f.data_len,
                len,
            });
            f.data_len += len;
        }
        add_copies(ckpt, tt, &mut files)?;
    }
    for f in &mut files {
        f.header = header_for(ckpt, spec.format, f);
        f.copies.sort_by_key(|c| c.dst_start);
        merge_adjacent(&mut f.copies);
    }
    let fingerprint = fingerprint(ckpt, &files);
    Ok(Plan {
        world_size: m,
        format: spec.format,
        tensors,
        files,
        fingerprint,
    })
}

/// File name of rank `rank` of `m` in each layout.
pub fn file_name(format: Format, rank: usize, m: usize) -> String {
    match format {
        Format::Remat => format!("rank-{rank:05}-of-{m:05}.safetensors"),
        Format::Dcp => format!("shard-{:05}-model-00001-of-00001.safetensors", rank + 1),
        Format::Hf if m == 1 => HF_SINGLE_NAME.into(),
        Format::Hf => format!("model-{:05}-of-{m:05}.safetensors", rank + 1),
    }
}

/// Intersects the tensor's source pieces with its target chunks (sort and sweep) and
/// turns each intersection into a strided copy into the owning file.
fn add_copies(ckpt: &Checkpoint, tt: &TargetTensor, files: &mut [TargetFile]) -> Result<()> {
    let t = &ckpt.tensors[tt.tensor];
    let pieces = t.distinct_pieces();
    let src: Vec<&Region> = pieces.iter().map(|p| &p.region).collect();
    let dst: Vec<&Region> = tt.chunks.iter().map(|c| &c.region).collect();
    for (i, j) in intersecting_pairs(&src, Some(&dst)) {
        let (p, c) = (pieces[i], &tt.chunks[j]);
        let file = &mut files[c.rank];
        let planned = file
            .chunks
            .iter()
            .rev()
            .find(|pc| pc.tensor == tt.tensor && pc.region == c.region)
            .map(|pc| pc.data_start)
            .unwrap_or(0);
        let Some(inter) = p.region.intersect(&c.region) else {
            continue;
        };
        let copy = strided_copy(
            (p.file, &p.region, p.start),
            (&c.region, planned),
            &inter,
            t.dtype.bits(),
        )
        .map_err(|what| ReshardError::Plan {
            tensor: t.name.clone(),
            what,
        })?;
        file.copies.push(copy);
    }
    Ok(())
}

/// Joins single-run copies that continue each other in both source and destination
/// (consecutive tensors of one file moving together), leaving the fewest runs.
fn merge_adjacent(copies: &mut Vec<StridedCopy>) {
    let mut out: Vec<StridedCopy> = Vec::with_capacity(copies.len());
    for c in copies.drain(..) {
        if let Some(last) = out.last_mut() {
            let mergeable = last.counts.is_empty()
                && c.counts.is_empty()
                && last.src_file == c.src_file
                && last.src_start + last.run == c.src_start
                && last.dst_start + last.run == c.dst_start;
            if mergeable {
                last.run += c.run;
                continue;
            }
        }
        out.push(c);
    }
    *copies = out;
}

fn header_for(ckpt: &Checkpoint, format: Format, f: &TargetFile) -> Vec<u8> {
    let entries: Vec<Entry> = f
        .chunks
        .iter()
        .map(|c| {
            let t = &ckpt.tensors[c.tensor];
            Entry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: c.region.sizes.clone(),
                start: c.data_start,
                end: c.data_start + c.len,
            }
        })
        .collect();
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    if format == Format::Dcp {
        metadata.insert("DCP_VERSION".into(), "1.0".into());
        let info: serde_json::Map<String, serde_json::Value> = f
            .chunks
            .iter()
            .map(|c| {
                (
                    ckpt.tensors[c.tensor].name.clone(),
                    serde_json::json!({ "saved_offsets": c.region.offsets }),
                )
            })
            .collect();
        metadata.insert(
            DCP_SHARDING_INFO.into(),
            serde_json::Value::Object(info).to_string(),
        );
    }
    encode_header(&entries, &metadata)
}

/// Identifies the plan and its source, so that `--finalize` refuses parts written by
/// machines that planned differently or read another checkpoint: every target file's
/// name, header and chunks, and every source file's name (relative to the checkpoint, so
/// machines may mount it at different paths), length, header bytes, and the chunk
/// checksums of its index when it has them.
fn fingerprint(ckpt: &Checkpoint, files: &[TargetFile]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for src in &ckpt.files {
        let name = src.path.strip_prefix(&ckpt.root).unwrap_or(&src.path);
        h.update(name.to_string_lossy().as_bytes());
        let bytes = src.map.bytes();
        h.update(&(bytes.len() as u64).to_le_bytes());
        // The length prefix and header JSON, as parsed (validated) when the file was opened.
        let header = usize::try_from(src.header.data_start).unwrap_or(usize::MAX);
        h.update(bytes.get(..header).unwrap_or(bytes));
    }
    for t in &ckpt.tensors {
        for p in &t.pieces {
            if let Some(sum) = p.checksum {
                h.update(&sum.to_le_bytes());
            }
        }
    }
    for f in files {
        h.update(f.name.as_bytes());
        h.update(&f.header);
        for c in &f.chunks {
            h.update(ckpt.tensors[c.tensor].name.as_bytes());
            for v in c.region.offsets.iter().chain(&c.region.sizes) {
                h.update(&v.to_le_bytes());
            }
        }
    }
    h.digest()
}

/// What `--dry-run` prints for one target rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankStats {
    pub rank: usize,
    pub files: usize,
    pub bytes_written: u64,
    /// Source bytes the page cache must bring in: touched 4 KiB pages.
    pub bytes_read: u64,
    pub source_files: usize,
    pub runs: u64,
}

impl RankStats {
    /// Bytes read per byte written.
    pub fn read_amplification(&self) -> f64 {
        if self.bytes_written == 0 {
            0.0
        } else {
            self.bytes_read as f64 / self.bytes_written as f64
        }
    }
}

const PAGE: u64 = 4096;

/// Per-rank statistics of a plan.
pub fn rank_stats(plan: &Plan) -> Vec<RankStats> {
    let mut stats: Vec<RankStats> = (0..plan.world_size)
        .map(|rank| RankStats {
            rank,
            ..Default::default()
        })
        .collect();
    for f in &plan.files {
        let s = &mut stats[f.rank];
        s.files += 1;
        s.bytes_written += f.file_len();
        let mut sources = std::collections::BTreeSet::new();
        for c in &f.copies {
            sources.insert(c.src_file);
            s.runs += c.runs();
            s.bytes_read += pages_touched(c) * PAGE;
        }
        s.source_files += sources.len();
    }
    stats
}

/// Pages a copy touches: each run's pages, but never more than the whole span's.
fn pages_touched(c: &StridedCopy) -> u64 {
    let span_pages = (c.src_start % PAGE + c.src_span()).div_ceil(PAGE);
    let per_run = c.run.div_ceil(PAGE) + u64::from(!c.run.is_multiple_of(PAGE));
    span_pages.min(c.runs().saturating_mul(per_run)).max(1)
}
