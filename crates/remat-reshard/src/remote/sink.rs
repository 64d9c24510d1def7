//! Writing a plan into an object store: each target file is written to scratch by the
//! executor (checksummed on the way), uploaded (multipart above one part), and then
//! certified by a marker object `.remat-parts/NAME.json` holding the plan fingerprint,
//! its size, the store's ETag and its chunk checksums. The index documents are written
//! last, by a whole run or by [`finalize`] after `--rank` runs, which checks every file
//! first. So a run stopped at any moment leaves no index (nothing that reads as a
//! complete checkpoint), and a re-run skips every file a marker certifies and the store
//! still holds unchanged (same size and ETag): nothing complete is uploaded twice.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStore, PutPayload, PutResult};
use serde::{Deserialize, Serialize};

use crate::checkpoint::Checkpoint;
use crate::checksum::{BLOCK_BYTES, block_digest, combine, from_hex, to_hex};
use crate::error::{ReshardError, Result, io_err};
use crate::exec::{ExecOptions, ExecReport, write_files};
use crate::location::Remote;
use crate::output::index_documents;
use crate::plan::{Plan, TargetFile};
use crate::remote::RemoteCheckpoint;
use crate::remote::block_on;
use crate::remote::fetch::{fetch, ranges_for};

/// Where the markers live, beside the files.
pub const MARKER_DIR: &str = ".remat-parts";

/// Certifies one uploaded target file.
#[derive(Serialize, Deserialize)]
struct Marker {
    fingerprint: String,
    name: String,
    rank: usize,
    bytes: u64,
    e_tag: Option<String>,
    checksums: Vec<String>,
}

/// Where the source bytes come from.
pub enum Source<'a> {
    Local(&'a Checkpoint),
    Remote(&'a RemoteCheckpoint),
}

impl Source<'_> {
    pub fn ckpt(&self) -> &Checkpoint {
        match self {
            Source::Local(c) => c,
            Source::Remote(rc) => &rc.ckpt,
        }
    }
}

fn marker_name(name: &str) -> String {
    format!("{MARKER_DIR}/{name}.json")
}

/// Writes the files of `opts.rank` (or all, then the index) under `dst`, skipping the
/// files markers certify.
pub fn execute(src: &Source, plan: &Plan, dst: &Remote, opts: &ExecOptions) -> Result<ExecReport> {
    let started = Instant::now();
    if let Some(rank) = opts.rank.filter(|&r| r >= plan.world_size) {
        return Err(ReshardError::Target(format!(
            "rank {rank} is outside the target world size {}",
            plan.world_size
        )));
    }
    block_on(refuse_complete(dst, plan, opts.overwrite))??;
    let slots: Vec<usize> = (0..plan.files.len())
        .filter(|&i| opts.rank.is_none_or(|r| plan.files[i].rank == r))
        .collect();
    let mut sums: Vec<Option<Vec<u64>>> = vec![None; plan.files.len()];
    if !opts.overwrite {
        for (slot, certified) in block_on(certified(dst, plan, &slots))?? {
            sums[slot] = Some(certified);
        }
    }
    let todo: Vec<usize> = slots
        .iter()
        .copied()
        .filter(|&s| sums[s].is_none())
        .collect();
    let fetched = match src {
        Source::Remote(rc) => Some(fetch(
            rc,
            ranges_for(&rc.ckpt, plan, &todo),
            opts.max_buffer,
        )?),
        Source::Local(_) => None,
    };
    let scratch = super::scratch_dir("dst")?;
    let written = write_and_upload(src.ckpt(), plan, dst, &todo, &scratch, opts);
    let _ = std::fs::remove_dir_all(&scratch);
    let mut report = written?;
    for (slot, s) in report.1.into_iter().enumerate() {
        if s.is_some() {
            sums[slot] = s;
        }
    }
    if opts.rank.is_none() {
        block_on(write_index(src.ckpt(), plan, dst, &sums))??;
    }
    report.0.files_resumed = slots.len() - todo.len();
    report.0.fetched = fetched;
    report.0.seconds = started.elapsed().as_secs_f64();
    Ok(report.0)
}

/// Refuses a destination holding a complete checkpoint unless overwriting; when
/// overwriting, removes its index first (so it never reads as complete again until
/// this run finishes) and every marker.
async fn refuse_complete(dst: &Remote, plan: &Plan, overwrite: bool) -> Result<()> {
    let index = crate::index::INDEX_NAME;
    let exists = match dst.store.head(&dst.key(index)).await {
        Ok(_) => true,
        Err(object_store::Error::NotFound { .. }) => false,
        Err(e) => return Err(dst.err(index, e)),
    };
    if !overwrite {
        if exists {
            return Err(ReshardError::OutputExists {
                path: dst.display(index),
            });
        }
        return Ok(());
    }
    let mut names = vec![
        index.to_string(),
        crate::checkpoint::HF_INDEX_NAME.to_string(),
    ];
    names.extend(plan.files.iter().map(|f| marker_name(&f.name)));
    for name in names {
        match dst.store.delete(&dst.key(&name)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(dst.err(&name, e)),
        }
    }
    Ok(())
}

