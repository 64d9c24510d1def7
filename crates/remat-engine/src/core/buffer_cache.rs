//! Freed tensor buffers kept for reuse, as a GPU caching allocator keeps freed blocks.
//!
//! A training step allocates the same shapes every step, and a fresh buffer costs page
//! faults, the kernel's zeroing and then ours. The pool therefore keeps freed buffers, keyed
//! by dtype and element count (an exact match, so no buffer is ever split or padded), and
//! hands them back to the next request of that size.
//!
//! Invariants (the pool holds the cache under its own lock):
//! 1. The cache never makes the process hold more tensor memory than the pool's high-water
//!    mark of live bytes: `live + cached <= high_water` after every operation. A cache hit
//!    moves bytes from cached to live; a freed buffer moves them back; a miss that would
//!    break the bound evicts cached buffers first, the largest first.
//! 2. Cached bytes are not live: budgets, peaks and the event log count live bytes only, so
//!    the accounting a plan is checked against is the same with or without the cache.
//! 3. A reused buffer holds stale values. `Tensor::zeros` zero-fills it; only a kernel that
//!    writes every element may ask for one as is (`Tensor::for_overwrite`).

use std::collections::HashMap;

use crate::core::buf::Buf;
use crate::core::dtype::DType;

/// Smallest buffer kept. Below this the system allocator serves requests from its own free
/// lists without page faults, so keeping them would only add lookups.
pub const MIN_CACHED_BYTES: u64 = 16 << 10;

#[derive(Debug)]
pub(crate) struct BufferCache {
    enabled: bool,
    bins: HashMap<(DType, usize), Vec<Buf>>,
    bytes: u64,
    /// The most live bytes the pool has held (never reset, unlike the reported peak).
    high_water: u64,
}

impl Default for BufferCache {
    fn default() -> Self {
        BufferCache {
            enabled: true,
            bins: HashMap::new(),
            bytes: 0,
            high_water: 0,
        }
    }
}

fn buf_bytes(buf: &Buf) -> u64 {
    (buf.len() * buf.dtype().size_bytes()) as u64
}

impl BufferCache {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Turns reuse on or off; off hands back every cached buffer (to be dropped by the
    /// caller outside the pool's lock).
    pub fn set_enabled(&mut self, on: bool) -> Vec<Buf> {
        self.enabled = on;
        if on { Vec::new() } else { self.drain() }
    }

    /// Every cached buffer, removed from the cache.
    pub fn drain(&mut self) -> Vec<Buf> {
        self.bytes = 0;
        self.bins.drain().flat_map(|(_, v)| v).collect()
    }

    /// Called after `live` grew by a new reservation: a buffer of exactly `key`'s size if
    /// one is cached; otherwise the buffers evicted so that `live + cached` stays within
    /// the high-water mark (invariant 1).
    pub fn on_reserve(&mut self, live: u64, key: Option<(DType, usize)>) -> Reuse {
        self.high_water = self.high_water.max(live);
        if let Some(buf) = key.and_then(|k| self.pop(k)) {
            return Reuse::Hit(buf);
        }
        Reuse::Miss(self.evict_above(live))
    }

    /// Lowers the bound to `cap` (a new, smaller budget): evicts until
    /// `live + cached <= cap`.
    pub fn limit(&mut self, live: u64, cap: u64) -> Vec<Buf> {
        self.high_water = self.high_water.min(cap.max(live));
        self.evict_above(live)
    }

    fn pop(&mut self, key: (DType, usize)) -> Option<Buf> {
        let bin = self.bins.get_mut(&key)?;
        let buf = bin.pop()?;
        if bin.is_empty() {
            self.bins.remove(&key);
        }
        self.bytes -= buf_bytes(&buf);
        Some(buf)
    }

    /// Evicts the largest cached buffers until `live + cached <= high_water`.
    fn evict_above(&mut self, live: u64) -> Vec<Buf> {
        let mut evicted = Vec::new();
        while live + self.bytes > self.high_water {
            let Some(&key) = self
                .bins
                .keys()
                .max_by_key(|(d, n)| (n * d.size_bytes(), *d as u8))
            else {
                break;
            };
            if let Some(buf) = self.pop(key) {
                evicted.push(buf);
            }
        }
        evicted
    }

    /// Takes a freed buffer whose bytes are still counted in `live` (they are released in
    /// the same step), or gives it back when it cannot be kept.
    pub fn put(&mut self, live: u64, buf: Buf) -> Option<Buf> {
        let bytes = buf_bytes(&buf);
        if !self.enabled
            || bytes < MIN_CACHED_BYTES
            || !buf.is_exact()
            || live + self.bytes > self.high_water
        {
            return Some(buf);
        }
        self.bytes += bytes;
        self.bins
            .entry((buf.dtype(), buf.len()))
            .or_default()
            .push(buf);
        None
    }
}

/// What a reservation found in the cache.
pub(crate) enum Reuse {
    Hit(Buf),
    /// No buffer of the size; these were evicted to make room (drop them unlocked).
    Miss(Vec<Buf>),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes in these tests are in KiB, so that every buffer is large enough to keep.
    const K: u64 = 1024;

