//! Pipeline stages with a per-micro-batch activation checkpoint manager.
//!
//! - [`manager`]: per stage, which micro-batches' activations are kept until backward and
//!   which are recomputed from the stage's kept input ([`CheckpointManager`], [`Strategy`]).
//! - [`schedule`]: GPipe and 1F1B as pure per-stage step lists, plus a simulator.
//! - [`runner`]: one thread per stage driving a [`StageWork`] through a schedule.
//! - [`transport`]: activations forward and gradients backward between neighbouring stages.
//! - [`wire`]: those messages as bytes, for a transport between processes.
//! - [`limits`]: the most stages and micro-batches remat runs.
//! - `mpi` (cargo feature `mpi`): stages as MPI ranks, with data-parallel replicas.

pub mod activation;
pub mod auto;
pub mod driver;
pub mod graph_stage;
pub mod limits;
pub mod manager;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod partition;
pub mod runner;
pub mod schedule;
pub mod staged_gpt;
pub mod staged_mlp;
pub mod transport;
pub mod wire;

pub use activation::{Activation, DType, DeepCopy, HostData, HostTensor};
pub use manager::{CheckpointError, CheckpointManager, EntryMeta, StoreOutcome, Strategy};
pub use runner::{
    PipelineConfig, PipelineReport, StageError, StageReport, StageWork, run_pipeline, run_stage,
};
pub use schedule::{Schedule, Step};
pub use transport::{ChannelTransport, Transport, TransportError};
