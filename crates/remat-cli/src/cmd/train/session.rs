//! The training loop of `remat train` and its summary.

use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use remat_engine::models::gpt::{Gpt, hf};
use remat_engine::{AdamW, AdamWConfig, Category, EngineError, ExecContext, MemoryPool, PoolStats};

use super::task::Task;
use super::{Args, hint};
use remat_units::human_bytes;

/// Loss per step and time per step of a finished run.
pub struct Trained {
    pub losses: Vec<f64>,
    pub step_times: Vec<Duration>,
    pub pool: PoolStats,
}

pub fn run(args: &Args, task: &Task) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.steps > 0,
        "--steps must be at least 1 (got 0): there is nothing to train or time"
    );
    if let Some(path) = &args.files.dump_grads {
        // Before training: a directory or device there would only fail after the step.
        hf::check_target(path).context("--dump-grads")?;
    }
    let config = args.model_config(task.vocab());
    let ckpt = args.checkpointing()?;
    let budget = args.budget()?;
    println!(
        "remat train: {} | GPT L={} d={} heads={}/{} ffn={} vocab={} ({} parameters) | batch {} x seq {} | policy {ckpt} | {} threads{}",
        task.describe(),
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.n_kv_heads,
        config.ffn_hidden,
        config.vocab,
        config.param_count(),
        args.batch,
        task.seq(),
        args.threads(),
        budget.map_or(String::new(), |b| format!(" | budget {}", human_bytes(b))),
    );
    let pool = match budget {
        Some(b) => MemoryPool::with_budget(b),
        None => MemoryPool::unbounded(),
    };
    match train(args, task, &pool, false) {
        Ok(t) => {
            print_summary(args, task, &t);
            Ok(())
        }
        Err(err) => match err.downcast_ref::<EngineError>() {
            Some(oom @ EngineError::OutOfMemory { .. }) => {
                // The out-of-memory error is the answer; a failed measurement only
                // weakens the hint.
                let hint = hint::for_budget(args, task, budget.unwrap_or(u64::MAX))
                    .unwrap_or_else(|e| format!("could not measure the policies: {e:#}"));
                anyhow::bail!("{oom}\nhint: {hint}")
            }
            _ => Err(err),
        },
    }
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

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

fn print_summary(args: &Args, task: &Task, t: &Trained) {
    let n = t.losses.len();
    let window = (n / 10).clamp(1, 20);
    if n > 0 {
        println!(
            "loss: first {window} steps {:.4}, last {window} steps {:.4}",
            mean(&t.losses[..window.min(n)]),
            mean(&t.losses[n - window.min(n)..])
        );
    }
    // The first step pays one-off costs (page faults, thread start-up): time the rest.
    let timed = if t.step_times.len() > 1 {
        &t.step_times[1..]
    } else {
        &t.step_times[..]
    };
    if !timed.is_empty() {
        let step = timed.iter().sum::<Duration>().as_secs_f64() / timed.len() as f64;
        let tokens = (args.batch * task.seq()) as f64;
        println!(
            "step time {:.2} ms, {:.0} tokens/s",
            step * 1e3,
            tokens / step.max(1e-12)
        );
    }
    let rows: Vec<Vec<String>> = Category::ALL
        .iter()
        .map(|&c| vec![c.to_string(), human_bytes(t.pool.category(c).peak)])
        .chain([vec![
            "total (peak of the sum)".into(),
            human_bytes(t.pool.peak),
        ]])
        .collect();
    print!("{}", super::table::render(&["memory", "peak"], &rows));
}
