//! AdamW over named f32 buffers: the spec models' optimizer. Their parameters are plain
//! buffers ([`crate::spec::run::Act`]), not engine tensors, so the engine's
//! [`crate::core::optim::AdamW`] does not apply; the moments of a buffer are created on its
//! first update and charged to the memory pool as optimizer state.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::core::pool::{Category, MemoryPool, Reservation};
use crate::session::error::{Result, SessionError};

/// AdamW (bias-corrected, decoupled weight decay) over buffers named by the caller.
pub struct AdamW {
    lr: f32,
    step: i32,
    moments: BTreeMap<String, (Vec<f32>, Vec<f32>)>,
    pool: Arc<MemoryPool>,
    held: Vec<Reservation>,
}

impl AdamW {
    pub const BETA1: f32 = 0.9;
    pub const BETA2: f32 = 0.999;
    pub const EPS: f32 = 1e-8;
    pub const WEIGHT_DECAY: f32 = 0.01;

    /// An optimizer at learning rate `lr` whose moments are charged to `pool`.
    pub fn new(lr: f32, pool: Arc<MemoryPool>) -> Self {
        AdamW {
            lr,
            step: 0,
            moments: BTreeMap::new(),
            pool,
            held: Vec::new(),
        }
    }

    /// Starts the next step: the updates after this call are bias-corrected for it.
    pub fn begin_step(&mut self) {
        self.step = self.step.saturating_add(1);
    }

    /// Steps begun so far.
    pub fn steps(&self) -> i32 {
        self.step
    }

    /// Bytes of optimizer state held (two f32 moments per value updated so far).
    pub fn state_bytes(&self) -> u64 {
        self.held.iter().map(Reservation::bytes).sum()
    }

    /// Updates `param` (named `name`) by its gradient `grad`; the first update of a name
    /// reserves its moments in the pool. A gradient of another length than the parameter
    /// is refused, naming the buffer.
    pub fn update(&mut self, name: &str, param: &mut [f32], grad: &[f32]) -> Result<()> {
        if grad.len() != param.len() {
            return Err(SessionError::invalid(format!(
                "AdamW: the gradient of `{name}` has {} values, the parameter {}",
                grad.len(),
                param.len()
            )));
        }
        if !self.moments.contains_key(name) {
            let bytes = 2 * 4 * param.len() as u64;
            let r = self
                .pool
                .reserve(bytes, Category::OptimizerState, None)
                .map_err(|oom| oom.at(format!("AdamW moments of `{name}`")))?;
            self.held.push(r);
        }
        let (m, v) = self
            .moments
            .entry(name.to_string())
            .or_insert_with(|| (vec![0.0; param.len()], vec![0.0; param.len()]));
        if m.len() != param.len() {
            return Err(SessionError::invalid(format!(
                "AdamW: `{name}` has {} values, but its moments were made for {}",
                param.len(),
                m.len()
            )));
        }
        let (c1, c2) = (
            1.0 - Self::BETA1.powi(self.step),
            1.0 - Self::BETA2.powi(self.step),
        );
        for i in 0..param.len() {
            m[i] = Self::BETA1 * m[i] + (1.0 - Self::BETA1) * grad[i];
            v[i] = Self::BETA2 * v[i] + (1.0 - Self::BETA2) * grad[i] * grad[i];
            let update = (m[i] / c1) / ((v[i] / c2).sqrt() + Self::EPS);
            param[i] -= self.lr * (update + Self::WEIGHT_DECAY * param[i]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-6 * b.abs().max(1.0)
    }

    #[test]
    fn one_step_matches_hand_computed_values() {
        let pool = MemoryPool::unbounded();
        let mut opt = AdamW::new(0.1, Arc::clone(&pool));
        let mut param = [1.0f32, -2.0, 0.5];
        let grad = [0.5f32, -0.25, 0.0];
        opt.begin_step();
        opt.update("w", &mut param, &grad).expect("update");
        // Step 1: m/c1 = g and v/c2 = g², so the update is g/(|g|+eps) = sign(g) (0 for
        // g = 0); then p -= lr * (update + 0.01 p).
        let want = [
            1.0 - 0.1 * (0.5 / (0.5 + 1e-8) + 0.01 * 1.0),
            -2.0 - 0.1 * (-0.25 / (0.25 + 1e-8) + 0.01 * -2.0),
            0.5 - 0.1 * (0.0 + 0.01 * 0.5),
        ];
        for (got, want) in param.iter().zip(want) {
            assert!(close(*got, want), "got {got}, want {want}");
        }
        // The moments (2 f32 per value) are charged to the pool as optimizer state.
        assert_eq!(opt.state_bytes(), 24);
        assert_eq!(pool.live(), 24);

        // Step 2 by hand for the first value: m = 0.9*0.05 + 0.1*0.5, v = 0.999*0.00025 +
        // 0.001*0.25, bias-corrected by 1-0.9² and 1-0.999².
        let p0 = param[0];
        opt.begin_step();
        opt.update("w", &mut param, &grad).expect("update");
        let (m, v) = (0.9 * 0.05 + 0.1 * 0.5, 0.999 * 0.00025 + 0.001 * 0.25);
        let (mh, vh) = (m / (1.0 - 0.81), v / (1.0 - 0.998001));
        let want0 = p0 - 0.1 * (mh / ((vh as f32).sqrt() + 1e-8) + 0.01 * p0);
        assert!(close(param[0], want0), "got {}, want {want0}", param[0]);
        assert_eq!(opt.state_bytes(), 24, "moments are made once per name");
    }

    #[test]
    fn a_gradient_of_another_length_is_refused_by_name() {
        let mut opt = AdamW::new(0.1, MemoryPool::unbounded());
        opt.begin_step();
        let err = opt
            .update("3.q_proj", &mut [0.0; 4], &[0.0; 3])
            .expect_err("length mismatch");
        assert_eq!(
            err.to_string(),
            "AdamW: the gradient of `3.q_proj` has 3 values, the parameter 4"
        );
    }

    #[test]
    fn moments_over_the_budget_name_the_buffer() {
        let mut opt = AdamW::new(0.1, MemoryPool::with_budget(16));
        opt.begin_step();
        let err = opt
            .update("embed", &mut [0.0; 4], &[0.0; 4])
            .expect_err("over budget");
        assert!(
            format!("{err}").contains("AdamW moments of `embed`"),
            "{err}"
        );
    }
}
