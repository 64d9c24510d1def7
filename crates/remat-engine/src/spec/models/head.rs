//! What every spec-driven language model runs around its blocks, not spec-driven: the token
//! embedding before the first block, and the final RMSNorm, LM head and mean cross-entropy
//! after the last, forward and backward, with their buffers charged to the step's pool.

use std::sync::Arc;

use crate::core::kernels;
use crate::spec::compile::Mode;
use crate::spec::run::Act;
use crate::spec::run::exec::Scratch;
use crate::spec::run::meter::{Hold, Meter, Use};
use crate::spec::run::{RunError, RunResult, linalg};

use super::grads::SpecGrads;

/// Token embeddings of `[batch, seq]` tokens from `embed` (`[vocab, hidden]`), charged to
/// the pool as layer 0's block input.
pub(crate) fn embed_tokens(
    embed: &Act,
    [batch, seq]: [usize; 2],
    tokens: &[u32],
    meter: &Arc<Meter>,
) -> RunResult<(Act, Hold)> {
    let (vocab, hidden) = (embed.shape[0], embed.shape[1]);
    let hold = meter.hold((tokens.len() * hidden * 4) as u64, Use::Forward, || {
        "embedding output (layer 0 block input `x`)".into()
    })?;
    let mut x = vec![0.0; tokens.len() * hidden];
    kernels::embedding_forward(&embed.data, vocab, hidden, tokens, &mut x)
        .map_err(kernel_err("embedding"))?;
    Ok((Act::new(x, vec![batch, seq, hidden]), hold))
}

/// The weights after the blocks: final RMSNorm and LM head (`[vocab, hidden]`).
#[derive(Clone, Copy)]
pub(crate) struct LmHead<'a> {
    pub final_norm: &'a Act,
    pub lm_head: &'a Act,
    pub eps: f64,
}

/// Final norm, LM head and mean cross-entropy, forward and backward (not spec-driven);
/// its buffers are charged to the pool like the blocks'.
pub(crate) fn lm_loss(
    head: LmHead,
    x: &Act,
    targets: &[u32],
    mode: Mode,
    meter: &Arc<Meter>,
    holds: &mut Vec<Hold>,
) -> RunResult<(f32, Scratch, SpecGrads)> {
    let (vocab, hidden) = (head.lm_head.shape[0], head.lm_head.shape[1]);
    let n = x.data.len() / hidden.max(1);
    let scratch =
        |len: usize, what: &'static str| Scratch::zeros(meter, len, || format!("LM head `{what}`"));
    let mut xf = scratch(x.data.len(), "final norm output")?;
    let mut rstd = scratch(n, "final norm rstd")?;
    kernels::rmsnorm_forward(&x.data, &head.final_norm.data, head.eps, &mut xf, &mut rstd)
        .map_err(kernel_err("final norm"))?;
    let mut logits = scratch(n * vocab, "logits")?;
    linalg::linear(
        &xf,
        &head.lm_head.data,
        n,
        hidden,
        vocab,
        &mut logits,
        false,
        1.0,
    );
    let mut lse = scratch(n, "logsumexp")?;
    let loss = kernels::cross_entropy_forward(&logits, targets, vocab, &mut lse)
        .map_err(kernel_err("cross-entropy"))?;
    let mut dlogits = scratch(logits.len(), "dlogits")?;
    kernels::cross_entropy_backward(&logits, targets, vocab, &lse, 1.0, &mut dlogits)
        .map_err(kernel_err("cross-entropy"))?;
    drop(logits);
    let mut grads = SpecGrads::default();
    let mut dxf = scratch(xf.len(), "dfinal norm output")?;
    linalg::linear_dx(
        &dlogits,
        &head.lm_head.data,
        n,
        hidden,
        vocab,
        &mut dxf,
        false,
        1.0,
    );
    let mut dnorm = vec![0.0; hidden];
    let mut dx = scratch(x.data.len(), "dx of the last block")?;
    kernels::rmsnorm_backward(
        &x.data,
        &head.final_norm.data,
        &rstd,
        &dxf,
        &mut dx,
        Some(&mut dnorm),
    )
    .map_err(kernel_err("final norm"))?;
    if mode == Mode::Full {
        let bytes = head.lm_head.bytes() + head.final_norm.bytes();
        holds.push(meter.hold(bytes, Use::Gradient, || {
            "gradients of `lm_head` and `final_norm`".into()
        })?);
        grads.lm_head = vec![0.0; head.lm_head.data.len()];
        linalg::linear_dw(&dlogits, &xf, n, hidden, vocab, &mut grads.lm_head, 1.0);
        grads.final_norm = dnorm;
    }
    Ok((loss, dx, grads))
}

pub(crate) fn kernel_err(what: &'static str) -> impl Fn(kernels::KernelError) -> RunError {
    move |e| RunError::Model(format!("{what}: {e}"))
}
