//! Fused cross-entropy: logits `[G, ..., vocab]` against `G` target lists, one mean loss
//! per group (output `[G]`). Slice `g`'s mean is the value of the scalar
//! [`crate::core::ops::cross_entropy::CrossEntropy`] on model `g` (the same kernel over the same
//! slice), and backward scales slice `g` by element `g` of the upstream gradient: seeded
//! with ones, exactly the scalar op's seed of 1.

use std::sync::Arc;

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::kernels::{self, IGNORE_INDEX};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

use super::group_split;

/// Input: logits `[G, ..., vocab]`; `targets[g]` has one target per row of slice `g`.
#[derive(Debug, Clone)]
pub struct FusedCrossEntropy {
    pub targets: Vec<Arc<[u32]>>,
}

impl Op for FusedCrossEntropy {
    fn kind(&self) -> &'static str {
        "fused_cross_entropy"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        let [x] = inputs else {
            return Err("fused cross_entropy takes 1 input (the logits)".into());
        };
        let per = group_split(x, self.targets.len())?;
        let vocab = match x.last() {
            Some(&v) if x.len() >= 2 && v > 0 => v,
            _ => {
                return Err(format!(
                    "fused cross_entropy needs logits [G, ..., vocab], got {x:?}"
                ));
            }
        };
        for (g, targets) in self.targets.iter().enumerate() {
            if targets.len() * vocab != per {
                return Err(format!(
                    "{} targets of list {g} for {} rows of logits {x:?}",
                    targets.len(),
                    per / vocab
                ));
            }
            if let Some(pos) = targets
                .iter()
                .position(|&t| t != IGNORE_INDEX && t as usize >= vocab)
            {
                return Err(format!(
                    "target {} at position {pos} of list {g} is out of range for vocabulary {vocab}",
                    targets[pos]
                ));
            }
            if targets.iter().all(|&t| t == IGNORE_INDEX) {
                return Err(format!(
                    "every target of list {g} is ignored; its mean loss is undefined"
                ));
            }
        }
        Ok(vec![self.targets.len()])
    }

    fn saves_input(&self, _slot: usize) -> bool {
        true
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let x = inputs[0];
        let shape = self
            .output_shape(&[x.shape()])
            .map_err(|m| cx.shape_error(m))?;
        let vocab = *x.shape().last().unwrap_or(&1);
        let rows: usize = self.targets.iter().map(|t| t.len()).sum();
        let out = cx.alloc_output(&shape, x.dtype())?;
        let lse = cx.alloc_output(&[rows], x.dtype())?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let xr = x.read();
            let xv = xr.as_slice::<T>()?;
            let (mut l, mut o) = (lse.write(), out.write());
            let (lv, ov) = (l.as_mut_slice::<T>()?, o.as_mut_slice::<T>()?);
            let mut row = 0;
            for (g, targets) in self.targets.iter().enumerate() {
                let n = targets.len();
                ov[g] = kernels::cross_entropy_forward(
                    &xv[row * vocab..][..n * vocab], targets, vocab, &mut lv[row..][..n],
                )
                .map_err(|e| e.at(cx.node_name()))?;
                row += n;
            }
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
                let (xv, lv, gv) = (xr.as_slice::<T>()?, lr.as_slice::<T>()?, gr.as_slice::<T>()?);
                let mut dw = dx.write();
                let dv = dw.as_mut_slice::<T>()?;
                let mut row = 0;
                for (group, targets) in self.targets.iter().enumerate() {
                    let n = targets.len();
                    let dloss = *gv.get(group).ok_or_else(|| cx.shape_error("upstream gradient is shorter than the group count"))?;
                    kernels::cross_entropy_backward(
                        &xv[row * vocab..][..n * vocab], targets, vocab, &lv[row..][..n], dloss,
                        &mut dv[row * vocab..][..n * vocab],
                    )
                    .map_err(|e| e.at(cx.node_name()))?;
                    row += n;
                }
                Ok::<(), crate::EngineError>(())
            })?;
            Ok(dx)
        })
    }
}

impl Graph {
    /// Mean cross-entropy of each slice of `logits [G, ..., vocab]` against `targets[g]`:
    /// a `[G]` vector of losses.
    pub fn fused_cross_entropy(
        &mut self,
        logits: NodeId,
        targets: Vec<Arc<[u32]>>,
    ) -> Result<NodeId> {
        self.apply(FusedCrossEntropy { targets }, &[logits])
    }
}