/// The marker of `f`, if there is one that parses.
async fn read_marker(dst: &Remote, f: &TargetFile) -> Result<Option<Marker>> {
    let name = marker_name(&f.name);
    let bytes = match dst.store.get(&dst.key(&name)).await {
        Ok(got) => got.bytes().await.map_err(|e| dst.err(&name, e))?,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(dst.err(&name, e)),
    };
    Ok(serde_json::from_slice(&bytes).ok())
}

/// Why `marker` does not certify `f` as the store holds it now, if it does not.
async fn uncertified(
    dst: &Remote,
    plan: &Plan,
    f: &TargetFile,
    m: &Marker,
) -> Result<Option<String>> {
    if m.fingerprint != to_hex(plan.fingerprint) || m.name != f.name || m.rank != f.rank {
        return Ok(Some(format!(
            "its marker comes from a different plan (fingerprint {}, this plan's {}): rerun rank {} with the same source and options",
            m.fingerprint,
            to_hex(plan.fingerprint),
            f.rank
        )));
    }
    if m.bytes != f.file_len() || m.checksums.len() != f.chunks.len() {
        return Ok(Some(format!(
            "its marker lists {} bytes and {} chunks, the plan {} and {}",
            m.bytes,
            m.checksums.len(),
            f.file_len(),
            f.chunks.len()
        )));
    }
    let meta = match dst.store.head(&dst.key(&f.name)).await {
        Ok(meta) => meta,
        Err(object_store::Error::NotFound { .. }) => {
            return Ok(Some("the file is missing though its marker exists".into()));
        }
        Err(e) => return Err(dst.err(&f.name, e)),
    };
    if meta.size != m.bytes || (m.e_tag.is_some() && meta.e_tag != m.e_tag) {
        return Ok(Some(format!(
            "the file is {} bytes with ETag {:?}, its marker says {} bytes with ETag {:?}: it changed after it was certified",
            meta.size, meta.e_tag, m.bytes, m.e_tag
        )));
    }
    Ok(None)
}

/// Chunk checksums of the files among `slots` that markers certify.
async fn certified(dst: &Remote, plan: &Plan, slots: &[usize]) -> Result<Vec<(usize, Vec<u64>)>> {
    let mut out = Vec::new();
    for &slot in slots {
        let f = &plan.files[slot];
        let Some(m) = read_marker(dst, f).await? else {
            continue;
        };
        if uncertified(dst, plan, f, &m).await?.is_some() {
            continue;
        }
        if let Some(sums) = m.checksums.iter().map(|s| from_hex(s)).collect() {
            out.push((slot, sums));
        }
    }
    Ok(out)
}

type Written = (ExecReport, Vec<Option<Vec<u64>>>);

/// Writes each file of `todo` to scratch, uploads it, certifies it, removes the scratch
/// copy: scratch holds one target file at a time.
fn write_and_upload(
    ckpt: &Checkpoint,
    plan: &Plan,
    dst: &Remote,
    todo: &[usize],
    scratch: &Path,
    opts: &ExecOptions,
) -> Result<Written> {
    let mut report = ExecReport {
        files_written: 0,
        bytes_written: 0,
        seconds: 0.0,
        buffer_bytes: 0,
        files_resumed: 0,
        fetched: None,
    };
    let mut sums = vec![None; plan.files.len()];
    for &slot in todo {
        let f = &plan.files[slot];
        let path = scratch.join(&f.name);
        let (r, mut s) = write_files(ckpt, plan, &[(slot, path.clone())], opts)?;
        let checksums = s[slot].take().unwrap_or_default();
        block_on(async {
            let put = upload(dst, &f.name, &path, opts.max_buffer).await?;
            put_marker(dst, plan, f, put.e_tag, &checksums).await
        })??;
        let _ = std::fs::remove_file(&path);
        sums[slot] = Some(checksums);
        report.files_written += 1;
        report.bytes_written += r.bytes_written;
        report.buffer_bytes = report.buffer_bytes.max(r.buffer_bytes);
    }
    Ok((report, sums))
}

