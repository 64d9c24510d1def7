//! Choosing among fitting mixes by running them.
//!
//! [`solve()`](super::solve()) is exact for its time model, and the model is additive:
//! keep-all's step plus each recompute op and host transfer. What it cannot see is that a
//! step keeping fewer bytes can itself run faster (fewer fresh pages touched, a smaller
//! working set in cache): measured on this project's benchmark, uniform policies that keep
//! less ran at 0.85-0.93 of keep-all's time, so the least *predicted* mix lost to them by
//! a few percent. A peak is predicted to the byte; a time is not.
//!
//! So [`tune`] takes the exact mixes for a ladder of budgets, from the given budget down to
//! the floor (every one of them fits the budget; lower rungs trade recompute for
//! footprint), runs each the same number of times, interleaved so that a slow moment of the
//! machine hits every candidate alike, and keeps the fastest median. Any of them gives the
//! same gradients bit for bit, so the choice changes the time only.

use std::time::Instant;

use crate::spec::compile::LayerChoice;
use crate::spec::run::meter::Meter;

use super::error::MixError;
use super::profile::{MixModel, Profile, Runner};
use super::solve::{Mix, floor, solve};

/// Rungs of the budget ladder: the budget, the floor, and evenly spaced budgets between.
pub const RUNGS: usize = 4;

/// A candidate mix and how it ran.
#[derive(Debug, Clone)]
pub struct Tried {
    /// The budget the mix was solved for (at most the tuned budget).
    pub budget: u64,
    pub mix: Mix,
    /// Median measured step time; `None` when nothing was measured (`rounds` = 0).
    pub seconds: Option<f64>,
}

/// The outcome of [`tune`]: every distinct candidate, and which one won.
#[derive(Debug, Clone)]
pub struct Tuned {
    pub tried: Vec<Tried>,
    /// Index into `tried` of the chosen mix.
    pub chosen: usize,
}

impl Tuned {
    pub fn mix(&self) -> &Mix {
        &self.tried[self.chosen].mix
    }
}

fn choices(mix: &Mix) -> Vec<LayerChoice> {
    mix.layers.iter().map(|l| l.choice.clone()).collect()
}

/// The exact mixes for [`RUNGS`] budgets from `budget` down to the floor, without
/// repeats; the first is [`solve()`] at `budget`. Below the floor:
/// [`MixError::BelowFloor`].
pub fn ladder(model: &MixModel, profile: &Profile, budget: u64) -> Result<Vec<Tried>, MixError> {
    let top = solve(model, profile, budget)?;
    let low = floor(profile);
    let mut tried = vec![Tried {
        budget,
        mix: top,
        seconds: None,
    }];
    for rung in (0..RUNGS - 1).rev() {
        let at = low + (budget - low) / (RUNGS as u64 - 1) * rung as u64;
        let mix = solve(model, profile, at)?;
        if tried.iter().all(|t| choices(&t.mix) != choices(&mix)) {
            tried.push(Tried {
                budget: at,
                mix,
                seconds: None,
            });
        }
    }
    Ok(tried)
}

/// The fastest measured of the [`ladder`]'s mixes for `budget`: one untimed run of each,
/// then `rounds` interleaved timed rounds. With `rounds` = 0, or a single candidate,
/// nothing runs and the first (least predicted time) is chosen.
pub fn tune(
    model: &MixModel,
    profile: &Profile,
    budget: u64,
    rounds: usize,
    run: &mut Runner,
) -> Result<Tuned, MixError> {
    let mut tried = ladder(model, profile, budget)?;
    if rounds == 0 || tried.len() == 1 {
        return Ok(Tuned { tried, chosen: 0 });
    }
    let plans = tried
        .iter()
        .map(|t| model.plans(&choices(&t.mix)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); plans.len()];
    for round in 0..=rounds {
        for (p, t) in plans.iter().zip(&mut times) {
            let meter = Meter::unbounded();
            let start = Instant::now();
            run(p, &meter)?;
            if round > 0 {
                t.push(start.elapsed().as_secs_f64());
            }
        }
    }
    for (t, measured) in tried.iter_mut().zip(times) {
        t.seconds = remat_units::upper_median(&measured);
    }
    // The first strictly fastest: a tie keeps the least predicted time.
    let mut chosen = 0;
    for (i, t) in tried.iter().enumerate() {
        if t.seconds < tried[chosen].seconds {
            chosen = i;
        }
    }
    Ok(Tuned { tried, chosen })
}
