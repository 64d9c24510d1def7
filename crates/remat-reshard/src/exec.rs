//! Execution: target files written in parallel from memory-mapped sources through
//! bounded buffers, checksummed on the way, crash-safe.

use std::fs::{File, OpenOptions};
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use rayon::prelude::*;
use xxhash_rust::xxh3::Xxh3;

use crate::checkpoint::Checkpoint;
use crate::checksum::{BLOCK_BYTES, combine};
use crate::error::{ReshardError, Result, io_err};
use crate::fsio::{Map, sync_dir};
use crate::geometry::StridedCopy;
use crate::output;
use crate::plan::{Plan, TargetFile};

/// The default bound on buffered memory.
pub const DEFAULT_MAX_BUFFER: u64 = 256 << 20;
/// Contiguous source runs at least this long are written straight from the map.
const DIRECT_MIN: u64 = 256 << 10;
/// Source pages are handed back in steps of this many bytes.
const RELEASE_STEP: u64 = 1 << 20;
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
}

impl ExecReport {
    pub fn gb_per_s(&self) -> f64 {
        self.bytes_written as f64 / self.seconds.max(1e-9) / 1e9
    }
}

/// One block of one chunk: the unit checksums are computed over.
#[derive(Clone, Copy, Debug)]
struct Segment {
    chunk: usize,
    block: u64,
    end: u64,
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
            "--rank {rank} is outside the target world size {}",
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
    let (report, sums) = write_files(ckpt, plan, &mine, opts)?;
    output::write_manifest(&manifest, plan, rank, &mine, &sums)?;
    Ok(report)
}

/// Writes `files` (plan slot, path) and returns, per slot, the chunk checksums.
fn write_files(
    ckpt: &Checkpoint,
    plan: &Plan,
    files: &[(usize, PathBuf)],
    opts: &ExecOptions,
) -> Result<(ExecReport, Vec<Option<Vec<u64>>>)> {
    let started = Instant::now();
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
    let digests: Vec<Vec<(usize, u64, u64)>> = tasks
        .par_iter()
        .map(|t| {
            let (slot, path) = &files[t.file];
            run_task(
                ckpt,
                &plan.files[*slot],
                &handles[t.file],
                path,
                t,
                &pool,
                opts,
            )
        })
        .collect::<Result<_>>()?;
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
        },
        sums,
    ))
}

fn create_sized(path: &Path, f: &TargetFile) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(io_err(path))?;
    file.set_len(f.file_len()).map_err(io_err(path))?;
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

/// Where a strided copy stands: its odometer, and how far into the current run it is.
struct Cursor<'c> {
    copy: &'c StridedCopy,
    idx: Vec<u64>,
    src: u64,
    dst: u64,
    done: u64,
    finished: bool,
    released: u64,
}

