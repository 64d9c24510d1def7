//! Byte accounting of the spec runtime's device activations: every buffer the runtime keeps
//! (saved slots, shared recompute buffers, prefetched slots, block inputs) holds a
//! [`Hold`] for its bytes, returned when the buffer is dropped.

use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeterStats {
    pub live: u64,
    pub peak: u64,
    /// Per-layer saved slots and kept block inputs.
    pub saved_live: u64,
    pub saved_peak: u64,
    /// Buffers shared by every layer's recompute.
    pub shared_live: u64,
    pub shared_peak: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    Saved,
    Shared,
    /// Prefetched from the host store for one layer's backward.
    Prefetched,
}

#[derive(Debug, Default)]
pub struct Meter {
    stats: Mutex<MeterStats>,
}

impl Meter {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn stats(&self) -> MeterStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn reset_peak(&self) {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.peak = s.live;
        s.shared_peak = s.shared_live;
        s.saved_peak = s.saved_live;
    }

    pub fn hold(self: &Arc<Self>, bytes: u64, use_: Use) -> Hold {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.live += bytes;
        s.peak = s.peak.max(s.live);
        match use_ {
            Use::Saved => {
                s.saved_live += bytes;
                s.saved_peak = s.saved_peak.max(s.saved_live);
            }
            Use::Shared => {
                s.shared_live += bytes;
                s.shared_peak = s.shared_peak.max(s.shared_live);
            }
            Use::Prefetched => {}
        }
        Hold {
            meter: Arc::clone(self),
            bytes,
            use_,
        }
    }
}

/// Bytes counted in a [`Meter`] until dropped.
#[derive(Debug)]
pub struct Hold {
    meter: Arc<Meter>,
    bytes: u64,
    use_: Use,
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut s = self.meter.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.live -= self.bytes;
        match self.use_ {
            Use::Saved => s.saved_live -= self.bytes,
            Use::Shared => s.shared_live -= self.bytes,
            Use::Prefetched => {}
        }
    }
}
