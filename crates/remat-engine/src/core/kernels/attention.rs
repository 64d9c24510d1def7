//! Causal multi-head self-attention with rotary position embedding and grouped-query heads.
//!
//! Layout: `q [batch, seq, n_heads, head_dim]`, `k, v [batch, seq, n_kv_heads, head_dim]`,
//! output like `q` (so the projections' `[tokens, heads * head_dim]` results are used as is).
//! Query head `h` attends with key/value head `h / (n_heads / n_kv_heads)`.
//!
//! Memory: forward keeps only the per-row log-sum-exp (`[batch, n_heads, seq]`), not the
//! `seq x seq` probabilities; backward rebuilds them block by block from `q`, `k` and the
//! log-sum-exp (the FlashAttention recipe, Dao et al. 2022). RoPE is applied on the fly to
//! a per-head copy, so the rotated q/k are never stored either. A per-head norm on q/k
//! (QK-norm) composes by normalizing q and k before calling this kernel.
//!
//! Work: query rows go in blocks of [`BLOCK`]; a block only multiplies against keys up to
//! its last row, so the causal upper triangle is mostly skipped. Each product is a `gemm`.
//! Threads split whole batch elements; within one, heads and blocks run in a fixed order, so
//! results are bit-identical for any thread count.

use rayon::prelude::*;

use super::matmul::{View, gemm_into};
use super::rope::{RopeTable, rotate_row};
use super::{Float, KernelError, check_len, lane_dot, lane_max, lane_sum};

/// Query rows per block.
const BLOCK: usize = 64;

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub batch: usize,
    pub seq: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionShape {
    pub fn validate(&self) -> Result<(), KernelError> {
        let s = self;
        if s.batch == 0 || s.seq == 0 || s.n_heads == 0 || s.n_kv_heads == 0 || s.head_dim == 0 {
            return Err(KernelError::Invalid {
                kernel: "attention",
                what: format!("zero-sized shape {s:?}"),
            });
        }
        if !s.n_heads.is_multiple_of(s.n_kv_heads) {
            return Err(KernelError::Invalid {
                kernel: "attention",
                what: format!(
                    "n_kv_heads {} does not divide n_heads {}",
                    s.n_kv_heads, s.n_heads
                ),
            });
        }
        Ok(())
    }
    /// Elements of `q` and of the output.
    pub fn q_len(&self) -> usize {
        self.batch * self.seq * self.n_heads * self.head_dim
    }
    /// Elements of `k` and of `v`.
    pub fn kv_len(&self) -> usize {
        self.batch * self.seq * self.n_kv_heads * self.head_dim
    }
    /// Elements of the saved log-sum-exp, `[batch, n_heads, seq]`.
    pub fn lse_len(&self) -> usize {
        self.batch * self.n_heads * self.seq
    }
    fn block(&self) -> usize {
        BLOCK.min(self.seq)
    }
    fn head_len(&self) -> usize {
        self.seq * self.head_dim
    }
    fn forward_worker_len(&self) -> usize {
        3 * self.head_len() + self.block() * self.seq
    }
    fn backward_worker_len(&self) -> usize {
        7 * self.head_len() + 2 * self.block() * self.seq
    }
    /// Floating-point operations of one forward (the two products, causal blocks only).
    pub fn forward_flops(&self) -> f64 {
        let mut cols = 0usize;
        let mut r0 = 0;
        while r0 < self.seq {
            let r1 = (r0 + self.block()).min(self.seq);
            cols += (r1 - r0) * r1;
            r0 = r1;
        }
        4.0 * (self.batch * self.n_heads * cols * self.head_dim) as f64
    }
}

/// Workers (parallel batch groups) to size scratch for in the current rayon pool.
pub fn attention_workers(shape: &AttentionShape) -> usize {
    rayon::current_num_threads().min(shape.batch).max(1)
}

/// Scratch elements [`attention_forward`] needs for `workers` parallel batch groups.
pub fn attention_forward_scratch_len(shape: &AttentionShape, workers: usize) -> usize {
    workers * shape.forward_worker_len()
}

