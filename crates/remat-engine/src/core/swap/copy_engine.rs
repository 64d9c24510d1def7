//! [`CopyEngine`]: one background worker per copy direction, each a FIFO queue, so copies
//! overlap compute the way a GPU's copy engines overlap its kernels.

use super::{HostStore, SlotId, SwapError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Device to host (offload, swap-out).
    Out,
    /// Host to device (prefetch, swap-in).
    In,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Direction::Out => "offload (device to host)",
            Direction::In => "prefetch (host to device)",
        })
    }
}

/// A deliberate slowdown of every copy: each takes at least `latency + bytes / bandwidth`.
/// The default copies as fast as memory allows.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Throttle {
    /// Bytes per second; `None` for no limit.
    pub bytes_per_sec: Option<f64>,
    /// Fixed cost added to every copy.
    pub latency: Duration,
}

impl Throttle {
    fn min_duration(&self, bytes: usize) -> Duration {
        let transfer = match self.bytes_per_sec {
            Some(bw) if bw > 0.0 => Duration::from_secs_f64(bytes as f64 / bw),
            _ => Duration::ZERO,
        };
        self.latency + transfer
    }
}

/// A buffer that can be moved to a copy worker and back: the device-side end of a copy.
/// Access goes through callbacks so that lock-guarded storage (a tensor) can take part.
pub trait CopyBuf: Send + 'static {
    fn byte_len(&self) -> usize;
    /// Calls `f` with the buffer's bytes.
    fn read_bytes(
        &self,
        f: &mut dyn FnMut(&[u8]) -> Result<(), SwapError>,
    ) -> Result<(), SwapError>;
    /// Calls `f` with the buffer's bytes, writable.
    fn write_bytes(
        &mut self,
        f: &mut dyn FnMut(&mut [u8]) -> Result<(), SwapError>,
    ) -> Result<(), SwapError>;
}

macro_rules! impl_copy_buf_for_pod_vec {
    ($($t:ty),*) => {$(
        impl CopyBuf for $t {
            fn byte_len(&self) -> usize {
                std::mem::size_of_val(&self[..])
            }
            fn read_bytes(
                &self,
                f: &mut dyn FnMut(&[u8]) -> Result<(), SwapError>,
            ) -> Result<(), SwapError> {
                f(bytemuck::cast_slice(&self[..]))
            }
            fn write_bytes(
                &mut self,
                f: &mut dyn FnMut(&mut [u8]) -> Result<(), SwapError>,
            ) -> Result<(), SwapError> {
                f(bytemuck::cast_slice_mut(&mut self[..]))
            }
        }
    )*};
}

impl_copy_buf_for_pod_vec!(Vec<u8>, Vec<f32>, Box<[f32]>);

/// Totals over the engine's life (or since [`CopyEngine::reset_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyStats {
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub copies_out: u64,
    pub copies_in: u64,
    /// Time the workers spent copying (throttle included), per direction.
    pub busy_out: Duration,
    pub busy_in: Duration,
    /// Time callers spent blocked in [`Transfer::wait`] on unfinished copies.
    pub stall: Duration,
    /// How many waits found their copy unfinished.
    pub stalled_waits: u64,
}

#[derive(Default)]
struct Counters {
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
    copies_out: AtomicU64,
    copies_in: AtomicU64,
    busy_out_ns: AtomicU64,
    busy_in_ns: AtomicU64,
    stall_ns: AtomicU64,
    stalled_waits: AtomicU64,
}

impl Counters {
    fn record_copy(&self, direction: Direction, bytes: usize, busy: Duration) {
        let (b, c, t) = match direction {
            Direction::Out => (&self.bytes_out, &self.copies_out, &self.busy_out_ns),
            Direction::In => (&self.bytes_in, &self.copies_in, &self.busy_in_ns),
        };
        b.fetch_add(bytes as u64, Ordering::Relaxed);
        c.fetch_add(1, Ordering::Relaxed);
        t.fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
    }
}

type Outcome<T> = Mutex<Option<Result<T, SwapError>>>;

struct Completion<T> {
    outcome: Outcome<T>,
    done: Condvar,
}

/// The completion handle of one queued copy.
pub struct Transfer<T> {
    completion: Arc<Completion<T>>,
    counters: Arc<Counters>,
}

/// What [`Transfer::wait`] returns: the copy's result and how long the caller was blocked.
#[derive(Debug)]
pub struct Waited<T> {
    pub value: T,
    pub stall: Duration,
}

