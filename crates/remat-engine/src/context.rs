//! The execution context: the memory pool and the thread pool a graph runs on.

use std::sync::Arc;

use crate::error::{EngineError, Result};
use crate::pool::MemoryPool;

/// What graphs run with: a memory pool (shared, never global) and a rayon thread pool of a
/// fixed size. Results are bit-identical across runs with the same thread count: kernels
/// split work by output element only, never by reduction order.
#[derive(Clone, Debug)]
pub struct ExecContext {
    pool: Arc<MemoryPool>,
    threads: usize,
    rayon: Arc<rayon::ThreadPool>,
}

impl ExecContext {
    /// A context with its own rayon pool of `threads` threads (at least 1).
    pub fn new(pool: Arc<MemoryPool>, threads: usize) -> Result<Self> {
        let threads = threads.max(1);
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
