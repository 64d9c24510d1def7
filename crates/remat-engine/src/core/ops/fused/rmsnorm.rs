//! Fused RMSNorm: `x [G, ..., d]` with one `[d]` weight per group; slice `g` is normalized
//! by the [`crate::core::kernels::rmsnorm_forward`] call the unfused op makes on it, and its
//! weight gradient is reduced by that kernel over that slice alone.

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::kernels;
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

use super::group_split;

/// Inputs: `x [G, ..., d]`, then `G` weights `[d]`.
#[derive(Debug, Clone, Copy)]
pub struct FusedRmsNorm {
    pub eps: f64,
}

/// Elements per group slice of `x`, after checking every weight.
fn slice_len(inputs: &[&[usize]]) -> Result<usize, String> {
    let [x, weights @ ..] = inputs else {
        return Err("fused rmsnorm takes x and one weight per group".into());
    };
    let per = group_split(x, weights.len())?;
    for (g, w) in weights.iter().enumerate() {
        if w.len() != 1 || x.last() != w.first() {
            return Err(format!(
                "rmsnorm weight {g} {w:?} does not match the last dimension of {x:?}"
            ));
        }
    }
    Ok(per)
}

impl Op for FusedRmsNorm {
    fn kind(&self) -> &'static str {
        "fused_rmsnorm"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        slice_len(inputs)?;
        Ok(inputs[0].to_vec())
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
        let x = inputs[0];
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape()).collect();
        let per = slice_len(&shapes).map_err(|m| cx.shape_error(m))?;
        let dim = inputs[1].numel().max(1);
        let out = cx.alloc_output_overwritten(x.shape(), x.dtype())?;
        let rstd = cx.alloc_output_overwritten(&[x.numel() / dim], x.dtype())?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let xr = x.read();
            let xv = xr.as_slice::<T>()?;
            let (mut o, mut r) = (out.write(), rstd.write());
            let (ov, rv) = (o.as_mut_slice::<T>()?, r.as_mut_slice::<T>()?);
            for (g, w) in inputs[1..].iter().enumerate() {
                let wr = w.read();
                let rows = per / dim;
                kernels::rmsnorm_forward(
                    &xv[g * per..][..per], wr.as_slice::<T>()?, self.eps,
                    &mut ov[g * per..][..per], &mut rv[g * rows..][..rows],
                )
                .map_err(|e| e.at(cx.node_name()))?;
            }
            Ok::<(), crate::EngineError>(())
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
        let per = slice_len(&saved.input_shapes).map_err(|m| cx.shape_error(m))?;
        let groups = saved.input_shapes.len() - 1;
        let x = saved.input(0)?;
        let rstd = cx.saved_aux(saved, "reciprocal std")?;
        let dx = cx.alloc_grad_or_scratch(0, x.shape(), x.dtype())?;
        let mut grads = vec![None; groups + 1];
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let (xr, rr, gr) = (x.read(), rstd.read(), g.read());
            let (xv, rv, gv) = (xr.as_slice::<T>()?, rr.as_slice::<T>()?, gr.as_slice::<T>()?);
            let mut dxw = dx.write();
            let dxv = dxw.as_mut_slice::<T>()?;
            for (group, grad) in grads[1..].iter_mut().enumerate() {
                let w = saved.input(group + 1)?;
                let dim = w.numel().max(1);
                let rows = per / dim;
                let dw = cx.needs_grad(group + 1).then(|| cx.alloc_grad(group + 1, w.shape(), w.dtype())).transpose()?;
                let (wr, mut dww) = (w.read(), dw.as_ref().map(Tensor::write));
                let dw_slice = match dww.as_mut() {
                    Some(d) => Some(d.as_mut_slice::<T>()?),
                    None => None,
                };
                kernels::rmsnorm_backward(
                    &xv[group * per..][..per], wr.as_slice::<T>()?, &rv[group * rows..][..rows],
                    &gv[group * per..][..per], &mut dxv[group * per..][..per], dw_slice,
                )
                .map_err(|e| e.at(cx.node_name()))?;
                drop(dww);
                *grad = dw;
            }
            Ok::<(), crate::EngineError>(())
        })?;
        grads[0] = cx.needs_grad(0).then_some(dx);
        Ok(grads)
    }
}

impl Graph {
    /// RMSNorm of each group slice of `x [G, ..., d]` with its own `weights[g] [d]`.
    pub fn fused_rmsnorm(&mut self, x: NodeId, weights: &[NodeId], eps: f64) -> Result<NodeId> {
        let mut inputs = vec![x];
        inputs.extend_from_slice(weights);
        self.apply(FusedRmsNorm { eps }, &inputs)
    }
}
