//! Selective state-space (Mamba-1) ops, forward beside backward: the causal depthwise
//! conv1d, SiLU, softplus, the low-rank dt projection, the selective scan and the gate.
//!
//! The mixer follows Hugging Face `MambaMixer`'s slow path: `xz = in_proj(x)` holds the
//! scan input (first `Di` channels) and the gate `z` (last `Di`); `x_dbc = x_proj(u)` holds
//! `[dt_low (R), B (N), C (N)]` per token; `A = -exp(A_log)`.
//!
//! The scan keeps only the state entering each chunk of `chunk` steps; backward re-runs a
//! chunk's recurrence from that state (the same float operations as the forward, so the
//! same bits) and walks it back. Work splits over the batch; every cross-batch sum runs in
//! batch order, so results do not depend on the thread count.

use rayon::prelude::*;

use super::act::Act;
use super::linalg;

type OpResult<T> = Result<T, String>;

/// `[batch, seq, width]` of a 3-D activation.
fn btw(x: &Act, what: &str) -> OpResult<(usize, usize, usize)> {
    match x.shape.as_slice() {
        [b, t, w] if b * t * w == x.data.len() => Ok((*b, *t, *w)),
        s => Err(format!("{what} of shape {s:?} is not [batch, seq, width]")),
    }
}

fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// Depthwise causal conv over the first `Di` channels of `xz` (`Di` = the weight's rows):
/// `out[t, d] = bias[d] + sum_k w[d, k] * xz[t - (K - 1) + k, d]`, zero before the start.
/// `w` is `[Di, K]` or PyTorch's `[Di, 1, K]`.
pub fn causal_conv1d(xz: &Act, w: &Act, bias: Option<&Act>) -> OpResult<Act> {
    let (b, t, width) = btw(xz, "conv input")?;
    let (di, k) = conv_dims(w)?;
    if di > width {
        return Err(format!("conv weight has {di} channels, input only {width}"));
    }
    if let Some(bias) = bias
        && bias.data.len() != di
    {
        return Err(format!(
            "conv bias of {} values for {di} channels",
            bias.data.len()
        ));
    }
    let mut out = vec![0.0f32; b * t * di];
    out.par_chunks_mut(t * di).enumerate().for_each(|(bi, ob)| {
        let x = &xz.data[bi * t * width..(bi + 1) * t * width];
        for ti in 0..t {
            for d in 0..di {
                let mut acc = bias.map_or(0.0, |bv| bv.data[d]);
                for kk in 0..k {
                    let s = ti + kk;
                    if s >= k - 1 {
                        acc += w.data[d * k + kk] * x[(s + 1 - k) * width + d];
                    }
                }
                ob[ti * di + d] = acc;
            }
        }
    });
    Ok(Act::new(out, vec![b, t, di]))
}

fn conv_dims(w: &Act) -> OpResult<(usize, usize)> {
    match w.shape.as_slice() {
        [di, k] | [di, 1, k] if *k > 0 => Ok((*di, *k)),
        s => Err(format!(
            "conv weight of shape {s:?} is not [channels, 1, kernel]"
        )),
    }
}

/// Gradients of [`causal_conv1d`]: adds into `dxz`'s first `Di` channels, `dw` and `dbias`.
pub fn causal_conv1d_backward(
    xz: &Act,
    w: &Act,
    dout: &[f32],
    dxz: &mut [f32],
    dw: &mut [f32],
    dbias: Option<&mut [f32]>,
) -> OpResult<()> {
    let (b, t, width) = btw(xz, "conv input")?;
    let (di, k) = conv_dims(w)?;
    for bi in 0..b {
        let x = &xz.data[bi * t * width..(bi + 1) * t * width];
        let dx = &mut dxz[bi * t * width..(bi + 1) * t * width];
        let g = &dout[bi * t * di..(bi + 1) * t * di];
        for ti in 0..t {
            for d in 0..di {
                let gv = g[ti * di + d];
                for kk in 0..k {
                    let s = ti + kk;
                    if s >= k - 1 {
                        let src = (s + 1 - k) * width + d;
                        dw[d * k + kk] += gv * x[src];
                        dx[src] += gv * w.data[d * k + kk];
                    }
                }
            }
        }
    }
    if let Some(db) = dbias {
        for row in dout.chunks(di) {
            for (o, v) in db.iter_mut().zip(row) {
                *o += v;
            }
        }
    }
    Ok(())
}

