//! Inverted dropout driven by the graph's counter-based RNG: the mask is a pure function of
//! the recorded `(seed, offset)`, so a recompute (and backward) regenerates it exactly
//! instead of storing it.

use rayon::prelude::*;

use crate::core::dtype::Element;
use crate::core::elementwise;
use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::rng::RngState;
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy)]
pub struct Dropout {
    /// Probability of zeroing an element, in `[0, 1)`.
    pub p: f32,
}

/// `dst[i] = src[i] * keep_scale` where element `i` is kept, else 0. Element `i`'s mask bit
/// depends only on `(state, i)`, so the chunking over threads cannot change it.
pub(crate) fn apply_mask<T: Element>(dst: &mut [T], src: &[T], state: RngState, p: f32) {
    let scale = T::from_f64(1.0 / (1.0 - p as f64));
    let run = |base: usize, dst: &mut [T], src: &[T]| {
        for (i, (d, &s)) in dst.iter_mut().zip(src).enumerate() {
            let kept = state.uniform((base + i) as u64) >= p;
            *d = if kept { s * scale } else { T::ZERO };
        }
    };
    if dst.len() >= elementwise::PAR_MIN {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .enumerate()
            .for_each(|(c, (d, s))| run(c * CHUNK, d, s));
    } else {
        run(0, dst, src);
    }
}

const CHUNK: usize = 1 << 13;

impl Op for Dropout {
    fn kind(&self) -> &'static str {
        "dropout"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        if !(0.0..1.0).contains(&self.p) {
            return Err(format!("dropout probability {} is outside [0, 1)", self.p));
        }
        match inputs {
            [x] => Ok(x.to_vec()),
            _ => Err("dropout takes 1 input".into()),
        }
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let x = inputs[0];
        let state = cx.rng(x.numel() as u64)?;
        let out = cx.alloc_output(x.shape(), x.dtype())?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let xr = x.read();
            let mut w = out.write();
            apply_mask(w.as_mut_slice::<T>()?, xr.as_slice::<T>()?, state, self.p);
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
        if !cx.needs_grad(0) {
            return Ok(vec![None]);
        }
        let state = cx.rng(g.numel() as u64)?;
        let dx = cx.alloc_grad(0, g.shape(), g.dtype())?;
        float_dispatch!(g.dtype(), cx.node_name(), T => {
            let gr = g.read();
            let mut w = dx.write();
            apply_mask(w.as_mut_slice::<T>()?, gr.as_slice::<T>()?, state, self.p);
            Ok::<(), crate::EngineError>(())
        })?;
        Ok(vec![Some(dx)])
    }
}

impl Graph {
    /// Zeroes each element with probability `p` and scales the rest by `1 / (1 - p)`.
    pub fn dropout(&mut self, x: NodeId, p: f32) -> Result<NodeId> {
        self.apply(Dropout { p }, &[x])
    }
}
