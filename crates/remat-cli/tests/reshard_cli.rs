//! `remat reshard` end to end: dry run, reshard, verify, refusal to overwrite, `--rank`
//! parts with the final index step, Hugging Face multi-file output, a named difference.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use remat_reshard::Dtype;
use remat_reshard::safetensors::{TensorData, write_file};

fn remat<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_remat"))
        .args(args)
        .output()
        .unwrap()
}

fn ok<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[S]) -> String {
    let out = remat(args);
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fails<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[S]) -> String {
    let out = remat(args);
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A small global checkpoint with matrices, a vector and a scalar.
fn source(dir: &Path) -> String {
    let a: Vec<u8> = (0..10 * 6 * 4).map(|i| (i * 7 % 251) as u8).collect();
    let b: Vec<u8> = (0..5 * 9 * 2).map(|i| (i * 13 % 251) as u8).collect();
    let c: Vec<u8> = (0..8).collect();
    let tensors = [
        TensorData {
            name: "layers.0.w",
            dtype: Dtype::F32,
            shape: &[10, 6],
            data: &a,
        },
        TensorData {
            name: "layers.1.w",
            dtype: Dtype::BF16,
            shape: &[5, 9],
            data: &b,
        },
        TensorData {
            name: "step",
            dtype: Dtype::I64,
            shape: &[],
            data: &c,
        },
    ];
    let path = dir.join("model.safetensors");
    write_file(&path, &tensors, &BTreeMap::new()).unwrap();
    path.to_string_lossy().into_owned()
}

fn p(dir: &Path, name: &str) -> String {
    dir.join(name).to_string_lossy().into_owned()
}

#[test]
fn dry_run_reshard_verify_and_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let out = p(tmp.path(), "out");
    let table = ok(&[
        "reshard",
        &src,
        &out,
        "-w",
        "3",
        "--preset",
        "parallel",
        "--dry-run",
    ]);
    assert!(
        table.contains("| rank |")
            && table.contains("read amplification")
            && table.contains("peak buffer memory"),
        "{table}"
    );
    assert!(!Path::new(&out).exists());
    let summary = ok(&[
        "reshard",
        &src,
        &out,
        "-w",
        "3",
        "--preset",
        "parallel",
        "--place",
        "layers.1.*=shard(1)",
    ]);
    // Binary units for bytes, plurals right: "wrote 3 files, 1.23 KiB in ...".
    assert!(
        summary.contains("wrote 3 files, ") && summary.contains("B in ") && summary.contains("B/s"),
        "{summary}"
    );
    assert!(ok(&["reshard", "verify", &src, &out]).contains("hold the same 3 tensors"));
    let e = fails(&["reshard", &src, &out, "-w", "2"]);
    assert!(e.contains("already exists") && e.contains("--force"), "{e}");
    ok(&["reshard", &src, &out, "-w", "2", "--force"]);
    assert!(ok(&["reshard", "verify", &out, &src]).contains("hold the same"));
    let e = fails(&[
        "reshard",
        &src,
        &out,
        "-w",
        "2",
        "--place",
        "step=shard(0)",
        "--force",
    ]);
    assert!(e.contains("tensor `step`") && e.contains("shard(0)"), "{e}");
}

#[test]
fn rank_parts_then_final_index_step() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let out = p(tmp.path(), "parts");
    let common = [
        "reshard", &src, &out, "-w", "2", "--format", "dcp", "--preset", "parallel",
    ];
    let with = |extra: &[&'static str]| -> Vec<String> {
        common.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    ok(&with(&["--rank", "0"]));
    let e = fails(&with(&["--finalize"]));
    assert!(e.contains("rank 1 has not finished"), "{e}");
    assert!(!Path::new(&out).join("remat.index.json").exists());
    assert!(
        !Path::new(&out)
            .join("shard-00001-model-00001-of-00001.safetensors")
            .exists()
    );
    ok(&with(&["--rank", "1"]));
    let e = fails(&[
        "reshard",
        &src,
        &out,
        "-w",
        "2",
        "--format",
        "dcp",
        "--finalize",
    ]);
    assert!(e.contains("different plan"), "{e}");
    ok(&with(&["--finalize"]));
    assert!(
        Path::new(&out)
            .join("shard-00002-model-00001-of-00001.safetensors")
            .exists()
    );
    assert!(ok(&["reshard", "verify", &src, &out, "--from-b", "dcp"]).contains("hold the same"));
    assert!(ok(&["reshard", "verify", &src, &out]).contains("chunk checksums checked"));
}

