//! The execution context: the memory pool and the thread pool a graph runs on.

use std::sync::Arc;

use crate::core::error::{EngineError, Result};
use crate::core::pool::MemoryPool;

/// What graphs run with: a memory pool (shared, never global) and a rayon thread pool of a
/// fixed size. Results are bit-identical across runs with the same thread count: kernels
/// split work by output element only, never by reduction order.
#[derive(Clone, Debug)]
pub struct ExecContext {
    pool: Arc<MemoryPool>,
    threads: usize,
    rayon: Arc<rayon::ThreadPool>,
}

/// Worker threads allowed per available core, and in all.
///
/// Gradients are bit-exact for a given thread count, so running more threads than cores
/// is legitimate: it reproduces, slowly, a run of a bigger machine. Up to 64 threads per
/// core covers any such machine a small host can stand in for; past that each worker gets
/// under 2% of a core and start-up and scheduling dominate (2000 workers on 2 cores ran for
/// minutes without finishing a step). 1024 is more cores than one CPU host has.
pub const THREADS_PER_CORE: usize = 64;
pub const MAX_THREADS: usize = 1024;

/// The most worker threads [`ExecContext::new`] starts on this machine.
pub fn max_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.saturating_mul(THREADS_PER_CORE).min(MAX_THREADS)
}

impl ExecContext {
    /// A context with its own rayon pool of `threads` threads (at least 1, at most
    /// [`max_threads`]: more is an error, not a hang).
    pub fn new(pool: Arc<MemoryPool>, threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        let limit = max_threads();
        if threads > limit {
            return Err(EngineError::Invalid(format!(
                "threads {threads} is more than this machine's limit of {limit} worker threads \
                 ({THREADS_PER_CORE} per available core, at most {MAX_THREADS})"
            )));
        }
        let rayon = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("remat-worker-{i}"))
            .build()
            .map_err(|e| EngineError::Invalid(format!("cannot start {threads} threads: {e}")))?;
        Ok(Self {
            pool,
            threads,
            rayon: Arc::new(rayon),
        })
    }

    /// A single-threaded context on an unbounded pool (tests, small tools).
    pub fn single_threaded() -> Result<Self> {
        Self::new(MemoryPool::unbounded(), 1)
    }

    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on this context's thread pool (so rayon and gemm use `threads` threads),
    /// with the caller's `tracing` subscriber (recompute logs reach it from the workers).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        self.rayon
            .install(move || tracing::dispatcher::with_default(&dispatch, f))
    }

    /// The same threads with another memory pool.
    pub fn with_pool(&self, pool: Arc<MemoryPool>) -> Self {
        Self {
            pool,
            threads: self.threads,
            rayon: Arc::clone(&self.rayon),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_many_threads_is_an_error_not_a_hang() {
        let limit = max_threads();
        for threads in [limit + 1, 1_000_000_000_000] {
            let err = ExecContext::new(MemoryPool::unbounded(), threads)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!("threads {threads}")) && err.contains("limit"),
                "{err}"
            );
        }
        assert_eq!(
            ExecContext::new(MemoryPool::unbounded(), 2)
                .unwrap()
                .threads(),
            2
        );
    }
}
