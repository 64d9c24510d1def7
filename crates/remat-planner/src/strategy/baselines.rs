//! Baseline strategies.

use super::{Planned, Problem, Strategy, plan_from_decisions};
use crate::error::PlanError;
use crate::plan::Decision;

/// Keeps every activation.
pub struct StoreAll;

impl Strategy for StoreAll {
    fn name(&self) -> String {
        "store-all".into()
    }
    fn summary(&self) -> &'static str {
        "keep every activation until its last use"
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        let decisions = vec![Decision::Keep; problem.graph.len()];
        plan_from_decisions(problem, &self.name(), decisions)
    }
}

/// The default instances, for `--compare` and the benchmark.
pub fn all() -> Vec<Box<dyn Strategy>> {
    vec![Box::new(StoreAll)]
}

/// Parses a parameterized baseline name.
pub fn parse(_name: &str) -> Option<Box<dyn Strategy>> {
    None
}