impl<'c> Cursor<'c> {
    /// A cursor at the first byte at or after data offset `pos`. Greedy decomposition by
    /// destination strides works because each dimension's span fits in the stride above.
    fn seek(copy: &'c StridedCopy, pos: u64) -> Cursor<'c> {
        let mut rel = pos.saturating_sub(copy.dst_start);
        let mut c = Cursor {
            copy,
            idx: vec![0; copy.counts.len()],
            src: copy.src_start,
            dst: copy.dst_start,
            done: 0,
            finished: false,
            released: copy.src_start / PAGE * PAGE,
        };
        for d in 0..copy.counts.len() {
            let i = (rel / copy.dst_strides[d]).min(copy.counts[d] - 1);
            rel -= i * copy.dst_strides[d];
            c.idx[d] = i;
            c.src += i * copy.src_strides[d];
            c.dst += i * copy.dst_strides[d];
        }
        if rel >= copy.run {
            c.step();
        } else {
            c.done = rel;
        }
        c.released = (c.src + c.done) / PAGE * PAGE;
        c
    }

    fn pos(&self) -> u64 {
        self.dst + self.done
    }

    fn run_left(&self) -> u64 {
        self.copy.run - self.done
    }

    fn src_pos(&self) -> u64 {
        self.src + self.done
    }

    fn step(&mut self) {
        self.done = 0;
        let c = self.copy;
        let mut d = self.idx.len();
        loop {
            if d == 0 {
                self.finished = true;
                return;
            }
            d -= 1;
            self.idx[d] += 1;
            self.src += c.src_strides[d];
            self.dst += c.dst_strides[d];
            if self.idx[d] < c.counts[d] {
                return;
            }
            self.src -= c.src_strides[d] * self.idx[d];
            self.dst -= c.dst_strides[d] * self.idx[d];
            self.idx[d] = 0;
        }
    }

    fn advance(&mut self, n: u64) {
        self.done += n;
        if self.done == self.copy.run {
            self.step();
        }
    }

    /// Gives back source pages wholly behind the cursor, in steps.
    fn release(&mut self, map: &Map) {
        let upto = if self.finished {
            self.copy.src_start + self.copy.src_span()
        } else {
            self.src_pos() / PAGE * PAGE
        };
        if upto >= self.released + RELEASE_STEP || (self.finished && upto > self.released) {
            map.release(self.released, upto - self.released);
            self.released = upto;
        }
    }
}

/// Runs shorter than this are copied into the window buffer; longer ones are written
/// straight from the source map by a gathering write, saving a copy.
const GATHER_MIN: u64 = 4096;

/// A piece of a window: bytes in a source map, or in the window buffer.
enum Seg {
    Map {
        file: usize,
        start: usize,
        len: usize,
    },
    Buf {
        start: usize,
        len: usize,
    },
}

/// Lays out the window `[pos, end)` in destination order: at every position exactly one
/// cursor continues (the plan covers each target byte once), so the one furthest behind
/// is the next to write.
fn gather(
    cursors: &mut [Cursor],
    pos: u64,
    end: u64,
    buf: &mut [u8],
    ckpt: &Checkpoint,
) -> Vec<Seg> {
    let mut segs: Vec<Seg> = Vec::new();
    let mut p = pos;
    let mut used = 0usize;
    while p < end {
        let Some(c) = cursors
            .iter_mut()
            .filter(|c| !c.finished)
            .min_by_key(|c| c.pos())
        else {
            break;
        };
        debug_assert_eq!(c.pos(), p, "the plan leaves a gap");
        let n = c.run_left().min(end - p);
        let start = c.src_pos() as usize;
        let len = n as usize;
        if n >= GATHER_MIN {
            segs.push(Seg::Map {
                file: c.copy.src_file,
                start,
                len,
            });
        } else {
            let src = &ckpt.files[c.copy.src_file].map.bytes()[start..start + len];
            buf[used..used + len].copy_from_slice(src);
            match segs.last_mut() {
                Some(Seg::Buf { start: s, len: l }) if *s + *l == used => *l += len,
                _ => segs.push(Seg::Buf { start: used, len }),
            }
            used += len;
        }
        c.advance(n);
        p += n;
    }
    segs
}

/// Writes all `slices` at `offset` with as few `pwritev` calls as the iovec limit allows.
fn write_vectored_at(out: &File, mut slices: Vec<IoSlice>, mut offset: u64) -> std::io::Result<()> {
    const IOV_MAX: usize = 1024;
    let mut rest: &mut [IoSlice] = &mut slices;
    while !rest.is_empty() {
        let batch = rest.len().min(IOV_MAX);
        let iov = rest.as_ptr().cast::<libc::iovec>();
        // SAFETY: IoSlice is ABI-compatible with iovec on Unix (guaranteed by std), the
        // slices outlive the call, and the descriptor is open for writing.
        let n = unsafe {
            libc::pwritev(
                out.as_raw_fd(),
                iov,
                batch as libc::c_int,
                offset as libc::off_t,
            )
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                "pwritev wrote nothing",
            ));
        }
        offset += n as u64;
        IoSlice::advance_slices(&mut rest, n as usize);
    }
    Ok(())
}

/// Hashes a task's bytes, block by block, as they are written in order.
struct BlockHasher<'s> {
    segments: &'s [Segment],
    next: usize,
    state: Xxh3,
    pos: u64,
    out: Vec<(usize, u64, u64)>,
}

