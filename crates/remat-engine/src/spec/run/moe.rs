//! Mixture-of-experts ops: the softmax top-k router (ties go to the lower expert index),
//! per-expert SwiGLU projections over the (token, choice) rows routed to each expert, and
//! the weighted combine; forward beside backward.
//!
//! Rows are grouped by expert in ascending row order and every cross-row sum runs in a
//! fixed order, so results do not depend on threads or scheduling.

use super::act::Act;
use super::linalg;

fn expert_rows(idx: &Act, experts: usize) -> Result<Vec<Vec<usize>>, String> {
    let mut rows = vec![Vec::new(); experts];
    for (r, &e) in idx.data.iter().enumerate() {
        let e = e as usize;
        if e >= experts || e as f32 != idx.data[r] {
            return Err(format!(
                "row {r} routes to expert {} of {experts}",
                idx.data[r]
            ));
        }
        rows[e].push(r);
    }
    Ok(rows)
}

fn expert_dims(w: &Act) -> Result<(usize, usize, usize), String> {
    match w.shape.as_slice() {
        [e, out, inp] => Ok((*e, *out, *inp)),
        s => Err(format!(
            "expert weights of shape {s:?} are not [experts, out, in]"
        )),
    }
}

fn gather(src: &[f32], width: usize, rows: &[usize], map: impl Fn(usize) -> usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * width);
    for &r in rows {
        let s = map(r);
        out.extend_from_slice(&src[s * width..(s + 1) * width]);
    }
    out
}

fn scatter(dst: &mut [f32], width: usize, rows: &[usize], src: &[f32]) {
    for (i, &r) in rows.iter().enumerate() {
        dst[r * width..(r + 1) * width].copy_from_slice(&src[i * width..(i + 1) * width]);
    }
}

/// Softmax over experts, then the `k` largest probabilities (lower index first on ties).
pub fn topk_softmax(logits: &Act, k: usize, normalize: bool) -> Result<Vec<Act>, String> {
    let e = *logits.shape.last().ok_or("logits have no shape")?;
    if k == 0 || k > e {
        return Err(format!("top-{k} of {e} experts"));
    }
    let n = logits.data.len() / e;
    let mut probs = vec![0.0f32; logits.data.len()];
    crate::core::kernels::softmax_forward(&logits.data, e, &mut probs)
        .map_err(|x| x.to_string())?;
    let mut weights = Vec::with_capacity(n * k);
    let mut indices = Vec::with_capacity(n * k);
    for p in probs.chunks(e) {
        let chosen = top_k(p, k);
        let sum: f32 = chosen.iter().map(|&i| p[i]).sum();
        for &i in &chosen {
            weights.push(if normalize { p[i] / sum } else { p[i] });
            indices.push(i as f32);
        }
    }
    Ok(vec![
        Act::new(weights, vec![n, k]),
        Act::new(indices, vec![n, k]),
    ])
}

/// Indices of the `k` largest values, largest first; a strict `>` keeps the lower index on ties.
fn top_k(p: &[f32], k: usize) -> Vec<usize> {
    let mut chosen: Vec<usize> = Vec::with_capacity(k);
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (i, &v) in p.iter().enumerate() {
            if chosen.contains(&i) {
                continue;
            }
            if best.is_none_or(|b| v > p[b]) {
                best = Some(i);
            }
        }
        chosen.extend(best);
    }
    chosen
}

/// Gradient of the router logits from the gradient of the top-k weights.
pub fn topk_softmax_backward(
    logits: &Act,
    indices: &Act,
    dweights: &[f32],
    normalize: bool,
) -> Vec<f32> {
    let e = *logits.shape.last().unwrap_or(&1);
    let k = *indices.shape.last().unwrap_or(&1);
    let mut probs = vec![0.0f32; logits.data.len()];
    // Same input and kernel as the forward: cannot fail where the forward succeeded.
    let _ = crate::core::kernels::softmax_forward(&logits.data, e, &mut probs);
    let mut dlogits = vec![0.0f32; logits.data.len()];
    let rows = probs.chunks(e).zip(dlogits.chunks_mut(e));
    for (t, (p, dl)) in rows.enumerate() {
        let sel: Vec<usize> = indices.data[t * k..(t + 1) * k]
            .iter()
            .map(|&i| i as usize)
            .collect();
        let dw = &dweights[t * k..(t + 1) * k];
        let mut dp = vec![0.0f32; e];
        if normalize {
            let sum: f32 = sel.iter().map(|&i| p[i]).sum();
            let dot: f32 = sel.iter().zip(dw).map(|(&i, &d)| d * (p[i] / sum)).sum();
            for (&i, &d) in sel.iter().zip(dw) {
                dp[i] = (d - dot) / sum;
            }
        } else {
            for (&i, &d) in sel.iter().zip(dw) {
                dp[i] = d;
            }
        }
        let dot: f32 = dp.iter().zip(p).map(|(a, b)| a * b).sum();
        for ((o, &pi), &dpi) in dl.iter_mut().zip(p).zip(&dp) {
            *o = pi * (dpi - dot);
        }
    }
    dlogits
}

