//! Execution: target files written in parallel from memory-mapped sources through
//! bounded buffers, checksummed on the way, crash-safe.

use std::fs::File;
use std::io::IoSlice;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use rayon::prelude::*;

use crate::checkpoint::Checkpoint;
use crate::checksum::{BLOCK_BYTES, combine};
use crate::error::{ReshardError, Result, io_err};
use crate::fsio::sync_dir;
use crate::geometry::StridedCopy;
use crate::output;
use crate::plan::{Plan, TargetFile};
use crate::sched::{Job, run_spread};
use crate::source_check;
use crate::stream::{BlockHasher, Cursor, Frontier, Seg, Segment, gather, write_vectored_at};

/// The default bound on buffered memory.
pub const DEFAULT_MAX_BUFFER: u64 = 256 << 20;
/// Contiguous source runs at least this long are written straight from the map.
const DIRECT_MIN: u64 = 256 << 10;
const PAGE: u64 = 4096;

/// How to execute a plan.
#[derive(Clone, Copy)]
pub struct ExecOptions<'a> {
    /// Bound on buffered bytes across all worker threads.
    pub max_buffer: u64,
    /// Replace existing output.
    pub overwrite: bool,
    /// Produce only this target rank's files (the index comes from [`finalize`]).
    pub rank: Option<usize>,
    /// Called with the number of bytes just written.
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
}

impl Default for ExecOptions<'_> {
    fn default() -> Self {
        ExecOptions {
            max_buffer: DEFAULT_MAX_BUFFER,
            overwrite: false,
            rank: None,
            progress: None,
        }
    }
}

/// What an execution did.
#[derive(Clone, Debug, PartialEq)]
pub struct ExecReport {
    pub files_written: usize,
    pub bytes_written: u64,
    pub seconds: f64,
    /// Peak bytes held in copy buffers.
    pub buffer_bytes: u64,
    /// Files a re-run found complete and certified in an object store, not written again.
    pub files_resumed: usize,
    /// Ranged reads of a remote source.
    pub fetched: Option<crate::remote::fetch::FetchStats>,
}

impl ExecReport {
    pub fn gb_per_s(&self) -> f64 {
        self.bytes_written as f64 / self.seconds.max(1e-9) / 1e9
    }
}

/// A contiguous range of a file's data section, written by one worker.
struct Task {
    file: usize,
    start: u64,
    end: u64,
    segments: Vec<Segment>,
}

fn tasks_for(slot: usize, f: &TargetFile) -> Vec<Task> {
    let mut tasks = Vec::new();
    let mut cur: Option<Task> = None;
    for (ci, c) in f.chunks.iter().enumerate() {
        for block in 0..c.len.div_ceil(BLOCK_BYTES) {
            let start = c.data_start + block * BLOCK_BYTES;
            let end = (start + BLOCK_BYTES).min(c.data_start + c.len);
            let t = cur.get_or_insert_with(|| Task {
                file: slot,
                start,
                end: start,
                segments: Vec::new(),
            });
            t.segments.push(Segment {
                chunk: ci,
                block,
                end,
            });
            t.end = end;
            if t.end - t.start >= BLOCK_BYTES {
                tasks.extend(cur.take());
            }
        }
    }
    tasks.extend(cur);
    tasks
}

/// Threads and the per-thread window the buffer bound allows.
fn window(max_buffer: u64) -> (usize, u64) {
    let threads = rayon::current_num_threads().max(1);
    let w = (max_buffer / threads as u64).max(64 << 10) / PAGE * PAGE;
    (threads, w)
}

/// Peak buffered bytes executing the files of `ranks` will use.
pub fn peak_buffer(plan: &Plan, max_buffer: u64, rank: Option<usize>) -> u64 {
    let (threads, w) = window(max_buffer);
    let mut sizes: Vec<u64> = plan
        .files
        .iter()
        .filter(|f| rank.is_none_or(|r| f.rank == r))
        .enumerate()
        .flat_map(|(i, f)| tasks_for(i, f))
        .map(|t| (t.end - t.start).min(w))
        .collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.iter().take(threads).sum()
}

