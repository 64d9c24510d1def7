//! `remat train --compare`: the same few steps under every policy, from the same
//! initialization and batches, in one table: peak activation memory, peak total, step time,
//! and whether every step's gradients equal store-all's bit for bit.

use std::time::Instant;

use indicatif::ProgressBar;
use remat_engine::models::gpt::{Checkpointing, Gpt};
use remat_engine::{AdamW, AdamWConfig, Category, ExecContext, MemoryPool};

use super::Args;
use super::budget::format_bytes;
use super::table;
use super::task::Task;

struct Row {
    ckpt: Checkpointing,
    peak_activations: u64,
    peak_total: u64,
    step_ms: f64,
    recomputed: u64,
    grads: Vec<Vec<Vec<u32>>>,
    losses: Vec<f64>,
}

fn run_policy(args: &Args, task: &Task, ckpt: Checkpointing) -> anyhow::Result<Row> {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), args.threads())?;
    let gpt = Gpt::new(&pool, args.model_config(task.vocab()))?;
    if let Some(path) = &args.files.init {
        remat_engine::models::gpt::hf::load_params(&gpt, path)?;
    }
    let opt_config = AdamWConfig {
        lr: args.lr,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(&pool, gpt.params(), opt_config)?;
    let (mut grads, mut losses, mut times, mut recomputed) =
        (Vec::new(), Vec::new(), Vec::new(), 0);
    for step in 0..args.compare_steps {
        let batch = task.batch(args.seed, step, args.batch);
        let start = Instant::now();
        let out = gpt.forward_backward(&ctx, &batch, ckpt, args.seed ^ (step << 32))?;
        times.push(start.elapsed().as_secs_f64());
        recomputed += out.recomputed;
        let bits = out
            .grads
            .iter()
            .map(|g| {
                g.as_ref().map_or(Ok(Vec::new()), |t| {
                    t.to_vec::<f32>()
                        .map(|v| v.iter().map(|x| x.to_bits()).collect())
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        grads.push(bits);
        losses.push(out.loss);
        opt.step(&out.grads)?;
    }
    times.sort_by(f64::total_cmp);
    let stats = pool.stats();
    Ok(Row {
        ckpt,
        peak_activations: stats.category(Category::Activations).peak,
        peak_total: stats.peak,
        step_ms: times.get(times.len() / 2).copied().unwrap_or(0.0) * 1e3,
        recomputed,
        grads,
        losses,
    })
}

pub fn run(args: &Args, task: &Task) -> anyhow::Result<()> {
    anyhow::ensure!(args.compare_steps > 0, "--compare-steps must be at least 1");
    let mut policies = Checkpointing::all();
    let wanted = args.checkpointing()?;
    if !policies.contains(&wanted) {
        policies.push(wanted);
    }
    let config = args.model_config(task.vocab());
    println!(
        "remat train --compare: {} | GPT L={} d={} heads={}/{} | batch {} x seq {} | {} steps per policy | {} threads",
        task.describe(),
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.n_kv_heads,
        args.batch,
        task.seq(),
        args.compare_steps,
        args.threads()
    );
    let bar = ProgressBar::new(policies.len() as u64);
    let mut rows = Vec::new();
    for ckpt in policies {
        bar.set_message(ckpt.to_string());
        rows.push(run_policy(args, task, ckpt)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let base = &rows[0];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let identical = r.grads == base.grads
                && r.losses
                    .iter()
                    .zip(&base.losses)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            vec![
                r.ckpt.to_string(),
                format_bytes(r.peak_activations),
                format!(
                    "{:.2}",
                    r.peak_activations as f64 / base.peak_activations.max(1) as f64
                ),
                format_bytes(r.peak_total),
                format!("{:.2}", r.step_ms),
                format!("{:.2}", r.step_ms / base.step_ms.max(1e-9)),
                r.recomputed.to_string(),
                if identical { "yes" } else { "NO" }.to_string(),
            ]
        })
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
    print!("{}", table::render(&header, &cells));
    if rows.iter().any(|r| r.grads != base.grads) {
        anyhow::bail!("some policy's gradients differ from store-all's");
    }
    Ok(())
}
