//! `remat train --models K` (issue 22): K GPT models trained together in one step, sharing
//! the device pool and `--memory-budget`, each with its own parameters, AdamW state, data
//! order (its `--seed`) and hyper-parameters (`--lr`, `--seed`, `--dropout`, `--d-model`:
//! one value for all or a comma list of K). The K steps are recorded into one engine graph
//! with K loss roots ([`remat_engine::models::multi`]), so `--policy auto` profiles, plans
//! and executes the whole K-model step. Model `k` sees exactly the batches, dropout masks and
//! updates `remat train --seed S_k --lr LR_k ...` alone would: its parameters after N steps
//! are bit-identical to that run's (same --threads).
//!
//! Models of one shape are fused by default ([`remat_engine::models::fused`]): each op of
//! theirs runs as one call over all of them (one grouped gemm over their weight matrices,
//! one attention, one norm), bit-identical to running them one after another, which
//! `--no-fuse` does. Models of different widths train together, unfused where the shapes
//! differ. Under a plan the units are the multiplexed graph's "models".

use std::time::{Duration, Instant};

use anyhow::Context;
use remat_engine::core::graph::Graph;
use remat_engine::models::fused::{ModelSet, SetStep};
use remat_engine::models::gpt::{Checkpointing, GptConfig};
use remat_engine::models::multi::{step_optimizers, take_grads};
use remat_engine::session::auto::{AutoSession, AutoSettings, fixed_policies, fixed_policy_sets};
use remat_engine::session::models::{Members, Models, limit_fuse_width, narrower_fusions};
use remat_engine::session::task::Task;
use remat_engine::{ExecContext, MemoryPool, Policy};
use remat_report::{Layout, render};
use remat_units::human_bytes;

use super::auto::summary;
use super::flags::{Args, PolicyChoice, first_unused_flag};

/// The K models' settings from `--models K` and the per-model flags; an error names the
/// flag at fault.
pub fn resolve_members(args: &Args, vocab: usize, models: usize) -> anyhow::Result<Members> {
    anyhow::ensure!(
        models >= 1,
        "--models must be at least 1 (got 0): it is the number of models trained together"
    );
    let lrs = args
        .lr
        .for_models(models, "--lr")
        .map_err(crate::usage::of)?;
    let seeds = args
        .seed
        .for_models(models, "--seed")
        .map_err(crate::usage::of)?;
    let dropouts = args
        .dropout
        .for_models(models, "--dropout")
        .map_err(crate::usage::of)?;
    let widths = args
        .d_model
        .for_models(models, "--d-model")
        .map_err(crate::usage::of)?;
    let mut configs = Vec::with_capacity(models);
    for k in 0..models {
        let d = widths[k];
        let config = GptConfig {
            d_model: d,
            ffn_hidden: args.ffn.unwrap_or((8 * d).div_ceil(3).div_ceil(16) * 16),
            dropout: dropouts[k],
            init_seed: seeds[k],
            ..args.model_config(vocab)
        };
        config
            .validate()
            .map_err(|e| crate::usage!("model {k} (--d-model {d}, --heads {}): {e}", args.heads))?;
        configs.push(config);
    }
    Ok(Members {
        configs,
        lrs,
        seeds,
    })
}

/// Refuses a budget below what the K models hold before any step, naming that floor.
pub fn check_budget(members: &Members, budget: Option<u64>) -> anyhow::Result<()> {
    let need = members.resident_bytes()?;
    match budget {
        Some(b) if need > b => anyhow::bail!(
            "--memory-budget {} is below the floor of the {} models together: their \
             parameters and optimizer state alone take {} ({need} bytes), before any \
             activation or gradient",
            human_bytes(b),
            members.len(),
            human_bytes(need)
        ),
        _ => Ok(()),
    }
}

