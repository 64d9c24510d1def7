//! LoRA adapters: `y += (alpha / rank) * dropout(x) A^T B^T` on a base projection, with a
//! counter-based dropout mask drawn from (seed, step, layer, target): a recompute in backward
//! re-applies exactly the forward's mask of that step, and every training step draws a fresh
//! one (a mask fixed for the whole run would drop the same input features forever).

use std::collections::BTreeMap;

use crate::core::kernels;
use crate::spec::ops::LORA_TARGETS;

use super::act::Act;
use super::linalg;

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

/// Which dropout mask an adapter uses: forward, recompute and backward of one training step
/// pass the same key, the next step another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskKey {
    /// The training step (the run's RNG offset).
    pub step: u64,
    pub layer: usize,
}

/// The generator seed of one step: the run's seed hashed with the step, so the masks of
/// two steps are independent draws rather than shifted copies of one stream.
fn step_seed(cfg: &LoraConfig, step: u64) -> u64 {
    kernels::philox_hash(cfg.seed, step)
}

/// The dropout counter range of (layer, target): disjoint for every pair within a step.
fn dropout_offset(layer: usize, target: &str) -> u64 {
    let t = LORA_TARGETS
        .iter()
        .position(|x| *x == target)
        .unwrap_or(LORA_TARGETS.len());
    ((layer as u64) * 16 + t as u64) << 36
}

/// `dropout(x)` with the mask of (step, layer, target).
pub fn dropped_input(cfg: &LoraConfig, key: MaskKey, target: &str, x: &[f32]) -> Vec<f32> {
    if cfg.dropout == 0.0 {
        return x.to_vec();
    }
    let mut out = vec![0.0; x.len()];
    // The probability was validated when the adapters were built.
    let _ = kernels::dropout_forward(
        x,
        cfg.dropout,
        step_seed(cfg, key.step),
        dropout_offset(key.layer, target),
        &mut out,
    );
    out
}

/// Adds the adapter's contribution to `y` (`[rows, out]`) for input `x` (`[rows, in]`).
pub fn apply(
    cfg: &LoraConfig,
    key: MaskKey,
    target: &str,
    adapter: &Adapter,
    x: &[f32],
    y: &mut [f32],
) {
    let (r, k) = (adapter.a.shape[0], adapter.a.shape[1]);
    let n = adapter.b.shape[0];
    let rows = x.len() / k;
    let xd = dropped_input(cfg, key, target, x);
    let mut u = vec![0.0; rows * r];
    linalg::linear(&xd, &adapter.a.data, rows, k, r, &mut u, false, 1.0);
    linalg::linear(&u, &adapter.b.data, rows, r, n, y, true, cfg.scale());
}

/// Backward: accumulates the adapter gradients and adds the input gradient into `dx`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    cfg: &LoraConfig,
    key: MaskKey,
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
    let xd = dropped_input(cfg, key, target, x);
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
            step_seed(cfg, key.step),
            dropout_offset(key.layer, target),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LoraConfig {
        LoraConfig {
            rank: 2,
            alpha: 4.0,
            dropout: 0.3,
            targets: vec!["q".into()],
            seed: 9,
        }
    }

    fn zeros(x: &[f32]) -> Vec<bool> {
        x.iter().map(|v| *v == 0.0).collect()
    }

    #[test]
    fn each_step_draws_a_fresh_mask_and_one_step_reuses_its_own() {
        let x = vec![1.0f32; 512];
        let key = |step, layer| MaskKey { step, layer };
        let m0 = zeros(&dropped_input(&cfg(), key(0, 1), "q", &x));
        let m1 = zeros(&dropped_input(&cfg(), key(1, 1), "q", &x));
        assert!(m0.iter().any(|z| *z) && m1.iter().any(|z| *z));
        assert_ne!(m0, m1, "two steps drew the same dropout mask");
        assert_eq!(m0, zeros(&dropped_input(&cfg(), key(0, 1), "q", &x)));
        assert_ne!(m0, zeros(&dropped_input(&cfg(), key(0, 2), "q", &x)));
        assert_ne!(m0, zeros(&dropped_input(&cfg(), key(0, 1), "k", &x)));
    }

    /// The backward masks its input gradient with the forward's mask of the same step.
    #[test]
    fn backward_uses_the_mask_of_its_step() {
        let c = LoraConfig { rank: 1, ..cfg() };
        let adapter = Adapter {
            a: Act::new(vec![1.0; 64], vec![1, 64]),
            b: Act::new(vec![1.0], vec![1, 1]),
        };
        let x = vec![1.0f32; 64];
        for step in [0, 5] {
            let key = MaskKey { step, layer: 0 };
            let mut dx = vec![0.0; 64];
            let mut grad = AdapterGrad {
                a: vec![0.0; 64],
                b: vec![0.0; 1],
            };
            backward(&c, key, "q", &adapter, &x, &[1.0], &mut dx, &mut grad);
            assert_eq!(zeros(&dx), zeros(&dropped_input(&c, key, "q", &x)));
        }
    }
}
