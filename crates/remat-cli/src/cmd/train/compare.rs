//! `remat train --compare`: the same few steps under every policy, from the same
//! initialization and batches, in one table: peak activation memory, peak total, step time,
//! and whether every step's gradients equal store-all's bit for bit.
//!
//! Each policy first runs one untimed warm-up step (page faults, thread start-up, gemm's
//! packing buffers: costs the first policy would otherwise pay alone), then the timed steps;
//! the median is reported. When those take under [`MIN_TIMED_S`] in all, the last step is
//! repeated (without the optimizer) until they do, so that a millisecond step's time is a
//! median of many. With `--memory-budget` every policy runs under that budget and a
//! policy that exceeds it is reported as such (gradients are then checked against an
//! unbounded store-all run when store-all itself does not fit).

use std::time::Instant;

use indicatif::ProgressBar;
use remat_engine::models::gpt::{Checkpointing, Gpt};
use remat_engine::session::task::Task;
use remat_engine::{
    AdamW, AdamWConfig, Category, EngineError, ExecContext, MemoryPool, Policy, Tensor,
};
use remat_report::{Layout, render};
use remat_units::human_bytes;

use super::flags::Args;

/// Seconds of timed steps each policy runs at least (more steps when they are short).
const MIN_TIMED_S: f64 = 0.4;
/// At most this many timed steps per policy, however short.
const MAX_TIMED_STEPS: usize = 200;

struct Row {
    peak_activations: u64,
    peak_total: u64,
    step_ms: f64,
    recomputed: u64,
    grads: Vec<Vec<Vec<u32>>>,
    losses: Vec<f64>,
}

/// A policy's run: measured, or stopped by the memory budget (with the error's text).
type Outcome = Result<Row, String>;

