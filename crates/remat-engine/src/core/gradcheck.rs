//! Finite-difference gradient checks computed in f64, usable by every op.
//!
//! The op runs on f64 tensors (kernels are generic over [`crate::Element`]); the scalar
//! checked is `sum(w * y)` for fixed pseudo-random weights `w`, so every output element
//! matters. Analytic gradients come from `backward_with(y, w)`; numerical ones from central
//! differences of a fresh forward per perturbed element.

use std::sync::Arc;

use crate::core::context::ExecContext;
use crate::core::error::{EngineError, Result};
use crate::core::graph::{Graph, NodeId};
use crate::core::pool::{Category, MemoryPool};
use crate::core::rng::RngState;
use crate::core::tensor::Tensor;

/// One input of a checked op.
#[derive(Clone, Debug)]
pub struct CheckInput {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
    /// Whether to check (and request) its gradient.
    pub differentiable: bool,
}

impl CheckInput {
    pub fn new(name: &str, shape: &[usize], data: Vec<f64>) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            data,
            differentiable: true,
        }
    }

    /// Pseudo-random values in `[-1, 1)`.
    pub fn random(name: &str, shape: &[usize], seed: u64) -> Self {
        let n: usize = shape.iter().product();
        let s = RngState { seed, offset: 0 };
        Self::new(
            name,
            shape,
            (0..n)
                .map(|i| 2.0 * s.uniform(i as u64) as f64 - 1.0)
                .collect(),
        )
    }

    /// Not differentiated (indices, targets).
    pub fn constant(mut self) -> Self {
        self.differentiable = false;
        self
    }
}

/// Tolerances: `|analytic - numeric| <= atol + rtol * max(|analytic|, |numeric|)`.
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    pub eps: f64,
    pub atol: f64,
    pub rtol: f64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Self {
            eps: 1e-6,
            atol: 1e-7,
            rtol: 1e-5,
        }
    }
}

/// Largest deviation found.
#[derive(Clone, Debug, Default)]
pub struct CheckReport {
    pub max_abs_error: f64,
    pub checked_elements: usize,
}

/// Output values and, when a seed was given, each input's gradient.
type RunResult = (Vec<f64>, Vec<Option<Vec<f64>>>);

type Build<'a> = dyn Fn(&mut Graph, &[NodeId]) -> Result<NodeId> + 'a;

fn run(
    ctx: &ExecContext,
    build: &Build<'_>,
    inputs: &[CheckInput],
    seed_w: Option<&[f64]>,
) -> Result<RunResult> {
    let pool = ctx.pool();
    let mut g = Graph::new(ctx);
    g.set_seed(0x5eed);
    let mut ids = Vec::with_capacity(inputs.len());
    for inp in inputs {
        let t = Tensor::from_vec(
            pool,
            &inp.name,
            &inp.shape,
            inp.data.clone(),
            Category::Activations,
        )?;
        ids.push(if inp.differentiable && seed_w.is_some() {
            g.input_with_grad(&inp.name, t)
        } else {
            g.input(&inp.name, t)
        });
    }
    let out = build(&mut g, &ids)?;
    g.forward()?;
    let y = g.value(out)?.to_f64_vec();
    let mut grads = Vec::new();
    if let Some(w) = seed_w {
        let shape = g.shape(out)?.to_vec();
        let seed = Tensor::from_vec(pool, "seed", &shape, w.to_vec(), Category::Temporaries)?;
        g.backward_with(out, seed)?;
        for &id in &ids {
            grads.push(g.grad(id)?.map(|t| t.to_f64_vec()));
        }
    }
    Ok((y, grads))
}

fn weighted(y: &[f64], w: &[f64]) -> f64 {
    y.iter().zip(w).map(|(a, b)| a * b).sum()
}