#[test]
fn hugging_face_multi_file_output_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let out = p(tmp.path(), "hf");
    ok(&[
        "reshard", &src, &out, "-w", "2", "--format", "hf", "--preset", "simple",
    ]);
    let index =
        std::fs::read_to_string(Path::new(&out).join("model.safetensors.index.json")).unwrap();
    assert!(
        index.contains("model-00001-of-00002.safetensors") && index.contains("weight_map"),
        "{index}"
    );
    assert!(ok(&["reshard", "verify", &out, &src, "--from-a", "hf"]).contains("hold the same"));
    let e = fails(&[
        "reshard",
        &src,
        &p(tmp.path(), "hf2"),
        "-w",
        "2",
        "--format",
        "hf",
        "--preset",
        "parallel",
    ]);
    assert!(e.contains("stores whole tensors"), "{e}");
    // From a sharded source without a preset, the hf layout takes whole tensors.
    let sharded = p(tmp.path(), "dcp3");
    ok(&[
        "reshard", &src, &sharded, "-w", "3", "--format", "dcp", "--preset", "parallel",
    ]);
    let whole = p(tmp.path(), "hf3");
    ok(&["reshard", &sharded, &whole, "-w", "2", "--format", "hf"]);
    assert!(
        Path::new(&whole)
            .join("model.safetensors.index.json")
            .exists()
    );
    assert!(ok(&["reshard", "verify", &whole, &src, "--from-a", "hf"]).contains("hold the same"));
}

#[test]
fn verify_names_the_first_differing_tensor_and_element() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let out = p(tmp.path(), "one");
    ok(&["reshard", &src, &out, "-w", "1", "--format", "hf"]);
    let file = Path::new(&out).join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    // layers.0.w is first in the data: element [2, 3] starts at byte (2 * 6 + 3) * 4.
    bytes[8 + n + (2 * 6 + 3) * 4 + 1] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let e = fails(&["reshard", "verify", &src, &out, "--from-b", "hf"]);
    assert!(
        e.contains("tensor `layers.0.w` differs first at element [2, 3]"),
        "{e}"
    );
    let e = fails(&["reshard", "verify", &src, &out]);
    assert!(e.contains("layers.0.w"), "{e}");
}

#[test]
fn a_parent_of_checkpoints_is_refused_with_the_ones_inside_named() {
    let tmp = tempfile::tempdir().unwrap();
    let parent = tmp.path().join("runs");
    let inner = parent.join("step-100");
    std::fs::create_dir_all(&inner).unwrap();
    std::fs::create_dir_all(parent.join("logs")).unwrap();
    source(&inner);
    let out = p(tmp.path(), "out");
    let e = fails(&["reshard", &p(tmp.path(), "runs"), &out, "-w", "2"]);
    assert!(
        e.contains("not a checkpoint remat can read")
            && e.contains("one level down")
            && e.contains("step-100/")
            && !e.contains("logs"),
        "{e}"
    );
    assert!(!Path::new(&out).exists());
    // An empty directory gets no such hint.
    let e = fails(&["reshard", &p(&parent, "logs"), &out, "-w", "2"]);
    assert!(!e.contains("one level down"), "{e}");
}

#[test]
fn file_urls_work_like_paths_and_unknown_schemes_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let out = tmp.path().join("out");
    let url = format!("file://{}", out.display());
    ok(&["reshard", &src, &url, "-w", "2"]);
    let said = ok(&["reshard", "verify", &format!("file://{src}"), &url]);
    assert!(said.contains("hold the same 3 tensors"), "{said}");
    let err = fails(&["reshard", &src, "gs://bucket/ckpt", "-w", "2"]);
    assert!(err.contains("unsupported scheme `gs://`"), "{err}");
}

