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

pub mod multiplexed;
pub mod per_model;

use std::time::{Duration, Instant};

use anyhow::Context;
use remat_engine::graph::Graph;
use remat_engine::models::fused::{ModelSet, SetStep, ShapeKey, record_set};
use remat_engine::models::gpt::{Batch, Checkpointing, Gpt, GptConfig};
use remat_engine::models::multi::{
    ModelStep, MultiStep, record_multi, step_optimizers, take_grads,
};
use remat_engine::{AdamW, AdamWConfig, ExecContext, MemoryPool, Policy};
use remat_units::human_bytes;

use super::train::task::Task;
use super::train::{Args, table};
use super::train_auto::{
    AutoSession, AutoSettings, PolicyChoice, fixed_policies, fixed_policy_sets,
};

/// The K models' settings, resolved from the per-model flags.
#[derive(Clone, Debug)]
pub struct Members {
    pub configs: Vec<GptConfig>,
    pub lrs: Vec<f64>,
    /// Seed of model k's initialization, data order and dropout.
    pub seeds: Vec<u64>,
}

impl Members {
    /// `--models K` with the per-model flags; an error names the flag at fault.
    pub fn from_args(args: &Args, vocab: usize, models: usize) -> anyhow::Result<Members> {
        anyhow::ensure!(
            models >= 1,
            "--models must be at least 1 (got 0): it is the number of models trained together"
        );
        let lrs = args.lr.for_models(models, "--lr")?;
        let seeds = args.seed.for_models(models, "--seed")?;
        let dropouts = args.dropout.for_models(models, "--dropout")?;
        let widths = args.d_model.for_models(models, "--d-model")?;
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
                .with_context(|| format!("model {k} (--d-model {d}, --heads {})", args.heads))?;
            configs.push(config);
        }
        Ok(Members {
            configs,
            lrs,
            seeds,
        })
    }

    pub fn len(&self) -> usize {
        self.configs.len()
    }

    /// How the models group into units for batches of `batch x seq`: same-shape models
    /// fused when `fuse`, every model a unit of its own otherwise.
    pub fn set(&self, batch: usize, seq: usize, fuse: bool) -> ModelSet {
        let keys: Vec<ShapeKey> = self
            .configs
            .iter()
            .map(|c| ShapeKey::new(c, batch, seq))
            .collect();
        ModelSet::group_keys(&keys, fuse)
    }

    /// Bytes every step holds whatever the plan: each model's parameters and its AdamW
    /// moments (two per parameter).
    pub fn resident_bytes(&self) -> anyhow::Result<u64> {
        let mut total = 0u64;
        for c in &self.configs {
            total = total.saturating_add(c.param_bytes()?.saturating_mul(3));
        }
        Ok(total)
    }

    /// Refuses a budget below what the K models hold before any step, naming that floor.
    pub fn check_budget(&self, budget: Option<u64>) -> anyhow::Result<()> {
        let need = self.resident_bytes()?;
        match budget {
            Some(b) if need > b => anyhow::bail!(
                "--memory-budget {} is below the floor of the {} models together: their \
                 parameters and optimizer state alone take {} ({need} bytes), before any \
                 activation or gradient",
                human_bytes(b),
                self.len(),
                human_bytes(need)
            ),
            _ => Ok(()),
        }
    }
}

/// The K models with their optimizers, on one pool.
pub struct Models {
    pub gpts: Vec<Gpt>,
    pub opts: Vec<AdamW>,
    pub seeds: Vec<u64>,
}

impl Models {
    pub fn new(pool: &std::sync::Arc<MemoryPool>, members: &Members) -> anyhow::Result<Models> {
        let mut gpts = Vec::with_capacity(members.len());
        let mut opts = Vec::with_capacity(members.len());
        for (k, config) in members.configs.iter().enumerate() {
            let gpt = Gpt::new(pool, config.clone()).with_context(|| format!("model {k}"))?;
            let opt_config = AdamWConfig {
                lr: members.lrs[k],
                weight_decay: 0.0,
                ..AdamWConfig::default()
            };
            opts.push(
                AdamW::new(pool, gpt.params(), opt_config)
                    .with_context(|| format!("model {k}'s optimizer"))?,
            );
            gpts.push(gpt);
        }
        Ok(Models {
            gpts,
            opts,
            seeds: members.seeds.clone(),
        })
    }

    /// Model k's batch of `step`: the one `remat train --seed S_k` draws.
    pub fn batches(&self, task: &Task, step: u64, batch: usize) -> Vec<Batch> {
        self.seeds
            .iter()
            .map(|&s| task.batch(s, step, batch))
            .collect()
    }

    /// The K models' shares of step `step` on `batches`.
    fn steps<'a>(&'a self, batches: &'a [Batch], step: u64) -> Vec<ModelStep<'a>> {
        self.gpts
            .iter()
            .zip(batches)
            .zip(&self.seeds)
            .map(|((model, batch), &seed)| ModelStep {
                model,
                batch,
                seed: step_seed(seed, step),
            })
            .collect()
    }

    /// Records the K models' step `step` on `batches` into `g`, each model's ops on their
    /// own (the unfused path; see [`Models::record_set`]).
    pub fn record(
        &self,
        g: &mut Graph,
        batches: &[Batch],
        step: u64,
        ckpt: Checkpointing,
    ) -> anyhow::Result<MultiStep> {
        Ok(record_multi(g, &self.steps(batches, step), ckpt)?)
    }

