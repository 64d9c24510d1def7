//! Streaming a target file's bytes: cursors walking strided copies in destination order,
//! windows assembled for gathering writes straight from the source maps, and block
//! checksums computed as the bytes go out.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::IoSlice;
use std::os::fd::AsRawFd;

use xxhash_rust::xxh3::Xxh3;

use crate::checkpoint::Checkpoint;
use crate::fsio::Map;
use crate::geometry::StridedCopy;

/// Source pages are handed back in steps of this many bytes.
const RELEASE_STEP: u64 = 1 << 20;
const PAGE: u64 = 4096;

/// One block of one chunk: the unit checksums are computed over.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Segment {
    pub chunk: usize,
    pub block: u64,
    pub end: u64,
}

/// Where a strided copy stands: its odometer, and how far into the current run it is.
pub(crate) struct Cursor<'c> {
    pub copy: &'c StridedCopy,
    idx: Vec<u64>,
    src: u64,
    dst: u64,
    done: u64,
    pub finished: bool,
    released: u64,
}

impl<'c> Cursor<'c> {
    /// A cursor at the first byte at or after data offset `pos`. Greedy decomposition by
    /// destination strides works because each dimension's span fits in the stride above.
    pub(crate) fn seek(copy: &'c StridedCopy, pos: u64) -> Cursor<'c> {
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

    pub(crate) fn pos(&self) -> u64 {
        self.dst + self.done
    }

    pub(crate) fn run_left(&self) -> u64 {
        self.copy.run - self.done
    }

    pub(crate) fn src_pos(&self) -> u64 {
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

    pub(crate) fn advance(&mut self, n: u64) {
        self.done += n;
        if self.done == self.copy.run {
            self.step();
        }
    }

    /// Gives back source pages wholly behind the cursor, in steps.
    pub(crate) fn release(&mut self, map: &Map) {
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
pub(crate) enum Seg {
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

/// The live cursors of a task, ordered by destination position: at every position
/// exactly one cursor continues (the plan covers each target byte once), so the one
/// furthest behind is the next to write. A heap keeps finding it logarithmic in the
/// number of cursors, which matters for files of many small tensors.
pub(crate) struct Frontier<'c> {
    pub cursors: Vec<Cursor<'c>>,
    heap: BinaryHeap<Reverse<(u64, usize)>>,
    touched: Vec<usize>,
    is_touched: Vec<bool>,
}

impl<'c> Frontier<'c> {
    pub(crate) fn new(cursors: Vec<Cursor<'c>>) -> Frontier<'c> {
        let heap = cursors
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.finished)
            .map(|(i, c)| Reverse((c.pos(), i)))
            .collect();
        let n = cursors.len();
        Frontier {
            cursors,
            heap,
            touched: Vec::new(),
            is_touched: vec![false; n],
        }
    }

    /// The cursor that writes the next byte.
    pub(crate) fn next(&self) -> Option<usize> {
        self.heap.peek().map(|Reverse((_, i))| *i)
    }

    /// Moves cursor `i` (the next) on by `n` bytes and notes it for [`Self::release`].
    pub(crate) fn advance(&mut self, i: usize, n: u64) {
        self.heap.pop();
        let c = &mut self.cursors[i];
        c.advance(n);
        if !c.finished {
            self.heap.push(Reverse((c.pos(), i)));
        }
        if !self.is_touched[i] {
            self.is_touched[i] = true;
            self.touched.push(i);
        }
    }

    /// Gives back the source pages behind every cursor moved since the last call.
    pub(crate) fn release(&mut self, ckpt: &Checkpoint) {
        for i in self.touched.drain(..) {
            self.is_touched[i] = false;
            let c = &mut self.cursors[i];
            c.release(&ckpt.files[c.copy.src_file].map);
        }
    }
}

/// Lays out the window `[pos, end)` in destination order, taking the cursors in turn.
pub(crate) fn gather(
    frontier: &mut Frontier,
    pos: u64,
    end: u64,
    buf: &mut [u8],
    ckpt: &Checkpoint,
) -> Vec<Seg> {
    let mut segs: Vec<Seg> = Vec::new();
    let mut p = pos;
    let mut used = 0usize;
    while p < end {
        let Some(i) = frontier.next() else {
            break;
        };
        let c = &frontier.cursors[i];
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
        frontier.advance(i, n);
        p += n;
    }
    segs
}

/// Writes all `slices` at `offset` with as few `pwritev` calls as the iovec limit allows.
pub(crate) fn write_vectored_at(
    out: &File,
    mut slices: Vec<IoSlice>,
    mut offset: u64,
) -> std::io::Result<()> {
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
pub(crate) struct BlockHasher<'s> {
    segments: &'s [Segment],
    next: usize,
    state: Xxh3,
    pos: u64,
    out: Vec<(usize, u64, u64)>,
}

impl<'s> BlockHasher<'s> {
    /// A hasher for a task whose bytes start at data offset `start`.
    pub(crate) fn new(segments: &'s [Segment], start: u64) -> BlockHasher<'s> {
        BlockHasher {
            segments,
            next: 0,
            state: Xxh3::new(),
            pos: start,
            out: Vec::new(),
        }
    }

    /// `(chunk, block, digest)` of every block completed.
    pub(crate) fn finish(self) -> Vec<(usize, u64, u64)> {
        self.out
    }

    pub(crate) fn feed(&mut self, mut bytes: &[u8]) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{for_each_run, r, strided_copy};

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
}