/// Checks the gradients of the graph `build` records on `inputs` (all f64).
pub fn check_op(
    build: impl Fn(&mut Graph, &[NodeId]) -> Result<NodeId>,
    inputs: &[CheckInput],
    tol: Tolerance,
) -> Result<CheckReport> {
    let ctx = ExecContext::new(Arc::new(MemoryPool::default()), 1)?;
    let (y, _) = run(&ctx, &build, inputs, None)?;
    let ws = RngState {
        seed: 0xC0FFEE,
        offset: 0,
    };
    let w: Vec<f64> = (0..y.len())
        .map(|i| 0.5 + ws.uniform(i as u64) as f64)
        .collect();
    let (_, analytic) = run(&ctx, &build, inputs, Some(&w))?;
    let mut report = CheckReport::default();
    for (k, inp) in inputs.iter().enumerate() {
        if !inp.differentiable {
            continue;
        }
        let grad = analytic[k]
            .clone()
            .unwrap_or_else(|| vec![0.0; inp.data.len()]);
        for (i, &analytic_i) in grad.iter().enumerate() {
            let mut probe = inputs.to_vec();
            probe[k].data[i] = inp.data[i] + tol.eps;
            let plus = weighted(&run(&ctx, &build, &probe, None)?.0, &w);
            probe[k].data[i] = inp.data[i] - tol.eps;
            let minus = weighted(&run(&ctx, &build, &probe, None)?.0, &w);
            let numeric = (plus - minus) / (2.0 * tol.eps);
            let err = (analytic_i - numeric).abs();
            if err > tol.atol + tol.rtol * analytic_i.abs().max(numeric.abs()) {
                return Err(EngineError::Invalid(format!(
                    "gradient check failed for input {} element {i}: analytic {}, numeric {numeric}",
                    inp.name, analytic_i
                )));
            }
            report.max_abs_error = report.max_abs_error.max(err);
            report.checked_elements += 1;
        }
    }
    Ok(report)
}

/// The graph's ops checked with [`check_op`]: their tests live here, beside the checker,
/// so the graph's own tests do not import it back.
#[cfg(test)]
mod tests {
    use super::*;

    fn check(build: impl Fn(&mut Graph, &[NodeId]) -> Result<NodeId>, inputs: &[CheckInput]) {
        let report = check_op(build, inputs, Tolerance::default()).unwrap();
        assert!(report.checked_elements > 0);
    }

    #[test]
    fn gradcheck_matmul_shared_and_batched() {
        check(
            |g, x| g.matmul(x[0], x[1]),
            &[
                CheckInput::random("a", &[2, 3, 4], 1),
                CheckInput::random("b", &[4, 5], 2),
            ],
        );
        check(
            |g, x| g.matmul(x[0], x[1]),
            &[
                CheckInput::random("a", &[2, 3, 4], 3),
                CheckInput::random("b", &[2, 4, 2], 4),
            ],
        );
    }

    #[test]
    fn gradcheck_elementwise_ops() {
        let a = CheckInput::random("a", &[3, 4], 5);
        let b = CheckInput::random("b", &[3, 4], 6);
        check(|g, x| g.add(x[0], x[1]), &[a.clone(), b.clone()]);
        check(|g, x| g.mul(x[0], x[1]), &[a.clone(), b.clone()]);
        check(|g, x| g.scale(x[0], -2.5), std::slice::from_ref(&a));
        check(
            |g, x| g.bias(x[0], x[1]),
            &[a.clone(), CheckInput::random("b", &[4], 7)],
        );
        check(|g, x| g.mse(x[0], x[1]), &[a.clone(), b.clone()]);
        // Keep inputs away from relu's kink, where finite differences are meaningless.
        let away: Vec<f64> = a
            .data
            .iter()
            .map(|v| if v.abs() < 0.05 { v + 0.1 } else { *v })
            .collect();
        check(|g, x| g.relu(x[0]), &[CheckInput::new("a", &[3, 4], away)]);
        check(|g, x| g.dropout(x[0], 0.3), std::slice::from_ref(&a));
        // x + x: two contributions to one gradient.
        check(|g, x| g.add(x[0], x[0]), &[a]);
    }

    #[test]
    fn gradcheck_layout_ops() {
        let a = CheckInput::random("a", &[2, 3, 4], 8);
        check(|g, x| g.reshape(x[0], &[6, 4]), std::slice::from_ref(&a));
        check(|g, x| g.transpose(x[0], 0, 2), std::slice::from_ref(&a));
        check(|g, x| g.transpose(x[0], 1, 2), std::slice::from_ref(&a));
        check(|g, x| g.slice(x[0], 1, 1, 2), std::slice::from_ref(&a));
        check(
            |g, x| {
                let parts = g.split(x[0], 2, &[1, 3])?;
                let t = g.scale(parts[0], 3.0)?;
                g.concat(&[parts[1], t], 2)
            },
            std::slice::from_ref(&a),
        );
        check(
            |g, x| g.concat(&[x[0], x[1]], 0),
            &[a, CheckInput::random("b", &[1, 3, 4], 9)],
        );
    }
}
