//! A GPT-style decoder (the Llama/Qwen block without biases): token embedding; `L` blocks
//! of `x += dropout(o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))))` with
//! `n = rmsnorm(x)`, then `x += dropout(down_proj(silu(gate_proj(n)) * up_proj(n)))` with
//! `n = rmsnorm(x)`; final RMSNorm; LM head; mean cross-entropy.
//!
//! Dropout sits on each residual branch before its add (GPT-2's `resid_dropout`), so the
//! residual stream itself is never masked; with `dropout = 0` no dropout node is recorded,
//! which makes the graph the Hugging Face Llama/Qwen2 computation exactly.
//!
//! Parameters are named as in Hugging Face Llama/Qwen checkpoints (see [`Gpt::params`]).
//! Layout: the embedding is `[vocab, d_model]` as in HF; every projection (including
//! `lm_head`) is stored **`[in, out]`** here (so `y = x @ W`), the transpose of HF's
//! `nn.Linear` `[out, in]`; [`hf`] transposes on load and save.
//!
//! Checkpointing ([`Checkpointing`]): any whole-graph [`Policy`], or
//! [`Graph::segment`]-based block checkpointing: one segment per block, or segments of
//! `ceil(sqrt(L))` blocks, keeping only each segment's input (the residual stream).
//! [`block_forward`] applies one block to a hidden state, for callers assembling their own
//! models or pipeline stages.
//!
//! Why one file of ~610 lines: the model's config, checkpointing choices, weights, step and
//! [`block_forward`] are one definition that the fused and multi-model recorders and the
//! pipeline stages build on; its tests are already in `gpt/tests.rs`.

pub mod hf;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::core::context::ExecContext;
use crate::core::error::{EngineError, Result};
use crate::core::graph::{Graph, GraphObserver, NodeId};
use crate::core::kernels::philox_hash;
use crate::core::ops::attention::Attention;
use crate::core::policy::Policy;
use crate::core::pool::{Category, MemoryPool, PoolStats};
use crate::core::tensor::Tensor;

pub use super::batch::Batch;

/// Model sizes and hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention); must divide `n_heads`.
    pub n_kv_heads: usize,
    /// Hidden width of the SwiGLU MLP.
    pub ffn_hidden: usize,
    pub rope_theta: f64,
    pub norm_eps: f64,
    /// Residual-branch dropout probability (0 records no dropout node).
    pub dropout: f32,
    /// Seed of the weight initialization.
    pub init_seed: u64,
}

impl GptConfig {
    /// The configuration of `remat bench engine` (issue 2, section 7).
    pub fn bench() -> Self {
        GptConfig {
            vocab: 256,
            d_model: 256,
            n_layers: 8,
            n_heads: 8,
            n_kv_heads: 8,
            ffn_hidden: 4 * 256,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            dropout: 0.0,
            init_seed: 0,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }

    /// The attention op of a block of this shape (RoPE at `rope_theta`).
    pub fn attention(&self) -> Attention {
        Attention {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim(),
            rope_theta: Some(self.rope_theta),
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::Invalid(format!("GPT config: {m}")));
        if self.vocab == 0 || self.d_model == 0 || self.n_layers == 0 || self.ffn_hidden == 0 {
            return bad(format!(
                "vocab, d_model, n_layers and ffn_hidden must be > 0 ({self:?})"
            ));
        }
        if self.n_heads == 0 || !self.d_model.is_multiple_of(self.n_heads) {
            return bad(format!(
                "n_heads {} must divide d_model {}",
                self.n_heads, self.d_model
            ));
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "n_kv_heads {} must divide n_heads {}",
                self.n_kv_heads, self.n_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even for rotary embedding",
                self.head_dim()
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!("dropout {} is outside [0, 1)", self.dropout));
        }
        self.param_bytes()?;
        Ok(())
    }

