//! Mixed per-layer plans of a spec-driven model: profile it, choose the mix of keep,
//! recompute and offload per layer and slot for a budget (`remat train --spec ... --policy
//! auto`, `remat spec inspect --memory-budget`, `remat bench spec`). The mix itself is
//! [`crate::spec::mix`]'s; this is the flow around it: a model's step run on a fresh host
//! store for every measurement, and the budget checked against the model's floor.

use std::fmt::Display;
use std::sync::Arc;

use remat_units::{exact_bytes, human_bytes};

use super::error::{During, Result, SessionError};
use crate::core::swap::HostStore;
use crate::spec::mix::{self, MixError, MixModel, Profile, Tuned};
use crate::spec::models::{SpecGrads, StepEnv, StepStats};
use crate::spec::run::meter::Meter;
use crate::spec::{Mode, Plan};

/// One step of a spec model under per-block-type plans (its error is the caller's).
pub type StepFn<'a, E> =
    dyn Fn(&[Plan], StepEnv) -> std::result::Result<(SpecGrads, StepStats), E> + 'a;

/// The mix model of compiled `plans` (one per block type) and each layer's type.
pub fn mix_model(plans: &[Plan], layer_block: Vec<usize>, mode: Mode) -> Result<MixModel> {
    let blocks: Vec<_> = plans
        .iter()
        .map(|p| (p.spec().clone(), p.config.clone()))
        .collect();
    Ok(MixModel::new(&blocks, layer_block, mode)?)
}

/// `step` as the library's runner: one step on a fresh host store, charged to `meter`; a
/// failed step is [`MixError::Profile`] with its error's text (`{:#}`: with its causes).
pub fn runner<'a, E: Display>(
    step: &'a StepFn<'a, E>,
) -> impl FnMut(&[Plan], &Arc<Meter>) -> std::result::Result<(), MixError> + 'a {
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
pub fn profile<E: Display>(model: &MixModel, rounds: usize, step: &StepFn<E>) -> Result<Profile> {
    let mut run = runner(step);
    mix::profile(model, rounds, &mut run).during("profiling the spec model")
}

/// Timed rounds of [`choose`]'s run-off between the budget ladder's mixes.
pub const TUNE_ROUNDS: usize = 3;

/// The mix for `budget` pool bytes, of which `base` (parameters, optimizer state) are
/// taken before the step begins: the fastest measured (`rounds` timed runs each, by
/// `step`) of the exact mixes for a ladder of budgets up to `budget` (see
/// [`crate::spec::mix::tune()`]).
pub fn choose<E: Display>(
    model: &MixModel,
    profile: &Profile,
    budget: u64,
    base: u64,
    rounds: usize,
    step: &StepFn<E>,
) -> Result<Tuned> {
    let floor = mix::floor(profile);
    let step_budget = budget.checked_sub(base).ok_or_else(|| {
        SessionError::invalid(format!(
            "--memory-budget {} is below the floor of this model: the parameters and optimizer state alone take {}, and the least peak any allowed mix reaches is {}; raise --memory-budget to at least {}",
            human_bytes(budget),
            human_bytes(base),
            human_bytes(base + floor),
            exact_bytes(base + floor)
        ))
    })?;
    let mut run = runner(step);
    mix::tune(model, profile, step_budget, rounds, &mut run).map_err(|e| match e {
        MixError::BelowFloor { .. } => SessionError::invalid(format!(
            "--memory-budget {} is below the floor of this model: no allowed mix of keep, recompute and offload peaks under {} ({} for parameters and optimizer state plus the step's least peak, {}), every slot's declared policy respected; raise --memory-budget to at least {}",
            human_bytes(budget),
            human_bytes(base + floor),
            human_bytes(base),
            human_bytes(floor),
            exact_bytes(base + floor)
        )),
        other => other.into(),
    })
}
