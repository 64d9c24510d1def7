//! Causal multi-head self-attention with rotary position embedding and grouped-query heads,
//! as one graph op over the projected `q [B, S, H*Dh]`, `k, v [B, S, Hkv*Dh]`.
//!
//! Backward reads q, k, v and the per-row log-sum-exp (aux, `[B, H, S]`): the `S x S`
//! probabilities are never stored, they are rebuilt block by block (see
//! [`crate::core::kernels::attention_forward`]). Per-head scratch comes from the pool as
//! temporaries. A QK-norm composes by applying [`Graph::rmsnorm`] to q and k (reshaped to
//! `[B, S, H, Dh]`) before this op.

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::kernels::{self, AttentionShape, RopeTable};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// RoPE base (10000 in Llama 2, 1e6 in Qwen3); `None` attends without positions.
    pub rope_theta: Option<f64>,
}

impl Attention {
    /// Every dimension before `[seq, width]` is folded into the batch: K fused models'
    /// `[K, B, S, ...]` attend as `K * B` sequences, each as it would alone (the kernel's
    /// result per sequence depends neither on the batch size nor on the thread count).
    fn shape_of(&self, q: &[usize]) -> Result<AttentionShape, String> {
        let [lead @ .., seq, width] = q else {
            return Err(format!(
                "attention q must be [batch, seq, heads*head_dim], got {q:?}"
            ));
        };
        if lead.is_empty() {
            return Err(format!(
                "attention q must be [batch, seq, heads*head_dim], got {q:?}"
            ));
        }
        let (batch, seq, width) = (lead.iter().product::<usize>(), *seq, *width);
        if width != self.n_heads * self.head_dim {
            return Err(format!(
                "q width {width} is not {} heads x {}",
                self.n_heads, self.head_dim
            ));
        }
        let shape = AttentionShape {
            batch,
            seq,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        };
        shape.validate().map_err(|e| e.to_string())?;
        Ok(shape)
    }

    fn rope<T: kernels::Float>(&self, cx: &OpCtx<'_>, seq: usize) -> Result<Option<RopeTable<T>>> {
        self.rope_theta
            .map(|theta| {
                RopeTable::new(seq, self.head_dim, theta).map_err(|e| e.at(cx.node_name()))
            })
            .transpose()
    }
}

