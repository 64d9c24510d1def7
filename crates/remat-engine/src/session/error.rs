//! The sessions' errors: what a library reported, a setting refused, or a budget no plan
//! meets, with what the session was doing when it happened.

use std::path::PathBuf;

use crate::core::error::EngineError;
use crate::core::swap::SwapError;
use crate::models::hf_file::HfError;
use crate::plan_exec::PlanExecError;
use crate::spec::SpecError;
use crate::spec::mix::MixError;
use crate::spec::run::error::RunError;
use remat_units::human_bytes;

/// What can go wrong in a session.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    PlanExec(#[from] PlanExecError),
    #[error(transparent)]
    Swap(#[from] SwapError),
    #[error(transparent)]
    Planner(#[from] remat_planner::PlanError),
    #[error(transparent)]
    Multi(#[from] remat_planner::multi::MultiError),
    #[error(transparent)]
    Mix(#[from] MixError),
    /// A spec or model config that could not be read or compiled.
    #[error(transparent)]
    Spec(Box<SpecError>),
    /// A spec-driven model that could not be built or stepped.
    #[error(transparent)]
    Run(Box<RunError>),
    /// A Hugging Face file that could not be read or written (`--init`, `--dump-grads`).
    #[error(transparent)]
    Hf(Box<HfError>),
    /// A setting refused before any work; the message names the flag or field.
    #[error("{0}")]
    Invalid(String),
    /// A data file that could not be read.
    #[error("reading --data {}", path.display())]
    ReadData {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// No plan meets the memory budget: the smallest peak any plan reaches, and by which.
    #[error(
        "no plan fits a memory budget of {budget} bytes ({}): the smallest feasible budget is {best_peak} bytes ({}, reached by {strategy}); static memory alone is {}",
        human_bytes(*budget),
        human_bytes(*best_peak),
        human_bytes(*static_bytes)
    )]
    NoPlanFits {
        budget: u64,
        best_peak: u64,
        strategy: String,
        static_bytes: u64,
    },
    /// What the session was doing when `source` failed.
    #[error("{doing}")]
    During {
        doing: String,
        #[source]
        source: Box<SessionError>,
    },
}

// Boxed: these errors are large, and every session result carries the enum.
impl From<SpecError> for SessionError {
    fn from(e: SpecError) -> Self {
        SessionError::Spec(Box::new(e))
    }
}

impl From<RunError> for SessionError {
    fn from(e: RunError) -> Self {
        SessionError::Run(Box::new(e))
    }
}

impl From<HfError> for SessionError {
    fn from(e: HfError) -> Self {
        SessionError::Hf(Box::new(e))
    }
}

pub type Result<T, E = SessionError> = std::result::Result<T, E>;

impl SessionError {
    /// `source`, said to have happened while doing `doing`.
    pub fn during(doing: impl Into<String>, source: impl Into<SessionError>) -> Self {
        SessionError::During {
            doing: doing.into(),
            source: Box::new(source.into()),
        }
    }

    /// A refused setting.
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        SessionError::Invalid(message.into())
    }
}

/// `result`'s error, said to have happened while doing something.
pub(crate) trait During<T> {
    fn during(self, doing: &str) -> Result<T>;
    fn during_with(self, doing: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<SessionError>> During<T> for std::result::Result<T, E> {
    fn during(self, doing: &str) -> Result<T> {
        self.map_err(|e| SessionError::during(doing, e))
    }

    fn during_with(self, doing: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| SessionError::during(doing(), e))
    }
}

/// An error shown with its causes, `outer: cause: cause` (as `{:#}` shows an
/// `anyhow::Error`), for messages that carry an error as text.
pub(crate) struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(e) = cause {
            write!(f, ": {e}")?;
            cause = e.source();
        }
        Ok(())
    }
}

/// Bytes in MiB without the unit, for table columns headed in MiB (prose uses
/// [`remat_units::human_bytes`]).
pub fn mib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn during_keeps_the_cause_as_the_source() {
        let err = SessionError::during("profiling the training step", SessionError::invalid("x"));
        assert_eq!(err.to_string(), "profiling the training step");
        let source = std::error::Error::source(&err).map(ToString::to_string);
        assert_eq!(source.as_deref(), Some("x"));
        assert_eq!(Chain(&err).to_string(), "profiling the training step: x");
    }
}
