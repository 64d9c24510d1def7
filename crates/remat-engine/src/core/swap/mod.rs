//! The host store for swapping activations out of the device pool, and the copy engine that
//! moves them in the background.
//!
//! - [`HostStore`] holds swapped-out buffers with its own byte accounting (live and peak),
//!   either in process memory or, given a directory, in one memory-mapped file on disk.
//! - [`CopyEngine`] is a small copy engine in front of a store: one worker thread per
//!   direction (device to host, host to device), each with a FIFO queue, so that an offload
//!   and a prefetch can overlap each other and the compute thread. Each submitted copy returns
//!   a [`Transfer`] completion handle; waiting on one that is not finished yet is measured
//!   as stall time. A [`Throttle`] (bandwidth limit and fixed latency) slows the copies down
//!   on purpose, to model a slow link or to make stalls visible in tests.
//!
//! Buffers cross threads by value (the [`CopyBuf`] trait): an offload moves the device
//! buffer into the worker and hands it back when the copy is done, so the caller frees the
//! device bytes only once they are safe on the host; a prefetch moves a freshly allocated
//! device buffer into the worker and hands it back filled.

mod copy_engine;
mod store;

pub use copy_engine::{CopyBuf, CopyEngine, CopyStats, Direction, Throttle, Transfer, Waited};
pub use store::{HostBacking, HostStats, HostStore, SlotId};

use std::path::PathBuf;

/// What can go wrong in the host store or the copy engine.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    #[error("swap file {path}: {action} failed")]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("host store has no slot {slot} (never allocated, or already released)")]
    UnknownSlot { slot: SlotId },
    #[error(
        "host slot {slot} holds {stored} bytes but the {what} is {requested} bytes; a swapped \
         tensor must come back into a buffer of exactly its size"
    )]
    SizeMismatch {
        slot: SlotId,
        what: &'static str,
        stored: u64,
        requested: u64,
    },
    #[error(
        "host store out of space: {requested} bytes requested for {tag} with {live} bytes live \
         of a {capacity}-byte host capacity"
    )]
    HostCapacity {
        tag: String,
        requested: u64,
        live: u64,
        capacity: u64,
    },
    #[error("{what} is not supported")]
    Unsupported { what: String },
    #[error("the {direction} copy worker has stopped; the transfer cannot run")]
    WorkerGone { direction: Direction },
}
