//! An engine model built from a few numbers, with a deterministic batch: what `remat
//! profile` records into the planner's graph IR and what the auto benchmark plans.
//! Errors name the `remat profile` flags that set what is wrong.

use std::sync::Arc;

use super::error::{During, Result, SessionError};
use crate::core::graph::{Graph, NodeId};
use crate::core::policy::Policy;
use crate::models::gpt::{Batch, Checkpointing, Gpt, GptConfig};
use crate::models::mlp::{Mlp, MlpConfig};
use crate::plan_exec::profile::{ProfileOptions, StepProfile, profile_step};
use crate::{Category, ExecContext, MemoryPool, Tensor};

/// Which model, and its size.
#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// `gpt` (the decoder of `remat train`) or `mlp` (the engine's MLP chain).
    pub model: String,
    /// GPT: blocks; MLP: hidden layers.
    pub layers: usize,
    /// GPT: model width; MLP: hidden width.
    pub d_model: usize,
    /// GPT: attention heads.
    pub heads: usize,
    /// GPT: tokens per sequence.
    pub seq: usize,
    /// Sequences (GPT) or rows (MLP) per batch.
    pub batch: usize,
    /// GPT: vocabulary size.
    pub vocab: usize,
    /// GPT: residual dropout probability.
    pub dropout: f32,
    /// Kernel threads (results are bit-exact for a given count).
    pub threads: usize,
}

/// One recorded training step of a model, ready to profile or run.
pub struct ModelStep {
    pub graph: Graph,
    pub loss: NodeId,
}

/// A model built in a pool; `record` makes a fresh graph of one step.
pub enum BuiltModel {
    Gpt {
        model: Gpt,
        batch: Batch,
    },
    Mlp {
        model: Mlp,
        x: Tensor,
        target: Tensor,
    },
}

impl ModelOptions {
    pub fn label(&self) -> String {
        match self.model.as_str() {
            "mlp" => format!("mlp-l{}-d{}-b{}", self.layers, self.d_model, self.batch),
            _ => format!(
                "gpt-l{}-d{}-h{}-s{}-b{}",
                self.layers, self.d_model, self.heads, self.seq, self.batch
            ),
        }
    }

    pub fn gpt_config(&self) -> Result<GptConfig> {
        let ffn_hidden = self.d_model.checked_mul(4).ok_or_else(|| {
            SessionError::invalid(format!(
                "--d-model {}: the MLP's hidden width (4 x d_model) overflows",
                self.d_model
            ))
        })?;
        Ok(GptConfig {
            vocab: self.vocab,
            d_model: self.d_model,
            n_layers: self.layers,
            n_heads: self.heads,
            n_kv_heads: self.heads,
            ffn_hidden,
            dropout: self.dropout,
            ..GptConfig::bench()
        })
    }

    /// Builds the model's parameters and a deterministic batch in `pool`.
    pub fn build(&self, pool: &Arc<MemoryPool>) -> Result<BuiltModel> {
        match self.model.as_str() {
            "gpt" => {
                let model = Gpt::new(pool, self.gpt_config()?)?;
                Ok(BuiltModel::Gpt {
                    batch: synthetic_batch(self.batch, self.seq, self.vocab)?,
                    model,
                })
            }
            "mlp" => {
                let dims = vec![self.d_model; self.layers + 1];
                let model = Mlp::new(
                    pool,
                    MlpConfig {
                        dims,
                        dropout: 0.0,
                        seed: 0,
                    },
                )?;
                let data = |seed: u64| -> Result<Tensor> {
                    let n = self.batch * self.d_model;
                    let v: Vec<f32> = (0..n as u64)
                        .map(|i| ((i * 2654435761 + seed) % 1000) as f32 / 500.0 - 1.0)
                        .collect();
                    Ok(Tensor::from_vec(
                        pool,
                        "x",
                        &[self.batch, self.d_model],
                        v,
                        Category::Activations,
                    )?)
                };
                Ok(BuiltModel::Mlp {
                    model,
                    x: data(1)?,
                    target: data(2)?,
                })
            }
            "qwen3" | "qwen3-moe" => Err(SessionError::invalid(format!(
                "--model {}: the Qwen3 blocks run on the spec runtime (`remat train --block {}`), \
                 not on the engine graph that profiling records, so they cannot be profiled or \
                 planned here; their recompute plans come from their declarative specs \
                 (`remat spec`). Profile `gpt` or `mlp`",
                self.model, self.model
            ))),
            other => Err(SessionError::invalid(format!(
                "--model {other:?}: expected `gpt` or `mlp`"
            ))),
        }
    }
}