async fn put_marker(
    dst: &Remote,
    plan: &Plan,
    f: &TargetFile,
    e_tag: Option<String>,
    sums: &[u64],
) -> Result<()> {
    let marker = Marker {
        fingerprint: to_hex(plan.fingerprint),
        name: f.name.clone(),
        rank: f.rank,
        bytes: f.file_len(),
        e_tag,
        checksums: sums.iter().map(|s| to_hex(*s)).collect(),
    };
    let name = marker_name(&f.name);
    let text = serde_json::to_vec_pretty(&marker).map_err(|e| dst.err(&name, e))?;
    dst.store
        .put(&dst.key(&name), PutPayload::from(text))
        .await
        .map_err(|e| dst.err(&name, e))?;
    Ok(())
}

/// Part size and parts in flight for a file of `len` bytes: parts of an eighth of the
/// buffer bound, at least S3's 5 MiB minimum and large enough to stay within its 10,000
/// parts, at most 64 MiB; in flight, as many as half the bound holds (1 to 8). Half:
/// the HTTP client holds a part's bytes until the server has answered, and the copy
/// buffers the executor freed just before stay with the allocator; measured on the
/// 0.91 GiB bench against moto, parts filling the whole bound put anonymous memory
/// 343 MiB over idle against a bound of 267 MiB.
fn upload_shape(len: u64, max_buffer: u64) -> (u64, usize) {
    let part = (max_buffer / 8)
        .clamp(5 << 20, 64 << 20)
        .max(len.div_ceil(10_000));
    let in_flight = (max_buffer / 2 / part).clamp(1, 8) as usize;
    (part, in_flight)
}

/// Uploads the scratch file at `path` as `name`: one PUT when it fits in one part, else
/// a multipart upload whose parts are read from the file as they are sent. A failed
/// upload is aborted, so no object appears at `name`.
pub(crate) async fn upload(
    dst: &Remote,
    name: &str,
    path: &Path,
    max_buffer: u64,
) -> Result<PutResult> {
    let file = File::open(path).map_err(io_err(path))?;
    let len = file.metadata().map_err(io_err(path))?.len();
    let (part, in_flight) = upload_shape(len, max_buffer);
    let key = dst.key(name);
    if len <= part {
        let bytes = read_at(&file, path, 0, len)?;
        return dst
            .store
            .put(&key, PutPayload::from(bytes))
            .await
            .map_err(|e| dst.err(name, e));
    }
    let mut up = dst
        .store
        .put_multipart(&key)
        .await
        .map_err(|e| dst.err(name, e))?;
    let sent = send_parts(&mut *up, (&file, path), len, (part, in_flight)).await;
    match sent {
        Ok(()) => up.complete().await.map_err(|e| dst.err(name, e)),
        Err(e) => {
            let _ = up.abort().await;
            Err(match e {
                PartError::Store(e) => dst.err(name, e),
                PartError::Local(e) => e,
            })
        }
    }
}

enum PartError {
    Store(String),
    Local(ReshardError),
}

async fn send_parts(
    up: &mut dyn object_store::MultipartUpload,
    (file, path): (&File, &Path),
    len: u64,
    (part, in_flight): (u64, usize),
) -> std::result::Result<(), PartError> {
    let mut running = tokio::task::JoinSet::new();
    let mut at = 0;
    while at < len {
        while running.len() >= in_flight {
            joined(running.join_next().await)?;
        }
        let n = part.min(len - at);
        let bytes = read_at(file, path, at, n).map_err(PartError::Local)?;
        running.spawn(up.put_part(PutPayload::from(bytes)));
        at += n;
    }
    while let Some(done) = running.join_next().await {
        joined(Some(done))?;
    }
    Ok(())
}

fn joined(
    done: Option<std::result::Result<object_store::Result<()>, tokio::task::JoinError>>,
) -> std::result::Result<(), PartError> {
    match done {
        Some(Ok(Ok(()))) | None => Ok(()),
        Some(Ok(Err(e))) => Err(PartError::Store(e.to_string())),
        Some(Err(e)) => Err(PartError::Store(format!("part upload task failed: {e}"))),
    }
}

fn read_at(file: &File, path: &Path, at: u64, len: u64) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, at).map_err(io_err(path))?;
    Ok(buf)
}

/// Writes the index documents (the remat index last), then removes the markers.
async fn write_index(
    ckpt: &Checkpoint,
    plan: &Plan,
    dst: &Remote,
    sums: &[Option<Vec<u64>>],
) -> Result<()> {
    for (name, bytes) in index_documents(ckpt, plan, sums)? {
        dst.store
            .put(&dst.key(&name), PutPayload::from(bytes))
            .await
            .map_err(|e| dst.err(&name, e))?;
    }
    // The index certifies the files now; markers are only resume state.
    for f in &plan.files {
        let _ = dst.store.delete(&dst.key(&marker_name(&f.name))).await;
    }
    Ok(())
}

