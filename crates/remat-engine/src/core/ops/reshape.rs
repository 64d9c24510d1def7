//! Reshape: a zero-copy view (shares storage, so it costs no memory of its own).

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::{Tensor, numel};

#[derive(Debug, Clone)]
pub struct Reshape {
    pub shape: Vec<usize>,
}

impl Op for Reshape {
    fn kind(&self) -> &'static str {
        "reshape"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [x] if numel(x) == numel(&self.shape) => Ok(self.shape.clone()),
            [x] => Err(format!("cannot reshape {x:?} to {:?}", self.shape)),
            _ => Err("reshape takes 1 input".into()),
        }
    }

    fn forward(&self, _cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        Ok(inputs[0].reshaped(&self.shape)?.into())
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        cx.single_grad(|_| g.reshaped(saved.input_shapes[0]))
    }
}

impl Graph {
    /// A view of `x` with another shape of the same element count.
    pub fn reshape(&mut self, x: NodeId, shape: &[usize]) -> Result<NodeId> {
        self.apply(
            Reshape {
                shape: shape.to_vec(),
            },
            &[x],
        )
    }
}
