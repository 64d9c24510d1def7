//! AdamW (decoupled weight decay), updating parameters in place. Its moment buffers are
//! charged to the pool as optimizer state. Large tensors are updated in parallel chunks on
//! the current rayon pool (bit-identical: each element is independent).

use std::sync::Arc;

use rayon::prelude::*;

use crate::core::dtype::Element;
use crate::core::elementwise;
use crate::core::error::{EngineError, Result};
use crate::core::pool::{Category, MemoryPool};
use crate::core::tensor::Tensor;

/// AdamW hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// AdamW over a fixed list of parameters.
#[derive(Debug)]
pub struct AdamW {
    pub config: AdamWConfig,
    params: Vec<(String, Tensor)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    step: u64,
}

/// The largest learning rate [`AdamWConfig::validate`] accepts. Adam moves every weight by
/// about `lr` per step whatever the gradient's scale, so above 1 a step moves weights by
/// more than their whole range (initializations are ~0.02): the run diverges at once.
pub const MAX_LR: f64 = 1.0;

impl AdamWConfig {
    /// Checks every hyper-parameter; an error names the field, its value and the range.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, value: f64, range: &str| {
            Err(EngineError::Optimizer(format!(
                "AdamW {field} {value} is invalid: it must be {range}"
            )))
        };
        if !(self.lr.is_finite() && self.lr > 0.0 && self.lr <= MAX_LR) {
            return bad("lr", self.lr, &format!("a number in (0, {MAX_LR}]"));
        }
        for (field, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return bad(field, beta, "in [0, 1)");
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("eps", self.eps, "a finite number > 0");
        }
        // Decoupled decay multiplies weights by 1 - lr * weight_decay: keep it in [0, 1].
        if !(self.weight_decay.is_finite()
            && self.weight_decay >= 0.0
            && self.lr * self.weight_decay <= 1.0)
        {
            return bad(
                "weight_decay",
                self.weight_decay,
                "finite, >= 0 and at most 1 / lr",
            );
        }
        Ok(())
    }
}

impl AdamW {
    /// Allocates the two moment buffers of every parameter from `pool` (after checking
    /// `config`: a NaN or absurd learning rate is an error, not a NaN loss).
    pub fn new(
        pool: &Arc<MemoryPool>,
        params: Vec<(String, Tensor)>,
        config: AdamWConfig,
    ) -> Result<Self> {
        config.validate()?;
        let mut m = Vec::with_capacity(params.len());
        let mut v = Vec::with_capacity(params.len());
        for (name, p) in &params {
            for buf in [&mut m, &mut v] {
                let t = Tensor::zeros(pool, p.shape(), p.dtype(), Category::OptimizerState, None)
                    .map_err(|e| e.at(format!("optimizer state of {name}")))?;
                buf.push(t);
            }
        }
        Ok(Self {
            config,
            params,
            m,
            v,
            step: 0,
        })
    }

    pub fn steps(&self) -> u64 {
        self.step
    }

    /// One update; `grads[i]` belongs to the i-th parameter (`None`: no gradient, skipped).
    pub fn step(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        if grads.len() != self.params.len() {
            return Err(EngineError::Optimizer(format!(
                "{} gradients for {} parameters",
                grads.len(),
                self.params.len()
            )));
        }
        self.step += 1;
        let c = self.config;
        let bc1 = 1.0 - c.beta1.powi(self.step as i32);
        let bc2 = 1.0 - c.beta2.powi(self.step as i32);
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let (name, p) = &self.params[i];
            if g.shape() != p.shape() {
                return Err(EngineError::Optimizer(format!(
                    "gradient of {name} has shape {:?}, parameter has {:?}",
                    g.shape(),
                    p.shape()
                )));
            }
            crate::float_dispatch!(p.dtype(), format!("AdamW on {name}"), T => {
                update::<T>(p, g, &self.m[i], &self.v[i], c, bc1, bc2)
            })?;
        }
        Ok(())
    }
}

