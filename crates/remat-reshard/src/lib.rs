//! remat-reshard
