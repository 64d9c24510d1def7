//! `remat train --block qwen3|qwen3-moe [--spec FILE] [--mode full|lora]`: trains a
//! Qwen3-style model whose blocks run through a compiled recompute spec, on the same task as
//! `remat train` (the embedded reversal task or `--data`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use remat_engine::models::qwen3::{BlockKind, Qwen3, Qwen3Grads};
use remat_engine::spec::run::lora::LoraConfig;
use remat_engine::spec::run::meter::Meter;
use remat_engine::spec::{Mode, Value, compile};
use remat_engine::swap::HostStore;

use super::spec::{human_bytes, load_spec_and_config, print_table};
use super::train::task::Task;

/// Flags of spec-driven training (flattened into `remat train`).
#[derive(clap::Args, Debug, Clone)]
pub struct SpecArgs {
    /// Train a spec-driven block instead of the GPT: qwen3 or qwen3-moe.
    #[arg(long)]
    pub block: Option<String>,
    /// Recompute spec (default: the shipped spec of --block).
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// Model config for --block (default: the shipped example config; vocab_size, batch and
    /// seq_len come from the task).
    #[arg(long)]
    pub block_config: Option<PathBuf>,
    /// Override a --block config value: KEY=VALUE (repeatable).
    #[arg(long = "block-set", value_name = "KEY=VALUE")]
    pub block_set: Vec<String>,
    /// full (every weight) or lora (adapters on q, k, v, o, gate, up, down).
    #[arg(long, default_value = "full")]
    pub mode: Mode,
    /// LoRA rank, alpha and dropout.
    #[arg(long, default_value_t = 8)]
    pub lora_rank: usize,
    #[arg(long, default_value_t = 16.0)]
    pub lora_alpha: f32,
    #[arg(long, default_value_t = 0.05)]
    pub lora_dropout: f64,
}

/// AdamW over named f32 buffers (moments created on first use).
struct AdamW {
    lr: f32,
    step: i32,
    moments: BTreeMap<String, (Vec<f32>, Vec<f32>)>,
}

impl AdamW {
    const BETA1: f32 = 0.9;
    const BETA2: f32 = 0.999;
    const EPS: f32 = 1e-8;
    const WEIGHT_DECAY: f32 = 0.01;

    fn update(&mut self, name: &str, param: &mut [f32], grad: &[f32]) {
        let (m, v) = self
            .moments
            .entry(name.to_string())
            .or_insert_with(|| (vec![0.0; param.len()], vec![0.0; param.len()]));
        let (c1, c2) = (
            1.0 - Self::BETA1.powi(self.step),
            1.0 - Self::BETA2.powi(self.step),
        );
        for i in 0..param.len() {
            m[i] = Self::BETA1 * m[i] + (1.0 - Self::BETA1) * grad[i];
            v[i] = Self::BETA2 * v[i] + (1.0 - Self::BETA2) * grad[i] * grad[i];
            let update = (m[i] / c1) / ((v[i] / c2).sqrt() + Self::EPS);
            param[i] -= self.lr * (update + Self::WEIGHT_DECAY * param[i]);
        }
    }
}

fn apply(opt: &mut AdamW, model: &mut Qwen3, grads: &Qwen3Grads, mode: Mode) {
    opt.step += 1;
    match mode {
        Mode::Full => {
            opt.update("embed", &mut model.embed.data, &grads.embed);
            opt.update("final_norm", &mut model.final_norm.data, &grads.final_norm);
            opt.update("lm_head", &mut model.lm_head.data, &grads.lm_head);
            for (l, (params, g)) in model.layers.iter_mut().zip(&grads.layers).enumerate() {
                for (name, grad) in g {
                    if let Some(p) = params.get_mut(name) {
                        opt.update(&format!("{l}.{name}"), &mut p.data, grad);
                    }
                }
            }
        }
        Mode::Lora => {
            let Some((_, adapters)) = model.lora.as_mut() else {
                return;
            };
            for (l, (layer, g)) in adapters.iter_mut().zip(&grads.adapters).enumerate() {
                for (target, grad) in g {
                    if let Some(a) = layer.get_mut(target) {
                        opt.update(&format!("{l}.{target}.A"), &mut a.a.data, &grad.a);
                        opt.update(&format!("{l}.{target}.B"), &mut a.b.data, &grad.b);
                    }
                }
            }
        }
    }
}

