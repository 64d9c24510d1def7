//! Cross-entropy of logits `[..., vocab]` against integer targets, mean over the counted
//! targets ([`crate::core::kernels::IGNORE_INDEX`] targets are skipped): a scalar (shape `[]`).
//! Keeps each row's log-sum-exp (aux) so backward forms the softmax without a second
//! reduction; like the embedding, the targets are data held by the op.

use std::sync::Arc;

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::kernels::{self, Float, IGNORE_INDEX};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone)]
pub struct CrossEntropy {
    pub targets: Arc<[u32]>,
}

impl Op for CrossEntropy {
    fn kind(&self) -> &'static str {
        "cross_entropy"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        let [x] = inputs else {
            return Err("cross_entropy takes 1 input (the logits)".into());
        };
        let vocab = *x
            .last()
            .ok_or("cross_entropy needs logits of shape [..., vocab]")?;
        let rows: usize = x[..x.len() - 1].iter().product();
        if rows != self.targets.len() {
            return Err(format!(
                "{} targets for {rows} rows of logits {x:?}",
                self.targets.len()
            ));
        }
        if let Some(pos) = self
            .targets
            .iter()
            .position(|&t| t != IGNORE_INDEX && t as usize >= vocab)
        {
            return Err(format!(
                "target {} at position {pos} is out of range for vocabulary {vocab}",
                self.targets[pos]
            ));
        }
        if self.targets.iter().all(|&t| t == IGNORE_INDEX) {
            return Err("every target is ignored; the mean loss is undefined".into());
        }
        Ok(Vec::new())
    }

    fn saves_input(&self, _slot: usize) -> bool {
        true
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let x = inputs[0];
        let vocab = *x.shape().last().unwrap_or(&1);
        let out = cx.alloc_output(&[], x.dtype())?;
        let lse = cx.alloc_output(&[self.targets.len()], x.dtype())?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let xr = x.read();
            let mut l = lse.write();
            let loss = kernels::cross_entropy_forward(xr.as_slice::<T>()?, &self.targets, vocab, l.as_mut_slice::<T>()?)
                .map_err(|e| e.at(cx.node_name()))?;
            out.write().as_mut_slice::<T>()?[0] = loss;
            Ok::<(), crate::EngineError>(())
        })?;
        Ok(OpOutput {
            value: out,
            aux: vec![lse],
        })
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        cx.single_grad(|cx| {
            let x = saved.input(0)?;
            let lse = cx.saved_aux(saved, "log-sum-exp")?;
            let vocab = *x.shape().last().unwrap_or(&1);
            let dx = cx.alloc_grad(0, x.shape(), x.dtype())?;
            float_dispatch!(x.dtype(), cx.node_name(), T => {
                let (xr, lr, gr) = (x.read(), lse.read(), g.read());
                let dloss = gr.as_slice::<T>()?.first().copied().unwrap_or(<T as Float>::ZERO);
                kernels::cross_entropy_backward(
                    xr.as_slice::<T>()?, &self.targets, vocab, lr.as_slice::<T>()?, dloss, dx.write().as_mut_slice::<T>()?,
                )
                .map_err(|e| e.at(cx.node_name()))
            })?;
            Ok(dx)
        })
    }
}

impl Graph {
    /// Mean cross-entropy of `logits [..., vocab]` against `targets` (one per row).
    pub fn cross_entropy(&mut self, logits: NodeId, targets: Arc<[u32]>) -> Result<NodeId> {
        self.apply(CrossEntropy { targets }, &[logits])
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::core::gradcheck::{CheckInput, Tolerance, check_op};
    use crate::core::kernels::IGNORE_INDEX;

    #[test]
    fn gradient_matches_finite_differences() {
        let targets: Arc<[u32]> = Arc::from(vec![2u32, IGNORE_INDEX, 0, 4, 1, 1]);
        let x = CheckInput::random("logits", &[2, 3, 5], 3);
        check_op(
            |g, i| g.cross_entropy(i[0], targets.clone()),
            &[x],
            Tolerance::default(),
        )
        .unwrap();
    }
}
