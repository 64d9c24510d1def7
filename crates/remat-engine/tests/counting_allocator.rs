//! Cross-checks the pool's accounting against what the process really allocates: a counting
//! global allocator records every allocation of at least `LARGE` bytes; the tensors of this
//! test are that large (small ones are taken from the pool's event log), and graph metadata
//! stays below it. Between steps, the process's live large allocations must be exactly the
//! pool's live bytes. Outside the pool: gemm's per-thread packing slab (allocated once per
//! thread, before counting starts here) and its transient packing buffers within a call.
//!
//! The pool keeps freed buffers for reuse (its buffer cache, for buffers of at least
//! `MIN_CACHED_BYTES`, which is `LARGE` here): the process then holds live plus cached
//! bytes, and that sum never exceeds the pool's high-water mark of live bytes. The check runs
//! once with the cache off (every pool allocation is a real one) and once with it on.
//!
//! (One test in this binary, so no other test allocates concurrently.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use remat_engine::core::pool::{EventKind, MIN_CACHED_BYTES};
use remat_engine::models::mlp::{Mlp, MlpConfig};
use remat_engine::{Category, DType, ExecContext, Graph, MemoryPool, Policy, Tensor};

const LARGE: usize = MIN_CACHED_BYTES as usize;

struct Counting;

static LIVE: AtomicU64 = AtomicU64::new(0);
static TOTAL: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE {
            LIVE.fetch_add(layout.size() as u64, Ordering::SeqCst);
            TOTAL.fetch_add(layout.size() as u64, Ordering::SeqCst);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE {
            LIVE.fetch_add(layout.size() as u64, Ordering::SeqCst);
            TOTAL.fetch_add(layout.size() as u64, Ordering::SeqCst);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() >= LARGE {
            LIVE.fetch_sub(layout.size() as u64, Ordering::SeqCst);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() >= LARGE {
            LIVE.fetch_sub(layout.size() as u64, Ordering::SeqCst);
        }
        if new_size >= LARGE {
            LIVE.fetch_add(new_size as u64, Ordering::SeqCst);
            TOTAL.fetch_add(new_size as u64, Ordering::SeqCst);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn counters() -> (u64, u64) {
    (LIVE.load(Ordering::SeqCst), TOTAL.load(Ordering::SeqCst))
}

/// What the pool logged since the last drain: bytes of large allocations, and the change
/// of small live bytes (below the allocator's threshold, so not counted there).
fn drain(pool: &MemoryPool) -> (u64, i64) {
    let mut large = 0;
    let mut small = 0i64;
    for e in pool.take_event_log() {
        match (e.kind, e.bytes >= LARGE as u64) {
            (EventKind::Alloc, true) => large += e.bytes,
            (EventKind::Alloc, false) => small += e.bytes as i64,
            (EventKind::Free, false) => small -= e.bytes as i64,
            (EventKind::Free, true) => {}
        }
    }
    pool.enable_event_log();
    (large, small)
}

#[test]
fn pool_accounting_matches_real_allocations() {
    // Each run's context is kept until the end: dropping one ends its worker thread, whose
    // gemm packing slab would then be freed at some moment during the next run's counting.
    let _uncached = run_checked(false);
    let _cached = run_checked(true);
}

/// Trains an MLP under three policies, checking the pool against the allocator at every
/// stage, with or without the pool's buffer cache. Returns the context (see above).
fn run_checked(cache: bool) -> ExecContext {
    // Single-threaded: gemm then packs into small thread-local buffers only.
    let pool = MemoryPool::unbounded();
    pool.set_buffer_cache(cache);
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    // gemm keeps a per-thread packing slab (the L2 size) for the life of the thread: it
    // is workspace outside the pool, so let it be allocated before counting starts.
    warm_up_gemm(&ctx);
    pool.trim();
    pool.enable_event_log();
    let (live0, total0) = counters();
    let (mut pool_large_total, mut pool_small_live) = (0u64, 0i64);
    let mut check = |what: &str| {
        let (large, small) = drain(&pool);
        pool_large_total += large;
        pool_small_live += small;
        let (live, total) = counters();
        let stats = pool.stats();
        assert_eq!(
            live - live0,
            stats.live - pool_small_live as u64 + stats.cached,
            "live bytes {what} (cache {cache})"
        );
        // The cache never makes the process hold more than the most the pool had live.
        assert!(
            stats.live + stats.cached <= stats.peak,
            "cached bytes {what}"
        );
        if !cache {
            // Every pool byte was really allocated; the process may allocate more in between
            // (gemm packs a transposed operand into a transient buffer inside one call), but
            // at every check the live bytes agree exactly.
            assert!(
                total - total0 >= pool_large_total,
                "bytes ever allocated {what}"
            );
        }
    };

    // Weights 64 x 64 and activations 64 x 64 are 16 KiB each; biases are small.
    let d = 64;
    let mlp = Mlp::new(
        &pool,
        MlpConfig {
            dims: vec![d; 5],
            dropout: 0.25,
            seed: 1,
        },
    )
    .unwrap();
    let x = Tensor::zeros(&pool, &[64, d], DType::F32, Category::Activations, None).unwrap();
    let t = Tensor::zeros(&pool, &[64, d], DType::F32, Category::Activations, None).unwrap();
    check("after creating parameters and inputs");

    for policy in [Policy::StoreAll, Policy::Sqrt, Policy::RecomputeAll] {
        let mut g = Graph::new(&ctx);
        let (xn, tn) = (g.input("x", x.clone()), g.input("t", t.clone()));
        let nodes = mlp.build(&mut g, xn, tn).unwrap();
        policy.apply(&mut g).unwrap();
        g.forward().unwrap();
        check(&format!("after forward under {policy}"));
        g.backward(nodes.loss).unwrap();
        check(&format!("after backward under {policy}"));
        drop(g);
        check(&format!("after dropping the {policy} graph"));
    }
    // Three steps of one model allocate the same sizes again: with the cache on, most of
    // the second and third steps' buffers are reused ones.
    let hits = pool.stats().cache_hits;
    assert_eq!(hits > 0, cache, "cache hits: {hits}");
    ctx
}

fn warm_up_gemm(ctx: &ExecContext) {
    let pool = ctx.pool();
    let mut g = Graph::new(ctx);
    let a = g.input(
        "a",
        Tensor::zeros(pool, &[64, 64], DType::F32, Category::Activations, None).unwrap(),
    );
    let m = g.matmul(a, a).unwrap();
    g.forward().unwrap();
    assert!(g.is_resident(m).unwrap());
}
