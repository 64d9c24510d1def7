//! Writing to a full filesystem: a typed error naming the path, exit 1, nothing left
//! behind. Needs an 8 KiB tmpfs, which needs root (mount); without it each test says it
//! is skipped and passes.

mod common;
use common::remat;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A tiny tmpfs mounted on a temporary directory, unmounted on drop.
struct FullDisk {
    dir: tempfile::TempDir,
}

impl FullDisk {
    fn mount(test: &str) -> Option<FullDisk> {
        let dir = tempfile::tempdir().ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=8k", "tmpfs"])
            .arg(dir.path())
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            eprintln!("{test}: skipped: cannot mount an 8 KiB tmpfs (needs root)");
            return None;
        }
        Some(FullDisk { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn entries(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    }
}

impl Drop for FullDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).output();
    }
}

fn assert_clean_failure(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "no {n:?} in {stderr}");
    }
}

#[test]
fn swap_dir_on_a_full_filesystem_is_an_error_not_sigbus() {
    let Some(disk) = FullDisk::mount("swap_dir_on_a_full_filesystem_is_an_error_not_sigbus") else {
        return;
    };
    let dir = disk.path().to_str().unwrap();
    let out = remat(&[
        "train",
        "--steps",
        "2",
        "--threads",
        "1",
        "--batch",
        "4",
        "--policy",
        "auto:chain-offload",
        "--memory-budget",
        "2200KiB",
        "--swap-dir",
        dir,
    ]);
    assert_clean_failure(&out, &["swap file", "No space left on device"]);
    assert!(disk.entries().is_empty(), "{:?}", disk.entries());
}

#[test]
fn dump_grads_and_profile_out_on_a_full_filesystem_leave_nothing() {
    let Some(disk) =
        FullDisk::mount("dump_grads_and_profile_out_on_a_full_filesystem_leave_nothing")
    else {
        return;
    };
    let grads = disk.path().join("g.safetensors");
    let out = remat(&[
        "train",
        "--steps",
        "1",
        "--threads",
        "1",
        "--batch",
        "2",
        "--dump-grads",
        grads.to_str().unwrap(),
    ]);
    assert_clean_failure(&out, &["--dump-grads", "g.safetensors", "No space left"]);
    assert!(disk.entries().is_empty(), "{:?}", disk.entries());
    let graph = disk.path().join("graph.json");
    let out = remat(&[
        "profile",
        "--threads",
        "1",
        "--runs",
        "1",
        "--out",
        graph.to_str().unwrap(),
    ]);
    assert_clean_failure(&out, &["--out", "graph.json", "No space left"]);
    assert!(disk.entries().is_empty(), "{:?}", disk.entries());
}

#[test]
fn outputs_that_are_directories_or_devices_are_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    for target in [d, "/dev/full", &format!("{d}/x/")] {
        let out = remat(&[
            "train",
            "--steps",
            "1",
            "--threads",
            "1",
            "--batch",
            "2",
            "--dump-grads",
            target,
        ]);
        assert_clean_failure(&out, &["--dump-grads"]);
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("step "),
            "trained before refusing {target}"
        );
        let out = remat(&["profile", "--threads", "1", "--runs", "1", "--out", target]);
        assert_clean_failure(&out, &["--out"]);
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::metadata("/dev/full")
            .unwrap()
            .file_type()
            .is_char_device()
    );
}