/// Runs a plan: every file at once into a staging directory swapped into place, or one
/// rank's part (see [`finalize`]).
pub fn execute(
    ckpt: &Checkpoint,
    plan: &Plan,
    dst: &Path,
    opts: &ExecOptions,
) -> Result<ExecReport> {
    output::check_not_source(ckpt, dst)?;
    output::check_not_file(dst)?;
    match opts.rank {
        None => execute_all(ckpt, plan, dst, opts),
        Some(r) => execute_rank(ckpt, plan, dst, r, opts),
    }
}

fn execute_all(
    ckpt: &Checkpoint,
    plan: &Plan,
    dst: &Path,
    opts: &ExecOptions,
) -> Result<ExecReport> {
    output::check_free(dst, opts.overwrite)?;
    let staging = output::staging_dir(dst)?;
    let result = (|| {
        let files: Vec<(usize, PathBuf)> = plan
            .files
            .iter()
            .enumerate()
            .map(|(i, f)| (i, staging.join(&f.name)))
            .collect();
        let (report, sums) = write_files(ckpt, plan, &files, opts)?;
        output::write_indexes(ckpt, plan, &staging, &sums)?;
        sync_dir(&staging)?;
        output::swap_into_place(&staging, dst)?;
        Ok(report)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}

fn execute_rank(
    ckpt: &Checkpoint,
    plan: &Plan,
    dst: &Path,
    rank: usize,
    opts: &ExecOptions,
) -> Result<ExecReport> {
    if rank >= plan.world_size {
        return Err(ReshardError::Target(format!(
            "rank {rank} is outside the target world size {}",
            plan.world_size
        )));
    }
    std::fs::create_dir_all(dst).map_err(io_err(dst))?;
    let mine: Vec<(usize, PathBuf)> = plan
        .files
        .iter()
        .enumerate()
        .filter(|(_, f)| f.rank == rank)
        .map(|(i, f)| (i, output::part_name(dst, &f.name)))
        .collect();
    for (i, _) in &mine {
        let done = dst.join(&plan.files[*i].name);
        if !opts.overwrite && (done.exists() || dst.join(crate::index::INDEX_NAME).exists()) {
            return Err(ReshardError::OutputExists { path: done });
        }
    }
    let manifest = output::manifest_path(dst, rank);
    let _ = std::fs::remove_file(&manifest);
    let result = write_files(ckpt, plan, &mine, opts).and_then(|(report, sums)| {
        output::write_manifest(&manifest, plan, rank, &mine, &sums).map(|()| report)
    });
    if result.is_err() {
        // No half-written part stays behind (pre-sized, it would look complete).
        for (_, path) in &mine {
            let _ = std::fs::remove_file(path);
        }
    }
    result
}

/// Writes `files` (plan slot, path) and returns, per slot, the chunk checksums.
pub(crate) fn write_files(
    ckpt: &Checkpoint,
    plan: &Plan,
    files: &[(usize, PathBuf)],
    opts: &ExecOptions,
) -> Result<(ExecReport, Vec<Option<Vec<u64>>>)> {
    let started = Instant::now();
    // Corrupt source data must fail, not be copied and given fresh checksums.
    let slots: Vec<usize> = files.iter().map(|f| f.0).collect();
    let checks = source_check::plan_checks(ckpt, plan, &slots);
    source_check::hash_pieces(ckpt, &checks)?;
    let handles: Vec<File> = files
        .iter()
        .map(|(slot, path)| create_sized(path, &plan.files[*slot]))
        .collect::<Result<_>>()?;
    let tasks: Vec<Task> = files
        .iter()
        .enumerate()
        .flat_map(|(i, (slot, _))| tasks_for(i, &plan.files[*slot]))
        .collect();
    let (_, w) = window(opts.max_buffer);
    // No task needs a window longer than itself.
    let w = tasks
        .iter()
        .map(|t| t.end - t.start)
        .max()
        .unwrap_or(0)
        .min(w);
    let pool = BufferPool {
        free: Mutex::new(Vec::new()),
        window: w,
        peak: Mutex::new((0, 0)),
    };
    let max_ends: Vec<Vec<u64>> = files
        .iter()
        .map(|(slot, _)| running_max_end(&plan.files[*slot]))
        .collect();
    let jobs: Vec<Job> = tasks
        .iter()
        .map(|t| Job {
            file: t.file,
            bytes: t.end - t.start,
        })
        .collect();
    let digests: Vec<Vec<(usize, u64, u64)>> =
        run_spread(&jobs, rayon::current_num_threads(), |i| {
            let t = &tasks[i];
            let (slot, path) = &files[t.file];
            let out = TaskOut {
                file: &handles[t.file],
                path,
                max_end: &max_ends[t.file],
            };
            run_task(ckpt, &plan.files[*slot], out, t, &pool, opts)
        })?;
    files
        .par_iter()
        .zip(&handles)
        .try_for_each(|((_, path), h)| h.sync_all().map_err(io_err(path)))?;
    let mut sums: Vec<Option<Vec<u64>>> = vec![None; plan.files.len()];
    let mut per_chunk: Vec<Vec<Vec<(u64, u64)>>> = files
        .iter()
        .map(|(slot, _)| vec![Vec::new(); plan.files[*slot].chunks.len()])
        .collect();
    for (t, d) in tasks.iter().zip(&digests) {
        for &(chunk, block, digest) in d {
            per_chunk[t.file][chunk].push((block, digest));
        }
    }
    for ((slot, _), chunks) in files.iter().zip(per_chunk) {
        sums[*slot] = Some(
            chunks
                .into_iter()
                .map(|mut blocks| {
                    blocks.sort_unstable();
                    combine(&blocks.iter().map(|b| b.1).collect::<Vec<_>>())
                })
                .collect(),
        );
    }
    source_check::check_via_output(ckpt, &checks, &sums)?;
    let bytes_written = files
        .iter()
        .map(|(slot, _)| plan.files[*slot].file_len())
        .sum();
    let peak = pool.peak.lock().map(|p| p.1).unwrap_or(0);
    Ok((
        ExecReport {
            files_written: files.len(),
            bytes_written,
            seconds: started.elapsed().as_secs_f64(),
            buffer_bytes: peak,
            files_resumed: 0,
            fetched: None,
        },
        sums,
    ))
}

fn create_sized(path: &Path, f: &TargetFile) -> Result<File> {
    let file = crate::fsio::create_sized(path, f.file_len())?;
    file.write_all_at(&f.header, 0).map_err(io_err(path))?;
    Ok(file)
}

/// Reusable copy buffers, so that the bound holds and pages are not faulted in afresh
/// for every task. Tracks (in use, peak) bytes.
struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    window: u64,
    peak: Mutex<(u64, u64)>,
}

impl BufferPool {
    fn take(&self) -> Vec<u8> {
        let buf = self
            .free
            .lock()
            .ok()
            .and_then(|mut f| f.pop())
            .unwrap_or_else(|| vec![0u8; self.window as usize]);
        if let Ok(mut p) = self.peak.lock() {
            p.0 += self.window;
            p.1 = p.1.max(p.0);
        }
        buf
    }

    fn give(&self, buf: Vec<u8>) {
        if let Ok(mut p) = self.peak.lock() {
            p.0 -= self.window;
        }
        if let Ok(mut f) = self.free.lock() {
            f.push(buf);
        }
    }
}

/// For each copy of `f` (sorted by destination start), the largest destination end of
/// it and every copy before it, so a task finds its copies by binary search.
fn running_max_end(f: &TargetFile) -> Vec<u64> {
    let mut max = 0;
    f.copies
        .iter()
        .map(|c| {
            max = max.max(c.dst_end());
            max
        })
        .collect()
}

/// The copies of `f` that write inside `[start, end)`: none before the first whose
/// running maximum end passes `start`, none from the first starting at `end`.
fn copies_in<'f>(
    f: &'f TargetFile,
    max_end: &[u64],
    start: u64,
    end: u64,
) -> impl Iterator<Item = &'f StridedCopy> {
    let lo = max_end.partition_point(|&e| e <= start);
    let hi = f.copies.partition_point(|c| c.dst_start < end).max(lo);
    f.copies[lo..hi].iter().filter(move |c| c.dst_end() > start)
}

