//! remat-reshard: load a checkpoint saved on N ranks onto M ranks, byte-exact, at memory
//! speed.
//!
//! Reads remat's sharded layout (see [`index`] for the index format), PyTorch DCP with
//! Hugging Face storage and Hugging Face layouts; plans every target chunk as box
//! intersections with the source pieces ([`plan()`]); executes the plan from memory maps
//! through bounded buffers, in parallel, crash-safe ([`exec`]); and verifies two layouts
//! hold the same tensors ([`verify()`]). [`run`] is a whole request as the front ends make
//! it (open, plan, then write, dry-run or finalize; verify by path).
//!
//! ```no_run
//! use remat_reshard::{Checkpoint, ExecOptions, Format, TargetSpec, execute, plan};
//! # fn main() -> remat_reshard::Result<()> {
//! let src = Checkpoint::open("ckpt-8".as_ref(), None)?;
//! let plan = plan(&src, &TargetSpec::new(3, Format::Remat))?;
//! execute(&src, &plan, "ckpt-3".as_ref(), &ExecOptions::default())?;
//! # Ok(()) }
//! ```

pub mod checkpoint;
pub mod checksum;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod fsio;
pub mod geometry;
pub mod index;
pub mod location;
pub mod open;
pub mod output;
pub mod plan;
mod readers;
pub mod remote;
pub mod run;
pub mod safetensors;
mod sched;
mod source_check;
mod stream;
pub mod target;
pub mod verify;

pub use checkpoint::{Checkpoint, Format, Piece, Placement, SkippedFile, TensorInfo};
pub use dtype::Dtype;
pub use error::{ReshardError, Result};
pub use exec::{DEFAULT_MAX_BUFFER, ExecOptions, ExecReport, execute, finalize, peak_buffer};
pub use plan::{Plan, RankStats, plan, rank_stats};
pub use target::{NameRule, Preset, Rule, TargetSpec};
pub use verify::{Difference, VerifyReport, verify};