/// After `--rank` runs into `dst`: checks every file (its marker, size, header, and the
/// checksum of every chunk, read back from the store) and writes the index.
pub fn finalize(
    ckpt: &Checkpoint,
    plan: &Plan,
    dst: &Remote,
    overwrite: bool,
    max_buffer: u64,
) -> Result<()> {
    block_on(async {
        let index = crate::index::INDEX_NAME;
        if !overwrite && dst.store.head(&dst.key(index)).await.is_ok() {
            return Err(ReshardError::OutputExists {
                path: dst.display(index),
            });
        }
        let mut sums = Vec::with_capacity(plan.files.len());
        for f in &plan.files {
            sums.push(Some(check_file(ckpt, dst, plan, f, max_buffer).await?));
        }
        write_index(ckpt, plan, dst, &sums).await
    })?
}

/// One file's marker, size, header and chunk checksums.
async fn check_file(
    ckpt: &Checkpoint,
    dst: &Remote,
    plan: &Plan,
    f: &TargetFile,
    max_buffer: u64,
) -> Result<Vec<u64>> {
    let bad = |what: String| ReshardError::Part {
        path: dst.display(&f.name),
        what,
    };
    let m = read_marker(dst, f).await?.ok_or_else(|| {
        bad(format!(
            "rank {} has not finished this file (no marker {})",
            f.rank,
            marker_name(&f.name)
        ))
    })?;
    if let Some(why) = uncertified(dst, plan, f, &m).await? {
        return Err(bad(why));
    }
    let key = dst.key(&f.name);
    let head = dst
        .store
        .get_range(&key, 0..f.header.len() as u64)
        .await
        .map_err(|e| dst.err(&f.name, e))?;
    if head[..] != f.header[..] {
        return Err(bad("header differs from the plan's".into()));
    }
    let actual = chunk_sums(dst, f, max_buffer).await?;
    for (c, (want, got)) in f.chunks.iter().zip(m.checksums.iter().zip(actual)) {
        if from_hex(want) != Some(got) {
            return Err(bad(format!(
                "tensor `{}`: the chunk at offsets {:?} hashes to {}, its marker says {want}: the file changed after it was written; rerun rank {}",
                ckpt.tensors[c.tensor].name,
                c.region.offsets,
                to_hex(got),
                f.rank
            )));
        }
    }
    Ok(m.checksums.iter().filter_map(|s| from_hex(s)).collect())
}

/// The chunk checksums of the stored file, read back block by block (ranged GETs of
/// checksum blocks, as many in flight as `max_buffer` holds).
async fn chunk_sums(dst: &Remote, f: &TargetFile, max_buffer: u64) -> Result<Vec<u64>> {
    let header = f.header.len() as u64;
    let mut blocks: Vec<(usize, u64, u64, u64)> = Vec::new();
    for (ci, c) in f.chunks.iter().enumerate() {
        for b in 0..c.len.div_ceil(BLOCK_BYTES) {
            let start = header + c.data_start + b * BLOCK_BYTES;
            let end = (start + BLOCK_BYTES).min(header + c.data_start + c.len);
            blocks.push((ci, b, start, end));
        }
    }
    let in_flight = (max_buffer / BLOCK_BYTES).clamp(1, 16) as usize;
    let key = dst.key(&f.name);
    let store: &dyn ObjectStore = &*dst.store;
    let mut digests: Vec<(usize, u64, u64)> = futures::stream::iter(blocks)
        .map(|(ci, b, s, e)| {
            let key = key.clone();
            async move {
                let bytes = store
                    .get_range(&key, s..e)
                    .await
                    .map_err(|e| dst.err(&f.name, e))?;
                Ok::<_, ReshardError>((ci, b, block_digest(&bytes)))
            }
        })
        .buffer_unordered(in_flight)
        .try_collect()
        .await?;
    digests.sort_unstable();
    let mut per_chunk: Vec<Vec<u64>> = vec![Vec::new(); f.chunks.len()];
    for (ci, _, d) in digests {
        per_chunk[ci].push(d);
    }
    Ok(per_chunk.iter().map(|d| combine(d)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts meet S3's limits (5 MiB at least, 10,000 at most) and what is in flight stays
    /// within half the bound, or one part where the bound is below S3's minimum.
    #[test]
    fn upload_parts_meet_s3_limits_and_half_the_bound() {
        for max_buffer in [1 << 20, 16 << 20, 20 << 20, 256 << 20, 4 << 30] {
            for len in [1u64, 6 << 20, 300 << 20, 1 << 40] {
                let (part, in_flight) = upload_shape(len, max_buffer);
                assert!(part >= 5 << 20, "{part}");
                assert!(len.div_ceil(part) <= 10_000, "{len} in parts of {part}");
                assert!(in_flight >= 1);
                let held = part * in_flight as u64;
                assert!(
                    held <= (max_buffer / 2).max(part),
                    "{held} held for {max_buffer}"
                );
            }
        }
    }
}
