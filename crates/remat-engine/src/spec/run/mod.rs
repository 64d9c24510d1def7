//! Running compiled specs: op implementations shared by forward and recompute, the
//! per-layer slot store with its buffers, and the mixture-of-experts ops.

pub mod act;
pub mod check;
pub mod error;
pub mod fingerprint;
pub mod linalg;
pub mod moe;
pub mod ops;
pub mod ssm;

pub use act::Act;
pub use error::{RunError, RunResult};
pub use ops::{OpEnv, execute};
pub mod exec;
pub mod lora;
pub mod meter;