/// Against the S3-compatible server of REMAT_S3_TEST_ENDPOINT (moto in CI), skipped
/// without one: local -> S3 -> local through `--endpoint`, verify on URLs, `--rank` and
/// `--finalize` on the store, and an error that names the URL, never the credentials.
#[test]
fn s3_round_trip_through_the_command() {
    let Some(endpoint) = std::env::var("REMAT_S3_TEST_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty())
    else {
        println!(
            "skipping: REMAT_S3_TEST_ENDPOINT is not set (an S3-compatible server such as `moto_server -p 5123`; .ci/run starts one)"
        );
        return;
    };
    let bucket = format!("remat-cli-{}", std::process::id());
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut s = std::net::TcpStream::connect(host).unwrap();
    use std::io::{Read, Write};
    write!(
        s,
        "PUT /{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.contains(" 200 "), "{reply}");
    let secret = "remat-cli-test-secret-3f9a";
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_remat"))
            .args(args)
            .args(["--endpoint", &endpoint])
            .env("AWS_ACCESS_KEY_ID", "remat-cli-test")
            .env("AWS_SECRET_ACCESS_KEY", secret)
            .output()
            .unwrap()
    };
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let at3 = format!("s3://{bucket}/m3");
    for rank in ["0", "1", "2"] {
        assert!(
            run(&["reshard", &src, &at3, "-w", "3", "--rank", rank])
                .status
                .success()
        );
    }
    let out = run(&["reshard", &src, &at3, "-w", "3", "--finalize"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let back = p(tmp.path(), "back");
    let out = run(&["reshard", &at3, &back, "-w", "2", "--format", "dcp"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("read amplification"), "{said}");
    let out = run(&["reshard", "verify", &src, &at3]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ok(&["reshard", "verify", &src, &back]);
    let out = run(&["reshard", "verify", &src, "s3://no-such-bucket-remat/x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("s3://no-such-bucket-remat/x"), "{err}");
    assert!(!err.contains(secret), "{err}");
}

/// One rank is "1 rank", one file "1 file"; bytes print in binary units and the bandwidth
/// per second, as every command prints them (never "1 ranks" or "0.000 GB").
#[test]
fn counts_are_singular_for_one_and_bytes_print_in_binary_units() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let out = p(tmp.path(), "one");
    let run = remat(&["reshard", &src, &out, "-w", "1"]);
    assert!(run.status.success(), "{run:?}");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("hf layout, 1 rank, 3 tensors, 1 -> 1 rank (remat layout)"),
        "{stderr}"
    );
    assert!(stdout.starts_with("wrote 1 file, "), "{stdout}");
    assert!(
        stdout.contains(" B in ") && stdout.contains("B/s (buffers peaked at "),
        "{stdout}"
    );
    assert!(
        !stdout.contains(" GB ") && !stdout.contains("files"),
        "{stdout}"
    );
    let verified = ok(&["reshard", "verify", &src, &out]);
    assert!(
        verified.contains("hold the same 3 tensors (") && verified.contains(" B compared, "),
        "{verified}"
    );
    assert!(!verified.contains(" GB "), "{verified}");
    // A message names no Rust API: the flag, and Python's argument.
    let again = fails(&["reshard", &src, &out, "-w", "1"]);
    assert!(
        again.contains("give --force (remat reshard) or force=True") && !again.contains("::"),
        "{again}"
    );
}

/// A buffer bound of 0 bytes holds nothing: refused before the source is read, exit 2.
#[test]
fn a_zero_buffer_and_a_zero_world_size_are_refused_before_anything_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = p(tmp.path(), "missing");
    let out = p(tmp.path(), "out");
    for (args, says) in [
        (
            vec!["-w", "2", "--max-buffer", "0"],
            "error: --max-buffer 0: comes to 0 bytes, which holds nothing",
        ),
        (vec!["-w", "0"], "error: --world-size 0: must be at least 1"),
        (
            vec!["-w", "-3"],
            "error: --world-size -3: the value is negative",
        ),
    ] {
        let run = remat(&[&["reshard", missing.as_str(), out.as_str()][..], &args].concat());
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.starts_with(says), "{args:?}: {stderr}");
        assert!(run.stdout.is_empty(), "{args:?}");
    }
    assert!(!Path::new(&out).exists());
}
