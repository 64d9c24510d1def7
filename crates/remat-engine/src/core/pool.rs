//! The device memory pool: a byte budget with exact per-category accounting.
//!
//! Every tensor buffer is registered with a pool for as long as it lives: the pool counts
//! the *requested* bytes (`numel * dtype size`, no rounding), so tests can compute peaks by
//! hand and the planner's simulator can be compared to a measured run to the byte. A pool is
//! an ordinary object (shared with `Arc`), never a global: pipeline stages each own one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::core::buf::Buf;
pub use crate::core::buffer_cache::MIN_CACHED_BYTES;
use crate::core::buffer_cache::{BufferCache, Reuse};
use crate::core::dtype::DType;
use crate::core::error::EngineError;

pub use crate::core::category::Category;

/// Live and peak bytes of one category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CategoryStats {
    pub live: u64,
    pub peak: u64,
}

/// A snapshot of the pool's accounting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub budget: Option<u64>,
    pub live: u64,
    pub peak: u64,
    /// Indexed like [`Category::ALL`].
    pub categories: [CategoryStats; 5],
    pub allocations: u64,
    /// Freed buffers held for reuse (not live: see [`MemoryPool::set_buffer_cache`]).
    pub cached: u64,
    /// Allocations served from those buffers.
    pub cache_hits: u64,
}

impl PoolStats {
    pub fn category(&self, c: Category) -> CategoryStats {
        self.categories[c.index()]
    }
}

/// Whether an event allocated or freed bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Alloc,
    Free,
}

/// One entry of the optional timeline of the pool (see [`MemoryPool::enable_event_log`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolEvent {
    pub kind: EventKind,
    pub bytes: u64,
    pub category: Category,
    /// Graph node index that allocated the buffer, when a graph did.
    pub node: Option<usize>,
    /// Total live bytes right after the event.
    pub live_after: u64,
}

#[derive(Debug, Default)]
struct PoolState {
    stats: PoolStats,
    events: Option<Vec<PoolEvent>>,
    cache: BufferCache,
}

/// A byte-budgeted memory pool. Cheap to share: wrap it in an `Arc`.
#[derive(Debug, Default)]
pub struct MemoryPool {
    state: Mutex<PoolState>,
    poison_overwritten: AtomicBool,
}

/// The pool-level out-of-memory error; the graph adds the node being run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolOom {
    pub category: Category,
    pub requested: u64,
    pub live: u64,
    pub budget: u64,
}

impl PoolOom {
    /// Attaches the name of the node (or tensor) being produced.
    pub fn at(self, node: impl Into<String>) -> EngineError {
        EngineError::OutOfMemory {
            node: node.into(),
            category: self.category,
            requested: self.requested,
            live: self.live,
            budget: self.budget,
        }
    }
}