    fn f32s(kib: usize) -> Buf {
        Buf::F32(vec![1.0; kib * 256])
    }

    fn f32_key(kib: usize) -> Option<(DType, usize)> {
        Some((DType::F32, kib * 256))
    }

    #[test]
    fn a_freed_buffer_is_reused_for_the_same_size_only() {
        let mut c = BufferCache::default();
        assert!(matches!(c.on_reserve(800 * K, None), Reuse::Miss(v) if v.is_empty()));
        // Freed while its 400 KiB are still live: kept, live + cached stays within 800 KiB.
        assert!(c.put(400 * K, f32s(400)).is_none());
        assert_eq!(c.bytes(), 400 * K);
        // Other sizes and dtypes miss, and there is room for them beside the cached one.
        assert!(matches!(c.on_reserve(40 * K, f32_key(40)), Reuse::Miss(v) if v.is_empty()));
        let f64_key = Some((DType::F64, 40 * 128));
        assert!(matches!(c.on_reserve(80 * K, f64_key), Reuse::Miss(v) if v.is_empty()));
        match c.on_reserve(480 * K, f32_key(400)) {
            Reuse::Hit(Buf::F32(v)) => assert_eq!(v.len(), 400 * 256),
            _ => panic!("expected a hit"),
        }
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn live_plus_cached_never_exceeds_the_high_water_mark() {
        let mut c = BufferCache::default();
        let _ = c.on_reserve(800 * K, None);
        assert!(c.put(800 * K, f32s(400)).is_none()); // 400 KiB live after, 400 cached
        assert!(c.put(400 * K, f32s(200)).is_none()); // 200 live after, 600 cached
        // 200 KiB live and a new 300 KiB buffer of another size: 500 + 600 > 800, so the
        // largest cached buffer goes.
        match c.on_reserve(500 * K, f32_key(300)) {
            Reuse::Miss(ev) => {
                assert_eq!(ev.iter().map(Buf::len).collect::<Vec<_>>(), [400 * 256])
            }
            Reuse::Hit(_) => panic!("no buffer of 300 KiB was cached"),
        }
        assert_eq!(c.bytes(), 200 * K);
    }

    #[test]
    fn a_smaller_budget_bounds_the_cache() {
        let mut c = BufferCache::default();
        let _ = c.on_reserve(800 * K, None);
        assert!(c.put(800 * K, f32s(400)).is_none());
        assert!(c.put(400 * K, f32s(200)).is_none()); // 200 KiB live, 600 cached
        let freed = c.limit(200 * K, 500 * K);
        assert_eq!(freed.iter().map(Buf::len).collect::<Vec<_>>(), [400 * 256]);
        assert_eq!(c.bytes(), 200 * K);
    }

    #[test]
    fn small_buffers_and_a_disabled_cache_keep_nothing() {
        let mut c = BufferCache::default();
        let _ = c.on_reserve(800 * K, None);
        assert!(c.put(800 * K, Buf::F32(vec![0.0; 100])).is_some());
        assert!(c.put(800 * K, f32s(400)).is_none());
        assert_eq!(c.set_enabled(false).len(), 1);
        assert_eq!(c.bytes(), 0);
        assert!(c.put(400 * K, f32s(400)).is_some());
    }
}
