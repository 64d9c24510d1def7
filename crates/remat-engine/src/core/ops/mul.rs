//! Elementwise product of two tensors of one shape.

use crate::core::elementwise;
use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy, Default)]
pub struct Mul;

impl Op for Mul {
    fn kind(&self) -> &'static str {
        "mul"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        super::add::same_shape("mul", inputs)
    }

    fn saves_input(&self, _slot: usize) -> bool {
        true
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let (a, b) = (inputs[0], inputs[1]);
        let out = cx.alloc_output(a.shape(), a.dtype())?;
        float_dispatch!(a.dtype(), cx.node_name(), T => {
            let (ar, br) = (a.read(), b.read());
            let mut w = out.write();
            elementwise::zip_map(w.as_mut_slice::<T>()?, ar.as_slice::<T>()?, br.as_slice::<T>()?, |x, y| x * y);
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
        let mut grads = Vec::with_capacity(2);
        for slot in 0..2 {
            if !cx.needs_grad(slot) {
                grads.push(None);
                continue;
            }
            // d(a*b)/da = b and vice versa.
            let other = saved.input(1 - slot)?;
            let d = cx.alloc_grad(slot, g.shape(), g.dtype())?;
            float_dispatch!(g.dtype(), cx.node_name(), T => {
                let (gr, or) = (g.read(), other.read());
                let mut w = d.write();
                elementwise::zip_map(w.as_mut_slice::<T>()?, gr.as_slice::<T>()?, or.as_slice::<T>()?, |x, y| x * y);
                Ok::<(), crate::EngineError>(())
            })?;
            grads.push(Some(d));
        }
        Ok(grads)
    }
}

impl Graph {
    /// Elementwise `a * b`.
    pub fn mul(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.apply(Mul, &[a, b])
    }
}
