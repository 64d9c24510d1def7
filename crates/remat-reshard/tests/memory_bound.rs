//! Anonymous memory stays within the buffer bound plus the largest chunk, on the local
//! path and on the object-store path (object_store's local backend: ranged reads into
//! scratch, uploads in parts). File pages mapped from the source are page cache, not
//! counted here (`remat bench reshard` reports both kinds).
//!
//! A test binary of its own with one test, so that no other test's allocations share
//! the process whose memory is sampled.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use remat_reshard::location::Remote;
use remat_reshard::remote::{mirror, sink};
use remat_reshard::{Checkpoint, Dtype, ExecOptions, Format, execute, plan};

/// RssAnon of this process, in bytes.
fn rss_anon() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap()
}

/// The largest RssAnon seen (sampled every millisecond) while `work` runs.
fn peak_anon(work: impl FnOnce()) -> u64 {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut peak = rss_anon();
            while !stop.load(Ordering::Relaxed) {
                peak = peak.max(rss_anon());
                std::thread::sleep(Duration::from_millis(1));
            }
            peak.max(rss_anon())
        });
        work();
        stop.store(true, Ordering::Relaxed);
        sampler.join().unwrap()
    })
}

const MAX_BUFFER: u64 = 16 << 20;
/// Allocator arenas, thread stacks, the I/O runtime and the plan itself.
const SLACK: u64 = 16 << 20;

#[test]
fn anonymous_memory_stays_within_the_bound_on_both_paths() {
    if !std::path::Path::new("/proc/self/status").exists() {
        println!("skipping: no /proc/self/status to read resident memory from");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // 12 tensors of 8 MiB (96 MiB), on 8 ranks: far above the bound.
    let mut rng = Rng(1);
    let tensors: Vec<Tensor> = (0..12)
        .map(|i| Tensor {
            name: format!("w{i:02}"),
            dtype: Dtype::F32,
            shape: vec![512, 4096],
            data: rng.bytes(512 * 4096 * 4),
        })
        .collect();
    let one = tmp.path().join("one");
    std::fs::create_dir(&one).unwrap();
    write_global(&one.join("model.safetensors"), &tensors);
    let eight = tmp.path().join("eight");
    reshard(&one, &eight, &spec(8, Format::Remat, Vec::new()));
    let opts = ExecOptions {
        max_buffer: MAX_BUFFER,
        ..Default::default()
    };
    let largest_chunk = 8 << 20;
    let bound = MAX_BUFFER + largest_chunk + SLACK;

    let ckpt = Checkpoint::open(&eight, None).unwrap();
    let p = plan(&ckpt, &spec(3, Format::Remat, Vec::new())).unwrap();
    let idle = rss_anon();
    let local = peak_anon(|| {
        execute(&ckpt, &p, &tmp.path().join("local-3"), &opts).unwrap();
    });
    drop(ckpt);
    let src = Remote::local_dir(&eight).unwrap();
    let dst = Remote::local_dir(&tmp.path().join("store-3")).unwrap();
    let idle_store = rss_anon();
    let store = peak_anon(|| {
        let rc = mirror::open(&src, None, MAX_BUFFER).unwrap();
        let p = plan(&rc.ckpt, &spec(3, Format::Remat, Vec::new())).unwrap();
        sink::execute(&sink::Source::Remote(&rc), &p, &dst, &opts).unwrap();
    });
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "anonymous growth: local {:.1} MiB, object store {:.1} MiB; bound {:.1} MiB; checkpoint 96 MiB",
        mib(local.saturating_sub(idle)),
        mib(store.saturating_sub(idle_store)),
        mib(bound)
    );
    assert!(
        local.saturating_sub(idle) <= bound,
        "local path: {local} over {idle}"
    );
    assert!(
        store.saturating_sub(idle_store) <= bound,
        "store path: {store} over {idle_store}"
    );
}