/// `x * sigmoid(x)`.
pub fn silu(x: &Act) -> Act {
    Act::new(
        x.data.iter().map(|&v| v * sigmoid(v)).collect(),
        x.shape.clone(),
    )
}

/// `dx = dy * silu'(x)`.
pub fn silu_backward(x: &[f32], dy: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(dy)
        .map(|(&v, &g)| {
            let s = sigmoid(v);
            g * s * (1.0 + v * (1.0 - s))
        })
        .collect()
}

/// PyTorch's `softplus` (beta 1, threshold 20): `x` above 20, else `ln(1 + e^x)`.
pub fn softplus(x: &Act) -> Act {
    let y = x
        .data
        .iter()
        .map(|&v| if v > 20.0 { v } else { v.exp().ln_1p() })
        .collect();
    Act::new(y, x.shape.clone())
}

pub fn softplus_backward(x: &[f32], dy: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(dy)
        .map(|(&v, &g)| if v > 20.0 { g } else { g * sigmoid(v) })
        .collect()
}

/// The first `r` columns of every row of `x` (`[rows, width]`), contiguous.
fn columns(x: &[f32], width: usize, start: usize, r: usize) -> Vec<f32> {
    x.chunks(width)
        .flat_map(|row| row[start..start + r].iter().copied())
        .collect()
}

/// `dt_raw = x_dbc[:, :R] W^T + b` with `W` `[Di, R]`.
pub fn dt_proj(x_dbc: &Act, w: &Act, bias: Option<&Act>) -> OpResult<Act> {
    let (b, t, width) = btw(x_dbc, "x_proj output")?;
    let (di, r) = match w.shape.as_slice() {
        [di, r] if *r <= width => (*di, *r),
        s => return Err(format!("dt_proj weight {s:?} is not [Di, R <= {width}]")),
    };
    let low = Act::new(columns(&x_dbc.data, width, 0, r), vec![b, t, r]);
    let y = super::act::linear(&low, w, bias)?;
    debug_assert_eq!(y.data.len(), b * t * di);
    Ok(y)
}

/// Gradients of [`dt_proj`]: adds into `dx_dbc`'s first `R` columns, `dw` and `dbias`.
pub fn dt_proj_backward(
    x_dbc: &Act,
    w: &Act,
    dy: &[f32],
    dx_dbc: &mut [f32],
    dw: &mut [f32],
    dbias: Option<&mut [f32]>,
) -> OpResult<()> {
    let (b, t, width) = btw(x_dbc, "x_proj output")?;
    let (di, r) = match w.shape.as_slice() {
        [di, r] => (*di, *r),
        s => return Err(format!("dt_proj weight {s:?} is not [Di, R]")),
    };
    let m = b * t;
    let low = columns(&x_dbc.data, width, 0, r);
    linalg::linear_dw(dy, &low, m, r, di, dw, 1.0);
    let mut dlow = vec![0.0; m * r];
    linalg::linear_dx(dy, &w.data, m, r, di, &mut dlow, false, 1.0);
    for (row, dl) in dx_dbc.chunks_mut(width).zip(dlow.chunks(r)) {
        for (o, v) in row[..r].iter_mut().zip(dl) {
            *o += v;
        }
    }
    if let Some(db) = dbias {
        for row in dy.chunks(di) {
            for (o, v) in db.iter_mut().zip(row) {
                *o += v;
            }
        }
    }
    Ok(())
}