/// Scratch elements [`attention_backward`] needs for `workers` parallel batch groups.
pub fn attention_backward_scratch_len(shape: &AttentionShape, workers: usize) -> usize {
    workers * shape.backward_worker_len()
}

fn workers_of(
    kernel: &'static str,
    shape: &AttentionShape,
    scratch: usize,
    per: usize,
) -> Result<usize, KernelError> {
    let w = scratch / per;
    if w == 0 || w > shape.batch || !scratch.is_multiple_of(per) {
        return Err(KernelError::Invalid {
            kernel,
            what: format!(
                "scratch of {scratch} elements is not 1..={} workers of {per}",
                shape.batch
            ),
        });
    }
    Ok(w)
}

fn check_rope<T: Float>(
    kernel: &'static str,
    shape: &AttentionShape,
    rope: Option<&RopeTable<T>>,
) -> Result<(), KernelError> {
    match rope {
        Some(t) if t.head_dim() != shape.head_dim || t.seq() < shape.seq => {
            Err(KernelError::Invalid {
                kernel,
                what: format!(
                    "rope table for head_dim {} and {} positions does not cover head_dim {} and seq {}",
                    t.head_dim(),
                    t.seq(),
                    shape.head_dim,
                    shape.seq
                ),
            })
        }
        _ => Ok(()),
    }
}

/// Splits `buf` (whole batches of `per_batch`) at the batch `bounds` of each worker.
fn split_batches<'a, T>(
    mut buf: &'a mut [T],
    per_batch: usize,
    bounds: &[usize],
) -> Vec<&'a mut [T]> {
    let mut parts = Vec::with_capacity(bounds.len() - 1);
    for w in bounds.windows(2) {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut((w[1] - w[0]) * per_batch);
        parts.push(head);
        buf = tail;
    }
    parts
}

fn batch_bounds(batch: usize, workers: usize) -> Vec<usize> {
    (0..=workers).map(|j| j * batch / workers).collect()
}

/// Copies head `col / head_dim` of a `[seq, heads*head_dim]` matrix into a contiguous
/// `[seq, head_dim]` buffer, rotating it if a table is given.
fn load_head<T: Float>(
    rope: Option<&RopeTable<T>>,
    src: &[T],
    col: usize,
    rs: usize,
    seq: usize,
    dst: &mut [T],
) {
    let d = dst.len() / seq;
    for p in 0..seq {
        let (s, o) = (
            &src[p * rs + col..p * rs + col + d],
            &mut dst[p * d..(p + 1) * d],
        );
        match rope {
            Some(t) => rotate_row(t, p, s, o, false),
            None => o.copy_from_slice(s),
        }
    }
}

/// Inverse of [`load_head`] for gradients: un-rotates and writes head `col / head_dim`.
fn store_head<T: Float>(
    rope: Option<&RopeTable<T>>,
    src: &[T],
    seq: usize,
    dst: &mut [T],
    col: usize,
    rs: usize,
) {
    let d = src.len() / seq;
    for p in 0..seq {
        let (s, o) = (
            &src[p * d..(p + 1) * d],
            &mut dst[p * rs + col..p * rs + col + d],
        );
        match rope {
            Some(t) => rotate_row(t, p, s, o, true),
            None => o.copy_from_slice(s),
        }
    }
}

