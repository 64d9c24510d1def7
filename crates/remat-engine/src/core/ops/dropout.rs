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

/// Masks (or copies) every slice of `src [G, ...]` into `dst`: slice `g` with probability
/// `p[g]`, drawing on the next of `states` where `p[g] > 0` (a slice with `p = 0` drew none).
pub(crate) fn mask_slices<T: Element>(dst: &mut [T], src: &[T], p: &[f32], states: &[RngState]) {
    let per = src.len() / p.len().max(1);
    let mut next = states.iter();
    for (g, &p) in p.iter().enumerate() {
        let (d, s) = (&mut dst[g * per..][..per], &src[g * per..][..per]);
        match (p > 0.0).then(|| next.next()).flatten() {
            Some(&state) => apply_mask(d, s, state, p),
            None => d.copy_from_slice(s),
        }
    }
}

/// A new tensor of `x` masked by [`mask_slices`]: the output in forward and recompute, the
/// gradient of input 0 in backward (which masks the incoming gradient with the same bits).
pub(crate) fn masked_copy(
    cx: &OpCtx<'_>,
    x: &Tensor,
    grad: bool,
    p: &[f32],
    states: &[RngState],
) -> Result<Tensor> {
    let out = if grad {
        cx.alloc_grad(0, x.shape(), x.dtype())?
    } else {
        cx.alloc_output(x.shape(), x.dtype())?
    };
    float_dispatch!(x.dtype(), cx.node_name(), T => {
        let xr = x.read();
        let mut w = out.write();
        mask_slices(w.as_mut_slice::<T>()?, xr.as_slice::<T>()?, p, states);
        Ok::<(), crate::EngineError>(())
    })?;
    Ok(out)
}

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
        Ok(masked_copy(cx, x, false, &[self.p], &[state])?.into())
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        _saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        cx.single_grad(|cx| {
            let state = cx.rng(g.numel() as u64)?;
            masked_copy(cx, g, true, &[self.p], &[state])
        })
    }
}

impl Graph {
    /// Zeroes each element with probability `p` and scales the rest by `1 / (1 - p)`.
    pub fn dropout(&mut self, x: NodeId, p: f32) -> Result<NodeId> {
        self.apply(Dropout { p }, &[x])
    }
}
