//! Swap of two axes (a copy into the new row-major layout).

use rayon::prelude::*;

use crate::core::elementwise;
use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy)]
pub struct Transpose {
    pub dim0: usize,
    pub dim1: usize,
}

impl Transpose {
    fn swapped(&self, shape: &[usize]) -> Result<Vec<usize>, String> {
        if self.dim0 >= shape.len() || self.dim1 >= shape.len() {
            return Err(format!(
                "cannot swap axes {} and {} of {shape:?}",
                self.dim0, self.dim1
            ));
        }
        let mut s = shape.to_vec();
        s.swap(self.dim0, self.dim1);
        Ok(s)
    }
}

/// Copies `src` (shape `shape`) into `dst` with axes `a < b` swapped. The tensor is seen as
/// `[outer, A, mid, B, inner]`; contiguous `inner` runs are copied whole, and the `outer`
/// blocks (independent) are spread over threads when large.
fn swap_axes<T: Copy + Send + Sync>(dst: &mut [T], src: &[T], shape: &[usize], a: usize, b: usize) {
    let (a, b) = (a.min(b), a.max(b));
    let outer: usize = shape[..a].iter().product();
    let (na, nb) = (shape[a], shape[b]);
    let mid: usize = shape[a + 1..b].iter().product();
    let inner: usize = shape[b + 1..].iter().product();
    let block = na * mid * nb * inner;
    if block == 0 || outer == 0 {
        return;
    }
    let copy_block = |dst: &mut [T], src: &[T]| {
        let mut o = 0;
        for j in 0..nb {
            for m in 0..mid {
                for i in 0..na {
                    let s = ((i * mid + m) * nb + j) * inner;
                    dst[o..o + inner].copy_from_slice(&src[s..s + inner]);
                    o += inner;
                }
            }
        }
    };
    if dst.len() >= elementwise::PAR_MIN && outer > 1 {
        dst.par_chunks_mut(block)
            .zip(src.par_chunks(block))
            .for_each(|(d, s)| copy_block(d, s));
    } else {
        dst.chunks_mut(block)
            .zip(src.chunks(block))
            .for_each(|(d, s)| copy_block(d, s));
    }
}

fn transposed(
    cx: &OpCtx<'_>,
    x: &Tensor,
    t: &Transpose,
    grad_slot: Option<usize>,
) -> Result<Tensor> {
    let shape = t.swapped(x.shape()).map_err(|m| cx.shape_error(m))?;
    let out = match grad_slot {
        Some(s) => cx.alloc_grad(s, &shape, x.dtype())?,
        None => cx.alloc_output(&shape, x.dtype())?,
    };
    float_dispatch!(x.dtype(), cx.node_name(), T => {
        let xr = x.read();
        let mut w = out.write();
        swap_axes(w.as_mut_slice::<T>()?, xr.as_slice::<T>()?, x.shape(), t.dim0, t.dim1);
        Ok::<(), crate::EngineError>(())
    })?;
    Ok(out)
}

impl Op for Transpose {
    fn kind(&self) -> &'static str {
        "transpose"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [x] => self.swapped(x),
            _ => Err("transpose takes 1 input".into()),
        }
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        Ok(transposed(cx, inputs[0], self, None)?.into())
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        _saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        cx.single_grad(|cx| transposed(cx, g, self, Some(0)))
    }
}

impl Graph {
    /// Swaps axes `dim0` and `dim1`.
    pub fn transpose(&mut self, x: NodeId, dim0: usize, dim1: usize) -> Result<NodeId> {
        self.apply(Transpose { dim0, dim1 }, &[x])
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn swaps_middle_axes() {
        // shape [2, 3, 2] -> swap 0 and 2 -> [2, 3, 2]
        let src: Vec<i32> = (0..12).collect();
        let mut dst = vec![0; 12];
        super::swap_axes(&mut dst, &src, &[2, 3, 2], 0, 2);
        // dst[k][j][i] = src[i][j][k]
        for i in 0..2 {
            for j in 0..3 {
                for k in 0..2 {
                    assert_eq!(dst[(k * 3 + j) * 2 + i], src[(i * 3 + j) * 2 + k]);
                }
            }
        }
    }
}