/// Forward. Writes `out` (like `q`) and `lse` (`[batch, n_heads, seq]`, kept for backward).
/// `scratch` holds [`attention_forward_scratch_len`] elements for some worker count.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<T: Float>(
    shape: &AttentionShape,
    rope: Option<&RopeTable<T>>,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: &mut [T],
    scratch: &mut [T],
) -> Result<(), KernelError> {
    const K: &str = "attention_forward";
    shape.validate()?;
    check_rope(K, shape, rope)?;
    check_len(K, "q", q.len(), shape.q_len())?;
    check_len(K, "k", k.len(), shape.kv_len())?;
    check_len(K, "v", v.len(), shape.kv_len())?;
    check_len(K, "out", out.len(), shape.q_len())?;
    check_len(K, "lse", lse.len(), shape.lse_len())?;
    let per = shape.forward_worker_len();
    let workers = workers_of(K, shape, scratch.len(), per)?;
    let bounds = batch_bounds(shape.batch, workers);
    let (qb, kvb) = (shape.q_len() / shape.batch, shape.kv_len() / shape.batch);
    let lb = shape.lse_len() / shape.batch;
    let outs = split_batches(out, qb, &bounds);
    let lses = split_batches(lse, lb, &bounds);
    let scratches = split_batches(scratch, per, &(0..=workers).collect::<Vec<_>>());
    outs.into_par_iter()
        .zip(lses)
        .zip(scratches)
        .enumerate()
        .for_each(|(w, ((out, lse), scratch))| {
            for (i, b) in (bounds[w]..bounds[w + 1]).enumerate() {
                let (q, k, v) = (
                    &q[b * qb..(b + 1) * qb],
                    &k[b * kvb..(b + 1) * kvb],
                    &v[b * kvb..(b + 1) * kvb],
                );
                forward_one(
                    shape,
                    rope,
                    q,
                    k,
                    v,
                    &mut out[i * qb..(i + 1) * qb],
                    &mut lse[i * lb..(i + 1) * lb],
                    scratch,
                );
            }
        });
    Ok(())
}

/// One batch element: all heads, all query blocks.
#[allow(clippy::too_many_arguments)]
fn forward_one<T: Float>(
    shape: &AttentionShape,
    rope: Option<&RopeTable<T>>,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: &mut [T],
    scratch: &mut [T],
) {
    let (s, dh, blk) = (shape.seq, shape.head_dim, shape.block());
    let (q_rs, kv_rs) = (shape.n_heads * dh, shape.n_kv_heads * dh);
    let rep = shape.n_heads / shape.n_kv_heads;
    let scale = T::ONE / T::from_usize(dh).sqrt();
    let (qr, rest) = scratch.split_at_mut(s * dh);
    let (kr, rest) = rest.split_at_mut(s * dh);
    let (vv, p) = rest.split_at_mut(s * dh);
    for h in 0..shape.n_heads {
        if h % rep == 0 {
            let g = h / rep;
            load_head(rope, k, g * dh, kv_rs, s, kr);
            load_head(None, v, g * dh, kv_rs, s, vv);
        }
        load_head(rope, q, h * dh, q_rs, s, qr);
        let mut r0 = 0;
        while r0 < s {
            let r1 = (r0 + blk).min(s);
            let (mb, nc) = (r1 - r0, r1);
            gemm_into(
                mb,
                nc,
                dh,
                p,
                nc,
                false,
                View::rows(&qr[r0 * dh..], dh),
                View::transposed(kr, dh),
                scale,
            );
            for i in 0..mb {
                let r = r0 + i;
                let row = &mut p[i * nc..(i + 1) * nc];
                lse[h * s + r] = super::vectorized(|| causal_softmax_row(row, r + 1));
            }
            gemm_into(
                mb,
                dh,
                nc,
                &mut out[r0 * q_rs + h * dh..],
                q_rs,
                false,
                View::rows(p, nc),
                View::rows(vv, dh),
                T::ONE,
            );
            r0 = r1;
        }
    }
}

/// Softmax over the first `valid` scores of `row` in place, zeros after; returns the
/// log-sum-exp of the valid scores.
#[inline]
fn causal_softmax_row<T: Float>(row: &mut [T], valid: usize) -> T {
    let (live, masked) = row.split_at_mut(valid);
    let m = lane_max(live);
    for x in live.iter_mut() {
        *x = (*x - m).exp();
    }
    let sum = lane_sum(live);
    let inv = T::ONE / sum;
    for x in live.iter_mut() {
        *x *= inv;
    }
    masked.fill(T::ZERO);
    m + sum.ln()
}