/// `m0+1, m2+3`: the units of `set`.
fn unit_labels(set: &ModelSet) -> String {
    (0..set.units.len())
        .map(|u| set.label(u))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The first line of an error chain's outermost message and its cause, for a one-line note.
fn first_line(e: &anyhow::Error) -> String {
    format!("{e:#}")
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// What fusion did, for the run's header: the fused units, and the models left alone.
pub fn fusion_line(set: &ModelSet, fuse: bool) -> String {
    if !fuse {
        return "fusion: off (--no-fuse), each model's ops run one after another".into();
    }
    let fused: Vec<String> = (0..set.units.len())
        .filter(|&u| set.units[u].len() > 1)
        .map(|u| set.label(u))
        .collect();
    let alone: Vec<String> = set
        .units
        .iter()
        .filter(|u| u.len() == 1)
        .map(|u| format!("m{}", u[0]))
        .collect();
    let mut line = match fused.len() {
        0 => "fusion: no two models share a shape, nothing fused".to_string(),
        _ => format!(
            "fusion: models {} fused (one call per op for each group)",
            fused.join(", ")
        ),
    };
    if !fused.is_empty() && !alone.is_empty() {
        line.push_str(&format!(
            "; {} unfused (a shape of its own)",
            alone.join(", ")
        ));
    }
    line
}

/// Per-model losses and step times of a run.
pub struct MultiRun {
    /// `losses[step][k]`.
    pub losses: Vec<Vec<f64>>,
    pub step_times: Vec<Duration>,
    pub peak: u64,
    /// Under a plan: each model's mean swap stall per step (ms), the steps after the first
    /// (a fused unit's stall, shared by its models, is given for each of them).
    pub stall_ms: Option<Vec<f64>>,
}

/// Flags a K-model run does not use: refused rather than ignored.
fn check_flags(args: &Args) -> anyhow::Result<()> {
    let more = [
        ("--init", args.files.init.is_some()),
        (
            "--swap-dir",
            args.files.swap_dir.is_some() && matches!(args.policy, PolicyChoice::Fixed(_)),
        ),
    ];
    match first_unused_flag(args, &more) {
        Some(flag) => anyhow::bail!(
            "{flag} cannot be combined with --models: K models train the built-in GPT \
             together in one step under a fixed --policy or --policy auto (drop {flag})"
        ),
        None => Ok(()),
    }
}

pub fn run(args: &Args, task: &Task, models: usize) -> anyhow::Result<()> {
    let members = resolve_members(args, task.vocab(), models)?;
    check_flags(args)?;
    check_budget(&members, args.memory_budget)?;
    println!(
        "remat train: {} | {models} GPT models L={} widths {} | batch {} x seq {} each | policy {} | {} threads{}",
        task.describe(),
        args.layers(),
        members
            .configs
            .iter()
            .map(|c| c.d_model.to_string())
            .collect::<Vec<_>>()
            .join(","),
        args.batch,
        task.seq(),
        policy_name(&args.policy),
        args.threads(),
        args.memory_budget
            .map_or(String::new(), |b| format!(" | budget {}", human_bytes(b))),
    );
    let fuse = !args.no_fuse;
    let mut set = members.set(args.batch, task.seq(), fuse);
    if let Some(width) = args.fuse_width {
        anyhow::ensure!(
            width >= 1,
            "--fuse-width must be at least 1 (got 0): it is the most models fused into one unit"
        );
        anyhow::ensure!(
            fuse,
            "--fuse-width {width} and --no-fuse contradict each other: --no-fuse fuses nothing"
        );
        set = limit_fuse_width(&set, width);
    }
    println!("{}", fusion_line(&set, fuse));
    let log_every = args.log_every.unwrap_or((args.steps / 15).max(1));
    let mut log = |step: u64, losses: &[f64]| {
        if step.is_multiple_of(log_every) || step + 1 == args.steps {
            println!("step {step:>5}  {}", loss_line(losses));
        }
    };
    let run = match &args.policy {
        PolicyChoice::Fixed(ckpt) => train_fixed(args, task, &members, *ckpt, &set, &mut log)?,
        PolicyChoice::Auto(strategy) => {
            // Fusion on and no --fuse-width: the plan may narrow the groups to fit.
            let choose_width = fuse && args.fuse_width.is_none();
            let (run, summary, planned) = train_auto(
                args,
                task,
                &members,
                strategy.clone(),
                &set,
                choose_width,
                &mut log,
            )?;
            println!("{summary}");
            set = planned;
            run
        }
    };
    print!(
        "{}",
        summary_table(&members, &set, &run.losses, run.stall_ms.as_deref())
    );
    let timed = if run.step_times.len() > 1 {
        &run.step_times[1..]
    } else {
        &run.step_times[..]
    };
    let step = timed.iter().sum::<Duration>().as_secs_f64() / timed.len().max(1) as f64;
    println!(
        "step time {:.2} ms for {models} models, {:.1} samples/s over all models, pool peak {}",
        step * 1e3,
        (models * args.batch) as f64 / step.max(1e-12),
        human_bytes(run.peak)
    );
    Ok(())
}

fn policy_name(policy: &PolicyChoice) -> String {
    match policy {
        PolicyChoice::Fixed(c) => c.to_string(),
        PolicyChoice::Auto(None) => "auto".into(),
        PolicyChoice::Auto(Some(s)) => format!("auto:{s}"),
    }
}

fn loss_line(losses: &[f64]) -> String {
    losses
        .iter()
        .enumerate()
        .map(|(k, l)| format!("m{k} loss {l:.4}"))
        .collect::<Vec<_>>()
        .join("  ")
}

/// Trains under a fixed policy: record the K-model step, forward, backward from the K
/// losses, one AdamW step per model.
pub fn train_fixed(
    args: &Args,
    task: &Task,
    members: &Members,
    ckpt: Checkpointing,
    set: &ModelSet,
    log: &mut dyn FnMut(u64, &[f64]),
) -> anyhow::Result<MultiRun> {
    let pool = match args.memory_budget {
        Some(b) => MemoryPool::with_budget(b),
        None => MemoryPool::unbounded(),
    };
    let ctx = ExecContext::new(pool.clone(), args.threads())?;
    let mut models = Models::new(&pool, members)?;
    let mut run = MultiRun {
        losses: Vec::new(),
        step_times: Vec::new(),
        peak: 0,
        stall_ms: None,
    };
    for step in 0..args.steps {
        let batches = models.batches(task, step, args.batch);
        let start = Instant::now();
        let losses = models.train_step(&ctx, &batches, step, ckpt, set)?;
        run.step_times.push(start.elapsed());
        log(step, &losses);
        run.losses.push(losses);
    }
    run.peak = pool.stats().peak;
    Ok(run)
}

/// Trains by a plan: profile the K-model step (K loss roots), plan it for the budget with
/// the planner's strategies and the engine's fixed policies, execute every step by it.
pub fn train_auto(
    args: &Args,
    task: &Task,
    members: &Members,
    strategy: Option<String>,
    set: &ModelSet,
    choose_width: bool,
    log: &mut dyn FnMut(u64, &[f64]),
) -> anyhow::Result<(MultiRun, String, ModelSet)> {
    let budget = args.memory_budget.ok_or_else(|| {
        crate::usage!(
            "--policy auto plans for a memory budget: give one with --memory-budget (e.g. 256MiB)"
        )
    })?;
    // Profiling keeps everything, which may not fit: the budget holds from the first
    // planned step on.
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), args.threads())?;
    let mut models = Models::new(&pool, members)?;
    // Apart from the models, which the recording closure borrows.
    let mut opts = std::mem::take(&mut models.opts);
    let store_all = Checkpointing::Graph(Policy::StoreAll);
    let record =
        |step: u64, ckpt: Checkpointing, set: &ModelSet| -> anyhow::Result<(Graph, SetStep)> {
            let mut g = Graph::new(&ctx);
            let batches = models.batches(task, step, args.batch);
            let recorded = models.record_set(&mut g, &batches, step, ckpt, set)?;
            Ok((g, recorded))
        };
    let name = format!("gpt-train-k{}-l{}", members.len(), args.layers());
    let prepare = |set: &ModelSet| -> anyhow::Result<(Graph, AutoSession)> {
        let (mut g0, step0) = record(0, store_all, set)?;
        let fixed = if strategy.is_none() {
            fixed_policy_sets(&g0, &fixed_policies(args.layers()), |ckpt| {
                record(0, ckpt, set).map(|(g, _)| g)
            })?
        } else {
            Vec::new()
        };
        let settings = AutoSettings {
            budget,
            strategy: strategy.clone(),
            swap_dir: args.files.swap_dir.clone(),
            bandwidth: None,
            profile_runs: 3,
            fixed,
        };
        let session = AutoSession::prepare_multi(&mut g0, &step0.roots, &name, &settings)?;
        Ok((g0, session))
    };
    // A fused op holds all of its unit's models' tensors at once, so fusing raises the
    // floor a plan can reach. With fusion left to remat, narrower groups are tried in turn
    // (down to no fusion) until one plans within the budget.
    let candidates = if choose_width {
        narrower_fusions(set)
    } else {
        vec![set.clone()]
    };
    let mut outcome = Err(anyhow::anyhow!("no grouping of the models to plan"));
    for (i, candidate) in candidates.iter().enumerate() {
        outcome = prepare(candidate).map(|prepared| (candidate.clone(), prepared));
        match (&outcome, candidates.get(i + 1)) {
            (Ok(_), _) => break,
            (Err(e), Some(next)) => println!(
                "fusion: units {} do not fit the budget ({}); trying {}",
                unit_labels(candidate),
                first_line(e),
                unit_labels(next)
            ),
            (Err(_), None) => {}
        }
    }
    let (set, (g0, session)) = match set.fused_units().next() {
        Some(_) if !choose_width => outcome.with_context(|| {
            format!(
                "planning {} units ({}); fused models' ops hold all their tensors at once, \
                 which raises the smallest feasible budget: a smaller --fuse-width, or \
                 --no-fuse, lowers it",
                set.units.len(),
                unit_labels(set)
            )
        })?,
        _ => outcome?,
    };
    let set = &set;
    let owners = session.profile.node_owners(&g0);
    drop(g0);
    pool.set_budget(Some(budget));
    pool.reset_peak();
    // Stalls are counted per unit (the plan's owners), then given to each unit's models.
    let units = set.units.len();
    let mut run = MultiRun {
        losses: Vec::new(),
        step_times: Vec::new(),
        peak: 0,
        stall_ms: None,
    };
    let mut stalls = vec![Duration::ZERO; units + 1];
    let mut reports = Vec::new();
    for step in 0..args.steps {
        let (mut g, recorded) = record(step, store_all, set)?;
        let report = session
            .step(&mut g)
            .with_context(|| format!("training step {step}"))?;
        let grads = take_grads(&mut g, &recorded.params)?;
        drop(g);
        ctx.install(|| step_optimizers(&mut opts, &grads))?;
        let losses = recorded.losses_from(&report.loss_values)?;
        run.step_times.push(report.step_time);
        run.peak = run.peak.max(report.peak_bytes);
        if step > 0 || args.steps == 1 {
            for (total, s) in stalls.iter_mut().zip(report.stall_by_owner(&owners, units)) {
                *total += s;
            }
        }
        log(step, &losses);
        run.losses.push(losses);
        reports.push(report);
    }
    let timed = if reports.len() > 1 {
        &reports[1..]
    } else {
        &reports[..]
    };
    let per_step = |d: Duration| d.as_secs_f64() * 1e3 / timed.len().max(1) as f64;
    let unit_of = set.unit_of();
    run.stall_ms = Some(unit_of.iter().map(|&u| per_step(stalls[u])).collect());
    let mut summary = summary(&session, timed);
    if set.units.iter().any(|u| u.len() > 1) {
        let owners: Vec<String> = (0..units)
            .map(|u| format!("{u} = {}", set.label(u)))
            .collect();
        summary.push_str(&format!(
            "\n  the plan's models are the units: {}",
            owners.join(", ")
        ));
    }
    if !stalls[units].is_zero() {
        summary.push_str(&format!(
            "\n  stall on tensors no model owns: {:.1} ms per step",
            per_step(stalls[units])
        ));
    }
    Ok((run, summary, set.clone()))
}