    /// Bytes of the f32 parameters, computed with checked arithmetic: an error (naming the
    /// sizes) when they exceed what one process can address, instead of a wrapped count.
    pub fn param_bytes(&self) -> Result<u64> {
        let (d, f, v) = (self.d_model, self.ffn_hidden, self.vocab);
        let too_big = || {
            EngineError::Invalid(format!(
                "GPT config: vocab {v}, d_model {d}, n_layers {}, n_heads {}, n_kv_heads {} and \
                 ffn_hidden {f} need more parameter bytes than a process can address \
                 ({} bytes at most)",
                self.n_layers,
                self.n_heads,
                self.n_kv_heads,
                isize::MAX
            ))
        };
        let kv = self
            .n_kv_heads
            .checked_mul(self.head_dim())
            .ok_or_else(too_big)?;
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(too_big);
        let add = |a: usize, b: usize| a.checked_add(b).ok_or_else(too_big);
        // Per block: two norms, q and o [d, d], k and v [d, kv], gate/up/down [d, f].
        let mut block = mul(2, d)?;
        block = add(block, mul(2, mul(d, d)?)?)?;
        block = add(block, mul(2, mul(d, kv)?)?)?;
        block = add(block, mul(3, mul(d, f)?)?)?;
        let blocks = mul(self.n_layers, block)?;
        // Embedding, final norm, head.
        let total = add(add(blocks, mul(2, mul(v, d)?)?)?, d)?;
        let bytes = mul(total, 4)?;
        if bytes > isize::MAX as usize {
            return Err(too_big());
        }
        Ok(bytes as u64)
    }

    /// Parameter count.
    pub fn param_count(&self) -> usize {
        let (d, kv) = (self.d_model, self.n_kv_heads * self.head_dim());
        let block = 2 * d + d * d + 2 * d * kv + d * d + 3 * d * self.ffn_hidden;
        self.vocab * d + self.n_layers * block + d + d * self.vocab
    }

    /// Floating-point operations of one training step (forward + backward, no recompute) on
    /// `batch x seq` tokens: 6 per weight per token for the matmuls, plus attention's two
    /// products (causal blocks as computed, forward once, backward 2.5x: it rebuilds the
    /// scores and forms four products).
    pub fn step_flops(&self, batch: usize, seq: usize) -> f64 {
        let tokens = (batch * seq) as f64;
        let matmul_params =
            self.param_count() - self.vocab * self.d_model - (2 * self.n_layers + 1) * self.d_model;
        let shape = crate::core::kernels::AttentionShape {
            batch,
            seq,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim(),
        };
        6.0 * matmul_params as f64 * tokens + 3.5 * shape.forward_flops() * self.n_layers as f64
    }
}

/// How a GPT step keeps or recomputes activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checkpointing {
    /// A whole-graph policy over every op node.
    Graph(Policy),
    /// Each block is a [`Graph::segment`]: only block inputs are kept. In every block
    /// mode the last segment is not checkpointed (backward needs it first).
    PerBlock,
    /// Segments of `n` consecutive blocks.
    Blocks(usize),
    /// Segments of `ceil(sqrt(L))` blocks (Chen et al. 2016 at block granularity).
    SqrtBlocks,
}

impl Checkpointing {
    /// Blocks per segment for `n_layers` layers (`None`: no segments).
    pub fn blocks_per_segment(&self, n_layers: usize) -> Option<usize> {
        match *self {
            Checkpointing::Graph(_) => None,
            Checkpointing::PerBlock => Some(1),
            Checkpointing::Blocks(n) => Some(n.max(1)),
            Checkpointing::SqrtBlocks => Some((n_layers as f64).sqrt().ceil().max(1.0) as usize),
        }
    }

    /// Every built-in choice, store-all first (for comparisons).
    pub fn all() -> Vec<Checkpointing> {
        vec![
            Checkpointing::Graph(Policy::StoreAll),
            Checkpointing::PerBlock,
            Checkpointing::SqrtBlocks,
            Checkpointing::Graph(Policy::Sqrt),
            Checkpointing::Graph(Policy::EveryN(4)),
            Checkpointing::Graph(Policy::ByDepth(3)),
            Checkpointing::Graph(Policy::RecomputeAll),
        ]
    }
}

impl fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpointing::Graph(p) => write!(f, "{p}"),
            Checkpointing::PerBlock => f.write_str("per-block"),
            Checkpointing::Blocks(n) => write!(f, "blocks:{n}"),
            Checkpointing::SqrtBlocks => f.write_str("sqrt-blocks"),
        }
    }
}

impl FromStr for Checkpointing {
    type Err = EngineError;