/// Backward. From `q`, `k`, `v`, the forward's `lse` and `dout`, writes (overwrites) `dq`,
/// `dk`, `dv`. `scratch` holds [`attention_backward_scratch_len`] elements.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Float>(
    shape: &AttentionShape,
    rope: Option<&RopeTable<T>>,
    q: &[T],
    k: &[T],
    v: &[T],
    lse: &[T],
    dout: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    scratch: &mut [T],
) -> Result<(), KernelError> {
    const K: &str = "attention_backward";
    shape.validate()?;
    check_rope(K, shape, rope)?;
    for (name, len, want) in [
        ("q", q.len(), shape.q_len()),
        ("k", k.len(), shape.kv_len()),
        ("v", v.len(), shape.kv_len()),
        ("lse", lse.len(), shape.lse_len()),
        ("dout", dout.len(), shape.q_len()),
        ("dq", dq.len(), shape.q_len()),
        ("dk", dk.len(), shape.kv_len()),
        ("dv", dv.len(), shape.kv_len()),
    ] {
        check_len(K, name, len, want)?;
    }
    let per = shape.backward_worker_len();
    let workers = workers_of(K, shape, scratch.len(), per)?;
    let bounds = batch_bounds(shape.batch, workers);
    let (qb, kvb, lb) = (
        shape.q_len() / shape.batch,
        shape.kv_len() / shape.batch,
        shape.lse_len() / shape.batch,
    );
    let dqs = split_batches(dq, qb, &bounds);
    let dks = split_batches(dk, kvb, &bounds);
    let dvs = split_batches(dv, kvb, &bounds);
    let scratches = split_batches(scratch, per, &(0..=workers).collect::<Vec<_>>());
    dqs.into_par_iter()
        .zip(dks)
        .zip(dvs)
        .zip(scratches)
        .enumerate()
        .for_each(|(w, (((dq, dk), dv), scratch))| {
            for (i, b) in (bounds[w]..bounds[w + 1]).enumerate() {
                let inputs = BatchInputs {
                    q: &q[b * qb..(b + 1) * qb],
                    k: &k[b * kvb..(b + 1) * kvb],
                    v: &v[b * kvb..(b + 1) * kvb],
                    lse: &lse[b * lb..(b + 1) * lb],
                    dout: &dout[b * qb..(b + 1) * qb],
                };
                let grads = BatchGrads {
                    dq: &mut dq[i * qb..(i + 1) * qb],
                    dk: &mut dk[i * kvb..(i + 1) * kvb],
                    dv: &mut dv[i * kvb..(i + 1) * kvb],
                };
                backward_one(shape, rope, inputs, grads, scratch);
            }
        });
    Ok(())
}

struct BatchInputs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    lse: &'a [T],
    dout: &'a [T],
}

struct BatchGrads<'a, T> {
    dq: &'a mut [T],
    dk: &'a mut [T],
    dv: &'a mut [T],
}

/// Per-head working buffers of the backward pass, carved out of one worker's scratch.
struct HeadScratch<'a, T> {
    qr: &'a mut [T],
    kr: &'a mut [T],
    vv: &'a mut [T],
    dout: &'a mut [T],
    dqr: &'a mut [T],
    dkr: &'a mut [T],
    dvv: &'a mut [T],
    p: &'a mut [T],
    dp: &'a mut [T],
}

impl<'a, T> HeadScratch<'a, T> {
    fn carve(scratch: &'a mut [T], head_len: usize) -> Self {
        let (qr, r) = scratch.split_at_mut(head_len);
        let (kr, r) = r.split_at_mut(head_len);
        let (vv, r) = r.split_at_mut(head_len);
        let (dout, r) = r.split_at_mut(head_len);
        let (dqr, r) = r.split_at_mut(head_len);
        let (dkr, r) = r.split_at_mut(head_len);
        let (dvv, r) = r.split_at_mut(head_len);
        let (p, dp) = r.split_at_mut(r.len() / 2);
        HeadScratch {
            qr,
            kr,
            vv,
            dout,
            dqr,
            dkr,
            dvv,
            p,
            dp,
        }
    }
}

