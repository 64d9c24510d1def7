//! Ranged GETs of exactly the source bytes some target files need, into the scratch
//! files of a remote checkpoint ([`super::mirror`]).

use std::os::unix::fs::FileExt;

use futures::{StreamExt, TryStreamExt};
use object_store::{GetOptions, GetRange};

use crate::checkpoint::Checkpoint;
use crate::error::{Result, io_err};
use crate::geometry::for_each_run;
use crate::plan::Plan;
use crate::remote::RemoteCheckpoint;
use crate::source_check;

/// Runs of one file closer than this are fetched by one request: a request costs a
/// round trip (tens of milliseconds to S3), in which a few hundred KiB would have
/// arrived anyway. Aligned splits read whole contiguous pieces and never gap.
const MERGE_GAP: u64 = 256 << 10;

/// Byte ranges `[start, end)` to fetch, per source file.
pub type Ranges = Vec<Vec<(u64, u64)>>;

/// What a fetch asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Distinct source bytes the target files copy (or whose checksums are checked).
    pub bytes_needed: u64,
    /// Bytes requested (needed bytes plus the small gaps merged into requests).
    pub bytes_requested: u64,
    pub requests: u64,
}

impl FetchStats {
    /// Bytes requested per byte needed: 1.0 when every request is needed bytes only.
    pub fn read_amplification(&self) -> f64 {
        self.bytes_requested as f64 / self.bytes_needed.max(1) as f64
    }

    pub fn add(&mut self, other: FetchStats) {
        self.bytes_needed += other.bytes_needed;
        self.bytes_requested += other.bytes_requested;
        self.requests += other.requests;
    }
}

/// The source bytes writing the files in `slots` reads: every run the plan copies, plus
/// whole pieces whose index checksum is checked by hashing them.
pub fn ranges_for(ckpt: &Checkpoint, plan: &Plan, slots: &[usize]) -> Ranges {
    let mut ranges: Ranges = vec![Vec::new(); ckpt.files.len()];
    for &slot in slots {
        for copy in &plan.files[slot].copies {
            let file = &mut ranges[copy.src_file];
            for_each_run(copy, |src, _| file.push((src, src + copy.run)));
        }
    }
    let checks = source_check::plan_checks(ckpt, plan, slots);
    for (_, p) in checks.hashed {
        ranges[p.file].push((p.start, p.start + p.len));
    }
    ranges
}

/// Every piece with a replica (the same box in another file): opening compares them.
pub fn replica_ranges(ckpt: &Checkpoint) -> Ranges {
    let mut ranges: Ranges = vec![Vec::new(); ckpt.files.len()];
    for t in &ckpt.tensors {
        for (i, p) in t.pieces.iter().enumerate() {
            let replicated = t
                .pieces
                .iter()
                .enumerate()
                .any(|(j, q)| i != j && q.region == p.region && !p.region.is_empty());
            if replicated {
                ranges[p.file].push((p.start, p.start + p.len));
            }
        }
    }
    ranges
}

/// Sorts `ranges` and merges those less than `gap` apart (touching or overlapping ones
/// with `gap` 0).
fn coalesce(mut ranges: Vec<(u64, u64)>, gap: u64) -> Vec<(u64, u64)> {
    ranges.retain(|r| r.1 > r.0);
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (s, e) in ranges {
        match out.last_mut() {
            Some(last) if s <= last.1 + gap => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

fn total(ranges: &[(u64, u64)]) -> u64 {
    ranges.iter().map(|r| r.1 - r.0).sum()
}

/// Fetches `ranges` into the scratch files, at most `max_buffer` bytes in flight.
pub fn fetch(rc: &RemoteCheckpoint, ranges: Ranges, max_buffer: u64) -> Result<FetchStats> {
    let (size, in_flight) = super::request_shape(max_buffer);
    let mut stats = FetchStats::default();
    let mut requests: Vec<(usize, u64, u64)> = Vec::new();
    for (file, r) in ranges.into_iter().enumerate() {
        let exact = coalesce(r, 0);
        stats.bytes_needed += total(&exact);
        let merged = coalesce(exact, MERGE_GAP);
        stats.bytes_requested += total(&merged);
        for (s, e) in merged {
            let mut at = s;
            while at < e {
                let end = (at + size).min(e);
                requests.push((file, at, end));
                at = end;
            }
        }
    }
    stats.requests = requests.len() as u64;
    super::block_on(async {
        futures::stream::iter(requests)
            .map(|(file, s, e)| get_into(rc, file, s, e))
            .buffer_unordered(in_flight)
            .try_collect::<Vec<()>>()
            .await
    })??;
    Ok(stats)
}

/// One ranged GET, written into the scratch file as its body arrives: the response is
/// never gathered in memory, so requests in flight hold only the transport's buffers.
async fn get_into(rc: &RemoteCheckpoint, file: usize, start: u64, end: u64) -> Result<()> {
    let (name, handle) = &rc.files[file];
    let err = |e: object_store::Error| rc.remote.err(name, e);
    let options = GetOptions {
        range: Some(GetRange::Bounded(start..end)),
        ..Default::default()
    };
    let got = rc
        .remote
        .store
        .get_opts(&rc.remote.key(name), options)
        .await
        .map_err(err)?;
    let mut body = got.into_stream();
    let mut at = start;
    while let Some(bytes) = body.next().await {
        let bytes = bytes.map_err(err)?;
        if at + bytes.len() as u64 > end {
            break;
        }
        handle
            .write_all_at(&bytes, at)
            .map_err(io_err(&rc.ckpt.files[file].path))?;
        at += bytes.len() as u64;
    }
    if at != end {
        return Err(rc.remote.err(
            name,
            format!(
                "asked for bytes {start}..{end}, got {}: the object changed while it was read",
                at - start
            ),
        ));
    }
    Ok(())
}

/// Fetches every source byte (for verification, which compares everything).
pub fn fetch_all(rc: &RemoteCheckpoint, max_buffer: u64) -> Result<FetchStats> {
    let mut ranges: Ranges = vec![Vec::new(); rc.ckpt.files.len()];
    for t in &rc.ckpt.tensors {
        for p in &t.pieces {
            ranges[p.file].push((p.start, p.start + p.len));
        }
    }
    fetch(rc, ranges, max_buffer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalescing_merges_touching_ranges_and_small_gaps_only() {
        let r = vec![(10, 20), (0, 10), (30, 40), (35, 50), (50, 50)];
        assert_eq!(coalesce(r.clone(), 0), vec![(0, 20), (30, 50)]);
        assert_eq!(coalesce(r, 10), vec![(0, 50)]);
        assert_eq!(
            coalesce(vec![(0, 1), (100, 101)], 98),
            vec![(0, 1), (100, 101)]
        );
    }
}
