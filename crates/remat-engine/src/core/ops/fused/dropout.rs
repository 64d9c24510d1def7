//! Fused dropout over `x [G, ...]`: slice `g` is masked with model `g`'s own probability
//! from a state drawn from model `g`'s random stream (each model draws the masks it draws
//! alone). A slice with `p = 0` passes through unchanged and draws nothing, as a model with
//! no dropout records no dropout node.

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::ops::dropout::masked_copy;
use crate::core::rng::RngState;
use crate::core::tensor::Tensor;

use super::group_split;

#[derive(Debug, Clone)]
pub struct FusedDropout {
    /// Per group: the probability of zeroing an element, in `[0, 1)`.
    pub p: Vec<f32>,
    /// Per group: the graph's random stream its state is drawn from.
    pub streams: Vec<usize>,
}

impl FusedDropout {
    /// The states of the masked slices, drawn now (forward) or replayed (recompute).
    fn draw(&self, cx: &mut OpCtx<'_>, per: usize) -> Result<Vec<RngState>> {
        let mut states = Vec::with_capacity(self.p.len());
        for (&p, &stream) in self.p.iter().zip(&self.streams) {
            if p > 0.0 {
                states.push(cx.rng_in_stream(stream, per as u64)?);
            }
        }
        Ok(states)
    }
}

impl Op for FusedDropout {
    fn kind(&self) -> &'static str {
        "fused_dropout"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        if self.p.len() != self.streams.len() {
            return Err(format!(
                "{} probabilities for {} streams",
                self.p.len(),
                self.streams.len()
            ));
        }
        if let Some(p) = self.p.iter().find(|p| !(0.0..1.0).contains(*p)) {
            return Err(format!("dropout probability {p} is outside [0, 1)"));
        }
        match inputs {
            [x] => group_split(x, self.p.len()).map(|_| x.to_vec()),
            _ => Err("fused dropout takes 1 input".into()),
        }
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let x = inputs[0];
        let per = x.numel() / self.p.len().max(1);
        let states = self.draw(cx, per)?;
        Ok(masked_copy(cx, x, false, &self.p, &states)?.into())
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        _saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        cx.single_grad(|cx| {
            let states = cx.rng_states().to_vec();
            let masked = self.p.iter().filter(|&&p| p > 0.0).count();
            if states.len() != masked {
                return Err(cx.shape_error(format!(
                    "forward drew {} random states for {masked} masked slices",
                    states.len()
                )));
            }
            masked_copy(cx, g, true, &self.p, &states)
        })
    }
}

impl Graph {
    /// Dropout of each slice `g` of `x [G, ...]` with probability `p[g]`, drawing from
    /// random stream `streams[g]`.
    pub fn fused_dropout(&mut self, x: NodeId, p: &[f32], streams: &[usize]) -> Result<NodeId> {
        let op = FusedDropout {
            p: p.to_vec(),
            streams: streams.to_vec(),
        };
        self.apply(op, &[x])
    }
}