impl MemoryPool {
    /// A pool without a budget (accounting only).
    pub fn unbounded() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A pool refusing allocations that would take live bytes above `budget`.
    pub fn with_budget(budget: u64) -> Arc<Self> {
        let pool = Self::default();
        pool.lock().stats.budget = Some(budget);
        Arc::new(pool)
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding the lock cannot leave the counters half-updated (each
        // update is a few integer writes), so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the budget. A smaller budget also bounds the buffer cache: live + cached
    /// stays within it.
    pub fn set_budget(&self, budget: Option<u64>) {
        let mut st = self.lock();
        st.stats.budget = budget;
        let live = st.stats.live;
        let freed = budget.map(|b| st.cache.limit(live, b)).unwrap_or_default();
        drop(st);
        drop(freed);
    }

    pub fn stats(&self) -> PoolStats {
        let st = self.lock();
        PoolStats {
            cached: st.cache.bytes(),
            ..st.stats.clone()
        }
    }

    /// Bytes of freed buffers held for reuse.
    pub fn cached(&self) -> u64 {
        self.lock().cache.bytes()
    }

    /// Whether freed buffers are kept for reuse (on by default). A training step allocates
    /// the same sizes every step; reusing a buffer saves its page faults and the zeroing of
    /// new memory. The cache never holds more than the high-water mark of live bytes minus
    /// the live bytes, and it is not counted as live (see `buffer_cache`). Turning it off
    /// frees what it holds.
    pub fn set_buffer_cache(&self, on: bool) {
        let freed = self.lock().cache.set_enabled(on);
        drop(freed);
    }

    /// A check for kernels: buffers handed out by [`crate::Tensor::for_overwrite`] are
    /// filled with NaN, so an element a kernel forgets to write shows in its results
    /// instead of silently reusing a stale value.
    pub fn set_poison_overwritten(&self, on: bool) {
        self.poison_overwritten.store(on, Ordering::Relaxed);
    }

    pub fn poisons_overwritten(&self) -> bool {
        self.poison_overwritten.load(Ordering::Relaxed)
    }

    /// Frees every cached buffer (the cache stays on).
    pub fn trim(&self) {
        let freed = self.lock().cache.drain();
        drop(freed);
    }

    pub fn live(&self) -> u64 {
        self.lock().stats.live
    }

    pub fn peak(&self) -> u64 {
        self.lock().stats.peak
    }

    /// Restarts peak tracking (overall and per category) at the current live bytes.
    pub fn reset_peak(&self) {
        let mut st = self.lock();
        st.stats.peak = st.stats.live;
        for c in st.stats.categories.iter_mut() {
            c.peak = c.live;
        }
    }

    /// Starts recording every alloc/free (clears a previous log).
    pub fn enable_event_log(&self) {
        self.lock().events = Some(Vec::new());
    }

    /// Stops recording and returns the events recorded so far.
    pub fn take_event_log(&self) -> Vec<PoolEvent> {
        self.lock().events.take().unwrap_or_default()
    }

    /// Registers `bytes` of `category`; fails without side effects when over budget.
    pub fn reserve(
        self: &Arc<Self>,
        bytes: u64,
        category: Category,
        node: Option<usize>,
    ) -> Result<Reservation, PoolOom> {
        self.reserve_buffer(bytes, category, node, None)
            .map(|(r, _)| r)
    }

    /// [`Self::reserve`], and a cached buffer of `numel` elements of `dtype` when one is
    /// held (its contents are stale).
    pub(crate) fn reserve_buffer(
        self: &Arc<Self>,
        bytes: u64,
        category: Category,
        node: Option<usize>,
        buffer: Option<(DType, usize)>,
    ) -> Result<(Reservation, Option<Buf>), PoolOom> {
        let mut st = self.lock();
        let live = st.stats.live;
        if let Some(budget) = st.stats.budget.filter(|&b| live + bytes > b) {
            return Err(PoolOom {
                category,
                requested: bytes,
                live,
                budget,
            });
        }
        let s = &mut st.stats;
        s.live += bytes;
        s.peak = s.peak.max(s.live);
        s.allocations += 1;
        let c = &mut s.categories[category.index()];
        c.live += bytes;
        c.peak = c.peak.max(c.live);
        let live_after = s.live;
        let (reused, evicted) = match st.cache.on_reserve(live_after, buffer) {
            Reuse::Hit(buf) => {
                st.stats.cache_hits += 1;
                (Some(buf), Vec::new())
            }
            Reuse::Miss(evicted) => (None, evicted),
        };
        if let Some(ev) = st.events.as_mut() {
            ev.push(PoolEvent {
                kind: EventKind::Alloc,
                bytes,
                category,
                node,
                live_after,
            });
        }
        drop(st);
        drop(evicted);
        let reservation = Reservation {
            pool: Arc::clone(self),
            bytes,
            category,
            node,
            released: false,
        };
        Ok((reservation, reused))
    }

    /// Returns `bytes` to the pool and offers the freed `buf` (if any) to the cache in the
    /// same step, so `live + cached` never rises.
    fn release(&self, bytes: u64, category: Category, node: Option<usize>, buf: Option<Buf>) {
        let mut st = self.lock();
        let live = st.stats.live;
        let refused = buf.and_then(|b| st.cache.put(live, b));
        let s = &mut st.stats;
        s.live -= bytes;
        s.categories[category.index()].live -= bytes;
        let live_after = s.live;
        if let Some(ev) = st.events.as_mut() {
            ev.push(PoolEvent {
                kind: EventKind::Free,
                bytes,
                category,
                node,
                live_after,
            });
        }
        drop(st);
        drop(refused);
    }
}

/// Bytes held in a pool; returned when dropped (the buffer it accounts for dies with it).
#[derive(Debug)]
pub struct Reservation {
    pool: Arc<MemoryPool>,
    bytes: u64,
    category: Category,
    node: Option<usize>,
    released: bool,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    pub fn category(&self) -> Category {
        self.category
    }
    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }
}

impl Reservation {
    /// Returns the bytes now, offering the buffer they accounted for to the pool's cache;
    /// the reservation is then spent and its drop does nothing.
    pub(crate) fn release_with(&mut self, buf: Buf) {
        if !self.released {
            self.released = true;
            self.pool
                .release(self.bytes, self.category, self.node, Some(buf));
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.released {
            self.pool
                .release(self.bytes, self.category, self.node, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_exact_bytes_per_category_and_peak() {
        let pool = MemoryPool::unbounded();
        let a = pool.reserve(12, Category::Activations, None).unwrap();
        let b = pool.reserve(100, Category::Parameters, None).unwrap();
        drop(a);
        let _c = pool.reserve(4, Category::Activations, Some(3)).unwrap();
        let s = pool.stats();
        assert_eq!(s.live, 104);
        assert_eq!(s.peak, 112);
        assert_eq!(
            s.category(Category::Activations),
            CategoryStats { live: 4, peak: 12 }
        );
        assert_eq!(s.category(Category::Parameters).live, 100);
        drop(b);
        assert_eq!(pool.live(), 4);
    }

    #[test]
    fn budget_refuses_without_side_effects() {
        let pool = MemoryPool::with_budget(100);
        let _a = pool.reserve(60, Category::Activations, None).unwrap();
        let err = pool.reserve(41, Category::Temporaries, None).unwrap_err();
        assert_eq!(err.requested, 41);
        assert_eq!(err.live, 60);
        assert_eq!(err.budget, 100);
        assert_eq!(pool.live(), 60);
        let msg = err.at("matmul#3").to_string();
        assert!(
            msg.contains("matmul#3")
                && msg.contains("requested 41 B of temporaries")
                && msg.contains("budget 100 B (1 B short)"),
            "{msg}"
        );
    }

    #[test]
    fn event_log_records_node_and_live_bytes() {
        let pool = MemoryPool::unbounded();
        pool.enable_event_log();
        let a = pool.reserve(8, Category::Activations, Some(7)).unwrap();
        drop(a);
        let ev = pool.take_event_log();
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0].kind, EventKind::Alloc);
        assert_eq!(ev[0].node, Some(7));
        assert_eq!(ev[1].kind, EventKind::Free);
        assert_eq!(ev[1].live_after, 0);
    }
}