    /// `per-block`, `blocks:N`, `sqrt-blocks`, or a [`Policy`] (`store-all`,
    /// `recompute-all`, `every:N`, `depth:N`, `sqrt`).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "per-block" | "block" => Ok(Checkpointing::PerBlock),
            "sqrt-blocks" => Ok(Checkpointing::SqrtBlocks),
            _ => match s.strip_prefix("blocks:") {
                Some(n) => n.parse::<usize>().ok().filter(|&n| n > 0).map(Checkpointing::Blocks).ok_or_else(|| {
                    EngineError::Invalid(format!("policy {s:?}: blocks:N needs a positive N"))
                }),
                // `every:N` / `depth:N` with a bad N: the policy's own message says so.
                None if s.starts_with("every:") || s.starts_with("depth:") => {
                    s.parse::<Policy>().map(Checkpointing::Graph)
                }
                None => s.parse::<Policy>().map(Checkpointing::Graph).map_err(|_| {
                    EngineError::Invalid(format!(
                        "unknown policy {s:?} (expected store-all, recompute-all, every:N, depth:N, sqrt, per-block, blocks:N or sqrt-blocks)"
                    ))
                }),
            },
        }
    }
}

/// One block's weights (projections `[in, out]`).
#[derive(Clone, Debug)]
pub struct BlockWeights {
    pub attn_norm: Tensor,
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub o_proj: Tensor,
    pub mlp_norm: Tensor,
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
}

/// One block's parameter nodes in a recorded graph.
#[derive(Clone, Copy, Debug)]
pub struct BlockNodes {
    pub attn_norm: NodeId,
    pub q_proj: NodeId,
    pub k_proj: NodeId,
    pub v_proj: NodeId,
    pub o_proj: NodeId,
    pub mlp_norm: NodeId,
    pub gate_proj: NodeId,
    pub up_proj: NodeId,
    pub down_proj: NodeId,
}

/// Names of a block's tensors after `model.layers.{i}.`, in [`BlockWeights`] field order.
pub const BLOCK_TENSORS: [&str; 9] = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

impl BlockWeights {
    fn tensors(&self) -> [&Tensor; 9] {
        [
            &self.attn_norm,
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.mlp_norm,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ]
    }
}

impl BlockNodes {
    pub(crate) fn from_slice(ids: &[NodeId]) -> Self {
        BlockNodes {
            attn_norm: ids[0],
            q_proj: ids[1],
            k_proj: ids[2],
            v_proj: ids[3],
            o_proj: ids[4],
            mlp_norm: ids[5],
            gate_proj: ids[6],
            up_proj: ids[7],
            down_proj: ids[8],
        }
    }
}

/// Nodes of one recorded step.
#[derive(Clone, Debug)]
pub struct GptStep {
    pub loss: NodeId,
    pub logits: NodeId,
    /// Parameter nodes in [`Gpt::params`] order.
    pub params: Vec<NodeId>,
    /// The residual stream after each block.
    pub block_outputs: Vec<NodeId>,
}

/// What one forward + backward produced.
#[derive(Debug)]
pub struct StepOutput {
    pub loss: f64,
    /// Gradients in [`Gpt::params`] order.
    pub grads: Vec<Option<Tensor>>,
    /// Pool statistics at the end of the step (peaks since the pool's last reset).
    pub pool: PoolStats,
    /// Nodes recomputed during backward.
    pub recomputed: u64,
}

/// The model's parameters.
#[derive(Clone, Debug)]
pub struct Gpt {
    pub config: GptConfig,
    pub embed: Tensor,
    pub blocks: Vec<BlockWeights>,
    pub final_norm: Tensor,
    pub lm_head: Tensor,
}

/// Uniform values with standard deviation `std` (Philox stream `stream` of `seed`).
fn init_values(n: usize, seed: u64, stream: u64, std: f64) -> impl Iterator<Item = f32> {
    let half_width = std * 3f64.sqrt();
    (0..n as u64).map(move |i| {
        let u = (philox_hash(seed, (stream << 40) | i) >> 11) as f64 / (1u64 << 53) as f64;
        ((2.0 * u - 1.0) * half_width) as f32
    })
}

