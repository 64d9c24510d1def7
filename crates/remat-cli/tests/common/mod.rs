//! Helpers shared by the CLI's integration tests (each test file uses a part of them).
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs the `remat` binary built for these tests with `args`.
pub fn remat<S: AsRef<OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_remat"))
        .args(args)
        .output()
        .expect("runs remat")
}

/// Runs `remat` and returns whether it succeeded and its stdout followed by its stderr.
pub fn remat_text<S: AsRef<OsStr>>(args: &[S]) -> (bool, String) {
    let out = remat(args);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// A training chain of `layers` layers in remat's JSON schema, written to `dir/{name}.json`:
/// 1 MiB activations, forward `forward_us` microseconds per layer and backward twice that,
/// `static_bytes` of static memory.
pub fn write_chain(
    dir: &Path,
    name: &str,
    layers: usize,
    forward_us: u64,
    static_bytes: u64,
) -> PathBuf {
    let backward_us = 2 * forward_us;
    let mut nodes = Vec::new();
    for i in 0..layers {
        let inputs = if i == 0 {
            String::new()
        } else {
            (i - 1).to_string()
        };
        nodes.push(format!(
            r#"{{"name": "fc{i}", "phase": "forward", "compute_time": {forward_us}, "output_bytes": 1048576, "inputs": [{inputs}]}}"#
        ));
    }
    nodes.push(format!(
        r#"{{"name": "loss", "phase": "backward", "compute_time": 1, "output_bytes": 4, "inputs": [{}]}}"#,
        layers - 1
    ));
    for k in 0..layers {
        let fw = layers - 1 - k;
        let inputs = if fw == 0 {
            format!("{}", layers + k)
        } else {
            format!("{}, {}", fw - 1, layers + k)
        };
        nodes.push(format!(
            r#"{{"name": "fc{fw}_backward", "phase": "backward", "compute_time": {backward_us}, "output_bytes": 1048576, "inputs": [{inputs}]}}"#
        ));
    }
    let text = format!(
        r#"{{"format": "remat-graph", "version": 1, "name": "{name}", "time_unit_s": 1e-6, "static_bytes": {static_bytes}, "nodes": [{}]}}"#,
        nodes.join(",\n")
    );
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, text).expect("writes the graph");
    path
}

/// Tensors as (name, shape, bytes), sorted by name, and the sorted metadata.
pub type Dump = (Vec<(String, Vec<usize>, Vec<u8>)>, String);

/// Every tensor of a safetensors file (a `--dump-grads` file: gradients and the step's
/// batch) and its metadata.
pub fn read_dump(path: &Path) -> Dump {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = file
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, t.shape().to_vec(), t.data().to_vec()))
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    // Sorted: the header's metadata map has no order of its own.
    let meta: std::collections::BTreeMap<_, _> =
        meta.metadata().clone().into_iter().flatten().collect();
    (tensors, format!("{meta:?}"))
}
