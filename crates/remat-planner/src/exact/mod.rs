//! Exact and fast planners: optimal chain checkpointing (a Rotor-style dynamic program that
//! reaches Griewank's binomial optimum on unit chains), Checkmate's MILP (feature `milp`)
//! and a fast eviction-based strategy for general graphs.

pub mod chain;
pub mod revolve;