impl Gpt {
    /// Weights: norms 1, the rest uniform with std 0.02, residual outputs (`o_proj`,
    /// `down_proj`) scaled by `1/sqrt(2L)` as in GPT-2; deterministic in `init_seed`.
    pub fn new(pool: &Arc<MemoryPool>, config: GptConfig) -> Result<Self> {
        config.validate()?;
        // Before building any weight: an impossible model under a budget is the pool's
        // out-of-memory error at once, not an abort allocating the first huge tensor.
        let need = config.param_bytes()?;
        let stats = pool.stats();
        if let Some(budget) = stats.budget
            && stats.live.saturating_add(need) > budget
        {
            return Err(crate::core::pool::PoolOom {
                category: Category::Parameters,
                requested: need,
                live: stats.live,
                budget,
            }
            .at("parameters (all of the model's weights)"));
        }
        let c = &config;
        let (d, kv, f) = (c.d_model, c.n_kv_heads * c.head_dim(), c.ffn_hidden);
        let mut stream = 0u64;
        let mut param = |name: &str, shape: &[usize], std: Option<f64>| -> Result<Tensor> {
            let n = shape.iter().product();
            stream += 1;
            let mut data = Vec::new();
            // Fallible: an unbudgeted model too large for this machine is an error.
            data.try_reserve_exact(n).map_err(|e| {
                EngineError::Invalid(format!(
                    "cannot allocate {} bytes for parameter {name} {shape:?}: {e}",
                    n as u128 * 4
                ))
            })?;
            match std {
                Some(s) => data.extend(init_values(n, c.init_seed, stream, s)),
                None => data.resize(n, 1.0f32),
            }
            Tensor::from_vec(pool, name, shape, data, Category::Parameters)
        };
        let resid = 0.02 / (2.0 * c.n_layers as f64).sqrt();
        let embed = param("model.embed_tokens.weight", &[c.vocab, d], Some(0.02))?;
        let mut blocks = Vec::new();
        blocks.try_reserve_exact(c.n_layers).map_err(|e| {
            EngineError::Invalid(format!(
                "cannot allocate the list of {} blocks: {e}",
                c.n_layers
            ))
        })?;
        for i in 0..c.n_layers {
            let n = |t: &str| format!("model.layers.{i}.{t}");
            blocks.push(BlockWeights {
                attn_norm: param(&n(BLOCK_TENSORS[0]), &[d], None)?,
                q_proj: param(&n(BLOCK_TENSORS[1]), &[d, d], Some(0.02))?,
                k_proj: param(&n(BLOCK_TENSORS[2]), &[d, kv], Some(0.02))?,
                v_proj: param(&n(BLOCK_TENSORS[3]), &[d, kv], Some(0.02))?,
                o_proj: param(&n(BLOCK_TENSORS[4]), &[d, d], Some(resid))?,
                mlp_norm: param(&n(BLOCK_TENSORS[5]), &[d], None)?,
                gate_proj: param(&n(BLOCK_TENSORS[6]), &[d, f], Some(0.02))?,
                up_proj: param(&n(BLOCK_TENSORS[7]), &[d, f], Some(0.02))?,
                down_proj: param(&n(BLOCK_TENSORS[8]), &[f, d], Some(resid))?,
            });
        }
        let final_norm = param("model.norm.weight", &[d], None)?;
        let lm_head = param("lm_head.weight", &[d, c.vocab], Some(0.02))?;
        Ok(Gpt {
            config,
            embed,
            blocks,
            final_norm,
            lm_head,
        })
    }

