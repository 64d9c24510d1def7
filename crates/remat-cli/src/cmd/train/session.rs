//! `remat train` under a fixed policy: the run (the loop is `fixed.rs`), its summary, and
//! the hint when it runs out of its memory budget.

use std::time::Duration;

use anyhow::Context;
use remat_engine::models::gpt::hf;
use remat_engine::session::task::Task;
use remat_engine::{Category, EngineError, MemoryPool};
use remat_report::{Layout, render};
use remat_units::human_bytes;

use super::fixed::{Trained, train};
use super::flags::Args;
use super::hint;

pub fn run(args: &Args, task: &Task) -> anyhow::Result<()> {
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
    print!("{}", render(Layout::Aligned, &["memory", "peak"], &rows));
}
