//! Fused token embedding: `G` tables `[vocab, d]` and `G` token lists of one shape `lead`;
//! output `[G, lead..., d]`. Slice `g` is gathered, and its table's gradient scatter-added,
//! by the kernel calls the unfused [`crate::core::ops::embedding::Embedding`] makes for model `g`.

use std::sync::Arc;

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::kernels;
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

/// Inputs: `G` tables `[vocab, d]`; `ids[g]` are group `g`'s tokens, row-major over `lead`.
#[derive(Debug, Clone)]
pub struct FusedEmbedding {
    pub ids: Vec<Arc<[u32]>>,
    pub lead: Vec<usize>,
}

impl Op for FusedEmbedding {
    fn kind(&self) -> &'static str {
        "fused_embedding"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        if inputs.is_empty() || inputs.len() != self.ids.len() {
            return Err(format!(
                "fused embedding of {} token lists takes as many tables, got {}",
                self.ids.len(),
                inputs.len()
            ));
        }
        let [vocab, dim] = *inputs[0] else {
            return Err(format!(
                "embedding table must be [vocab, dim], got {:?}",
                inputs[0]
            ));
        };
        let per: usize = self.lead.iter().product();
        for (g, (table, ids)) in inputs.iter().zip(&self.ids).enumerate() {
            if **table != [vocab, dim] {
                return Err(format!(
                    "table {g} is {table:?}, table 0 is [{vocab}, {dim}]"
                ));
            }
            if ids.len() != per {
                return Err(format!(
                    "token list {g} has {} ids, shape {:?} needs {per}",
                    ids.len(),
                    self.lead
                ));
            }
            if let Some(pos) = ids.iter().position(|&t| t as usize >= vocab) {
                return Err(format!(
                    "token {} at position {pos} of list {g} is out of range for vocabulary {vocab}",
                    ids[pos]
                ));
            }
        }
        let mut out = vec![self.ids.len()];
        out.extend(&self.lead);
        out.push(dim);
        Ok(out)
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape()).collect();
        let shape = self.output_shape(&shapes).map_err(|m| cx.shape_error(m))?;
        let (vocab, dim) = (shapes[0][0], shapes[0][1]);
        let out = cx.alloc_output(&shape, inputs[0].dtype())?;
        float_dispatch!(inputs[0].dtype(), cx.node_name(), T => {
            let mut o = out.write();
            let ov = o.as_mut_slice::<T>()?;
            for (g, (table, ids)) in inputs.iter().zip(&self.ids).enumerate() {
                let per = ids.len() * dim;
                let wr = table.read();
                kernels::embedding_forward(wr.as_slice::<T>()?, vocab, dim, ids, &mut ov[g * per..][..per])
                    .map_err(|e| e.at(cx.node_name()))?;
            }
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
        let (vocab, dim) = (saved.input_shapes[0][0], saved.input_shapes[0][1]);
        let mut grads = Vec::with_capacity(self.ids.len());
        float_dispatch!(g.dtype(), cx.node_name(), T => {
            let gr = g.read();
            let gv = gr.as_slice::<T>()?;
            for (group, ids) in self.ids.iter().enumerate() {
                if !cx.needs_grad(group) {
                    grads.push(None);
                    continue;
                }
                let per = ids.len() * dim;
                let dw = cx.alloc_grad(group, &[vocab, dim], g.dtype())?;
                kernels::embedding_backward(ids, &gv[group * per..][..per], vocab, dim, dw.write().as_mut_slice::<T>()?)
                    .map_err(|e| e.at(cx.node_name()))?;
                grads.push(Some(dw));
            }
            Ok::<(), crate::EngineError>(())
        })?;
        Ok(grads)
    }
}

impl Graph {
    /// Looks up `ids[g]` (each shaped `lead`) in `tables[g]`: output `[G, lead..., dim]`.
    pub fn fused_embedding(
        &mut self,
        tables: &[NodeId],
        ids: Vec<Arc<[u32]>>,
        lead: &[usize],
    ) -> Result<NodeId> {
        let op = FusedEmbedding {
            ids,
            lead: lead.to_vec(),
        };
        self.apply(op, tables)
    }
}