impl<T> Transfer<T> {
    /// True once the copy has finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.completion
            .outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Block until the copy is done; the time blocked is the stall and is also added to the
    /// engine's [`CopyStats::stall`].
    pub fn wait(self) -> Result<Waited<T>, SwapError> {
        let start = Instant::now();
        let mut guard = self
            .completion
            .outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut blocked = false;
        let outcome = loop {
            if let Some(outcome) = guard.take() {
                break outcome;
            }
            blocked = true;
            guard = self
                .completion
                .done
                .wait(guard)
                .unwrap_or_else(|e| e.into_inner());
        };
        let stall = if blocked {
            start.elapsed()
        } else {
            Duration::ZERO
        };
        if blocked {
            let c = &self.counters;
            c.stall_ns
                .fetch_add(stall.as_nanos() as u64, Ordering::Relaxed);
            c.stalled_waits.fetch_add(1, Ordering::Relaxed);
        }
        outcome.map(|value| Waited { value, stall })
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Two copy workers in front of a [`HostStore`].
pub struct CopyEngine {
    store: Arc<HostStore>,
    throttle: Throttle,
    out_queue: Option<Sender<Job>>,
    in_queue: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    counters: Arc<Counters>,
}

impl CopyEngine {
    pub fn new(store: Arc<HostStore>, throttle: Throttle) -> Self {
        let (out_tx, out_rx) = channel::<Job>();
        let (in_tx, in_rx) = channel::<Job>();
        let workers = [("remat-swap-out", out_rx), ("remat-swap-in", in_rx)]
            .into_iter()
            .filter_map(|(name, rx)| {
                // A worker that fails to spawn leaves its queue closed; submissions then fail
                // with `WorkerGone` instead of hanging.
                std::thread::Builder::new()
                    .name(name.to_string())
                    .spawn(move || {
                        for job in rx {
                            job();
                        }
                    })
                    .ok()
            })
            .collect();
        CopyEngine {
            store,
            throttle,
            out_queue: Some(out_tx),
            in_queue: Some(in_tx),
            workers,
            counters: Arc::new(Counters::default()),
        }
    }

    pub fn store(&self) -> &Arc<HostStore> {
        &self.store
    }

    pub fn throttle(&self) -> Throttle {
        self.throttle
    }

    /// Queue a copy of `src` into a new host slot. The slot is reserved now (so a full host
    /// store fails here, synchronously); the handle gives back the slot and `src` when the
    /// bytes are on the host, at which point the caller may free `src`.
    pub fn offload<B: CopyBuf>(
        &self,
        src: B,
        tag: &str,
    ) -> Result<Transfer<(SlotId, B)>, SwapError> {
        let len = src.byte_len();
        let slot = self.store.reserve(len as u64, tag)?;
        let store = Arc::clone(&self.store);
        let submitted = self.submit(Direction::Out, len, move || {
            src.read_bytes(&mut |bytes| store.write(slot, bytes))?;
            Ok((slot, src))
        });
        if submitted.is_err() {
            let _ = self.store.release(slot);
        }
        submitted
    }

    /// Queue a copy of host slot `slot` into `dst` (exactly the slot's size). If
    /// `release_after` the slot is freed once copied. The handle gives back `dst` filled.
    pub fn prefetch<B: CopyBuf>(
        &self,
        slot: SlotId,
        dst: B,
        release_after: bool,
    ) -> Result<Transfer<B>, SwapError> {
        let len = self.store.len_of(slot)?;
        if len != dst.byte_len() as u64 {
            return Err(SwapError::SizeMismatch {
                slot,
                what: "prefetch destination",
                stored: len,
                requested: dst.byte_len() as u64,
            });
        }
        let store = Arc::clone(&self.store);
        let mut dst = dst;
        self.submit(Direction::In, len as usize, move || {
            dst.write_bytes(&mut |bytes| store.read(slot, bytes))?;
            if release_after {
                store.release(slot)?;
            }
            Ok(dst)
        })
    }

    fn submit<T: Send + 'static>(
        &self,
        direction: Direction,
        bytes: usize,
        copy: impl FnOnce() -> Result<T, SwapError> + Send + 'static,
    ) -> Result<Transfer<T>, SwapError> {
        let completion = Arc::new(Completion {
            outcome: Mutex::new(None),
            done: Condvar::new(),
        });
        let counters = Arc::clone(&self.counters);
        let throttle = self.throttle;
        let job_completion = Arc::clone(&completion);
        let job_counters = Arc::clone(&counters);
        let job: Job = Box::new(move || {
            let start = Instant::now();
            let result = copy();
            let floor = throttle.min_duration(bytes);
            let elapsed = start.elapsed();
            if elapsed < floor {
                std::thread::sleep(floor - elapsed);
            }
            job_counters.record_copy(direction, bytes, start.elapsed());
            let mut outcome = job_completion
                .outcome
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            *outcome = Some(result);
            job_completion.done.notify_all();
        });
        let queue = match direction {
            Direction::Out => &self.out_queue,
            Direction::In => &self.in_queue,
        };
        queue
            .as_ref()
            .and_then(|q| q.send(job).ok())
            .ok_or(SwapError::WorkerGone { direction })?;
        Ok(Transfer {
            completion,
            counters,
        })
    }

    pub fn stats(&self) -> CopyStats {
        let c = &self.counters;
        let ns = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        CopyStats {
            bytes_out: c.bytes_out.load(Ordering::Relaxed),
            bytes_in: c.bytes_in.load(Ordering::Relaxed),
            copies_out: c.copies_out.load(Ordering::Relaxed),
            copies_in: c.copies_in.load(Ordering::Relaxed),
            busy_out: ns(&c.busy_out_ns),
            busy_in: ns(&c.busy_in_ns),
            stall: ns(&c.stall_ns),
            stalled_waits: c.stalled_waits.load(Ordering::Relaxed),
        }
    }

    pub fn reset_stats(&self) {
        let c = &self.counters;
        for a in [
            &c.bytes_out,
            &c.bytes_in,
            &c.copies_out,
            &c.copies_in,
            &c.busy_out_ns,
            &c.busy_in_ns,
            &c.stall_ns,
            &c.stalled_waits,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        // Closing the queues lets each worker finish what is queued and exit.
        self.out_queue = None;
        self.in_queue = None;
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<f32> {
        // Include values whose bits matter: negative zero, NaN payload, subnormal, infinity.
        let mut v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        v[0] = -0.0;
        v[1] = f32::from_bits(0x7fc0_1234);
        v[2] = f32::from_bits(1);
        v[3] = f32::NEG_INFINITY;
        v
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn offload_then_prefetch_preserves_bits_and_accounts_bytes() {
        let engine = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
        let src = data(4096);
        let expected = bits(&src);
        let out = engine.offload(src, "x").unwrap().wait().unwrap();
        let (slot, src_back) = out.value;
        assert_eq!(bits(&src_back), expected);
        drop(src_back);
        assert_eq!(engine.store().stats().live_bytes, 4096 * 4);
        let back = engine
            .prefetch(slot, vec![0f32; 4096], true)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(bits(&back.value), expected);
        assert_eq!(engine.store().stats().live_bytes, 0);
        let s = engine.stats();
        assert_eq!(
            (s.bytes_out, s.bytes_in, s.copies_out, s.copies_in),
            (16384, 16384, 1, 1)
        );
    }

    #[test]
    fn slow_link_shows_up_as_stall_and_fast_one_hides() {
        let throttle = Throttle {
            bytes_per_sec: None,
            latency: Duration::from_millis(60),
        };
        let engine = CopyEngine::new(Arc::new(HostStore::in_memory()), throttle);
        let slot = engine.store().put(&[7u8; 64], "t").unwrap();
        let waited = engine
            .prefetch(slot, vec![0u8; 64], false)
            .unwrap()
            .wait()
            .unwrap();
        assert!(
            waited.stall >= Duration::from_millis(40),
            "{:?}",
            waited.stall
        );
        assert_eq!(engine.stats().stalled_waits, 1);
        // A copy that is done before its use costs no stall. The worker runs its queue in
        // order, so once a later copy is done this one is too (no sleeping on a guess).
        let t = engine.prefetch(slot, vec![0u8; 64], false).unwrap();
        engine
            .prefetch(slot, vec![0u8; 64], false)
            .unwrap()
            .wait()
            .unwrap();
        assert!(t.is_done());
        let waited = t.wait().unwrap();
        assert_eq!(waited.stall, Duration::ZERO);
        assert_eq!(waited.value, vec![7u8; 64]);
    }

    /// A buffer whose offload cannot finish before the test opens its gate.
    struct Gated {
        bytes: Vec<u8>,
        gate: std::sync::mpsc::Receiver<()>,
    }

    impl CopyBuf for Gated {
        fn byte_len(&self) -> usize {
            self.bytes.len()
        }
        fn read_bytes(
            &self,
            f: &mut dyn FnMut(&[u8]) -> Result<(), SwapError>,
        ) -> Result<(), SwapError> {
            // A closed gate (sender dropped) opens it too: the test cannot hang.
            let _ = self.gate.recv();
            f(&self.bytes)
        }
        fn write_bytes(
            &mut self,
            f: &mut dyn FnMut(&mut [u8]) -> Result<(), SwapError>,
        ) -> Result<(), SwapError> {
            f(&mut self.bytes)
        }
    }

    #[test]
    fn directions_run_concurrently() {
        // The offload blocks its worker until the gate opens; the prefetch, on the other
        // worker, completes meanwhile.
        let engine = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
        let slot = engine.store().put(&[1u8; 8], "in").unwrap();
        let (open, gate) = std::sync::mpsc::channel();
        let blocked_out = engine
            .offload(
                Gated {
                    bytes: vec![2u8; 64],
                    gate,
                },
                "out",
            )
            .unwrap();
        let fast_in = engine.prefetch(slot, vec![0u8; 8], true).unwrap();
        assert_eq!(fast_in.wait().unwrap().value, vec![1u8; 8]);
        assert!(!blocked_out.is_done());
        open.send(()).unwrap();
        let (slot, back) = blocked_out.wait().unwrap().value;
        assert_eq!(back.bytes, vec![2u8; 64]);
        engine.store().release(slot).unwrap();
    }

    #[test]
    fn wrong_sized_prefetch_is_refused() {
        let engine = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
        let slot = engine.store().put(&[0u8; 12], "t").unwrap();
        let err = engine
            .prefetch(slot, vec![0f32; 2], false)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("12 bytes") && err.contains("8 bytes"), "{err}");
    }
}
