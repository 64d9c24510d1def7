pub mod bench;
pub mod plan;
pub mod profile;
pub mod reshard;
pub mod spec;
pub mod train;