impl BlockHasher<'_> {
    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let seg = self.segments[self.next];
            let take = ((seg.end - self.pos) as usize).min(bytes.len());
            self.state.update(&bytes[..take]);
            self.pos += take as u64;
            bytes = &bytes[take..];
            if self.pos == seg.end {
                self.out.push((seg.chunk, seg.block, self.state.digest()));
                self.state.reset();
                self.next += 1;
            }
        }
    }
}

fn run_task(
    ckpt: &Checkpoint,
    f: &TargetFile,
    out: &File,
    path: &Path,
    task: &Task,
    pool: &BufferPool,
    opts: &ExecOptions,
) -> Result<Vec<(usize, u64, u64)>> {
    let header = f.header.len() as u64;
    let mut cursors: Vec<Cursor> = f
        .copies
        .iter()
        .filter(|c| c.dst_start < task.end && c.dst_end() > task.start)
        .map(|c| Cursor::seek(c, task.start))
        .collect();
    let mut hasher = BlockHasher {
        segments: &task.segments,
        next: 0,
        state: Xxh3::new(),
        pos: task.start,
        out: Vec::new(),
    };
    let mut buf = pool.take();
    let mut pos = task.start;
    let result = (|| {
        while pos < task.end {
            let direct = cursors
                .iter_mut()
                .find(|c| !c.finished && c.pos() == pos && c.run_left() >= DIRECT_MIN);
            let n = if let Some(c) = direct {
                let map = &ckpt.files[c.copy.src_file].map;
                let n = c.run_left().min(task.end - pos).min(pool.window);
                let s = c.src_pos() as usize;
                let bytes = &map.bytes()[s..s + n as usize];
                out.write_all_at(bytes, header + pos)
                    .map_err(io_err(path))?;
                hasher.feed(bytes);
                c.advance(n);
                c.release(map);
                n
            } else {
                let end = (pos + pool.window).min(task.end);
                let segs = gather(&mut cursors, pos, end, &mut buf, ckpt);
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
                write_vectored_at(out, slices, header + pos).map_err(io_err(path))?;
                for c in cursors.iter_mut() {
                    let map = &ckpt.files[c.copy.src_file].map;
                    c.release(map);
                }
                end - pos
            };
            pos += n;
            if let Some(p) = opts.progress {
                p(n);
            }
            cursors.retain(|c| !c.finished);
        }
        Ok(())
    })();
    pool.give(buf);
    result.map(|()| hasher.out)
}

/// The final step of a `--rank` run: checks every rank's part against the plan, moves
/// the files to their final names and writes the index last.
pub fn finalize(ckpt: &Checkpoint, plan: &Plan, dst: &Path, overwrite: bool) -> Result<()> {
    output::check_not_source(ckpt, dst)?;
    let index = dst.join(crate::index::INDEX_NAME);
    if index.exists() && !overwrite {
        return Err(ReshardError::OutputExists { path: index });
    }
    let sums = output::check_parts(plan, dst)?;
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
    use crate::geometry::{Region, for_each_run, strided_copy};

    fn r(offsets: &[u64], sizes: &[u64]) -> Region {
        Region {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
        }
    }

    /// Seeking anywhere lands on the first byte the copy writes at or after that point.
    #[test]
    fn seek_lands_on_the_first_run_byte_at_or_after_any_position() {
        let cases = [
            (r(&[0, 2, 1], &[4, 3, 5]), r(&[1, 0, 0], &[3, 6, 7]), 16),
            (r(&[0, 0], &[5, 2]), r(&[0, 0], &[5, 8]), 32),
            (r(&[2, 0], &[2, 8]), r(&[0, 0], &[5, 8]), 8),
        ];
        for (src, dst, bits) in cases {
            let inter = src.intersect(&dst).unwrap();
            let copy = strided_copy((0, &src, 100), (&dst, 40), &inter, bits).unwrap();
            let mut bytes = Vec::new();
            for_each_run(&copy, |_, d| bytes.extend(d..d + copy.run));
            for pos in 0..copy.dst_end() + 3 {
                let c = Cursor::seek(&copy, pos);
                match bytes.iter().find(|&&b| b >= pos) {
                    Some(&b) => assert_eq!((c.finished, c.pos()), (false, b), "seek to {pos}"),
                    None => assert!(c.finished, "seek to {pos}"),
                }
            }
        }
    }

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
