//! Helpers shared by the CLI's integration tests (each test file uses a part of them).
#![allow(dead_code)]

use std::ffi::OsStr;
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