fn block_kind(name: &str) -> anyhow::Result<BlockKind> {
    match name {
        "qwen3" => Ok(BlockKind::Dense),
        "qwen3-moe" => Ok(BlockKind::Moe),
        other => anyhow::bail!("unknown --block `{other}` (expected qwen3 or qwen3-moe)"),
    }
}

/// Runs spec-driven training with `remat train`'s common flags.
pub fn run(args: &super::train::Args, task: &Task) -> anyhow::Result<()> {
    let block = args.spec_args.block.as_deref().unwrap_or("qwen3");
    let kind = block_kind(block)?;
    let ctx = remat_engine::ExecContext::new(
        remat_engine::pool::MemoryPool::unbounded(),
        args.threads(),
    )?;
    ctx.install(|| train(args, task, block, kind))
}

fn train(
    args: &super::train::Args,
    task: &Task,
    block: &str,
    kind: BlockKind,
) -> anyhow::Result<()> {
    let sa = &args.spec_args;
    let spec_source = sa
        .spec
        .as_ref()
        .map_or(block.to_string(), |p| p.display().to_string());
    let (shipped_spec, mut config) =
        load_spec_and_config(block, sa.block_config.as_deref(), &sa.block_set)?;
    let spec = match &sa.spec {
        Some(path) => remat_engine::spec::BlockSpec::load(path)?,
        None => shipped_spec,
    };
    config = config
        .set("vocab_size", Value::Int(task.vocab() as i64))
        .set("batch", Value::Int(args.batch as i64))
        .set("seq_len", Value::Int(task.seq() as i64));
    let plan =
        compile(&spec, &config, sa.mode).with_context(|| format!("compiling {spec_source}"))?;
    let mut model = Qwen3::new(kind, &plan.config, args.seed)?;
    if sa.mode == Mode::Lora {
        let lora = LoraConfig {
            rank: sa.lora_rank,
            alpha: sa.lora_alpha,
            dropout: sa.lora_dropout,
            targets: ["q", "k", "v", "o", "gate", "up", "down"]
                .map(String::from)
                .to_vec(),
            seed: args.seed ^ 0x10ba,
        };
        model = model.with_lora(lora, false)?;
    }
    println!(
        "{} block, spec {spec_source}, {} mode: {} layers, hidden {}, {} trainable parameters; {}",
        block,
        sa.mode.name(),
        model.dims.layers,
        model.dims.hidden,
        model.trainable(sa.mode),
        task.describe()
    );
    let host = HostStore::in_memory();
    let meter = Meter::new();
    let mut opt = AdamW {
        lr: args.lr as f32,
        step: 0,
        moments: BTreeMap::new(),
    };
    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let log_every = args.log_every.unwrap_or((args.steps / 15).max(1));
    let start = Instant::now();
    let (mut first, mut last, mut peak, mut host_peak) = (None, 0.0f32, 0u64, 0u64);
    for step in 0..args.steps {
        let batch = task.batch(args.seed, step, args.batch);
        let (grads, stats) = model.step(&plan, &batch.tokens, &batch.targets, &host, &meter)?;
        apply(&mut opt, &mut model, &grads, sa.mode);
        first.get_or_insert(stats.loss);
        last = stats.loss;
        peak = peak.max(stats.activations.peak);
        host_peak = host_peak.max(stats.host_peak);
        bar.set_message(format!("loss {:.4}", stats.loss));
        bar.inc(1);
        if step % log_every == 0 || step + 1 == args.steps {
            bar.println(format!("step {step:>5}  loss {:.4}", stats.loss));
        }
    }
    bar.finish_and_clear();
    let elapsed = start.elapsed().as_secs_f64();
    let tokens = (args.steps as usize * args.batch * task.seq()) as f64;
    print_table(
        &[
            "first loss",
            "last loss",
            "peak block activations",
            "host store peak",
            "plan: saved + shared",
            "step time",
            "tokens/s",
        ],
        &[vec![
            format!("{:.4}", first.unwrap_or(0.0)),
            format!("{last:.4}"),
            human_bytes(peak),
            human_bytes(host_peak),
            human_bytes(plan.device_bytes()),
            format!("{:.1} ms", 1e3 * elapsed / args.steps.max(1) as f64),
            format!("{:.0}", tokens / elapsed),
        ]],
    );
    Ok(())
}
