//! Broadcasting bias: `x[..., n] + b[n]`.

use rayon::prelude::*;

use crate::core::elementwise;
use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy, Default)]
pub struct Bias;

/// Columns per parallel task of the bias-gradient reduction.
const COL_BLOCK: usize = 64;

impl Op for Bias {
    fn kind(&self) -> &'static str {
        "bias"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [x, b] if b.len() == 1 && x.last() == b.first() => Ok(x.to_vec()),
            [x, b] => Err(format!(
                "bias {b:?} does not match the last dimension of {x:?}"
            )),
            _ => Err("bias takes 2 inputs".into()),
        }
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let (x, b) = (inputs[0], inputs[1]);
        let n = b.numel();
        let out = cx.alloc_output(x.shape(), x.dtype())?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let (xr, br) = (x.read(), b.read());
            let (xv, bv) = (xr.as_slice::<T>()?, br.as_slice::<T>()?);
            let mut w = out.write();
            elementwise::rows_mut(w.as_mut_slice::<T>()?, n, |r, row| {
                let src = &xv[r * n..][..n];
                for ((o, &s), &c) in row.iter_mut().zip(src).zip(bv) {
                    *o = s + c;
                }
            });
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
        let n = saved.input_shapes[1][0];
        let db = if cx.needs_grad(1) {
            let db = cx.alloc_grad(1, &[n], g.dtype())?;
            float_dispatch!(g.dtype(), cx.node_name(), T => {
                let gr = g.read();
                let gv = gr.as_slice::<T>()?;
                let rows = gv.len().checked_div(n).unwrap_or(0);
                let mut w = db.write();
                // Column sums in a fixed row order per column: parallel over columns only,
                // so the bits do not depend on the thread count.
                let sum_cols = |c0: usize, acc: &mut [T]| {
                    for r in 0..rows {
                        let row = &gv[r * n + c0..][..acc.len()];
                        for (a, &v) in acc.iter_mut().zip(row) {
                            *a += v;
                        }
                    }
                };
                let dbv = w.as_mut_slice::<T>()?;
                if gv.len() >= elementwise::PAR_MIN {
                    dbv.par_chunks_mut(COL_BLOCK).enumerate().for_each(|(i, acc)| sum_cols(i * COL_BLOCK, acc));
                } else {
                    dbv.chunks_mut(COL_BLOCK).enumerate().for_each(|(i, acc)| sum_cols(i * COL_BLOCK, acc));
                }
                Ok::<(), crate::EngineError>(())
            })?;
            Some(db)
        } else {
            None
        };
        Ok(vec![cx.needs_grad(0).then(|| g.clone()), db])
    }
}

impl Graph {
    /// `x[..., n] + b[n]`, broadcasting `b` over the leading dimensions.
    pub fn bias(&mut self, x: NodeId, b: NodeId) -> Result<NodeId> {
        self.apply(Bias, &[x, b])
    }
}
