//! Mixed per-model plans from the command line: profile a spec model, choose the mix for
//! a budget, print it per layer (`remat train --spec ... --policy auto`, `remat spec
//! inspect --memory-budget`, `remat bench spec`).

use std::sync::Arc;

use anyhow::Context;
use remat_engine::models::qwen3::{Qwen3Grads, StepEnv, StepStats};
use remat_engine::spec::mix::{self, Mix, MixError, MixModel, Profile, Tuned};
use remat_engine::spec::run::meter::Meter;
use remat_engine::spec::{Mode, Plan};
use remat_engine::swap::HostStore;

use remat_units::human_bytes;

use super::spec::print_table;

/// One step of a spec model under per-block-type plans.
pub type StepFn<'a> = dyn Fn(&[Plan], StepEnv) -> anyhow::Result<(Qwen3Grads, StepStats)> + 'a;

/// The mix model of compiled `plans` (one per block type) and each layer's type.
pub fn mix_model(plans: &[Plan], layer_block: Vec<usize>, mode: Mode) -> anyhow::Result<MixModel> {
    let blocks: Vec<_> = plans
        .iter()
        .map(|p| (p.spec().clone(), p.config.clone()))
        .collect();
    Ok(MixModel::new(&blocks, layer_block, mode)?)
}

/// `step` as the library's runner: one step on a fresh host store, charged to `meter`.
pub fn runner<'a>(
    step: &'a StepFn<'a>,
) -> impl FnMut(&[Plan], &Arc<Meter>) -> Result<(), MixError> + 'a {
    move |plans: &[Plan], meter: &Arc<Meter>| {
        let host = HostStore::in_memory();
        let env = StepEnv {
            host: &host,
            meter,
            step: 0,
        };
        step(plans, env)
            .map(drop)
            .map_err(|e| MixError::Profile(format!("{e:#}")))
    }
}

/// Profiles the model by running `step` (`rounds` timed runs per timing).
pub fn profile(model: &MixModel, rounds: usize, step: &StepFn) -> anyhow::Result<Profile> {
    let mut run = runner(step);
    mix::profile(model, rounds, &mut run).context("profiling the spec model")
}

/// Timed rounds of [`choose`]'s run-off between the budget ladder's mixes.
pub const TUNE_ROUNDS: usize = 3;

/// The mix for `budget` pool bytes, of which `base` (parameters, optimizer state) are
/// taken before the step begins: the fastest measured (`rounds` timed runs each, by
/// `step`) of the exact mixes for a ladder of budgets up to `budget` (see
/// `remat_engine::spec::mix::tune`).
pub fn choose(
    model: &MixModel,
    profile: &Profile,
    budget: u64,
    base: u64,
    rounds: usize,
    step: &StepFn,
) -> anyhow::Result<Tuned> {
    let floor = mix::floor(profile);
    let step_budget = budget.checked_sub(base).ok_or_else(|| {
        anyhow::anyhow!(
            "--memory-budget {budget} B is below the floor of this model: the parameters and optimizer state alone take {base} B, and the least peak any allowed mix reaches is {} B; raise --memory-budget to at least {}",
            base + floor,
            base + floor
        )
    })?;
    let mut run = runner(step);
    mix::tune(model, profile, step_budget, rounds, &mut run).map_err(|e| match e {
        MixError::BelowFloor { .. } => anyhow::anyhow!(
            "--memory-budget {budget} B is below the floor of this model: no allowed mix of keep, recompute and offload peaks under {} B ({} B for parameters and optimizer state plus the step's least peak, {floor} B), every slot's declared policy respected; raise --memory-budget to at least {}",
            base + floor,
            base,
            base + floor
        ),
        other => other.into(),
    })
}

/// The chosen mix per layer: what is rebuilt and offloaded, the bytes kept, the time.
pub fn print_mix(model: &MixModel, profile: &Profile, mix: &Mix, base: u64) {
    let rows: Vec<Vec<String>> = mix
        .layers
        .iter()
        .enumerate()
        .map(|(l, layer)| {
            let block = &model.blocks[model.layer_block[l]].resolved.spec.name;
            let list = |v: &[String]| {
                if v.is_empty() {
                    "-".to_string()
                } else {
                    v.join(" ")
                }
            };
            vec![
                l.to_string(),
                block.clone(),
                list(&layer.recomputed),
                list(&layer.offloaded),
                human_bytes(layer.kept),
                human_bytes(layer.offloaded_bytes),
                format!("{:.2} ms", 1e3 * layer.seconds),
            ]
        })
        .collect();
    print_table(
        &[
            "layer",
            "block",
            "recomputed",
            "offloaded",
            "kept on device",
            "on host",
            "added time",
        ],
        &rows,
    );
    println!(
        "predicted: peak {} ({} step + {} parameters and optimizer state), step {:.1} ms ({:.1} ms with everything kept); floor {}",
        human_bytes(base + mix.peak),
        human_bytes(mix.peak),
        human_bytes(base),
        1e3 * mix.seconds,
        1e3 * profile.base_seconds,
        human_bytes(base + mix::floor(profile)),
    );
}

/// The run-off of [`choose`]: each candidate's budget rung, predicted peak and time, and
/// measured time; the chosen one marked. Prints nothing when only one candidate ran.
pub fn print_tuned(tuned: &Tuned, base: u64) {
    if tuned.tried.len() < 2 || tuned.tried.iter().all(|t| t.seconds.is_none()) {
        return;
    }
    let rows: Vec<Vec<String>> = tuned
        .tried
        .iter()
        .enumerate()
        .map(|(i, t)| {
            vec![
                human_bytes(base + t.budget),
                human_bytes(base + t.mix.peak),
                format!("{:.1} ms", 1e3 * t.mix.seconds),
                t.seconds
                    .map_or("-".into(), |s| format!("{:.1} ms", 1e3 * s)),
                if i == tuned.chosen { "chosen" } else { "" }.into(),
            ]
        })
        .collect();
    println!(
        "run-off between the exact mixes of a ladder of budgets (median of the timed rounds):"
    );
    print_table(
        &[
            "solved for",
            "predicted peak",
            "predicted step",
            "measured step",
            "",
        ],
        &rows,
    );
}
