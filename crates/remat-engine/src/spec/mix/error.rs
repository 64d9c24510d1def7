//! Errors of profiling and solving mixed plans.

use thiserror::Error;

use crate::spec::SpecError;
use crate::spec::run::RunError;

#[derive(Debug, Error)]
pub enum MixError {
    // Boxed: the spec and run errors are large, and this one is returned by closures.
    #[error(transparent)]
    Spec(Box<SpecError>),
    #[error(transparent)]
    Run(Box<RunError>),
    #[error(
        "--memory-budget {} is below the floor of this model: no allowed mix of keep, recompute and offload peaks under {} (every slot's declared policy respected); raise --memory-budget to at least {}",
        remat_units::human_bytes(*budget),
        remat_units::human_bytes(*floor),
        remat_units::exact_bytes(*floor)
    )]
    BelowFloor { budget: u64, floor: u64 },
    #[error("profile: {0}")]
    Profile(String),
}

impl From<SpecError> for MixError {
    fn from(e: SpecError) -> Self {
        MixError::Spec(Box::new(e))
    }
}

impl From<RunError> for MixError {
    fn from(e: RunError) -> Self {
        MixError::Run(Box::new(e))
    }
}
