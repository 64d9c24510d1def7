//! remat-planner
