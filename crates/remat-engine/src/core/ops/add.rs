//! Elementwise sum of two tensors of one shape.

use crate::core::elementwise;
use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy, Default)]
pub struct Add;

pub(crate) fn same_shape(kind: &str, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    match inputs {
        [a, b] if a == b => Ok(a.to_vec()),
        [a, b] => Err(format!("{kind} needs equal shapes, got {a:?} and {b:?}")),
        _ => Err(format!("{kind} takes 2 inputs")),
    }
}

impl Op for Add {
    fn kind(&self) -> &'static str {
        "add"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        same_shape("add", inputs)
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let (a, b) = (inputs[0], inputs[1]);
        // Same shapes (checked by output_shape): every element is written.
        let out = cx.alloc_output_overwritten(a.shape(), a.dtype())?;
        float_dispatch!(a.dtype(), cx.node_name(), T => {
            let (ar, br) = (a.read(), b.read());
            let mut w = out.write();
            elementwise::zip_map(w.as_mut_slice::<T>()?, ar.as_slice::<T>()?, br.as_slice::<T>()?, |x, y| x + y);
            Ok::<(), crate::EngineError>(())
        })?;
        Ok(out.into())
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        _saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        // The gradient passes through unchanged: share it instead of copying.
        Ok(vec![
            cx.needs_grad(0).then(|| g.clone()),
            cx.needs_grad(1).then(|| g.clone()),
        ])
    }
}

impl Graph {
    /// `a + b` (equal shapes; see [`Graph::bias`] for broadcasting a vector).
    pub fn add(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.apply(Add, &[a, b])
    }
}
