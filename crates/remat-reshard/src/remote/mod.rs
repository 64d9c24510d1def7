//! Checkpoints in object stores (S3 and S3-compatible servers, or a local directory
//! through the same interface).
//!
//! A remote source is opened from its objects' headers alone: each safetensors object
//! becomes a sparse scratch file of its full size holding only its header ([`mirror`]),
//! so the readers, the planner and the executor see an ordinary checkpoint. Before
//! anything reads data, exactly the byte ranges the target files need are fetched into
//! those files with ranged GETs ([`fetch`]), concurrently, each request bounded so that
//! requests in flight hold at most `--max-buffer`. The fetched bytes live in the page
//! cache (file pages the executor hands back as it passes them), not in anonymous memory.
//!
//! A remote destination ([`sink`]) gets each target file written to scratch by the
//! executor, then uploaded in multipart parts, then certified by a marker object
//! holding its size, ETag and chunk checksums. The index goes last, so a stopped run
//! leaves no complete-looking checkpoint; a re-run skips every file its marker
//! certifies. Retries with backoff (throttling, dropped connections) are the store
//! client's ([`crate::location`]).
//!
//! object_store is async: a tokio runtime lives only inside these calls (`block_on`),
//! so the library's API stays synchronous.

pub mod fetch;
pub mod mirror;
pub mod sink;

use std::fs::File;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::location::Remote;

/// A remote checkpoint: the opened checkpoint plus what fetching its data needs. Made by
/// [`mirror`], filled by [`fetch`], read by [`sink`]; it sits here, above them, so the
/// parts share it without importing each other.
pub struct RemoteCheckpoint {
    pub ckpt: Checkpoint,
    pub remote: Remote,
    /// Object name of each of `ckpt.files`, with a handle to write fetched bytes into.
    pub(crate) files: Vec<(String, File)>,
}

/// Runs `f` to completion on a runtime made for the call.
pub(crate) fn block_on<F: Future>(f: F) -> Result<F::Output> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| {
            crate::error::store_err("(runtime)", format!("cannot start the I/O runtime: {e}"))
        })?;
    Ok(rt.block_on(f))
}

/// A fresh scratch directory: `REMAT_SCRATCH` when set, else the system temp dir.
pub(crate) fn scratch_dir(what: &str) -> Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = std::env::var_os("REMAT_SCRATCH")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = base.join(format!("remat-{what}-{}-{n}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(crate::error::io_err(&dir))?;
    }
    std::fs::create_dir_all(&dir).map_err(crate::error::io_err(&dir))?;
    Ok(dir)
}

/// Request sizes and how many may be in flight so that together they hold at most
/// `max_buffer` bytes: requests of a quarter of the bound (between 1 and 16 MiB: smaller
/// ones pay the request latency too often, larger ones lose parallelism), up to 16 at a time.
pub(crate) fn request_shape(max_buffer: u64) -> (u64, usize) {
    let size = (max_buffer / 4).clamp(1 << 20, 16 << 20);
    let in_flight = (max_buffer / size).clamp(1, 16) as usize;
    (size, in_flight)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_in_flight_hold_at_most_the_bound() {
        for max_buffer in [1 << 20, 4 << 20, 256 << 20, 4 << 30] {
            let (size, in_flight) = request_shape(max_buffer);
            assert!((1 << 20..=16 << 20).contains(&size));
            assert!(size * in_flight as u64 <= max_buffer, "{max_buffer}");
        }
    }
}
