//! The training loop of `remat train` under a fixed policy, shared by the run
//! (`session.rs`) and the out-of-memory hint's probes (`hint.rs`).

use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use remat_engine::models::gpt::{Gpt, hf};
use remat_engine::session::task::Task;
use remat_engine::{AdamW, AdamWConfig, ExecContext, MemoryPool, PoolStats};

use super::flags::Args;

/// Loss per step and time per step of a finished run.
pub struct Trained {
    pub losses: Vec<f64>,
    pub step_times: Vec<Duration>,
    pub pool: PoolStats,
}

fn bar(steps: u64) -> ProgressBar {
    let bar = ProgressBar::new(steps);
    let style =
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  loss {msg}  [{elapsed} < {eta}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
    bar.set_style(style);
    bar
}

/// Runs the configured training on `pool`; `quiet` prints nothing (memory probes).
pub fn train(
    args: &Args,
    task: &Task,
    pool: &std::sync::Arc<MemoryPool>,
    quiet: bool,
) -> anyhow::Result<Trained> {
    let config = args.model_config(task.vocab());
    let ckpt = args.checkpointing()?;
    let ctx = ExecContext::new(pool.clone(), args.threads())?;
    let gpt = Gpt::new(pool, config)?;
    if let Some(path) = &args.files.init {
        hf::load_params(&gpt, path)?;
        if !quiet {
            println!("loaded parameters from {}", path.display());
        }
    }
    let opt_config = AdamWConfig {
        lr: args.lr.one(),
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(pool, gpt.params(), opt_config)?;
    let log_every = args.log_every.unwrap_or((args.steps / 15).max(1));
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        bar(args.steps)
    };
    let mut losses = Vec::new();
    let mut step_times = Vec::new();
    for step in 0..args.steps {
        let batch = task.batch(args.seed.one(), step, args.batch);
        let start = Instant::now();
        let out = gpt.forward_backward(&ctx, &batch, ckpt, args.seed.one() ^ (step << 32))?;
        if let Some(path) = args.files.dump_grads.as_ref().filter(|_| step == 0) {
            let record = hf::StepRecord {
                batch: &batch,
                loss: out.loss,
                config: &gpt.config,
            };
            dump_grads(&gpt, &out.grads, &record, path)?;
        }
        // On the step's own --threads pool (AdamW splits large tensors over it).
        ctx.install(|| opt.step(&out.grads))?;
        drop(out.grads);
        step_times.push(start.elapsed());
        losses.push(out.loss);
        bar.set_message(format!("{:.4}", out.loss));
        bar.inc(1);
        if !quiet && (step % log_every == 0 || step + 1 == args.steps) {
            // Through `suspend` so the line also prints when stderr is not a terminal
            // (indicatif then hides the bar and would swallow `bar.println`).
            bar.suspend(|| println!("step {step:>5}  loss {:.4}", out.loss));
        }
    }
    bar.finish_and_clear();
    Ok(Trained {
        losses,
        step_times,
        pool: pool.stats(),
    })
}

fn dump_grads(
    gpt: &Gpt,
    grads: &[Option<remat_engine::Tensor>],
    record: &hf::StepRecord<'_>,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    let named: Vec<_> = gpt
        .params()
        .into_iter()
        .zip(grads)
        .filter_map(|((name, _), g)| g.clone().map(|g| (name, g)))
        .collect();
    // The error names the path already.
    hf::save_step(path, &named, record).context("--dump-grads")?;
    println!(
        "wrote the first step's gradients ({} tensors) and its batch and loss to {}",
        named.len(),
        path.display()
    );
    Ok(())
}
