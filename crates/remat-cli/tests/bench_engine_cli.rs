//! `remat bench engine` end to end on a tiny model, and its PyTorch peer protocol
//! (`--torch`) against a stand-in peer: PyTorch itself is not installed on the CI machine.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};

const TINY: [&str; 10] = [
    "bench", "engine", "--layers", "1", "--batch", "1", "--seq", "16", "--steps", "2",
];

fn remat(extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_remat"))
        .args(TINY)
        .args(extra)
        .output()
        .expect("the remat binary runs")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A stand-in for `python -c SCRIPT ARGS...`: writes more warnings than a pipe holds (the
/// bench must keep draining them), says ready, then answers every policy with a step time
/// and stops at an empty line.
fn fake_peer(dir: &std::path::Path) -> PathBuf {
    let path = dir.join("fake-python");
    let script = "#!/bin/sh\nhead -c 300000 /dev/zero | tr '\\0' w >&2\necho 'ready 9.9-fake'\nwhile read -r policy; do\n  [ -z \"$policy\" ] && exit 0\n  echo 0.25\ndone\n";
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[test]
fn prints_every_policy_and_the_reuse_row() {
    let out = remat(&[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for row in [
        "store-all",
        "per-block",
        "sqrt-blocks",
        "store-all, no buffer reuse",
    ] {
        assert!(
            stdout.lines().any(|l| l.starts_with(row)),
            "{row} missing:\n{stdout}"
        );
    }
    assert!(!stdout.contains("PyTorch 9.9"), "{stdout}");
}

#[test]
fn a_torch_peer_is_timed_in_the_same_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let peer = fake_peer(dir.path());
    let out = remat(&["--torch", peer.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for policy in ["store-all", "per-block"] {
        let row = format!("PyTorch 9.9-fake {policy}");
        let line = stdout.lines().find(|l| l.starts_with(&row));
        let line = line.unwrap_or_else(|| panic!("{row} missing:\n{stdout}"));
        assert!(
            line.contains("0.250"),
            "the peer's time is reported: {line}"
        );
    }
    assert!(
        stdout.contains("remat's step time over PyTorch's") && stdout.contains("per-block "),
        "{stdout}"
    );
}

#[test]
fn a_peer_that_fails_is_an_error_naming_the_flag() {
    let out = remat(&["--torch", "false"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--torch") && stderr.contains("ended early"),
        "{stderr}"
    );

    let out = remat(&["--torch", "/nonexistent/python"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--torch: cannot start `/nonexistent/python`"),
        "{stderr}"
    );
}