/// Per (token, choice) row `r = t * k + j`: `x[t] Wg[e]^T` and `x[t] Wu[e]^T`, `e = idx[r]`.
pub fn gate_up(x: &Act, idx: &Act, wg: &Act, wu: &Act) -> Result<Vec<Act>, String> {
    let (experts, f, d) = expert_dims(wg)?;
    if expert_dims(wu)? != (experts, f, d) || *x.shape.last().unwrap_or(&0) != d {
        return Err(format!(
            "x {:?}, gate {:?}, up {:?} disagree",
            x.shape, wg.shape, wu.shape
        ));
    }
    let k = *idx.shape.last().unwrap_or(&1);
    let rows_of = expert_rows(idx, experts)?;
    let total = idx.data.len();
    let (mut gate, mut up) = (vec![0.0; total * f], vec![0.0; total * f]);
    for (e, rows) in rows_of.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        let xe = gather(&x.data, d, rows, |r| r / k);
        let mut out = vec![0.0; rows.len() * f];
        for (w, dst) in [(wg, &mut gate), (wu, &mut up)] {
            linalg::linear(
                &xe,
                &w.data[e * f * d..(e + 1) * f * d],
                rows.len(),
                d,
                f,
                &mut out,
                false,
                1.0,
            );
            scatter(dst, f, rows, &out);
        }
    }
    Ok(vec![
        Act::new(gate, vec![total, f]),
        Act::new(up, vec![total, f]),
    ])
}

/// Backward of [`gate_up`]: accumulates into `dx` (`[tokens, d]`) in (token, choice) order
/// and, when given, into the expert weight gradients.
#[allow(clippy::too_many_arguments)]
pub fn gate_up_backward(
    x: &Act,
    idx: &Act,
    wg: &Act,
    wu: &Act,
    dgate: &[f32],
    dup: &[f32],
    dx: &mut [f32],
    mut dweights: Option<(&mut [f32], &mut [f32])>,
) -> Result<(), String> {
    let (experts, f, d) = expert_dims(wg)?;
    let k = *idx.shape.last().unwrap_or(&1);
    let rows_of = expert_rows(idx, experts)?;
    let mut dx_rows = vec![0.0; idx.data.len() * d];
    for (e, rows) in rows_of.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        let n = rows.len();
        let (dg, du) = (gather(dgate, f, rows, |r| r), gather(dup, f, rows, |r| r));
        let (wge, wue) = (
            &wg.data[e * f * d..(e + 1) * f * d],
            &wu.data[e * f * d..(e + 1) * f * d],
        );
        let mut dxe = vec![0.0; n * d];
        linalg::linear_dx(&dg, wge, n, d, f, &mut dxe, false, 1.0);
        linalg::linear_dx(&du, wue, n, d, f, &mut dxe, true, 1.0);
        scatter(&mut dx_rows, d, rows, &dxe);
        if let Some((dwg, dwu)) = dweights.as_mut() {
            let xe = gather(&x.data, d, rows, |r| r / k);
            linalg::linear_dw(&dg, &xe, n, d, f, &mut dwg[e * f * d..(e + 1) * f * d], 1.0);
            linalg::linear_dw(&du, &xe, n, d, f, &mut dwu[e * f * d..(e + 1) * f * d], 1.0);
        }
    }
    for (t, dxt) in dx.chunks_mut(d).enumerate() {
        for j in 0..k {
            let r = t * k + j;
            for (o, &v) in dxt.iter_mut().zip(&dx_rows[r * d..(r + 1) * d]) {
                *o += v;
            }
        }
    }
    Ok(())
}

/// Per row: `act[r] Wd[e]^T`.
pub fn down(act: &Act, idx: &Act, wd: &Act) -> Result<Act, String> {
    let (experts, d, f) = expert_dims(wd)?;
    let rows_of = expert_rows(idx, experts)?;
    let total = idx.data.len();
    if act.data.len() != total * f {
        return Err(format!("act {:?} is not [{total}, {f}]", act.shape));
    }
    let mut y = vec![0.0; total * d];
    for (e, rows) in rows_of.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        let ae = gather(&act.data, f, rows, |r| r);
        let mut out = vec![0.0; rows.len() * d];
        linalg::linear(
            &ae,
            &wd.data[e * d * f..(e + 1) * d * f],
            rows.len(),
            f,
            d,
            &mut out,
            false,
            1.0,
        );
        scatter(&mut y, d, rows, &out);
    }
    Ok(Act::new(y, vec![total, d]))
}

