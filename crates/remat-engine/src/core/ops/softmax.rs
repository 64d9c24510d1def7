//! Softmax over the last dimension; backward reads the output only.

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::kernels;
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy, Default)]
pub struct Softmax;

impl Op for Softmax {
    fn kind(&self) -> &'static str {
        "softmax"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [x] if x.last().is_some_and(|&d| d > 0) => Ok(x.to_vec()),
            [x] => Err(format!(
                "softmax needs a non-empty last dimension, got {x:?}"
            )),
            _ => Err("softmax takes 1 input".into()),
        }
    }

    fn saves_output(&self) -> bool {
        true
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let x = inputs[0];
        let dim = *x.shape().last().unwrap_or(&1);
        let out = cx.alloc_output(x.shape(), x.dtype())?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            kernels::softmax_forward(x.read().as_slice::<T>()?, dim, out.write().as_mut_slice::<T>()?)
                .map_err(|e| e.at(cx.node_name()))
        })?;
        Ok(out.into())
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        cx.single_grad(|cx| {
            let y = saved.output()?;
            let dim = *y.shape().last().unwrap_or(&1);
            let dx = cx.alloc_grad(0, y.shape(), y.dtype())?;
            float_dispatch!(y.dtype(), cx.node_name(), T => {
                let (yr, gr) = (y.read(), g.read());
                kernels::softmax_backward(yr.as_slice::<T>()?, gr.as_slice::<T>()?, dim, dx.write().as_mut_slice::<T>()?)
                    .map_err(|e| e.at(cx.node_name()))
            })?;
            Ok(dx)
        })
    }
}

impl Graph {
    /// Softmax along the last dimension.
    pub fn softmax(&mut self, x: NodeId) -> Result<NodeId> {
        self.apply(Softmax, &[x])
    }
}

#[cfg(test)]
mod tests {
    use crate::core::gradcheck::{CheckInput, Tolerance, check_op};

    #[test]
    fn gradient_matches_finite_differences() {
        let x = CheckInput::random("x", &[3, 6], 4);
        check_op(|g, i| g.softmax(i[0]), &[x], Tolerance::default()).unwrap();
    }
}