fn backward_one<T: Float>(
    shape: &AttentionShape,
    rope: Option<&RopeTable<T>>,
    x: BatchInputs<'_, T>,
    g: BatchGrads<'_, T>,
    scratch: &mut [T],
) {
    let (s, dh) = (shape.seq, shape.head_dim);
    let (q_rs, kv_rs) = (shape.n_heads * dh, shape.n_kv_heads * dh);
    let rep = shape.n_heads / shape.n_kv_heads;
    let mut w = HeadScratch::carve(scratch, s * dh);
    for h in 0..shape.n_heads {
        let kvh = h / rep;
        if h % rep == 0 {
            load_head(rope, x.k, kvh * dh, kv_rs, s, w.kr);
            load_head(None, x.v, kvh * dh, kv_rs, s, w.vv);
            w.dkr.fill(T::ZERO);
            w.dvv.fill(T::ZERO);
        }
        load_head(rope, x.q, h * dh, q_rs, s, w.qr);
        load_head(None, x.dout, h * dh, q_rs, s, w.dout);
        backward_head(shape, &x.lse[h * s..(h + 1) * s], &mut w);
        store_head(rope, w.dqr, s, g.dq, h * dh, q_rs);
        if h % rep == rep - 1 {
            store_head(rope, w.dkr, s, g.dk, kvh * dh, kv_rs);
            store_head(None, w.dvv, s, g.dv, kvh * dh, kv_rs);
        }
    }
}

/// One head: rebuilds each block's probabilities from the log-sum-exp, then
/// `dV += P^T dO`, `dP = dO V^T`, `dS = P (dP - rowsum(P dP)) / sqrt(d)`, `dQ = dS K`,
/// `dK += dS^T Q` (all in the rotated frame; the caller un-rotates).
/// `rowsum(P dP)` equals `rowsum(dO O)`, so the forward output is not needed.
fn backward_head<T: Float>(shape: &AttentionShape, lse: &[T], w: &mut HeadScratch<'_, T>) {
    let (s, dh, blk) = (shape.seq, shape.head_dim, shape.block());
    let scale = T::ONE / T::from_usize(dh).sqrt();
    let mut r0 = 0;
    while r0 < s {
        let r1 = (r0 + blk).min(s);
        let (mb, nc) = (r1 - r0, r1);
        let (p, dp) = (&mut *w.p, &mut *w.dp);
        gemm_into(
            mb,
            nc,
            dh,
            p,
            nc,
            false,
            View::rows(&w.qr[r0 * dh..], dh),
            View::transposed(w.kr, dh),
            scale,
        );
        for i in 0..mb {
            let r = r0 + i;
            let row = &mut p[i * nc..(i + 1) * nc];
            let l = lse[r];
            super::vectorized(|| {
                for x in row[..=r].iter_mut() {
                    *x = (*x - l).exp();
                }
            });
            row[r + 1..].fill(T::ZERO);
        }
        let dout_blk = View::rows(&w.dout[r0 * dh..], dh);
        gemm_into(
            nc,
            dh,
            mb,
            w.dvv,
            dh,
            true,
            View::transposed(p, nc),
            dout_blk,
            T::ONE,
        );
        gemm_into(
            mb,
            nc,
            dh,
            dp,
            nc,
            false,
            dout_blk,
            View::transposed(w.vv, dh),
            T::ONE,
        );
        for i in 0..mb {
            let live = r0 + i + 1;
            let (pr, dr) = (&p[i * nc..i * nc + live], &mut dp[i * nc..i * nc + nc]);
            super::vectorized(|| {
                let dot = lane_dot(pr, dr);
                for (d, &a) in dr.iter_mut().zip(pr) {
                    *d = a * (*d - dot) * scale;
                }
            });
            dr[live..].fill(T::ZERO);
        }
        gemm_into(
            mb,
            dh,
            nc,
            &mut w.dqr[r0 * dh..],
            dh,
            false,
            View::rows(dp, nc),
            View::rows(w.kr, dh),
            T::ONE,
        );
        gemm_into(
            nc,
            dh,
            mb,
            w.dkr,
            dh,
            true,
            View::transposed(dp, nc),
            View::rows(&w.qr[r0 * dh..], dh),
            T::ONE,
        );
        r0 = r1;
    }
}

#[cfg(test)]
mod tests;
