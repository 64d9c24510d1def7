//! Mean squared error: `mean((pred - target)^2)`, a scalar (shape `[]`).

use crate::core::dtype::Element;
use crate::core::elementwise;
use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy, Default)]
pub struct Mse;

impl Op for Mse {
    fn kind(&self) -> &'static str {
        "mse"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        super::add::same_shape("mse", inputs).map(|_| Vec::new())
    }

    fn saves_input(&self, _slot: usize) -> bool {
        true
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let (p, t) = (inputs[0], inputs[1]);
        let out = cx.alloc_output(&[], p.dtype())?;
        float_dispatch!(p.dtype(), cx.node_name(), T => {
            let (pr, tr) = (p.read(), t.read());
            // A sequential f64 sum: one fixed order whatever the thread count.
            let sum: f64 = pr.as_slice::<T>()?.iter().zip(tr.as_slice::<T>()?).map(|(&a, &b)| {
                let d = (a - b).to_f64();
                d * d
            }).sum();
            let n = p.numel().max(1) as f64;
            out.write().as_mut_slice::<T>()?[0] = T::from_f64(sum / n);
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
        let (p, t) = (saved.input(0)?, saved.input(1)?);
        let mut grads = Vec::with_capacity(2);
        for (slot, sign) in [(0, 1.0), (1, -1.0)] {
            if !cx.needs_grad(slot) {
                grads.push(None);
                continue;
            }
            let d = cx.alloc_grad(slot, p.shape(), p.dtype())?;
            float_dispatch!(p.dtype(), cx.node_name(), T => {
                let scale = T::from_f64(sign * 2.0 / p.numel().max(1) as f64) * g.read().as_slice::<T>()?[0];
                let (pr, tr) = (p.read(), t.read());
                let mut w = d.write();
                elementwise::zip_map(w.as_mut_slice::<T>()?, pr.as_slice::<T>()?, tr.as_slice::<T>()?, |a, b| (a - b) * scale);
                Ok::<(), crate::EngineError>(())
            })?;
            grads.push(Some(d));
        }
        Ok(grads)
    }
}

impl Graph {
    /// `mean((pred - target)^2)` as a scalar node.
    pub fn mse(&mut self, pred: NodeId, target: NodeId) -> Result<NodeId> {
        self.apply(Mse, &[pred, target])
    }
}
