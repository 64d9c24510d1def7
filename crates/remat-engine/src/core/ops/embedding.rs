//! Token embedding: `out[..., :] = weight[ids[...], :]` for a `[vocab, dim]` table.
//!
//! The token ids are data, not a differentiable input, so the op holds them (shared, 4
//! bytes per token) and a recompute gathers the same rows.

use std::sync::Arc;

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::kernels;
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone)]
pub struct Embedding {
    /// Token ids, row-major over `lead`.
    pub ids: Arc<[u32]>,
    /// Leading output dimensions (e.g. `[batch, seq]`); their product is `ids.len()`.
    pub lead: Vec<usize>,
}

impl Op for Embedding {
    fn kind(&self) -> &'static str {
        "embedding"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        let [w] = inputs else {
            return Err("embedding takes 1 input (the table)".into());
        };
        let [vocab, dim] = **w else {
            return Err(format!("embedding table must be [vocab, dim], got {w:?}"));
        };
        if self.lead.iter().product::<usize>() != self.ids.len() {
            return Err(format!(
                "{} token ids do not fill shape {:?}",
                self.ids.len(),
                self.lead
            ));
        }
        if let Some(pos) = self.ids.iter().position(|&t| t as usize >= vocab) {
            return Err(format!(
                "token {} at position {pos} is out of range for vocabulary {vocab}",
                self.ids[pos]
            ));
        }
        let mut out = self.lead.clone();
        out.push(dim);
        Ok(out)
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let w = inputs[0];
        let (vocab, dim) = (w.shape()[0], w.shape()[1]);
        let shape = self
            .output_shape(&[w.shape()])
            .map_err(|m| cx.shape_error(m))?;
        let out = cx.alloc_output(&shape, w.dtype())?;
        float_dispatch!(w.dtype(), cx.node_name(), T => {
            let wr = w.read();
            let mut o = out.write();
            kernels::embedding_forward(wr.as_slice::<T>()?, vocab, dim, &self.ids, o.as_mut_slice::<T>()?)
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
            let (vocab, dim) = (saved.input_shapes[0][0], saved.input_shapes[0][1]);
            let dw = cx.alloc_grad(0, &[vocab, dim], g.dtype())?;
            float_dispatch!(g.dtype(), cx.node_name(), T => {
                let gr = g.read();
                let mut w = dw.write();
                kernels::embedding_backward(&self.ids, gr.as_slice::<T>()?, vocab, dim, w.as_mut_slice::<T>()?)
                    .map_err(|e| e.at(cx.node_name()))
            })?;
            Ok(dw)
        })
    }
}

impl Graph {
    /// Looks up `ids` (shaped `lead`) in `table [vocab, dim]`: output `lead ++ [dim]`.
    pub fn embedding(&mut self, table: NodeId, ids: Arc<[u32]>, lead: &[usize]) -> Result<NodeId> {
        self.apply(
            Embedding {
                ids,
                lead: lead.to_vec(),
            },
            &[table],
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::core::gradcheck::{CheckInput, Tolerance, check_op};

    #[test]
    fn gradient_matches_finite_differences() {
        let ids: Arc<[u32]> = Arc::from(vec![3u32, 1, 3, 0, 2, 3]);
        let table = CheckInput::random("table", &[5, 4], 1);
        check_op(
            |g, x| g.embedding(x[0], ids.clone(), &[2, 3]),
            &[table],
            Tolerance::default(),
        )
        .unwrap();
    }

    #[test]
    fn out_of_range_token_fails_at_record_time() {
        let ctx = crate::ExecContext::single_threaded().unwrap();
        let mut g = crate::Graph::new(&ctx);
        let t = crate::Tensor::from_vec(
            ctx.pool(),
            "t",
            &[4, 2],
            vec![0f32; 8],
            crate::Category::Parameters,
        )
        .unwrap();
        let w = g.param("table", &t);
        let err = g.embedding(w, Arc::from(vec![1u32, 7]), &[2]).unwrap_err();
        assert!(
            err.to_string()
                .contains("token 7 at position 1 is out of range for vocabulary 4"),
            "{err}"
        );
    }
}