/// Backward of [`down`]: writes `dact`, accumulates the weight gradient when given.
pub fn down_backward(
    act: &Act,
    idx: &Act,
    wd: &Act,
    dy: &[f32],
    dact: &mut [f32],
    mut dwd: Option<&mut [f32]>,
) -> Result<(), String> {
    let (experts, d, f) = expert_dims(wd)?;
    let rows_of = expert_rows(idx, experts)?;
    for (e, rows) in rows_of.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        let n = rows.len();
        let dye = gather(dy, d, rows, |r| r);
        let we = &wd.data[e * d * f..(e + 1) * d * f];
        let mut dae = vec![0.0; n * f];
        linalg::linear_dx(&dye, we, n, f, d, &mut dae, false, 1.0);
        scatter(dact, f, rows, &dae);
        if let Some(dw) = dwd.as_mut() {
            let ae = gather(&act.data, f, rows, |r| r);
            linalg::linear_dw(&dye, &ae, n, f, d, &mut dw[e * d * f..(e + 1) * d * f], 1.0);
        }
    }
    Ok(())
}

/// `y[t] = sum_j w[t, j] * expert_out[t * k + j] (+ shared[t])`.
pub fn combine(expert_out: &Act, weights: &Act, shared: Option<&Act>) -> Result<Act, String> {
    let k = *weights.shape.last().unwrap_or(&1);
    let d = *expert_out.shape.last().unwrap_or(&1);
    let n = weights.data.len() / k.max(1);
    if expert_out.data.len() != n * k * d {
        return Err(format!(
            "expert rows {:?} for weights {:?}",
            expert_out.shape, weights.shape
        ));
    }
    let mut y = vec![0.0; n * d];
    for (t, yt) in y.chunks_mut(d).enumerate() {
        for j in 0..k {
            let (w, r) = (weights.data[t * k + j], t * k + j);
            for (o, &v) in yt.iter_mut().zip(&expert_out.data[r * d..(r + 1) * d]) {
                *o += w * v;
            }
        }
        if let Some(s) = shared {
            for (o, &v) in yt.iter_mut().zip(&s.data[t * d..(t + 1) * d]) {
                *o += v;
            }
        }
    }
    let shape = shared.map_or(vec![n, d], |s| s.shape.clone());
    if shared.is_some_and(|s| s.data.len() != n * d) {
        return Err("shared expert output does not match the routed output".into());
    }
    Ok(Act::new(y, shape))
}

/// Backward of [`combine`]: `(d expert_out, d weights)`; the shared branch's gradient is `dy`.
pub fn combine_backward(expert_out: &Act, weights: &Act, dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let k = *weights.shape.last().unwrap_or(&1);
    let d = *expert_out.shape.last().unwrap_or(&1);
    let n = weights.data.len() / k.max(1);
    let mut deo = vec![0.0; n * k * d];
    let mut dw = vec![0.0; n * k];
    for t in 0..n {
        let dyt = &dy[t * d..(t + 1) * d];
        for j in 0..k {
            let r = t * k + j;
            let w = weights.data[r];
            let row = &expert_out.data[r * d..(r + 1) * d];
            dw[r] = dyt.iter().zip(row).map(|(a, b)| a * b).sum();
            for (o, &g) in deo[r * d..(r + 1) * d].iter_mut().zip(dyt) {
                *o = w * g;
            }
        }
    }
    (deo, dw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_breaks_ties_towards_the_lower_expert() {
        assert_eq!(top_k(&[0.1, 0.3, 0.3, 0.3], 2), vec![1, 2]);
        assert_eq!(top_k(&[0.5, 0.1, 0.5, 0.0], 3), vec![0, 2, 1]);
        let logits = Act::new(vec![0.0, 1.0, 1.0, 0.5], vec![1, 4]);
        let out = topk_softmax(&logits, 2, true).unwrap();
        assert_eq!(out[1].data, vec![1.0, 2.0]);
        assert_eq!(out[0].data[0], out[0].data[1]);
        assert!((out[0].data.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn router_gradient_matches_finite_differences() {
        let logits = Act::new(vec![0.3, -0.2, 0.9, 0.1, 0.5, 0.4, -1.0, 0.2], vec![2, 4]);
        let dw = [0.7f32, -0.4, 0.2, 0.9];
        for normalize in [false, true] {
            let fwd = |l: &Act| {
                let w = topk_softmax(l, 2, normalize).unwrap();
                w[0].data
                    .iter()
                    .zip(&dw)
                    .map(|(a, b)| (a * b) as f64)
                    .sum::<f64>()
            };
            let idx = topk_softmax(&logits, 2, normalize).unwrap().remove(1);
            let grad = topk_softmax_backward(&logits, &idx, &dw, normalize);
            for (i, g) in grad.iter().enumerate() {
                let (mut hi, mut lo) = (logits.clone(), logits.clone());
                hi.data[i] += 1e-3;
                lo.data[i] -= 1e-3;
                let num = (fwd(&hi) - fwd(&lo)) / 2e-3;
                assert!((num - *g as f64).abs() < 2e-3, "{i}: {num} vs {g}");
            }
        }
    }
}