/// One row per model: its settings, its mean loss over the first and last steps and, under
/// a plan, its swap stall per step.
/// With fused units, a `unit` column says which models ran fused (their stall is the
/// unit's).
pub fn summary_table(
    members: &Members,
    set: &ModelSet,
    losses: &[Vec<f64>],
    stall_ms: Option<&[f64]>,
) -> String {
    let fused = set.units.iter().any(|u| u.len() > 1);
    let unit_of = set.unit_of();
    let n = losses.len();
    let window = (n / 10).clamp(1, 20).min(n.max(1));
    let mean = |k: usize, rows: &[Vec<f64>]| {
        rows.iter().map(|r| r[k]).sum::<f64>() / rows.len().max(1) as f64
    };
    let first = format!("loss first {window}");
    let last = format!("loss last {window}");
    let rows: Vec<Vec<String>> = (0..members.len())
        .map(|k| {
            let c = &members.configs[k];
            let mut row = vec![
                format!("m{k}"),
                c.d_model.to_string(),
                format!("{}", members.lrs[k]),
                members.seeds[k].to_string(),
                format!("{}", c.dropout),
                format!("{:.4}", mean(k, &losses[..window.min(n)])),
                format!("{:.4}", mean(k, &losses[n - window.min(n)..])),
            ];
            if fused {
                row.push(set.label(unit_of[k]));
            }
            if let Some(stall) = stall_ms {
                row.push(format!("{:.2}", stall[k]));
            }
            row
        })
        .collect();
    let mut header = vec!["model", "d_model", "lr", "seed", "dropout", &first, &last];
    if fused {
        header.push("unit");
    }
    if stall_ms.is_some() {
        header.push("swap stall ms/step");
    }
    render(Layout::Aligned, &header, &rows)
}