    /// Records the K models' step `step` on `batches` into `g` as the units of `set`: one
    /// loss root per unit ([`SetStep::roots`], for `backward_many`, the profiler and the
    /// plan executor), each model's loss read with [`SetStep::losses`] (after forward) or
    /// [`SetStep::losses_from`] (a plan's `StepReport::loss_values`), each model's
    /// gradients with `take_grads(g, &step.params)`.
    pub fn record_set(
        &self,
        g: &mut Graph,
        batches: &[Batch],
        step: u64,
        ckpt: Checkpointing,
        set: &ModelSet,
    ) -> anyhow::Result<SetStep> {
        Ok(record_set(g, &self.steps(batches, step), set, ckpt)?)
    }

    /// One training step of the K models under a fixed policy, fused as `set` says:
    /// record, forward, backward from every unit's loss root, one AdamW step per model.
    /// Returns each model's loss.
    pub fn train_step(
        &mut self,
        ctx: &ExecContext,
        batches: &[Batch],
        step: u64,
        ckpt: Checkpointing,
        set: &ModelSet,
    ) -> anyhow::Result<Vec<f64>> {
        let mut g = Graph::new(ctx);
        let recorded = self.record_set(&mut g, batches, step, ckpt, set)?;
        g.forward()
            .with_context(|| format!("training step {step} (forward)"))?;
        let losses = recorded.losses(&g)?;
        g.backward_many(&recorded.roots)
            .with_context(|| format!("training step {step} (backward)"))?;
        let grads = take_grads(&mut g, &recorded.params)?;
        drop(g);
        ctx.install(|| step_optimizers(&mut self.opts, &grads))?;
        Ok(losses)
    }
}

/// `set` with every unit of more than `width` models split, in model order, into units of
/// at most `width` (as even as possible: 5 models at width 2 give 2 + 2 + 1). MuTWO fuses
/// the models into a few groups and multiplexes the groups, so that one group's swaps hide
/// behind another's compute; one unit of all K leaves nothing to hide behind.
pub fn limit_fuse_width(set: &ModelSet, width: usize) -> ModelSet {
    let width = width.max(1);
    let mut units = Vec::with_capacity(set.units.len());
    for unit in &set.units {
        let parts = unit.len().div_ceil(width).max(1);
        let (base, extra) = (unit.len() / parts, unit.len() % parts);
        let mut start = 0;
        for p in 0..parts {
            let len = base + usize::from(p < extra);
            units.push(unit[start..start + len].to_vec());
            start += len;
        }
    }
    ModelSet { units }
}

/// `set`, then narrower groupings of it: the widest unit halved (rounding up) each time,
/// down to every model alone. What `--policy auto` tries, in order, when fusion is left to
/// it and the fused units need more than the budget.
pub fn narrower_fusions(set: &ModelSet) -> Vec<ModelSet> {
    let mut out = vec![set.clone()];
    let mut width = set.units.iter().map(Vec::len).max().unwrap_or(1);
    while width > 1 {
        width = width.div_ceil(2).min(width - 1);
        out.push(limit_fuse_width(set, width));
    }
    out
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

/// The dropout seed of a step, as `remat train` alone uses it.
pub fn step_seed(seed: u64, step: u64) -> u64 {
    seed ^ (step << 32)
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
    match super::train_auto::first_unused_flag(args, &more) {
        Some(flag) => anyhow::bail!(
            "{flag} cannot be combined with --models: K models train the built-in GPT \
             together in one step under a fixed --policy or --policy auto (drop {flag})"
        ),
        None => Ok(()),
    }
}

pub fn run(args: &Args, task: &Task, models: usize) -> anyhow::Result<()> {
    let members = Members::from_args(args, task.vocab(), models)?;
    check_flags(args)?;
    members.check_budget(args.memory_budget)?;
    anyhow::ensure!(
        args.steps > 0,
        "--steps must be at least 1 (got 0): there is nothing to train or time"
    );
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
    let budget = args.memory_budget.context(
        "--policy auto plans for a memory budget: give one with --memory-budget (e.g. 256MiB)",
    )?;
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
                Ok(record(0, ckpt, set)?.0)
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
    let mut summary = session.summary(timed);
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
    table::render(&header, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuse_width_splits_units_evenly_in_model_order() {
        // Models 0, 1, 3, 4, 5 share a shape; model 2 has its own.
        let set = ModelSet {
            units: vec![vec![0, 1, 3, 4, 5], vec![2]],
        };
        let split = limit_fuse_width(&set, 2);
        assert_eq!(split.units, vec![vec![0, 1], vec![3, 4], vec![5], vec![2]]);
        assert_eq!(
            limit_fuse_width(&set, 3).units,
            vec![vec![0, 1, 3], vec![4, 5], vec![2]]
        );
        assert_eq!(limit_fuse_width(&set, 5).units, set.units);
        assert_eq!(limit_fuse_width(&set, 1).units.len(), 6);
        let tries: Vec<Vec<Vec<usize>>> = narrower_fusions(&set)
            .into_iter()
            .map(|s| s.units)
            .collect();
        assert_eq!(
            tries,
            vec![
                set.units.clone(),
                vec![vec![0, 1, 3], vec![4, 5], vec![2]],
                vec![vec![0, 1], vec![3, 4], vec![5], vec![2]],
                vec![vec![0], vec![1], vec![3], vec![4], vec![5], vec![2]],
            ]
        );
        // Width 0 is treated as 1 (the CLI refuses it before).
        assert_eq!(limit_fuse_width(&set, 0).units.len(), 6);
    }
}
