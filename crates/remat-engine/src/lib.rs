//! remat-engine