struct TaskOut<'a> {
    file: &'a File,
    path: &'a Path,
    max_end: &'a [u64],
}

fn run_task(
    ckpt: &Checkpoint,
    f: &TargetFile,
    out: TaskOut,
    task: &Task,
    pool: &BufferPool,
    opts: &ExecOptions,
) -> Result<Vec<(usize, u64, u64)>> {
    let header = f.header.len() as u64;
    let cursors: Vec<Cursor> = copies_in(f, out.max_end, task.start, task.end)
        .map(|c| Cursor::seek(c, task.start))
        .collect();
    let mut frontier = Frontier::new(cursors);
    let mut hasher = BlockHasher::new(&task.segments, task.start);
    let mut buf = pool.take();
    let mut pos = task.start;
    let path = out.path;
    let result = (|| {
        while pos < task.end {
            let Some(next) = frontier.next() else {
                break;
            };
            let c = &frontier.cursors[next];
            let n = if c.run_left() >= DIRECT_MIN {
                let map = &ckpt.files[c.copy.src_file].map;
                let n = c.run_left().min(task.end - pos).min(pool.window);
                let s = c.src_pos() as usize;
                let bytes = &map.bytes()[s..s + n as usize];
                out.file
                    .write_all_at(bytes, header + pos)
                    .map_err(io_err(path))?;
                hasher.feed(bytes);
                frontier.advance(next, n);
                n
            } else {
                let end = (pos + pool.window).min(task.end);
                let segs = gather(&mut frontier, pos, end, &mut buf, ckpt);
                let slices: Vec<IoSlice> = segs
                    .iter()
                    .map(|seg| match *seg {
                        Seg::Map { file, start, len } => {
                            IoSlice::new(&ckpt.files[file].map.bytes()[start..start + len])
                        }
                        Seg::Buf { start, len } => IoSlice::new(&buf[start..start + len]),
                    })
                    .collect();
                for slice in &slices {
                    hasher.feed(slice);
                }
                write_vectored_at(out.file, slices, header + pos).map_err(io_err(path))?;
                end - pos
            };
            frontier.release(ckpt);
            pos += n;
            if let Some(p) = opts.progress {
                p(n);
            }
        }
        if pos < task.end {
            return Err(ReshardError::Plan {
                tensor: String::new(),
                what: format!(
                    "internal: the plan leaves bytes {pos}..{} of {} unwritten",
                    task.end, f.name
                ),
            });
        }
        Ok(())
    })();
    pool.give(buf);
    result.map(|()| hasher.finish())
}