fn grad_bits(grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Vec<u32>>> {
    grads
        .iter()
        .map(|g| {
            g.as_ref().map_or(Ok(Vec::new()), |t| {
                t.to_vec::<f32>()
                    .map(|v| v.iter().map(|x| x.to_bits()).collect())
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(Into::into)
}

/// The median of `xs` (the mean of the middle two for an even count).
fn run_policy(
    args: &Args,
    task: &Task,
    ckpt: Checkpointing,
    budget: Option<u64>,
) -> anyhow::Result<Outcome> {
    match measure_policy(args, task, ckpt, budget) {
        Ok(row) => Ok(Ok(row)),
        Err(err) => match err.downcast_ref::<EngineError>() {
            Some(oom @ EngineError::OutOfMemory { .. }) => Ok(Err(oom.to_string())),
            _ => Err(err),
        },
    }
}

fn measure_policy(
    args: &Args,
    task: &Task,
    ckpt: Checkpointing,
    budget: Option<u64>,
) -> anyhow::Result<Row> {
    let pool = match budget {
        Some(b) => MemoryPool::with_budget(b),
        None => MemoryPool::unbounded(),
    };
    let ctx = ExecContext::new(pool.clone(), args.threads())?;
    let gpt = Gpt::new(&pool, args.model_config(task.vocab()))?;
    if let Some(path) = &args.files.init {
        remat_engine::models::gpt::hf::load_params(&gpt, path)?;
    }
    let opt_config = AdamWConfig {
        lr: args.lr.one(),
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(&pool, gpt.params(), opt_config)?;
    // Untimed warm-up on the first batch; its gradients are dropped, no optimizer step.
    let warm_up = task.batch(args.seed.one(), 0, args.batch);
    drop(gpt.forward_backward(&ctx, &warm_up, ckpt, args.seed.one())?);
    let (mut grads, mut losses, mut times, mut recomputed) =
        (Vec::new(), Vec::new(), Vec::new(), 0);
    for step in 0..args.compare_steps {
        let batch = task.batch(args.seed.one(), step, args.batch);
        let start = Instant::now();
        let out = gpt.forward_backward(&ctx, &batch, ckpt, args.seed.one() ^ (step << 32))?;
        times.push(start.elapsed().as_secs_f64());
        recomputed += out.recomputed;
        grads.push(grad_bits(&out.grads)?);
        losses.push(out.loss);
        // On the step's own threads: the global rayon pool would start more threads that
        // compete with the next timed step.
        ctx.install(|| opt.step(&out.grads))?;
    }
    // Short steps: a median of a few is mostly scheduling jitter, so the last batch's step
    // is timed again (gradients dropped, no optimizer step, the same peak) until
    // MIN_TIMED_S of steps are measured.
    let last = task.batch(
        args.seed.one(),
        args.compare_steps.saturating_sub(1),
        args.batch,
    );
    while times.iter().sum::<f64>() < MIN_TIMED_S && times.len() < MAX_TIMED_STEPS {
        let start = Instant::now();
        drop(gpt.forward_backward(&ctx, &last, ckpt, args.seed.one())?);
        times.push(start.elapsed().as_secs_f64());
    }
    let stats = pool.stats();
    Ok(Row {
        peak_activations: stats.category(Category::Activations).peak,
        peak_total: stats.peak,
        step_ms: remat_units::median(&times).unwrap_or(0.0) * 1e3,
        recomputed,
        grads,
        losses,
    })
}

fn identical(a: &Row, b: &Row) -> bool {
    a.grads == b.grads
        && a.losses.len() == b.losses.len()
        && a.losses
            .iter()
            .zip(&b.losses)
            .all(|(x, y)| x.to_bits() == y.to_bits())
}

fn cells(ckpt: Checkpointing, outcome: &Outcome, base: &Row) -> Vec<String> {
    let Ok(r) = outcome else {
        let mut row = vec![ckpt.to_string(), "over budget".to_string()];
        row.extend(std::iter::repeat_n("-".to_string(), 6));
        return row;
    };
    vec![
        ckpt.to_string(),
        human_bytes(r.peak_activations),
        format!(
            "{:.2}",
            r.peak_activations as f64 / base.peak_activations.max(1) as f64
        ),
        human_bytes(r.peak_total),
        format!("{:.2}", r.step_ms),
        format!("{:.2}", r.step_ms / base.step_ms.max(1e-9)),
        r.recomputed.to_string(),
        if identical(r, base) { "yes" } else { "NO" }.to_string(),
    ]
}

pub fn run(args: &Args, task: &Task) -> anyhow::Result<()> {
    let budget = args.budget()?;
    let store_all = Checkpointing::Graph(Policy::StoreAll);
    let mut policies = Checkpointing::all();
    let wanted = args.checkpointing()?;
    if !policies.contains(&wanted) {
        policies.push(wanted);
    }
    let config = args.model_config(task.vocab());
    println!(
        "remat train --compare: {} | GPT L={} d={} heads={}/{} | batch {} x seq {} | 1 warm-up + {} timed steps per policy, repeated up to {MIN_TIMED_S} s (median) | {} threads{}",
        task.describe(),
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.n_kv_heads,
        args.batch,
        task.seq(),
        args.compare_steps,
        args.threads(),
        budget.map_or(String::new(), |b| format!(" | budget {}", human_bytes(b))),
    );
    let bar = ProgressBar::new(policies.len() as u64);
    let mut outcomes = Vec::new();
    for &ckpt in &policies {
        bar.set_message(ckpt.to_string());
        outcomes.push(run_policy(args, task, ckpt, budget)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    // Store-all is first in `Checkpointing::all()`.
    let reference = match outcomes.first() {
        Some(Ok(_)) => None,
        _ => Some(measure_policy(args, task, store_all, None)?),
    };
    let base = match (&reference, outcomes.first()) {
        (Some(r), _) | (None, Some(Ok(r))) => r,
        (None, _) => anyhow::bail!("no store-all run to compare with"),
    };
    let rows: Vec<Vec<String>> = policies
        .iter()
        .zip(&outcomes)
        .map(|(&ckpt, outcome)| cells(ckpt, outcome, base))
        .collect();
    let header = [
        "policy",
        "peak activations",
        "x store-all",
        "peak total",
        "step ms",
        "x store-all",
        "recomputes",
        "grads bit-identical",
    ];
    print!("{}", render(Layout::Aligned, &header, &rows));
    if let Some(b) = budget {
        let over: Vec<String> = policies
            .iter()
            .zip(&outcomes)
            .filter(|(_, o)| o.is_err())
            .map(|(c, _)| c.to_string())
            .collect();
        if !over.is_empty() {
            println!(
                "over --memory-budget {}: {}",
                human_bytes(b),
                over.join(", ")
            );
        }
        if reference.is_some() {
            println!(
                "store-all does not fit the budget: ratios and gradients are against a store-all run without one"
            );
        }
    }
    if outcomes.iter().flatten().any(|r| !identical(r, base)) {
        anyhow::bail!("some policy's gradients differ from store-all's");
    }
    Ok(())
}
