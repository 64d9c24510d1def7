//! Elementwise loops shared by the basic ops: split over rayon chunks when large enough to
//! pay for it, each chunk run through `kernels::simd::vectorized` (AVX2 where the CPU has it). Every
//! element is computed independently, so neither the chunking nor the vector width ever
//! changes a bit.

use rayon::prelude::*;

use crate::core::kernels::vectorized;

/// Below this many elements a loop runs on the calling thread.
pub const PAR_MIN: usize = 1 << 15;
const CHUNK: usize = 1 << 13;

/// `dst[i] = f(a[i])`.
pub fn map<T: Copy + Send + Sync>(dst: &mut [T], a: &[T], f: impl Fn(T) -> T + Sync) {
    if dst.len() >= PAR_MIN {
        dst.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .for_each(|(d, a)| vectorized(|| d.iter_mut().zip(a).for_each(|(d, &a)| *d = f(a))));
    } else {
        vectorized(|| dst.iter_mut().zip(a).for_each(|(d, &a)| *d = f(a)));
    }
}

/// `dst[i] = f(a[i], b[i])`.
pub fn zip_map<T: Copy + Send + Sync>(
    dst: &mut [T],
    a: &[T],
    b: &[T],
    f: impl Fn(T, T) -> T + Sync,
) {
    if dst.len() >= PAR_MIN {
        dst.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .zip(b.par_chunks(CHUNK))
            .for_each(|((d, a), b)| {
                vectorized(|| {
                    d.iter_mut()
                        .zip(a)
                        .zip(b)
                        .for_each(|((d, &a), &b)| *d = f(a, b))
                })
            });
    } else {
        vectorized(|| {
            dst.iter_mut()
                .zip(a)
                .zip(b)
                .for_each(|((d, &a), &b)| *d = f(a, b))
        });
    }
}

/// `dst[i] = f(dst[i], a[i])` (in-place update).
pub fn update<T: Copy + Send + Sync>(dst: &mut [T], a: &[T], f: impl Fn(T, T) -> T + Sync) {
    if dst.len() >= PAR_MIN {
        dst.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .for_each(|(d, a)| {
                vectorized(|| d.iter_mut().zip(a).for_each(|(d, &a)| *d = f(*d, a)))
            });
    } else {
        vectorized(|| dst.iter_mut().zip(a).for_each(|(d, &a)| *d = f(*d, a)));
    }
}

/// Runs `f(row_index, row)` over the rows of a row-major `[rows, cols]` buffer.
pub fn rows_mut<T: Send>(dst: &mut [T], cols: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if cols == 0 {
        return;
    }
    if dst.len() >= PAR_MIN {
        dst.par_chunks_mut(cols)
            .enumerate()
            .for_each(|(r, row)| f(r, row));
    } else {
        dst.chunks_mut(cols)
            .enumerate()
            .for_each(|(r, row)| f(r, row));
    }
}
