//! `remat train --policy auto[:STRATEGY] --memory-budget B`: profile the first step, plan it
//! for the budget, and run every step by the plan (issue 5, section 3). The session is
//! `remat_engine::session::auto`; here are the flags it refuses, the training loop and the
//! summary it prints.

use std::time::Duration;

use anyhow::Context;
use remat_engine::core::graph::{Graph, NodeId};
use remat_engine::models::gpt::{Checkpointing, Gpt, hf};
use remat_engine::plan_exec::StepReport;
use remat_engine::session::auto::{
    AutoSession, AutoSettings, fixed_policies, fixed_policy_sets, forward_bytes_by_fate, mib,
};
use remat_engine::session::task::Task;
use remat_engine::{AdamW, AdamWConfig, ExecContext, MemoryPool, Policy};
use remat_planner::multi::MultiPlanned;
use remat_units::{human_bandwidth, human_bytes};

use super::flags::{Args, first_unused_flag};

/// `remat train` flags that `--policy auto` does not use: refused rather than ignored.
pub fn check_flags(args: &Args) -> anyhow::Result<()> {
    match first_unused_flag(args, &[]) {
        Some(flag) => anyhow::bail!(
            "{flag} cannot be combined with --policy auto: auto profiles and plans the \
             single-stage GPT step itself (drop {flag}, or use a fixed --policy)"
        ),
        None => Ok(()),
    }
}

/// The training loop of `remat train --policy auto[:STRATEGY]`.
pub fn run(args: &Args, task: &Task, strategy: Option<String>) -> anyhow::Result<()> {
    let budget = args.memory_budget.ok_or_else(|| {
        crate::usage!(
            "--policy auto plans for a memory budget: give one with --memory-budget (e.g. 256MiB)"
        )
    })?;
    let config = args.model_config(task.vocab());
    let n_layers = config.n_layers;
    println!(
        "remat train: {} | GPT L={} d={} heads={} ({} parameters) | batch {} x seq {} | policy auto{} | budget {} | {} threads",
        task.describe(),
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.param_count(),
        args.batch,
        task.seq(),
        strategy
            .as_deref()
            .map_or(String::new(), |s| format!(":{s}")),
        human_bytes(budget),
        args.threads(),
    );
    // Profiling runs the step keeping everything, which may not fit: the budget is enforced
    // from the first planned step on.
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), args.threads())?;
    let gpt = Gpt::new(&pool, config)?;
    if let Some(path) = &args.files.init {
        hf::load_params(&gpt, path)?;
    }
    let opt_config = AdamWConfig {
        lr: args.lr.one(),
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    // Created before profiling: its state is static memory the plan must leave room for.
    let mut opt = AdamW::new(&pool, gpt.params(), opt_config)?;
    let settings = AutoSettings {
        budget,
        strategy,
        swap_dir: args.files.swap_dir.clone(),
        bandwidth: None,
        profile_runs: 5,
        fixed: Vec::new(),
    };
    let record = |step: u64| -> anyhow::Result<(Graph, Vec<NodeId>, NodeId)> {
        let mut g = Graph::new(&ctx);
        g.set_seed(args.seed.one() ^ (step << 32));
        let batch = task.batch(args.seed.one(), step, args.batch);
        let s = gpt.record(&mut g, &batch, Checkpointing::Graph(Policy::StoreAll))?;
        Ok((g, s.params, s.loss))
    };
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message("profiling and planning the training step");
    spinner.enable_steady_tick(Duration::from_millis(120));
    let (mut g0, _, loss0) = record(0)?;
    let mut settings = settings;
    if settings.strategy.is_none() {
        let batch0 = task.batch(args.seed.one(), 0, args.batch);
        settings.fixed = fixed_policy_sets(
            &g0,
            &fixed_policies(n_layers),
            |ckpt| -> anyhow::Result<Graph> {
                let mut g = Graph::new(&ctx);
                gpt.record(&mut g, &batch0, ckpt)?;
                Ok(g)
            },
        )?;
    }
    let session =
        AutoSession::prepare(&mut g0, loss0, &format!("gpt-train-l{n_layers}"), &settings);
    spinner.finish_and_clear();
    let session = session?;
    drop(g0);
    pool.set_budget(Some(budget));
    let bar = indicatif::ProgressBar::new(args.steps);
    let log_every = args.log_every.unwrap_or((args.steps / 15).max(1));
    let (mut losses, mut reports) = (Vec::new(), Vec::new());
    for step in 0..args.steps {
        let (mut g, params, _) = record(step)?;
        let report = session
            .step(&mut g)
            .with_context(|| format!("training step {step}"))?;
        let grads = params
            .iter()
            .map(|&p| g.take_grad(p))
            .collect::<Result<Vec<_>, _>>()?;
        drop(g);
        opt.step(&grads)?;
        let loss = report.loss.unwrap_or(f64::NAN);
        losses.push(loss);
        reports.push(report);
        bar.set_message(format!("{loss:.4}"));
        bar.inc(1);
        if step % log_every == 0 || step + 1 == args.steps {
            bar.suspend(|| println!("step {step:>5}  loss {loss:.4}"));
        }
    }
    bar.finish_and_clear();
    let n = losses.len();
    let window = (n / 10).clamp(1, 20).min(n.max(1));
    if n > 0 {
        let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
        println!(
            "loss: first {window} steps {:.4}, last {window} steps {:.4}",
            mean(&losses[..window]),
            mean(&losses[n - window..])
        );
    }
    // The first step pays one-off costs: time the rest, as `remat train` does.
    let timed = if reports.len() > 1 {
        &reports[1..]
    } else {
        &reports[..]
    };
    println!("{}", summary(&session, timed));
    Ok(())
}