/// The final step of a `--rank` run: checks every rank's part against the plan, moves
/// the files to their final names and writes the index last.
pub fn finalize(ckpt: &Checkpoint, plan: &Plan, dst: &Path, overwrite: bool) -> Result<()> {
    output::check_not_source(ckpt, dst)?;
    output::check_not_file(dst)?;
    let index = dst.join(crate::index::INDEX_NAME);
    if index.exists() && !overwrite {
        return Err(ReshardError::OutputExists { path: index });
    }
    let sums = output::check_parts(ckpt, plan, dst)?;
    for f in &plan.files {
        let part = output::part_name(dst, &f.name);
        if part.exists() {
            std::fs::rename(&part, dst.join(&f.name)).map_err(io_err(&part))?;
        }
    }
    sync_dir(dst)?;
    output::write_indexes(ckpt, plan, dst, &sums)?;
    for rank in 0..plan.world_size {
        let _ = std::fs::remove_file(output::manifest_path(dst, rank));
    }
    sync_dir(dst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::r;

    #[test]
    fn tasks_cut_big_chunks_at_block_boundaries_and_group_small_ones() {
        let f = TargetFile {
            rank: 0,
            name: "f".into(),
            chunks: [
                (0, 10),
                (10, 2 * BLOCK_BYTES + 5),
                (2 * BLOCK_BYTES + 15, 7),
            ]
            .iter()
            .map(|&(start, len)| crate::plan::PlannedChunk {
                tensor: 0,
                region: r(&[], &[]),
                data_start: start,
                len,
            })
            .collect(),
            header: Vec::new(),
            data_len: 2 * BLOCK_BYTES + 22,
            copies: Vec::new(),
        };
        let tasks = tasks_for(0, &f);
        let spans: Vec<(u64, u64)> = tasks.iter().map(|t| (t.start, t.end)).collect();
        assert_eq!(
            spans,
            vec![
                (0, BLOCK_BYTES + 10),
                (BLOCK_BYTES + 10, 2 * BLOCK_BYTES + 10),
                (2 * BLOCK_BYTES + 10, 2 * BLOCK_BYTES + 22)
            ]
        );
        let blocks: Vec<(usize, u64)> = tasks
            .iter()
            .flat_map(|t| t.segments.iter().map(|s| (s.chunk, s.block)))
            .collect();
        assert_eq!(blocks, vec![(0, 0), (1, 0), (1, 1), (1, 2), (2, 0)]);
    }
}