    /// `(Hugging Face name, tensor)` of every parameter: embedding, then each block in
    /// [`BLOCK_TENSORS`] order, then `model.norm.weight` and `lm_head.weight`.
    pub fn params(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), self.embed.clone())];
        for (i, b) in self.blocks.iter().enumerate() {
            for (name, t) in BLOCK_TENSORS.iter().zip(b.tensors()) {
                out.push((format!("model.layers.{i}.{name}"), t.clone()));
            }
        }
        out.push(("model.norm.weight".into(), self.final_norm.clone()));
        out.push(("lm_head.weight".into(), self.lm_head.clone()));
        out
    }

    /// Records one step on `batch` with the given checkpointing.
    pub fn record(&self, g: &mut Graph, batch: &Batch, ckpt: Checkpointing) -> Result<GptStep> {
        let c = &self.config;
        let params: Vec<NodeId> = self
            .params()
            .iter()
            .map(|(name, t)| g.param(name, t))
            .collect();
        let mut x = g.embedding(params[0], batch.tokens.clone(), &[batch.batch, batch.seq])?;
        g.set_name(x, "embed")?;
        let per_segment = ckpt.blocks_per_segment(c.n_layers);
        let blocks: Vec<BlockNodes> = (0..c.n_layers)
            .map(|i| BlockNodes::from_slice(&params[1 + 9 * i..10 + 9 * i]))
            .collect();
        let mut block_outputs = Vec::with_capacity(c.n_layers);
        let mut i = 0;
        while i < c.n_layers {
            let end = per_segment.map_or(c.n_layers, |n| (i + n).min(c.n_layers));
            let run = |g: &mut Graph, mut h: NodeId, outs: &mut Vec<NodeId>| -> Result<NodeId> {
                for (l, w) in blocks.iter().enumerate().take(end).skip(i) {
                    h = block_forward(g, c, l, h, w)?;
                    outs.push(h);
                }
                Ok(h)
            };
            // The last segment stays un-checkpointed: backward starts with it, so dropping
            // and at once rebuilding it would cost a block's forward and save nothing at
            // the peak (as `torch.utils.checkpoint.checkpoint_sequential` does).
            x = match per_segment {
                Some(_) if end < c.n_layers => g.segment(|g| run(g, x, &mut block_outputs))?,
                _ => run(g, x, &mut block_outputs)?,
            };
            i = end;
        }
        let n = params.len();
        let h = g.rmsnorm(x, params[n - 2], c.norm_eps)?;
        g.set_name(h, "final_norm")?;
        let logits = g.matmul(h, params[n - 1])?;
        g.set_name(logits, "lm_head")?;
        let loss = g.cross_entropy(logits, batch.targets.clone())?;
        g.set_name(loss, "loss")?;
        if let Checkpointing::Graph(policy) = ckpt {
            policy.apply(g)?;
        }
        Ok(GptStep {
            loss,
            logits,
            params,
            block_outputs,
        })
    }

    /// Records, runs forward and backward, and returns the loss and gradients.
    pub fn forward_backward(
        &self,
        ctx: &ExecContext,
        batch: &Batch,
        ckpt: Checkpointing,
        seed: u64,
    ) -> Result<StepOutput> {
        self.forward_backward_observed(ctx, batch, ckpt, seed, None)
    }

    /// [`Gpt::forward_backward`] reporting every node execution to `observer` (profiling).
    pub fn forward_backward_observed(
        &self,
        ctx: &ExecContext,
        batch: &Batch,
        ckpt: Checkpointing,
        seed: u64,
        observer: Option<Box<dyn GraphObserver>>,
    ) -> Result<StepOutput> {
        let mut g = Graph::new(ctx);
        g.set_seed(seed);
        g.set_observer(observer);
        let step = self.record(&mut g, batch, ckpt)?;
        g.forward()?;
        let loss = g.scalar(step.loss)?;
        g.backward(step.loss)?;
        let grads = step
            .params
            .iter()
            .map(|&p| g.take_grad(p))
            .collect::<Result<Vec<_>>>()?;
        let recomputed = g
            .node_ids()
            .map(|id| g.recompute_count(id).unwrap_or(0))
            .sum();
        drop(g);
        Ok(StepOutput {
            loss,
            grads,
            pool: ctx.pool().stats(),
            recomputed,
        })
    }
}

/// Applies block `layer` (weights `w`) to the residual stream `x [batch, seq, d_model]`.
pub fn block_forward(
    g: &mut Graph,
    c: &GptConfig,
    layer: usize,
    x: NodeId,
    w: &BlockNodes,
) -> Result<NodeId> {
    let name =
        |g: &mut Graph, id: NodeId, part: &str| g.set_name(id, format!("layers.{layer}.{part}"));
    let h = g.rmsnorm(x, w.attn_norm, c.norm_eps)?;
    name(g, h, "input_layernorm")?;
    let (q, k, v) = (
        g.matmul(h, w.q_proj)?,
        g.matmul(h, w.k_proj)?,
        g.matmul(h, w.v_proj)?,
    );
    name(g, q, "q_proj")?;
    name(g, k, "k_proj")?;
    name(g, v, "v_proj")?;
    let a = g.attention(q, k, v, c.attention())?;
    name(g, a, "self_attn")?;
    let mut o = g.matmul(a, w.o_proj)?;
    name(g, o, "o_proj")?;
    if c.dropout > 0.0 {
        o = g.dropout(o, c.dropout)?;
        name(g, o, "attn_dropout")?;
    }
    let x = g.add(x, o)?;
    name(g, x, "attn_residual")?;
    let h = g.rmsnorm(x, w.mlp_norm, c.norm_eps)?;
    name(g, h, "post_attention_layernorm")?;
    let (gate, up) = (g.matmul(h, w.gate_proj)?, g.matmul(h, w.up_proj)?);
    name(g, gate, "gate_proj")?;
    name(g, up, "up_proj")?;
    let act = g.swiglu(gate, up)?;
    name(g, act, "swiglu")?;
    let mut d = g.matmul(act, w.down_proj)?;
    name(g, d, "down_proj")?;
    if c.dropout > 0.0 {
        d = g.dropout(d, c.dropout)?;
        name(g, d, "mlp_dropout")?;
    }
    let out = g.add(x, d)?;
    name(g, out, "output")?;
    Ok(out)
}

#[cfg(test)]
mod tests;
