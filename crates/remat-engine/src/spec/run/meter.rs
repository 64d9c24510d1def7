//! Byte accounting of the spec runtime through the engine's [`MemoryPool`]: every buffer the
//! runtime keeps (block inputs, forward intermediates, saved slots, shared recompute
//! buffers, prefetched slots, backward scratch, gradients) holds a [`Hold`] for its actual
//! bytes, returned when the buffer is dropped. The pool enforces the byte budget (its
//! typed out-of-memory error names the layer and slot) and measures the peak; the meter
//! adds a breakdown of what the pool's activation bytes were for, so a run shows the
//! difference between per-layer saved storage and the buffers shared across layers.

use std::sync::{Arc, Mutex};

use crate::core::pool::{Category, MemoryPool, Reservation};

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

/// A stretch of a training step whose peak the profile needs on its own: the layers'
/// forwards, the LM head, the layers' backwards, and what follows the last backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    Forward(usize),
    Head,
    Backward(usize),
    Tail,
}

/// One phase of a traced step: the pool's live bytes when it began and its peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhaseRecord {
    pub phase: Phase,
    pub start: u64,
    pub peak: u64,
}

/// What a traced step recorded: its phases in order, and how long each recompute step and
/// each host-store transfer took.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub phases: Vec<PhaseRecord>,
    /// (layer, recipe index, seconds) per recompute op run in backward.
    pub recomputes: Vec<(usize, usize, f64)>,
    /// (layer, `@input:NAME` or slot name, seconds) per offload (forward) or prefetch
    /// (backward) of one value.
    pub transfers: Vec<(usize, String, f64)>,
    open: Option<(Phase, u64)>,
}

/// The runtime's view of a pool.
#[derive(Debug)]
pub struct Meter {
    pool: Arc<MemoryPool>,
    breakdown: Mutex<Breakdown>,
    trace: Mutex<Option<Trace>>,
}

impl Meter {
    pub fn new(pool: Arc<MemoryPool>) -> Arc<Self> {
        Arc::new(Self {
            pool,
            breakdown: Mutex::new(Breakdown::default()),
            trace: Mutex::new(None),
        })
    }

    fn trace_lock(&self) -> std::sync::MutexGuard<'_, Option<Trace>> {
        self.trace.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts tracing (clears an earlier trace). While tracing, every [`Meter::mark`]
    /// restarts the pool's peak, so a traced step reports per-phase peaks, not one.
    pub fn start_trace(&self) {
        *self.trace_lock() = Some(Trace::default());
    }

    /// Whether a trace is being recorded (the runtime times its recomputes only then).
    pub fn tracing(&self) -> bool {
        self.trace_lock().is_some()
    }

    /// Ends the open phase and returns the trace; `None` when not tracing.
    pub fn take_trace(&self) -> Option<Trace> {
        self.close_phase();
        self.trace_lock().take()
    }

    fn close_phase(&self) {
        let mut guard = self.trace_lock();
        let Some(trace) = guard.as_mut() else { return };
        if let Some((phase, start)) = trace.open.take() {
            trace.phases.push(PhaseRecord {
                phase,
                start,
                peak: self.pool.peak(),
            });
        }
    }

    /// Begins `phase` (ending the previous one) when tracing; otherwise nothing.
    pub fn mark(&self, phase: Phase) {
        if !self.tracing() {
            return;
        }
        self.close_phase();
        self.pool.reset_peak();
        if let Some(trace) = self.trace_lock().as_mut() {
            trace.open = Some((phase, self.pool.live()));
        }
    }

    /// Records the duration of a recompute op of `layer` (recipe `recipe`) when tracing.
    pub fn record_recompute(&self, layer: usize, recipe: usize, seconds: f64) {
        if let Some(trace) = self.trace_lock().as_mut() {
            trace.recomputes.push((layer, recipe, seconds));
        }
    }

    /// Records the duration of one host-store transfer when tracing.
    pub fn record_transfer(&self, layer: usize, name: &str, seconds: f64) {
        if let Some(trace) = self.trace_lock().as_mut() {
            trace.transfers.push((layer, name.to_string(), seconds));
        }
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
    fn a_trace_has_one_peak_per_phase() {
        let meter = Meter::unbounded();
        meter.mark(Phase::Head); // not tracing: nothing recorded
        meter.start_trace();
        meter.mark(Phase::Forward(0));
        let a = meter.hold(100, Use::Forward, || "a".into()).unwrap();
        drop(meter.hold(50, Use::Scratch, || "b".into()).unwrap());
        meter.mark(Phase::Backward(0));
        drop(a);
        let _c = meter.hold(20, Use::Scratch, || "c".into()).unwrap();
        let trace = meter.take_trace().unwrap();
        let phases: Vec<(Phase, u64, u64)> = trace
            .phases
            .iter()
            .map(|p| (p.phase, p.start, p.peak))
            .collect();
        assert_eq!(
            phases,
            [(Phase::Forward(0), 0, 150), (Phase::Backward(0), 100, 100)]
        );
        assert!(!meter.tracing());
    }

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
