//! Set-up shared by the planner's integration tests: where `../shared/graphs` is, a tiny
//! deterministic generator and a node constructor for hand-made graphs. Each test binary
//! uses a part of it, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::path::PathBuf;

use remat_planner::{Node, Phase};

/// `../shared/graphs` beside the checkout, or `$REMAT_SHARED_DIR/graphs` (for worktrees
/// that do not sit beside it); `None`, saying so, when neither exists, so that tests that
/// read the shared graphs skip rather than fail on a machine without them.
pub fn graphs_dir() -> Option<PathBuf> {
    let beside = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/graphs"
    ));
    let from_env = std::env::var_os("REMAT_SHARED_DIR").map(|d| PathBuf::from(d).join("graphs"));
    let dir = if beside.is_dir() {
        beside
    } else {
        from_env.unwrap_or(beside)
    };
    if dir.is_dir() {
        eprintln!("reading shared graphs from {}", dir.display());
        Some(dir)
    } else {
        eprintln!("skipping: {} is absent", dir.display());
        None
    }
}

/// xorshift64: reproducible random graphs without a dependency.
pub struct Rng(pub u64);

impl Rng {
    /// A value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

pub fn node(name: String, phase: Phase, time: u64, bytes: u64, inputs: Vec<usize>) -> Node {
    Node {
        name,
        phase,
        compute_time: time as f64,
        output_bytes: bytes,
        inputs,
    }
}
