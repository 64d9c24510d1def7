//! Exact and fast planners: optimal chain checkpointing (a Rotor-style dynamic program that
//! reaches Griewank's binomial optimum on unit chains), Checkmate's MILP (feature `milp`)
//! and a fast eviction-based strategy for general graphs.

pub mod chain;
pub mod chain_graph;
pub mod chain_strategy;
pub mod evict;
#[cfg(feature = "milp")]
pub mod milp;
pub mod revolve;

use crate::strategy::Strategy;

/// The strategies of this module, for the registry.
pub fn strategies() -> Vec<Box<dyn Strategy>> {
    let all: Vec<Box<dyn Strategy>> =
        vec![Box::new(evict::Evict), Box::new(chain_strategy::ChainDp)];
    #[cfg(feature = "milp")]
    let all = {
        let mut all = all;
        all.push(Box::new(milp::CheckmateMilp {
            options: milp::MilpOptions::default(),
        }));
        all
    };
    all
}
