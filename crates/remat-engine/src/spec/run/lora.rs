//! LoRA adapters: `y += (alpha / rank) * dropout(x) A^T B^T` on a base projection, with a
//! counter-based dropout mask drawn from (seed, layer, target) so a recompute in backward
//! re-applies exactly the forward's mask.

use std::collections::BTreeMap;

use crate::kernels;
use crate::spec::ops::LORA_TARGETS;

use super::linalg;
use super::ops::Act;

/// Adapter hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f32,
    pub dropout: f64,
    /// Which of q, k, v, o, up, gate, down carry adapters.
    pub targets: Vec<String>,
    pub seed: u64,
}

impl LoraConfig {
    pub fn scale(&self) -> f32 {
        self.alpha / self.rank as f32
    }
}

/// One adapter: `a` is `[rank, in]`, `b` is `[out, rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Adapter {
    pub a: Act,
    pub b: Act,
}

/// Gradients of one adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterGrad {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
}

/// The dropout counter range of (layer, target): disjoint for every pair.
fn dropout_offset(layer: usize, target: &str) -> u64 {
    let t = LORA_TARGETS
        .iter()
        .position(|x| *x == target)
        .unwrap_or(LORA_TARGETS.len());
    ((layer as u64) * 16 + t as u64) << 36
}

/// `dropout(x)` with the mask of (layer, target).
pub fn dropped_input(cfg: &LoraConfig, layer: usize, target: &str, x: &[f32]) -> Vec<f32> {
    if cfg.dropout == 0.0 {
        return x.to_vec();
    }
    let mut out = vec![0.0; x.len()];
    // The probability was validated when the adapters were built.
    let _ = kernels::dropout_forward(
        x,
        cfg.dropout,
        cfg.seed,
        dropout_offset(layer, target),
        &mut out,
    );
    out
}

/// Adds the adapter's contribution to `y` (`[rows, out]`) for input `x` (`[rows, in]`).
pub fn apply(
    cfg: &LoraConfig,
    layer: usize,
    target: &str,
    adapter: &Adapter,
    x: &[f32],
    y: &mut [f32],
) {
    let (r, k) = (adapter.a.shape[0], adapter.a.shape[1]);
    let n = adapter.b.shape[0];
    let rows = x.len() / k;
    let xd = dropped_input(cfg, layer, target, x);
    let mut u = vec![0.0; rows * r];
    linalg::linear(&xd, &adapter.a.data, rows, k, r, &mut u, false, 1.0);
    linalg::linear(&u, &adapter.b.data, rows, r, n, y, true, cfg.scale());
}

/// Backward: accumulates the adapter gradients and adds the input gradient into `dx`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    cfg: &LoraConfig,
    layer: usize,
    target: &str,
    adapter: &Adapter,
    x: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    grad: &mut AdapterGrad,
) {
    let (r, k) = (adapter.a.shape[0], adapter.a.shape[1]);
    let n = adapter.b.shape[0];
    let rows = x.len() / k;
    let xd = dropped_input(cfg, layer, target, x);
    let mut u = vec![0.0; rows * r];
    linalg::linear(&xd, &adapter.a.data, rows, k, r, &mut u, false, 1.0);
    linalg::linear_dw(dy, &u, rows, r, n, &mut grad.b, cfg.scale());
    let mut du = vec![0.0; rows * r];
    linalg::linear_dx(dy, &adapter.b.data, rows, r, n, &mut du, false, cfg.scale());
    linalg::linear_dw(&du, &xd, rows, k, r, &mut grad.a, 1.0);
    let mut dxd = vec![0.0; rows * k];
    linalg::linear_dx(&du, &adapter.a.data, rows, k, r, &mut dxd, false, 1.0);
    if cfg.dropout != 0.0 {
        let mut masked = vec![0.0; dxd.len()];
        let _ = kernels::dropout_backward(
            &dxd,
            cfg.dropout,
            cfg.seed,
            dropout_offset(layer, target),
            &mut masked,
        );
        dxd = masked;
    }
    for (o, v) in dx.iter_mut().zip(&dxd) {
        *o += v;
    }
}

/// Adapters of one layer, by target.
pub type LayerAdapters = BTreeMap<String, Adapter>;
