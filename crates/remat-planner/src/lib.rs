//! remat-planner
pub mod exact;
