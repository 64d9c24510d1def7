//! Rectified linear unit; backward reads its output (`x > 0` iff `y > 0`).

use crate::core::dtype::Element;
use crate::core::elementwise;
use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy, Default)]
pub struct Relu;

impl Op for Relu {
    fn kind(&self) -> &'static str {
        "relu"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [x] => Ok(x.to_vec()),
            _ => Err("relu takes 1 input".into()),
        }
    }

    fn saves_output(&self) -> bool {
        true
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let x = inputs[0];
        let out = cx.alloc_output(x.shape(), x.dtype())?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let xr = x.read();
            let mut w = out.write();
            elementwise::map(w.as_mut_slice::<T>()?, xr.as_slice::<T>()?, |v| if v > T::ZERO { v } else { T::ZERO });
            Ok::<(), crate::EngineError>(())
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
            let dx = cx.alloc_grad(0, g.shape(), g.dtype())?;
            float_dispatch!(g.dtype(), cx.node_name(), T => {
                let (gr, yr) = (g.read(), y.read());
                let mut w = dx.write();
                elementwise::zip_map(w.as_mut_slice::<T>()?, gr.as_slice::<T>()?, yr.as_slice::<T>()?, |gv, yv| if yv > T::ZERO { gv } else { T::ZERO });
                Ok::<(), crate::EngineError>(())
            })?;
            Ok(dx)
        })
    }
}

impl Graph {
    pub fn relu(&mut self, x: NodeId) -> Result<NodeId> {
        self.apply(Relu, &[x])
    }
}