/// Sizes of one scan.
#[derive(Debug, Clone, Copy)]
struct ScanDims {
    b: usize,
    t: usize,
    di: usize,
    n: usize,
    /// Width of an `x_dbc` row and where B starts in it (`R`).
    width: usize,
    r: usize,
    chunk: usize,
}

impl ScanDims {
    fn chunks(&self) -> usize {
        self.t.div_ceil(self.chunk)
    }
}

fn scan_dims(
    u: &Act,
    dt: &Act,
    a_log: &Act,
    x_dbc: &Act,
    d: &Act,
    chunk: usize,
) -> OpResult<ScanDims> {
    let (b, t, di) = btw(u, "scan input u")?;
    if dt.shape != u.shape {
        return Err(format!("dt of shape {:?}, u of {:?}", dt.shape, u.shape));
    }
    let n = match a_log.shape.as_slice() {
        [rows, n] if *rows == di => *n,
        s => return Err(format!("A_log of shape {s:?} is not [{di}, state_size]")),
    };
    let (bx, tx, width) = btw(x_dbc, "x_proj output")?;
    if (bx, tx) != (b, t) || width < 2 * n {
        return Err(format!(
            "x_proj output of shape {:?} cannot hold dt_rank + 2 x state_size {n} columns for u of {:?}",
            x_dbc.shape, u.shape
        ));
    }
    if d.data.len() != di {
        return Err(format!("D of {} values for {di} channels", d.data.len()));
    }
    if chunk == 0 {
        return Err("scan chunk length 0".into());
    }
    Ok(ScanDims {
        b,
        t,
        di,
        n,
        width,
        r: width - 2 * n,
        chunk,
    })
}

/// One recurrence step for channel `dd` at token row `row` (offsets into `[T, *]` of one
/// batch): `h = exp(A dt) h + (dt B) u`. Shared by forward and backward's recompute, so
/// the rebuilt states are the forward's bits.
#[inline]
fn scan_step(h: &mut [f32], a: &[f32], dt: f32, u: f32, bvec: &[f32]) {
    for ((hv, &av), &bv) in h.iter_mut().zip(a).zip(bvec) {
        *hv = (av * dt).exp() * *hv + (dt * bv) * u;
    }
}

/// The selective scan with D skip: returns `y` `[B, T, Di]` and the state entering each
/// chunk, `[B, ceil(T / chunk), Di, N]` (the first chunk's is zero).
pub fn selective_scan(
    u: &Act,
    dt: &Act,
    a_log: &Act,
    x_dbc: &Act,
    d: &Act,
    chunk: usize,
) -> OpResult<Vec<Act>> {
    let s = scan_dims(u, dt, a_log, x_dbc, d, chunk)?;
    let a: Vec<f32> = a_log.data.iter().map(|v| -v.exp()).collect();
    let (t, di, n, nc) = (s.t, s.di, s.n, s.chunks());
    let mut y = vec![0.0f32; s.b * t * di];
    let mut states = vec![0.0f32; s.b * nc * di * n];
    y.par_chunks_mut(t * di)
        .zip(states.par_chunks_mut(nc * di * n))
        .enumerate()
        .for_each(|(bi, (yb, sb))| {
            let base = bi * t;
            let mut h = vec![0.0f32; di * n];
            for ti in 0..t {
                if ti % s.chunk == 0 {
                    let c = ti / s.chunk;
                    sb[c * di * n..(c + 1) * di * n].copy_from_slice(&h);
                }
                let row = &x_dbc.data[(base + ti) * s.width..(base + ti + 1) * s.width];
                let (bvec, cvec) = (&row[s.r..s.r + n], &row[s.r + n..s.r + 2 * n]);
                for dd in 0..di {
                    let i = (base + ti) * di + dd;
                    let hd = &mut h[dd * n..(dd + 1) * n];
                    scan_step(hd, &a[dd * n..(dd + 1) * n], dt.data[i], u.data[i], bvec);
                    let mut acc = 0.0f32;
                    for (hv, cv) in hd.iter().zip(cvec) {
                        acc += hv * cv;
                    }
                    yb[ti * di + dd] = acc + u.data[i] * d.data[dd];
                }
            }
        });
    Ok(vec![
        Act::new(y, u.shape.clone()),
        Act::new(states, vec![s.b, nc, di, n]),
    ])
}