/// Predicted against measured, for the end-of-run summary.
pub fn summary(session: &AutoSession, reports: &[StepReport]) -> String {
    let peak = reports.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
    let times: Vec<f64> = reports.iter().map(|r| r.step_time.as_secs_f64()).collect();
    let time = remat_units::median(&times).unwrap_or(0.0);
    let stall: f64 =
        reports.iter().map(|r| r.stall.as_secs_f64()).sum::<f64>() / reports.len().max(1) as f64;
    let r = &session.planned.report;
    let (kept, swapped, recomputed) = forward_bytes_by_fate(&session.profile.graph, r);
    let g = &session.profile.graph;
    [
        format!(
            "auto plan: strategy {} for a budget of {} (static {}, store-all peak {}), bandwidth {}, swaps cost {:.2} ms of compute per MiB",
            session.planned.plan.strategy,
            human_bytes(session.budget),
            human_bytes(g.static_bytes()),
            human_bytes(g.store_all_peak()),
            human_bandwidth(session.bandwidth),
            session.copy_cost * 1e3 * (1u64 << 20) as f64
        ),
        format!("  forward outputs (activations) kept {}, swapped {}, recomputed {} (each counted once)", human_bytes(kept), human_bytes(swapped), human_bytes(recomputed)),
        considered_line(session),
        format!("  {:<10} {:>12} {:>12}", "", "predicted", "measured"),
        format!("  {:<10} {:>12} {:>12}", "peak MiB", mib(r.peak_bytes), mib(peak)),
        format!("  {:<10} {:>12.1} {:>12.1}", "step ms", r.total_time * 1e3, time * 1e3),
        format!("  {:<10} {:>12.1} {:>12.1}", "stall ms", r.stall_time * 1e3, stall * 1e3),
    ]
    .into_iter()
    .chain(session.multiplexed.iter().flat_map(|m| hiding_lines(m, 12)))
    .collect::<Vec<_>>()
    .join("\n")
}

/// How many candidate plans were weighed and the runner-up.
fn considered_line(session: &AutoSession) -> String {
    let mut fits: Vec<(&str, f64)> = session
        .considered
        .iter()
        .filter_map(|c| c.outcome.as_ref().ok().map(|&(t, _)| (c.name.as_str(), t)))
        .collect();
    fits.sort_by(|a, b| a.1.total_cmp(&b.1));
    let next = fits.get(1).map_or(String::new(), |(n, t)| {
        format!("; next fastest {n} ({:.1} ms)", t * 1e3)
    });
    format!(
        "  weighed {} candidate plans, {} fit the budget and run exactly{next}",
        session.considered.len(),
        fits.len()
    )
}

/// Which model's compute ran while each swap copied, and what stayed exposed (simulated,
/// in ms): the multiplexed plan's hiding, one line per swapped tensor (at most `max`).
fn hiding_lines(planned: &MultiPlanned, max: usize) -> Vec<String> {
    let model = |m: Option<usize>| m.map_or("shared".to_string(), |m| format!("model {m}"));
    let mut lines = vec![format!(
        "  multiplexed plan: {} swaps; simulated exposed stall per model: {}",
        planned.swaps.len(),
        planned
            .models
            .iter()
            .map(|s| format!("{} {:.2} ms", model(s.model), s.stall_time * 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    )];
    for s in planned.swaps.iter().take(max) {
        let by = s
            .in_hidden_by
            .iter()
            .map(|&(m, t)| format!("{} {:.2} ms", model(m), t * 1e3))
            .collect::<Vec<_>>();
        lines.push(format!(
            "    {} ({}, {} B): copy back hidden by {}; exposed {:.2} ms",
            s.name,
            model(s.model),
            s.bytes,
            if by.is_empty() {
                "nothing".to_string()
            } else {
                by.join(", ")
            },
            s.exposed * 1e3
        ));
    }
    if planned.swaps.len() > max {
        lines.push(format!("    ... {} more", planned.swaps.len() - max));
    }
    lines
}
