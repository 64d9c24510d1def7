//! Byte accounting of the spec runtime through the engine's [`MemoryPool`]: every buffer the
//! runtime keeps (block inputs, forward intermediates, saved slots, shared recompute
//! buffers, prefetched slots, backward scratch, gradients) holds a [`Hold`] for its actual
//! bytes, returned when the buffer is dropped. The pool enforces the byte budget (its
//! typed out-of-memory error names the layer and slot) and measures the peak; the meter
//! adds a breakdown of what the pool's activation bytes were for, so a run shows the
//! difference between per-layer saved storage and the buffers shared across layers.

use std::sync::{Arc, Mutex};

use crate::pool::{Category, MemoryPool, Reservation};

use super::error::{RunError, RunResult};

/// Live and peak bytes of the runtime's own uses (the pool has the totals).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeterStats {
    /// Pool peak over the step (every category, parameters included when the caller
    /// registered them).
    pub peak: u64,
    /// Per-layer saved slots and kept block inputs.
    pub saved_live: u64,
    pub saved_peak: u64,
    /// Buffers shared by every layer's recompute.
    pub shared_live: u64,
    pub shared_peak: u64,
    /// Activations and backward scratch of the step, whatever they are for.
    pub activations_peak: u64,
}

/// What a held buffer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Per-layer storage kept from a layer's forward to its backward.
    Saved,
    /// A recompute buffer shared by all layers.
    Shared,
    /// Prefetched from the host store for one layer's backward.
    Prefetched,
    /// A forward value still in use by the layer's forward (or the block output).
    Forward,
    /// Backward scratch: gradients of activations, rebuilt-but-not-kept op outputs.
    Scratch,
    /// Parameter gradients.
    Gradient,
}

impl Use {
    fn category(self) -> Category {
        match self {
            Use::Saved | Use::Shared | Use::Prefetched | Use::Forward => Category::Activations,
            Use::Scratch => Category::Temporaries,
            Use::Gradient => Category::Gradients,
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Breakdown {
    saved_live: u64,
    saved_peak: u64,
    shared_live: u64,
    shared_peak: u64,
}

/// The runtime's view of a pool.
#[derive(Debug)]
pub struct Meter {
    pool: Arc<MemoryPool>,
    breakdown: Mutex<Breakdown>,
}

impl Meter {
    pub fn new(pool: Arc<MemoryPool>) -> Arc<Self> {
        Arc::new(Self {
            pool,
            breakdown: Mutex::new(Breakdown::default()),
        })
    }

    /// A meter on a pool without a budget.
    pub fn unbounded() -> Arc<Self> {
        Self::new(MemoryPool::unbounded())
    }

    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Breakdown> {
        // The counters are plain integer updates: a poisoned lock is still consistent.
        self.breakdown.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> MeterStats {
        let b = *self.lock();
        let pool = self.pool.stats();
        MeterStats {
            peak: pool.peak,
            saved_live: b.saved_live,
            saved_peak: b.saved_peak,
            shared_live: b.shared_live,
            shared_peak: b.shared_peak,
            activations_peak: pool.category(Category::Activations).peak
                + pool.category(Category::Temporaries).peak,
        }
    }

    pub fn reset_peak(&self) {
        self.pool.reset_peak();
        let mut b = self.lock();
        b.saved_peak = b.saved_live;
        b.shared_peak = b.shared_live;
    }

    /// Registers `bytes` for `use_`; over the pool's budget it is the engine's
    /// out-of-memory error naming `what` (layer and slot).
    pub fn hold(
        self: &Arc<Self>,
        bytes: u64,
        use_: Use,
        what: impl FnOnce() -> String,
    ) -> RunResult<Hold> {
        let reservation = self
            .pool
            .reserve(bytes, use_.category(), None)
            .map_err(|oom| RunError::Memory(oom.at(what())))?;
        let mut b = self.lock();
        match use_ {
            Use::Saved => {
                b.saved_live += bytes;
                b.saved_peak = b.saved_peak.max(b.saved_live);
            }
            Use::Shared => {
                b.shared_live += bytes;
                b.shared_peak = b.shared_peak.max(b.shared_live);
            }
            _ => {}
        }
        Ok(Hold {
            meter: Arc::clone(self),
            _reservation: reservation,
            bytes,
            use_,
        })
    }
}

/// Bytes held in the pool (and the meter's breakdown) until dropped.
#[derive(Debug)]
pub struct Hold {
    meter: Arc<Meter>,
    _reservation: Reservation,
    bytes: u64,
    use_: Use,
}

impl Hold {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut b = self.meter.lock();
        match self.use_ {
            Use::Saved => b.saved_live -= self.bytes,
            Use::Shared => b.shared_live -= self.bytes,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_count_in_the_pool_and_the_breakdown() {
        let meter = Meter::unbounded();
        let a = meter.hold(100, Use::Saved, || "a".into()).unwrap();
        let b = meter.hold(40, Use::Shared, || "b".into()).unwrap();
        let c = meter.hold(8, Use::Scratch, || "c".into()).unwrap();
        assert_eq!(meter.pool().live(), 148);
        drop((a, c));
        let s = meter.stats();
        assert_eq!((s.peak, s.saved_peak, s.saved_live), (148, 100, 0));
        assert_eq!((s.shared_live, s.shared_peak), (40, 40));
        drop(b);
        assert_eq!(meter.pool().live(), 0);
    }

    #[test]
    fn over_budget_is_the_engine_oom_naming_the_buffer() {
        let meter = Meter::new(MemoryPool::with_budget(64));
        let _a = meter.hold(60, Use::Saved, || "a".into()).unwrap();
        let e = meter
            .hold(8, Use::Shared, || "layer 2 slot `ln1`".into())
            .unwrap_err();
        assert!(matches!(
            e,
            RunError::Memory(crate::EngineError::OutOfMemory { .. })
        ));
        assert!(e.to_string().contains("layer 2 slot `ln1`"), "{e}");
        assert_eq!(meter.stats().shared_live, 0);
    }
}