/// Gradients of [`selective_scan`].
pub struct ScanGrads {
    pub du: Vec<f32>,
    pub ddt: Vec<f32>,
    pub da_log: Vec<f32>,
    /// Gradient of `x_dbc`: zero in the dt columns, B and C in theirs.
    pub dx_dbc: Vec<f32>,
    pub dd: Vec<f32>,
}

/// Per-batch part of [`ScanGrads`] (`da`, `dd` summed over batches afterwards, in order).
struct BatchGrads {
    du: Vec<f32>,
    ddt: Vec<f32>,
    dx: Vec<f32>,
    da: Vec<f32>,
    dd: Vec<f32>,
}

/// Backward of [`selective_scan`] from `dy`, re-running each chunk from its saved state.
#[allow(clippy::too_many_arguments)]
pub fn selective_scan_backward(
    u: &Act,
    dt: &Act,
    a_log: &Act,
    x_dbc: &Act,
    d: &Act,
    states: &Act,
    chunk: usize,
    dy: &[f32],
) -> OpResult<ScanGrads> {
    let s = scan_dims(u, dt, a_log, x_dbc, d, chunk)?;
    let want = [s.b, s.chunks(), s.di, s.n];
    if states.shape != want {
        return Err(format!(
            "scan states of shape {:?}, expected {want:?}",
            states.shape
        ));
    }
    let a: Vec<f32> = a_log.data.iter().map(|v| -v.exp()).collect();
    let parts: Vec<BatchGrads> = (0..s.b)
        .into_par_iter()
        .map(|bi| scan_backward_batch(&s, bi, &a, u, dt, x_dbc, d, states, dy))
        .collect();
    let mut g = ScanGrads {
        du: Vec::with_capacity(u.data.len()),
        ddt: Vec::with_capacity(u.data.len()),
        da_log: vec![0.0; a.len()],
        dx_dbc: Vec::with_capacity(x_dbc.data.len()),
        dd: vec![0.0; s.di],
    };
    let mut da = vec![0.0f32; a.len()];
    for p in parts {
        g.du.extend_from_slice(&p.du);
        g.ddt.extend_from_slice(&p.ddt);
        g.dx_dbc.extend_from_slice(&p.dx);
        da.iter_mut().zip(&p.da).for_each(|(o, v)| *o += v);
        g.dd.iter_mut().zip(&p.dd).for_each(|(o, v)| *o += v);
    }
    // A = -exp(A_log): dA/dA_log = A.
    for ((o, &gv), &av) in g.da_log.iter_mut().zip(&da).zip(&a) {
        *o = gv * av;
    }
    Ok(g)
}

