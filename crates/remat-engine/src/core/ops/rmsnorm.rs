//! RMSNorm over the last dimension with a learned scale; keeps the reciprocal std per row
//! (an aux tensor) so backward does not reduce over `x^2` again.

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::kernels;
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy)]
pub struct RmsNorm {
    pub eps: f64,
}

impl Op for RmsNorm {
    fn kind(&self) -> &'static str {
        "rmsnorm"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [x, w] if w.len() == 1 && x.last() == w.first() => Ok(x.to_vec()),
            [x, w] => Err(format!(
                "rmsnorm weight {w:?} does not match the last dimension of {x:?}"
            )),
            _ => Err("rmsnorm takes 2 inputs (x, weight)".into()),
        }
    }

    fn saves_input(&self, _slot: usize) -> bool {
        true
    }

    fn flops(&self, inputs: &[&[usize]]) -> u64 {
        inputs
            .first()
            .map_or(0, |x| 4 * x.iter().product::<usize>() as u64)
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let (x, w) = (inputs[0], inputs[1]);
        let rows = x.numel() / w.numel().max(1);
        // The kernel writes every element of both (the weight gradient is the one it sums).
        let out = cx.alloc_output_overwritten(x.shape(), x.dtype())?;
        let rstd = cx.alloc_output_overwritten(&[rows], x.dtype())?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let (xr, wr) = (x.read(), w.read());
            let (mut o, mut r) = (out.write(), rstd.write());
            kernels::rmsnorm_forward(xr.as_slice::<T>()?, wr.as_slice::<T>()?, self.eps, o.as_mut_slice::<T>()?, r.as_mut_slice::<T>()?)
                .map_err(|e| e.at(cx.node_name()))
        })?;
        Ok(OpOutput {
            value: out,
            aux: vec![rstd],
        })
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let (x, w) = (saved.input(0)?, saved.input(1)?);
        let rstd = cx.saved_aux(saved, "reciprocal std")?;
        // The kernel produces dx in any case (an unneeded one goes to scratch); the weight
        // gradient only when it is needed.
        let dx = cx.alloc_grad_or_scratch(0, x.shape(), x.dtype())?;
        let dw = cx
            .needs_grad(1)
            .then(|| cx.alloc_grad(1, w.shape(), w.dtype()))
            .transpose()?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let (xr, wr, rr, gr) = (x.read(), w.read(), rstd.read(), g.read());
            let mut dxw = dx.write();
            let mut dww = dw.as_ref().map(Tensor::write);
            let dw_slice = match dww.as_mut() {
                Some(d) => Some(d.as_mut_slice::<T>()?),
                None => None,
            };
            kernels::rmsnorm_backward(
                xr.as_slice::<T>()?, wr.as_slice::<T>()?, rr.as_slice::<T>()?, gr.as_slice::<T>()?,
                dxw.as_mut_slice::<T>()?, dw_slice,
            )
            .map_err(|e| e.at(cx.node_name()))
        })?;
        Ok(vec![cx.needs_grad(0).then_some(dx), dw])
    }
}

impl Graph {
    /// `x * rsqrt(mean(x^2, last) + eps) * weight`.
    pub fn rmsnorm(&mut self, x: NodeId, weight: NodeId, eps: f64) -> Result<NodeId> {
        self.apply(RmsNorm { eps }, &[x, weight])
    }
}

#[cfg(test)]
mod tests {
    use crate::core::gradcheck::{CheckInput, Tolerance, check_op};

    #[test]
    fn gradient_matches_finite_differences() {
        let x = CheckInput::random("x", &[2, 3, 5], 1);
        let w = CheckInput::random("w", &[5], 2);
        check_op(
            |g, i| g.rmsnorm(i[0], i[1], 1e-5),
            &[x, w],
            Tolerance::default(),
        )
        .unwrap();
    }

    #[test]
    fn mismatched_weight_is_a_shape_error() {
        let ctx = crate::ExecContext::single_threaded().unwrap();
        let mut g = crate::Graph::new(&ctx);
        let p = |n| {
            crate::Tensor::from_vec(
                ctx.pool(),
                "t",
                &[n],
                vec![0f32; n],
                crate::Category::Parameters,
            )
            .unwrap()
        };
        let (x, w) = (g.param("x", &p(6)), g.param("w", &p(4)));
        let err = g.rmsnorm(x, w, 1e-5).unwrap_err();
        assert!(
            err.to_string()
                .contains("does not match the last dimension"),
            "{err}"
        );
    }
}
