//! Mixed per-model plans from the command line: profile a spec model, choose the mix for
//! a budget, print it per layer (`remat train --spec ... --policy auto`, `remat spec
//! inspect --memory-budget`, `remat bench spec`).

use std::sync::Arc;

use anyhow::Context;
use remat_engine::models::qwen3::{Qwen3Grads, StepEnv, StepStats};
use remat_engine::spec::mix::{self, Mix, MixError, MixModel, Profile};
use remat_engine::spec::run::meter::Meter;
use remat_engine::spec::{Mode, Plan};
use remat_engine::swap::HostStore;

use super::spec::{human_bytes, print_table};

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

/// Profiles the model by running `step` (`rounds` timed runs per timing).
pub fn profile(model: &MixModel, rounds: usize, step: &StepFn) -> anyhow::Result<Profile> {
    let mut run = |plans: &[Plan], meter: &Arc<Meter>| -> Result<(), MixError> {
        let host = HostStore::in_memory();
        let env = StepEnv {
            host: &host,
            meter,
            step: 0,
        };
        step(plans, env)
            .map(drop)
            .map_err(|e| MixError::Profile(format!("{e:#}")))
    };
    mix::profile(model, rounds, &mut run).context("profiling the spec model")
}

/// The mix for `budget` pool bytes, of which `base` (parameters, optimizer state) are
/// taken before the step begins.
pub fn choose(model: &MixModel, profile: &Profile, budget: u64, base: u64) -> anyhow::Result<Mix> {
    let floor = mix::floor(profile);
    let step_budget = budget.checked_sub(base).ok_or_else(|| {
        anyhow::anyhow!(
            "--memory-budget {budget} B is below the floor of this model: the parameters and optimizer state alone take {base} B, and the least peak any allowed mix reaches is {} B; raise --memory-budget to at least {}",
            base + floor,
            base + floor
        )
    })?;
    mix::solve(model, profile, step_budget).map_err(|e| match e {
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
