//! Resharding against a real S3-compatible server (moto's server mode in CI: .ci/run
//! starts it and sets REMAT_S3_TEST_ENDPOINT). Without an endpoint every test here says
//! it is skipped and why. Reads ../shared (the PyTorch DCP fixture) when it is there.

mod common;
mod s3;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use remat_reshard::run::{Action, Outcome};
use remat_reshard::{Dtype, Format, Placement, Rule, TargetSpec};
use s3::*;

const WORLDS: [usize; 5] = [1, 2, 3, 5, 8];

fn original(dir: &Path, seed: u64, count: usize) -> (PathBuf, Vec<Tensor>) {
    let mut rng = Rng(seed);
    let tensors = random_tensors(&mut rng, count);
    let orig = dir.join("orig");
    std::fs::create_dir_all(&orig).unwrap();
    write_global(&orig.join("model.safetensors"), &tensors);
    (orig, tensors)
}

fn write(endpoint: &str, src: &str, dst: &str, spec: TargetSpec) -> remat_reshard::ExecReport {
    written(reshard_s3(endpoint, (src, dst), spec, None, Action::Write, 4 << 20).unwrap())
}

#[test]
fn round_trips_n_to_m_to_n_through_s3_are_byte_exact() {
    let Some(ep) = endpoint() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (orig, tensors) = original(tmp.path(), 5, 12);
    let orig = orig.to_string_lossy().into_owned();
    let b = bucket(&ep, "trip");
    let mut rng = Rng(11);
    let formats = [Format::Remat, Format::Dcp, Format::Hf];
    for (i, n) in WORLDS.into_iter().enumerate() {
        // Local original onto the store as N ranks (a mixed run).
        let at_n = format!("s3://{b}/n{n}");
        write(
            &ep,
            &orig,
            &at_n,
            spec(n, Format::Remat, random_rules(&mut rng, &tensors, n)),
        );
        same(&ep, &orig, &at_n);
        for (j, m) in WORLDS.into_iter().enumerate().filter(|&(_, m)| m != n) {
            let at_m = format!("s3://{b}/n{n}-m{m}");
            let back = format!("s3://{b}/n{n}-m{m}-n{n}");
            let format = formats[(i + j) % 3];
            let rules = if format == Format::Hf {
                Vec::new()
            } else {
                random_rules(&mut rng, &tensors, m)
            };
            let r = write(&ep, &at_n, &at_m, spec(m, format, rules));
            let fetched = r.fetched.expect("a remote source is fetched");
            assert!(fetched.bytes_requested >= fetched.bytes_needed);
            write(&ep, &at_m, &back, spec(n, Format::Remat, Vec::new()));
            same(&ep, &orig, &at_m);
            same(&ep, &orig, &back);
        }
    }
    // And off the store onto a local directory.
    let local = tmp.path().join("from-s3");
    write(
        &ep,
        &format!("s3://{b}/n3-m5"),
        &local.to_string_lossy(),
        spec(2, Format::Hf, Vec::new()),
    );
    same(&ep, &orig, &local.to_string_lossy());
}

/// Uploads a local file as it is (the fixture keeps its own bytes on the store).
fn put_object(endpoint: &str, bucket: &str, key: &str, bytes: &[u8]) {
    let host = authority(endpoint);
    let mut s = TcpStream::connect(&host).unwrap();
    write!(
        s,
        "PUT /{bucket}/{key} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        bytes.len()
    )
    .unwrap();
    s.write_all(bytes).unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.contains(" 200 "), "{reply}");
}

