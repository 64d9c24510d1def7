//! `remat profile`: record a training step of an engine model into the planner's graph IR.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use remat_engine::graph::{Graph, NodeId};
use remat_engine::models::gpt::{Batch, Checkpointing, Gpt, GptConfig};
use remat_engine::models::mlp::{Mlp, MlpConfig};
use remat_engine::policy::Policy;
use remat_engine::profile::{ProfileOptions, StepProfile, profile_step};
use remat_engine::{Category, ExecContext, MemoryPool, Tensor};

/// Which model, and its size.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// `gpt` (the decoder of `remat train`) or `mlp` (the engine's MLP chain). The Qwen3
    /// blocks run on the spec runtime and cannot be profiled.
    #[arg(long, default_value = "gpt")]
    pub model: String,
    /// GPT: blocks; MLP: hidden layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// GPT: model width; MLP: hidden width.
    #[arg(long, default_value_t = 128)]
    pub d_model: usize,
    /// GPT: attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// GPT: tokens per sequence.
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    /// Sequences (GPT) or rows (MLP) per batch.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// GPT: vocabulary size.
    #[arg(long, default_value_t = 256)]
    pub vocab: usize,
    /// GPT: residual dropout probability.
    #[arg(long, default_value_t = 0.0)]
    pub dropout: f32,
    /// Kernel threads (results are bit-exact for a given count).
    #[arg(long, default_value_t = 2)]
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

impl ModelArgs {
    pub fn label(&self) -> String {
        match self.model.as_str() {
            "mlp" => format!("mlp-l{}-d{}-b{}", self.layers, self.d_model, self.batch),
            _ => format!(
                "gpt-l{}-d{}-h{}-s{}-b{}",
                self.layers, self.d_model, self.heads, self.seq, self.batch
            ),
        }
    }

    pub fn gpt_config(&self) -> anyhow::Result<GptConfig> {
        let ffn_hidden = self.d_model.checked_mul(4).ok_or_else(|| {
            anyhow::anyhow!(
                "--d-model {}: the MLP's hidden width (4 x d_model) overflows",
                self.d_model
            )
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
    pub fn build(&self, pool: &Arc<MemoryPool>) -> anyhow::Result<BuiltModel> {
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
                let data = |seed: u64| -> anyhow::Result<Tensor> {
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
            "qwen3" | "qwen3-moe" => anyhow::bail!(
                "--model {}: the Qwen3 blocks run on the spec runtime (`remat train --block {}`), \
                 not on the engine graph that profiling records, so they cannot be profiled or \
                 planned here; their recompute plans come from their declarative specs \
                 (`remat spec`). Profile `gpt` or `mlp`",
                self.model,
                self.model
            ),
            other => anyhow::bail!("--model {other:?}: expected `gpt` or `mlp`"),
        }
    }
}

impl BuiltModel {
    /// Records one training step (store-all retention: a plan decides the rest).
    pub fn record(&self, ctx: &ExecContext, seed: u64) -> anyhow::Result<ModelStep> {
        self.record_with(ctx, seed, None)
    }

    /// Records one step with one of the engine's own checkpointing policies (GPT) or
    /// graph policies (MLP).
    pub fn record_with(
        &self,
        ctx: &ExecContext,
        seed: u64,
        ckpt: Option<Checkpointing>,
    ) -> anyhow::Result<ModelStep> {
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
pub fn synthetic_batch(batch: usize, seq: usize, vocab: usize) -> anyhow::Result<Batch> {
    let too_big = || {
        anyhow::anyhow!("--batch {batch} x --seq {seq} tokens cannot be allocated on this machine")
    };
    let n = batch.checked_mul(seq).ok_or_else(too_big)?;
    let tok = |i: usize, s: usize| (i.wrapping_mul(7919).wrapping_add(s) % vocab.max(1)) as u32;
    let column = |shift: usize| -> anyhow::Result<Vec<u32>> {
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

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Timed runs per op (after a warm-up); the median is kept.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Where to write the graph (remat's JSON schema, read by `remat plan`).
    #[arg(long)]
    pub out: PathBuf,
}

/// Builds the model and profiles one step of it.
pub fn profile_model(
    model: &ModelArgs,
    runs: usize,
) -> anyhow::Result<(
    Arc<MemoryPool>,
    ExecContext,
    BuiltModel,
    ModelStep,
    StepProfile,
)> {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(Arc::clone(&pool), model.threads)?;
    let built = model.build(&pool)?;
    let label = model.label();
    let mut step = built.record(&ctx, 0)?;
    let opts = ProfileOptions { runs, name: label };
    let profile = profile_step(&mut step.graph, step.loss, &opts)
        .with_context(|| format!("profiling {}", model.label()))?;
    Ok((pool, ctx, built, step, profile))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // Before profiling: a directory or device at --out would only fail at the end.
    crate::fsutil::check_target("--out", &args.out)?;
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(format!(
        "profiling {} ({} runs)",
        args.model.label(),
        args.runs + 1
    ));
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let (_, _, _, _, profile) = profile_model(&args.model, args.runs)?;
    spinner.finish_and_clear();
    let g = &profile.graph;
    crate::fsutil::write_atomically(
        "--out",
        &args.out,
        remat_planner::import::remat_json::to_json(g).as_bytes(),
    )?;
    let fwd = g
        .nodes()
        .iter()
        .filter(|n| n.phase == remat_planner::Phase::Forward)
        .count();
    println!(
        "{}: {} nodes ({} forward, {} backward) -> {}",
        g.name(),
        g.len(),
        fwd,
        g.len() - fwd,
        args.out.display()
    );
    println!("static memory     {:>12} bytes", g.static_bytes());
    println!(
        "store-all peak    {:>12} bytes (activations {} bytes)",
        g.store_all_peak(),
        g.store_all_peak() - g.static_bytes()
    );
    println!("memory floor      {:>12} bytes", g.memory_floor());
    println!(
        "step time         {:>12.2} ms (sum of op medians {:.2} ms; op times scaled by {:.2} to match the step)",
        profile.measured_step_time * 1e3,
        g.base_time() / profile.time_scale * 1e3,
        profile.time_scale
    );
    Ok(())
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

    #[test]
    fn a_width_whose_mlp_overflows_is_an_error() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            model: ModelArgs,
        }
        let cli = <Cli as clap::Parser>::try_parse_from(["x", "--d-model", "4611686018427387904"]);
        let err = cli.unwrap().model.gpt_config().unwrap_err().to_string();
        assert!(
            err.contains("--d-model") && err.contains("overflows"),
            "{err}"
        );
    }
}
