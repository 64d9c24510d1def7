//! Multiplication by a constant.

use crate::core::dtype::Element;
use crate::core::elementwise;
use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub factor: f64,
}

fn scaled(cx: &OpCtx<'_>, x: &Tensor, factor: f64, grad_slot: Option<usize>) -> Result<Tensor> {
    let out = match grad_slot {
        Some(slot) => cx.alloc_grad(slot, x.shape(), x.dtype())?,
        None => cx.alloc_output(x.shape(), x.dtype())?,
    };
    float_dispatch!(x.dtype(), cx.node_name(), T => {
        let f = T::from_f64(factor);
        let xr = x.read();
        let mut w = out.write();
        elementwise::map(w.as_mut_slice::<T>()?, xr.as_slice::<T>()?, |v| v * f);
        Ok::<(), crate::EngineError>(())
    })?;
    Ok(out)
}

impl Op for Scale {
    fn kind(&self) -> &'static str {
        "scale"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [a] => Ok(a.to_vec()),
            _ => Err("scale takes 1 input".into()),
        }
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        Ok(scaled(cx, inputs[0], self.factor, None)?.into())
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        _saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        cx.single_grad(|cx| scaled(cx, g, self.factor, Some(0)))
    }
}

impl Graph {
    /// `x * factor` (the factor is rounded to the tensor's dtype).
    pub fn scale(&mut self, x: NodeId, factor: f64) -> Result<NodeId> {
        self.apply(Scale { factor }, &[x])
    }
}