#[test]
fn the_pytorch_dcp_fixture_round_trips_through_s3() {
    let Some(ep) = endpoint() else { return };
    let fixture = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/fixtures/torch-dcp-hf-w4"
    ));
    if !fixture.is_dir() {
        println!("skipping: {} is absent", fixture.display());
        return;
    }
    println!("reading the PyTorch fixture at {}", fixture.display());
    let tmp = tempfile::tempdir().unwrap();
    let shards = tmp.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    let b = bucket(&ep, "fixture");
    for rank in 1..=4 {
        let name = format!("shard-{rank:05}-model-00001-of-00001.safetensors");
        std::fs::copy(fixture.join(&name), shards.join(&name)).unwrap();
        put_object(
            &ep,
            &b,
            &format!("w4/{name}"),
            &std::fs::read(fixture.join(&name)).unwrap(),
        );
    }
    let shards = shards.to_string_lossy().into_owned();
    let src = format!("s3://{b}/w4");
    same(&ep, &shards, &src);
    for m in WORLDS {
        let at_m = format!("s3://{b}/m{m}");
        let back = format!("s3://{b}/m{m}-w4");
        write(&ep, &src, &at_m, spec(m, Format::Remat, Vec::new()));
        write(&ep, &at_m, &back, spec(4, Format::Dcp, Vec::new()));
        same(&ep, &shards, &at_m);
        same(&ep, &shards, &back);
    }
}

#[test]
fn rank_runs_leave_nothing_complete_until_finalize_and_reruns_upload_nothing() {
    let Some(ep) = endpoint() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (orig, _) = original(tmp.path(), 8, 10);
    let orig = orig.to_string_lossy().into_owned();
    let b = bucket(&ep, "ranks");
    let dst = format!("s3://{b}/out");
    let proxy = Proxy::start(&ep, Faults::default());
    let m = 3;
    for rank in 0..m {
        let r = reshard_s3(
            &proxy.endpoint,
            (&orig, &dst),
            spec(m, Format::Dcp, Vec::new()),
            Some(rank),
            Action::Write,
            4 << 20,
        );
        assert_eq!(written(r.unwrap()).files_written, 1);
        let listed = keys(&ep, &b, "out/");
        assert!(
            !listed
                .iter()
                .any(|k| k.ends_with(".json") && !k.contains(".remat-parts")),
            "{listed:?}"
        );
    }
    // A re-run of every rank finds its file certified and uploads nothing.
    let before = proxy.lines().len();
    for rank in 0..m {
        let r = reshard_s3(
            &proxy.endpoint,
            (&orig, &dst),
            spec(m, Format::Dcp, Vec::new()),
            Some(rank),
            Action::Write,
            4 << 20,
        );
        let r = written(r.unwrap());
        assert_eq!((r.files_written, r.files_resumed), (0, 1));
    }
    let rerun = proxy.lines()[before..].to_vec();
    assert!(
        rerun
            .iter()
            .all(|l| l.starts_with("GET ") || l.starts_with("HEAD ")),
        "{rerun:?}"
    );
    let out = reshard_s3(
        &ep,
        (&orig, &dst),
        spec(m, Format::Dcp, Vec::new()),
        None,
        Action::Finalize,
        4 << 20,
    )
    .unwrap();
    assert!(matches!(out, Outcome::Finalized { parts: 3 }), "{out:?}");
    same(&ep, &orig, &dst);
    assert!(keys(&ep, &b, "out/.remat-parts").is_empty());
}

/// One tensor of `rows` x 4096 f32 (16 KiB a row), so that target files upload in
/// several 5 MiB parts.
fn large(dir: &Path, rows: u64) -> PathBuf {
    let orig = dir.join("large");
    std::fs::create_dir_all(&orig).unwrap();
    let mut rng = Rng(3);
    let t = Tensor {
        name: "w".into(),
        dtype: Dtype::F32,
        shape: vec![rows, 4096],
        data: rng.bytes(rows as usize * 4096 * 4),
    };
    write_global(&orig.join("model.safetensors"), &[t]);
    orig
}

fn shard0(m: usize) -> TargetSpec {
    spec(
        m,
        Format::Remat,
        vec![remat_reshard::NameRule {
            pattern: "*".into(),
            rule: Rule::Place(Placement::Shard(0)),
        }],
    )
}