#[allow(clippy::too_many_arguments)]
fn scan_backward_batch(
    s: &ScanDims,
    bi: usize,
    a: &[f32],
    u: &Act,
    dt: &Act,
    x_dbc: &Act,
    d: &Act,
    states: &Act,
    dy: &[f32],
) -> BatchGrads {
    let (t, di, n, nc, l) = (s.t, s.di, s.n, s.chunks(), s.chunk);
    let base = bi * t;
    let mut out = BatchGrads {
        du: vec![0.0; t * di],
        ddt: vec![0.0; t * di],
        dx: vec![0.0; t * s.width],
        da: vec![0.0; di * n],
        dd: vec![0.0; di],
    };
    // Gradient flowing into h_t from later steps, per channel.
    let mut g = vec![0.0f32; di * n];
    // The chunk's states: hs[i] is the state before step i of the chunk.
    let mut hs = vec![0.0f32; (l + 1) * n];
    for c in (0..nc).rev() {
        let (t0, t1) = (c * l, ((c + 1) * l).min(t));
        for dd in 0..di {
            let start = ((bi * nc + c) * di + dd) * n;
            hs[..n].copy_from_slice(&states.data[start..start + n]);
            let ad = &a[dd * n..(dd + 1) * n];
            for ti in t0..t1 {
                let i = (base + ti) * di + dd;
                let row = &x_dbc.data[(base + ti) * s.width..][..s.width];
                let k = ti - t0;
                let (prev, next) = hs.split_at_mut((k + 1) * n);
                next[..n].copy_from_slice(&prev[k * n..]);
                scan_step(
                    &mut next[..n],
                    ad,
                    dt.data[i],
                    u.data[i],
                    &row[s.r..s.r + n],
                );
            }
            let gd = &mut g[dd * n..(dd + 1) * n];
            for ti in (t0..t1).rev() {
                let i = (base + ti) * di + dd;
                let k = ti - t0;
                let (dtv, uv, dyv) = (dt.data[i], u.data[i], dy[i]);
                let row = &x_dbc.data[(base + ti) * s.width..][..s.width];
                let drow = &mut out.dx[ti * s.width..(ti + 1) * s.width];
                out.du[ti * di + dd] += dyv * d.data[dd];
                out.dd[dd] += dyv * uv;
                let (mut du, mut ddt) = (0.0f32, 0.0f32);
                for j in 0..n {
                    let (bv, cv) = (row[s.r + j], row[s.r + n + j]);
                    // y_t = C_t . h_t: into h_t and C_t.
                    gd[j] += dyv * cv;
                    drow[s.r + n + j] += dyv * hs[(k + 1) * n + j];
                    // h_t = exp(A dt) h_{t-1} + (dt B) u.
                    let decay = (ad[j] * dtv).exp();
                    let da = gd[j] * hs[k * n + j] * decay;
                    ddt += da * ad[j] + gd[j] * bv * uv;
                    out.da[dd * n + j] += da * dtv;
                    drow[s.r + j] += gd[j] * dtv * uv;
                    du += gd[j] * dtv * bv;
                    gd[j] *= decay;
                }
                out.du[ti * di + dd] += du;
                out.ddt[ti * di + dd] += ddt;
            }
        }
    }
    out
}

/// `y * silu(z)`, `z` the last `Di` channels of `xz`.
pub fn gate(y: &Act, xz: &Act) -> OpResult<Act> {
    let (b, t, di) = btw(y, "scan output")?;
    let (bx, tx, width) = btw(xz, "in_proj output")?;
    if (bx, tx) != (b, t) || width < di {
        return Err(format!("gate of {:?} by {:?}", y.shape, xz.shape));
    }
    let out = y
        .data
        .chunks(di)
        .zip(xz.data.chunks(width))
        .flat_map(|(yr, xr)| {
            yr.iter()
                .zip(&xr[width - di..])
                .map(|(&v, &z)| v * (z * sigmoid(z)))
        })
        .collect();
    Ok(Act::new(out, y.shape.clone()))
}

/// Gradients of [`gate`]: returns `dy`; adds `dz` into `dxz`'s last `Di` channels.
pub fn gate_backward(y: &Act, xz: &Act, dout: &[f32], dxz: &mut [f32]) -> Vec<f32> {
    let di = y.shape.last().copied().unwrap_or(1);
    let width = xz.shape.last().copied().unwrap_or(1);
    let mut dy = vec![0.0f32; y.data.len()];
    for (((dyr, yr), (xr, dxr)), gr) in dy
        .chunks_mut(di)
        .zip(y.data.chunks(di))
        .zip(xz.data.chunks(width).zip(dxz.chunks_mut(width)))
        .zip(dout.chunks(di))
    {
        let (z, dz) = (&xr[width - di..], &mut dxr[width - di..]);
        for j in 0..di {
            let sg = sigmoid(z[j]);
            dyr[j] = gr[j] * (z[j] * sg);
            dz[j] += gr[j] * yr[j] * sg * (1.0 + z[j] * (1.0 - sg));
        }
    }
    dy
}

#[cfg(test)]
mod tests;
