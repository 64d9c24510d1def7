//! The registry: every strategy remat knows, and finding one by name.
//!
//! [`registry`] lists them, fast ones first (the baselines, MuTWO, the exact ones of
//! [`crate::exact`], the anytime solver of [`crate::solve`]); [`lookup`] finds one by name,
//! including the parameterized `every:N`, `by-depth:D` and `threshold:F`. The search
//! ([`crate::search`]) runs what [`registry`] lists; `--strategy` names what [`lookup`] finds.

use crate::error::PlanError;
use crate::solve;
use crate::strategy::{Strategy, baselines, mutwo};

/// Every registered strategy, fast ones first.
pub fn registry() -> Vec<Box<dyn Strategy>> {
    let mut strategies = baselines::all();
    strategies.push(Box::new(mutwo::MuTwo));
    strategies.push(Box::new(mutwo::MuTwoRefined));
    strategies.extend(crate::exact::strategies());
    strategies.push(Box::new(solve::Anytime::default()));
    strategies
}

/// Finds a strategy by name; `every:N`, `by-depth:D` and `threshold:F` take a parameter.
pub fn lookup(name: &str) -> Result<Box<dyn Strategy>, PlanError> {
    if let Some(parsed) = baselines::parse(name) {
        return parsed;
    }
    registry()
        .into_iter()
        .find(|s| s.name() == name)
        .ok_or_else(|| PlanError::UnknownStrategy {
            name: name.to_string(),
            known: registry()
                .iter()
                .map(|s| s.name())
                .chain(std::iter::once(baselines::PARAMETERIZED.to_string()))
                .collect::<Vec<_>>()
                .join(", "),
        })
}
