//! The benchmarks' errors: what a library reported, or what a benchmark refused or saw
//! fail, with what it was doing when it happened. Printed with [`chain`] (or `{:#}` by
//! `anyhow` in the binary), a failure reads `what it was doing: why`, cause after cause.

use std::fmt::Display;

/// What can go wrong in a benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Engine(#[from] remat_engine::EngineError),
    #[error(transparent)]
    Session(#[from] remat_engine::session::SessionError),
    #[error(transparent)]
    PlanExec(#[from] remat_engine::plan_exec::PlanExecError),
    #[error(transparent)]
    Swap(#[from] remat_engine::core::swap::SwapError),
    #[error(transparent)]
    Spec(#[from] remat_engine::spec::SpecError),
    #[error(transparent)]
    SpecRun(#[from] remat_engine::spec::run::RunError),
    #[error(transparent)]
    Mix(#[from] remat_engine::spec::mix::MixError),
    #[error(transparent)]
    Pipeline(#[from] remat_engine::pipeline::driver::PipelineBuildError),
    #[error(transparent)]
    Stage(
        #[from]
        remat_engine::pipeline::StageError<remat_engine::pipeline::graph_stage::GraphStageError>,
    ),
    #[error(transparent)]
    MicroBatches(#[from] remat_engine::pipeline::limits::MicroBatchesOutOfRange),
    #[error(transparent)]
    Planner(#[from] remat_planner::PlanError),
    #[error(transparent)]
    Import(#[from] remat_planner::ImportError),
    #[error(transparent)]
    Synth(#[from] remat_planner::synth::SynthError),
    #[error(transparent)]
    Graph(#[from] remat_planner::GraphError),
    #[error(transparent)]
    Multi(#[from] remat_planner::multi::MultiError),
    #[error(transparent)]
    Units(#[from] remat_units::UnitError),
    #[error(transparent)]
    Reshard(#[from] remat_reshard::ReshardError),
    #[error(transparent)]
    ReshardRun(#[from] remat_reshard::run::RunError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    ParseInt(#[from] std::num::ParseIntError),
    #[error(transparent)]
    ParseFloat(#[from] std::num::ParseFloatError),
    /// A flag the benchmark refuses, or a measurement that went wrong; the message says
    /// which and why.
    #[error("{0}")]
    Failed(String),
    /// What the benchmark was doing when `source` failed.
    #[error("{doing}")]
    During {
        doing: String,
        #[source]
        source: Box<BenchError>,
    },
}

pub type Result<T, E = BenchError> = std::result::Result<T, E>;

impl BenchError {
    /// A failure described by `message`.
    pub fn msg(message: impl Display) -> Self {
        BenchError::Failed(message.to_string())
    }
}

/// `error` and its causes, outermost first, joined by `: ` (as `anyhow` prints `{:#}`).
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Says what the benchmark was doing when a result's error (or an empty option) happened.
pub trait Context<T> {
    fn context(self, doing: impl Display) -> Result<T>;
    fn with_context<D: Display>(self, doing: impl FnOnce() -> D) -> Result<T>;
}

impl<T, E: Into<BenchError>> Context<T> for std::result::Result<T, E> {
    fn context(self, doing: impl Display) -> Result<T> {
        self.map_err(|e| BenchError::During {
            doing: doing.to_string(),
            source: Box::new(e.into()),
        })
    }

    fn with_context<D: Display>(self, doing: impl FnOnce() -> D) -> Result<T> {
        self.map_err(|e| BenchError::During {
            doing: doing().to_string(),
            source: Box::new(e.into()),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, doing: impl Display) -> Result<T> {
        self.ok_or_else(|| BenchError::msg(doing))
    }

    fn with_context<D: Display>(self, doing: impl FnOnce() -> D) -> Result<T> {
        self.ok_or_else(|| BenchError::msg(doing()))
    }
}

/// Returns early with a [`BenchError::Failed`] of the formatted message.
macro_rules! bail {
    ($($message:tt)+) => {
        return Err($crate::error::BenchError::msg(format!($($message)+)))
    };
}

/// Returns early with a [`BenchError::Failed`] of the formatted message unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($message:tt)+) => {{
        // Bound first: `!(a > b)` on floats reads as `a <= b`, which NaN would not be.
        let holds: bool = $cond;
        if !holds {
            $crate::error::bail!($($message)+);
        }
    }};
}

/// A [`BenchError::Failed`] of the formatted message.
macro_rules! failed {
    ($($message:tt)+) => {
        $crate::error::BenchError::msg(format!($($message)+))
    };
}

pub(crate) use {bail, ensure, failed};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_keeps_the_cause_and_chain_prints_it() {
        let inner: Result<()> = Err(BenchError::msg("disk full"));
        let err = inner.context("writing the checkpoint").unwrap_err();
        assert_eq!(err.to_string(), "writing the checkpoint");
        assert_eq!(chain(&err), "writing the checkpoint: disk full");
        let none: Option<u8> = None;
        assert_eq!(
            none.context("no value").unwrap_err().to_string(),
            "no value"
        );
    }

    #[test]
    fn bail_and_ensure_format_their_message() {
        fn check(n: usize) -> Result<()> {
            ensure!(n > 0, "--steps must be at least 1 (got {n})");
            if n > 9 {
                bail!("--steps {n} is too many");
            }
            Ok(())
        }
        assert!(check(1).is_ok());
        assert_eq!(
            check(0).unwrap_err().to_string(),
            "--steps must be at least 1 (got 0)"
        );
        assert_eq!(check(10).unwrap_err().to_string(), "--steps 10 is too many");
        assert_eq!(failed!("{} x", 2).to_string(), "2 x");
    }
}