impl Op for Attention {
    fn kind(&self) -> &'static str {
        "attention"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        let [q, k, v] = inputs else {
            return Err("attention takes 3 inputs (q, k, v)".into());
        };
        let s = self.shape_of(q)?;
        let mut kv = q[..q.len() - 1].to_vec();
        kv.push(s.n_kv_heads * s.head_dim);
        if **k != *kv || **v != *kv {
            return Err(format!("k {k:?} and v {v:?} must be {kv:?} for q {q:?}"));
        }
        if self.rope_theta.is_some() && !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "rotary embedding needs an even head_dim, got {}",
                self.head_dim
            ));
        }
        Ok(q.to_vec())
    }

    fn saves_input(&self, _slot: usize) -> bool {
        true
    }

    fn flops(&self, inputs: &[&[usize]]) -> u64 {
        inputs
            .first()
            .and_then(|q| self.shape_of(q).ok())
            .map_or(0, |s| s.forward_flops() as u64)
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
        let shape = self.shape_of(q.shape()).map_err(|m| cx.shape_error(m))?;
        // Every row of out (one product per query block) and of lse is written.
        let out = cx.alloc_output_overwritten(q.shape(), q.dtype())?;
        let lse =
            cx.alloc_output_overwritten(&[shape.batch, shape.n_heads, shape.seq], q.dtype())?;
        let workers = cx.threads().min(shape.batch).max(1);
        let scratch = cx.alloc_temp(
            &[kernels::attention_forward_scratch_len(&shape, workers)],
            q.dtype(),
        )?;
        float_dispatch!(q.dtype(), cx.node_name(), T => {
            let rope = self.rope::<T>(cx, shape.seq)?;
            let (qr, kr, vr) = (q.read(), k.read(), v.read());
            let (mut o, mut l, mut s) = (out.write(), lse.write(), scratch.write());
            kernels::attention_forward(
                &shape, rope.as_ref(), qr.as_slice::<T>()?, kr.as_slice::<T>()?, vr.as_slice::<T>()?,
                o.as_mut_slice::<T>()?, l.as_mut_slice::<T>()?, s.as_mut_slice::<T>()?,
            )
            .map_err(|e| e.at(cx.node_name()))
        })?;
        drop(scratch);
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
        let (q, k, v) = (saved.input(0)?, saved.input(1)?, saved.input(2)?);
        let lse = cx.saved_aux(saved, "log-sum-exp")?;
        let shape = self.shape_of(q.shape()).map_err(|m| cx.shape_error(m))?;
        let alloc = |cx: &OpCtx<'_>, slot: usize, t: &Tensor| {
            if cx.needs_grad(slot) {
                cx.alloc_grad(slot, t.shape(), t.dtype())
            } else {
                cx.alloc_temp(t.shape(), t.dtype())
            }
        };
        let (dq, dk, dv) = (alloc(cx, 0, q)?, alloc(cx, 1, k)?, alloc(cx, 2, v)?);
        let workers = cx.threads().min(shape.batch).max(1);
        let scratch = cx.alloc_temp(
            &[kernels::attention_backward_scratch_len(&shape, workers)],
            q.dtype(),
        )?;
        float_dispatch!(q.dtype(), cx.node_name(), T => {
            let rope = self.rope::<T>(cx, shape.seq)?;
            let (qr, kr, vr, lr, gr) = (q.read(), k.read(), v.read(), lse.read(), g.read());
            let (mut dqw, mut dkw, mut dvw, mut s) = (dq.write(), dk.write(), dv.write(), scratch.write());
            kernels::attention_backward(
                &shape, rope.as_ref(), qr.as_slice::<T>()?, kr.as_slice::<T>()?, vr.as_slice::<T>()?,
                lr.as_slice::<T>()?, gr.as_slice::<T>()?,
                dqw.as_mut_slice::<T>()?, dkw.as_mut_slice::<T>()?, dvw.as_mut_slice::<T>()?, s.as_mut_slice::<T>()?,
            )
            .map_err(|e| e.at(cx.node_name()))
        })?;
        drop(scratch);
        Ok(vec![
            cx.needs_grad(0).then_some(dq),
            cx.needs_grad(1).then_some(dk),
            cx.needs_grad(2).then_some(dv),
        ])
    }
}

impl Graph {
    /// Causal self-attention of `q [B, S, H*Dh]` over `k, v [B, S, Hkv*Dh]`.
    pub fn attention(&mut self, q: NodeId, k: NodeId, v: NodeId, op: Attention) -> Result<NodeId> {
        self.apply(op, &[q, k, v])
    }
}

#[cfg(test)]
mod tests {
    use super::Attention;
    use crate::core::gradcheck::{CheckInput, Tolerance, check_op};

    #[test]
    fn gqa_with_rope_gradient_matches_finite_differences() {
        let op = Attention {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 4,
            rope_theta: Some(10000.0),
        };
        let q = CheckInput::random("q", &[2, 3, 16], 1);
        let k = CheckInput::random("k", &[2, 3, 8], 2);
        let v = CheckInput::random("v", &[2, 3, 8], 3);
        check_op(
            |g, i| g.attention(i[0], i[1], i[2], op),
            &[q, k, v],
            Tolerance::default(),
        )
        .unwrap();
    }

    #[test]
    fn mismatched_kv_is_a_shape_error() {
        let op = Attention {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 2,
            rope_theta: None,
        };
        let err = op_shape_err(op, &[1, 3, 4], &[1, 3, 4]);
        assert!(err.contains("must be [1, 3, 2]"), "{err}");
    }

    fn op_shape_err(op: Attention, q: &[usize], kv: &[usize]) -> String {
        use crate::core::op::Op;
        op.output_shape(&[q, kv, kv]).unwrap_err()
    }
}