impl BuiltModel {
    /// Records one training step (store-all retention: a plan decides the rest).
    pub fn record(&self, ctx: &ExecContext, seed: u64) -> Result<ModelStep> {
        self.record_with(ctx, seed, None)
    }

    /// Records one step with one of the engine's own checkpointing policies (GPT) or
    /// graph policies (MLP).
    pub fn record_with(
        &self,
        ctx: &ExecContext,
        seed: u64,
        ckpt: Option<Checkpointing>,
    ) -> Result<ModelStep> {
        let mut graph = Graph::new(ctx);
        graph.set_seed(seed);
        let loss = match self {
            BuiltModel::Gpt { model, batch } => {
                let step = model.record(
                    &mut graph,
                    batch,
                    ckpt.unwrap_or(Checkpointing::Graph(Policy::StoreAll)),
                )?;
                step.loss
            }
            BuiltModel::Mlp { model, x, target } => {
                let xn = graph.input("x", x.clone());
                let tn = graph.input("target", target.clone());
                let nodes = model.build(&mut graph, xn, tn)?;
                if let Some(Checkpointing::Graph(policy)) = ckpt {
                    policy.apply(&mut graph)?;
                }
                nodes.loss
            }
        };
        Ok(ModelStep { graph, loss })
    }
}

/// Tokens of a fixed pattern: costs and memory of a step do not depend on the values.
/// A batch whose token count overflows, or that this machine cannot allocate, is an error
/// naming the flags, not an abort.
pub fn synthetic_batch(batch: usize, seq: usize, vocab: usize) -> Result<Batch> {
    let too_big = || {
        SessionError::invalid(format!(
            "--batch {batch} x --seq {seq} tokens cannot be allocated on this machine"
        ))
    };
    let n = batch.checked_mul(seq).ok_or_else(too_big)?;
    let tok = |i: usize, s: usize| (i.wrapping_mul(7919).wrapping_add(s) % vocab.max(1)) as u32;
    let column = |shift: usize| -> Result<Vec<u32>> {
        let mut v = Vec::new();
        v.try_reserve_exact(n).map_err(|_| too_big())?;
        v.extend((0..n).map(|i| tok(i + shift, 3)));
        Ok(v)
    };
    Ok(Batch {
        tokens: column(0)?.into(),
        targets: column(1)?.into(),
        batch,
        seq,
    })
}

/// A model built and one step of it profiled: the pool, the context (its threads), the
/// model, the recorded step and its profile.
pub type Profiled = (
    Arc<MemoryPool>,
    ExecContext,
    BuiltModel,
    ModelStep,
    StepProfile,
);

/// Builds the model and profiles one step of it.
pub fn profile_model(model: &ModelOptions, runs: usize) -> Result<Profiled> {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(Arc::clone(&pool), model.threads)?;
    let built = model.build(&pool)?;
    let label = model.label();
    let mut step = built.record(&ctx, 0)?;
    let opts = ProfileOptions { runs, name: label };
    let profile = profile_step(&mut step.graph, step.loss, &opts)
        .during_with(|| format!("profiling {}", model.label()))?;
    Ok((pool, ctx, built, step, profile))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_too_large_to_hold_are_errors_naming_the_flags() {
        let err = synthetic_batch(usize::MAX, 2, 256).unwrap_err().to_string();
        assert!(err.contains("--batch") && err.contains("--seq"), "{err}");
        let err = synthetic_batch(1 << 40, 1 << 20, 256)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot be allocated"), "{err}");
        let ok = synthetic_batch(2, 3, 5).unwrap();
        assert_eq!(ok.tokens.len(), 6);
        assert!(ok.tokens.iter().all(|&t| t < 5));
    }
}