#[test]
fn a_dropped_connection_and_a_refused_part_are_retried_not_reuploaded() {
    let Some(ep) = endpoint() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let orig = large(tmp.path(), 1536).to_string_lossy().into_owned();
    let b = bucket(&ep, "faults");
    let dst = format!("s3://{b}/out");
    let proxy = Proxy::start(
        &ep,
        Faults {
            drop_parts: 1,
            refuse_parts: 1,
            ..Default::default()
        },
    );
    let r = reshard_s3(
        &proxy.endpoint,
        (&orig, &dst),
        shard0(2),
        None,
        Action::Write,
        20 << 20,
    );
    assert_eq!(written(r.unwrap()).files_written, 2);
    let lines = proxy.lines();
    assert!(
        lines.iter().any(|l| l.starts_with("DROPPED PUT")),
        "{lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("REFUSED PUT")),
        "{lines:?}"
    );
    same(&ep, &orig, &dst);
    // Each file was uploaded once: one multipart upload created, one completed, and its
    // parts retried alone.
    for rank in 0..2 {
        let key = format!("out/rank-{rank:05}-of-00002.safetensors");
        let ups = uploads_of(&lines, &b, &key);
        let creates = ups.iter().filter(|l| l.contains("?uploads")).count();
        let completes = ups
            .iter()
            .filter(|l| l.starts_with("POST ") && l.contains("uploadId="))
            .count();
        assert_eq!((creates, completes), (1, 1), "{key}: {ups:?}");
    }
}

/// The child of [`a_run_killed_between_files_resumes_without_uploading_them_again`]:
/// reshards as told by its environment, slowly (each request delayed by a proxy), to be
/// killed partway.
#[test]
#[ignore = "run as a child process by the kill test"]
fn killed_child() {
    let (Ok(ep), Ok(src), Ok(dst)) = (
        std::env::var("REMAT_CHILD_ENDPOINT"),
        std::env::var("REMAT_CHILD_SRC"),
        std::env::var("REMAT_CHILD_DST"),
    ) else {
        panic!("the kill test's child needs REMAT_CHILD_ENDPOINT, _SRC and _DST");
    };
    let proxy = Proxy::start(
        &ep,
        Faults {
            delay: Duration::from_millis(150),
            ..Default::default()
        },
    );
    let _ = reshard_s3(
        &proxy.endpoint,
        (&src, &dst),
        shard0(8),
        None,
        Action::Write,
        20 << 20,
    );
}

#[test]
fn a_run_killed_between_files_resumes_without_uploading_them_again() {
    let Some(ep) = endpoint() else { return };
    let tmp = tempfile::tempdir().unwrap();
    // 8 files of 6 MiB: each a multipart upload of two parts.
    let orig = large(tmp.path(), 3072).to_string_lossy().into_owned();
    let b = bucket(&ep, "kill");
    let dst = format!("s3://{b}/out");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "killed_child", "--nocapture"])
        .env("REMAT_CHILD_ENDPOINT", &ep)
        .env("REMAT_CHILD_SRC", &orig)
        .env("REMAT_CHILD_DST", &dst)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let markers = loop {
        let m: Vec<String> = keys(&ep, &b, "out/.remat-parts/");
        if m.len() >= 2 {
            break m;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the child certified no file"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the child ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    // Killed: no index, so nothing reads as a complete checkpoint.
    let listed = keys(&ep, &b, "out/");
    assert!(
        !listed.iter().any(|k| k.ends_with("remat.index.json")),
        "{listed:?}"
    );
    let markers = keys(&ep, &b, "out/.remat-parts/")
        .into_iter()
        .chain(markers)
        .collect::<std::collections::BTreeSet<_>>();
    assert!(
        markers.len() < 8,
        "the child finished every file before it was killed"
    );
    // Resumed: the certified files are not uploaded again, the rest are.
    let proxy = Proxy::start(&ep, Faults::default());
    let r = written(
        reshard_s3(
            &proxy.endpoint,
            (&orig, &dst),
            shard0(8),
            None,
            Action::Write,
            20 << 20,
        )
        .unwrap(),
    );
    assert_eq!(r.files_written + r.files_resumed, 8);
    assert_eq!(r.files_resumed, markers.len(), "{r:?}");
    let lines = proxy.lines();
    for m in &markers {
        let name = m
            .trim_start_matches("out/.remat-parts/")
            .trim_end_matches(".json");
        assert!(
            uploads_of(&lines, &b, &format!("out/{name}")).is_empty(),
            "{name} uploaded again: {lines:?}"
        );
    }
    same(&ep, &orig, &dst);
}