fn update<T: Element>(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    c: AdamWConfig,
    bc1: f64,
    bc2: f64,
) -> Result<()> {
    let gr = g.read();
    let gv = gr.as_slice::<T>()?;
    let (mut pw, mut mw, mut vw) = (p.write(), m.write(), v.write());
    let (pv, mv, vv) = (
        pw.as_mut_slice::<T>()?,
        mw.as_mut_slice::<T>()?,
        vw.as_mut_slice::<T>()?,
    );
    let (b1, b2) = (T::from_f64(c.beta1), T::from_f64(c.beta2));
    let (one, lr, eps) = (T::ONE, T::from_f64(c.lr), T::from_f64(c.eps));
    let decay = T::from_f64(1.0 - c.lr * c.weight_decay);
    let (bc1, bc2) = (T::from_f64(bc1), T::from_f64(bc2));
    // Every element is updated on its own, so splitting the loop over threads never
    // changes a bit.
    let run = |pv: &mut [T], gv: &[T], mv: &mut [T], vv: &mut [T]| {
        for (((p, &g), m), v) in pv.iter_mut().zip(gv).zip(mv.iter_mut()).zip(vv.iter_mut()) {
            *m = b1 * *m + (one - b1) * g;
            *v = b2 * *v + (one - b2) * g * g;
            let mh = *m / bc1;
            let vh = *v / bc2;
            *p = *p * decay - lr * mh / (vh.sqrt() + eps);
        }
    };
    if pv.len() >= elementwise::PAR_MIN {
        const CHUNK: usize = 1 << 14;
        pv.par_chunks_mut(CHUNK)
            .zip(gv.par_chunks(CHUNK))
            .zip(mv.par_chunks_mut(CHUNK))
            .zip(vv.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| run(p, g, m, v));
    } else {
        run(pv, gv, mv, vv);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_step_moves_each_weight_by_lr_against_the_gradient_sign() {
        let pool = MemoryPool::unbounded();
        let p = Tensor::from_vec(
            &pool,
            "p",
            &[3],
            vec![1.0f64, -2.0, 0.5],
            Category::Parameters,
        )
        .unwrap();
        let g = Tensor::from_vec(
            &pool,
            "g",
            &[3],
            vec![0.3f64, -4.0, 0.0],
            Category::Gradients,
        )
        .unwrap();
        let cfg = AdamWConfig {
            lr: 0.1,
            weight_decay: 0.0,
            ..Default::default()
        };
        let mut opt = AdamW::new(&pool, vec![("p".into(), p.clone())], cfg).unwrap();
        assert_eq!(pool.stats().category(Category::OptimizerState).live, 48);
        opt.step(&[Some(g)]).unwrap();
        let v = p.to_vec::<f64>().unwrap();
        // Bias-corrected first step: m/sqrt(v) = sign(g), so each weight moves by lr.
        assert!((v[0] - 0.9).abs() < 1e-6);
        assert!((v[1] + 1.9).abs() < 1e-6);
        assert_eq!(v[2], 0.5);
        assert_eq!(p.version(), 1);
    }

    #[test]
    fn weight_decay_is_decoupled() {
        let pool = MemoryPool::unbounded();
        let p = Tensor::from_vec(&pool, "p", &[1], vec![2.0f64], Category::Parameters).unwrap();
        let g = Tensor::from_vec(&pool, "g", &[1], vec![0.0f64], Category::Gradients).unwrap();
        let cfg = AdamWConfig {
            lr: 0.1,
            weight_decay: 0.5,
            ..Default::default()
        };
        let mut opt = AdamW::new(&pool, vec![("p".into(), p.clone())], cfg).unwrap();
        opt.step(&[Some(g)]).unwrap();
        assert!((p.to_vec::<f64>().unwrap()[0] - 2.0 * 0.95).abs() < 1e-12);
    }

    #[test]
    fn invalid_hyper_parameters_are_errors_naming_the_field() {
        let pool = MemoryPool::unbounded();
        let p = Tensor::from_vec(&pool, "p", &[1], vec![2.0f32], Category::Parameters).unwrap();
        let cases = [
            (
                "lr",
                AdamWConfig {
                    lr: f64::NAN,
                    ..Default::default()
                },
            ),
            (
                "lr",
                AdamWConfig {
                    lr: f64::INFINITY,
                    ..Default::default()
                },
            ),
            (
                "lr",
                AdamWConfig {
                    lr: -1.0,
                    ..Default::default()
                },
            ),
            (
                "lr",
                AdamWConfig {
                    lr: 0.0,
                    ..Default::default()
                },
            ),
            (
                "lr",
                AdamWConfig {
                    lr: 1e308,
                    ..Default::default()
                },
            ),
            (
                "beta1",
                AdamWConfig {
                    beta1: 1.0,
                    ..Default::default()
                },
            ),
            (
                "beta2",
                AdamWConfig {
                    beta2: f64::NAN,
                    ..Default::default()
                },
            ),
            (
                "eps",
                AdamWConfig {
                    eps: 0.0,
                    ..Default::default()
                },
            ),
            (
                "weight_decay",
                AdamWConfig {
                    weight_decay: -0.1,
                    ..Default::default()
                },
            ),
        ];
        for (field, cfg) in cases {
            let err = AdamW::new(&pool, vec![("p".into(), p.clone())], cfg)
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("AdamW {field} ")), "{field}: {err}");
        }
    }

    #[test]
    fn wrong_gradient_count_is_an_error() {
        let pool = MemoryPool::unbounded();
        let p = Tensor::from_vec(&pool, "p", &[1], vec![2.0f32], Category::Parameters).unwrap();
        let mut opt = AdamW::new(&pool, vec![("p".into(), p)], AdamWConfig::default()).unwrap();
        assert!(
            opt.step(&[])
                .unwrap_err()
                .to_string()
                .contains("0 gradients for 1 parameters")
        );
    }
}
