//! The object-store paths (ranged reads into scratch, uploads, markers, the index last,
//! `--rank` runs, finalize, resume) on object_store's local file system backend: the
//! same code as against S3, with the files open to inspection.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use common::*;
use remat_reshard::location::Remote;
use remat_reshard::remote::{mirror, sink};
use remat_reshard::run::verify_paths;
use remat_reshard::{ExecOptions, Format, ReshardError, TargetSpec, plan};

fn opts(rank: Option<usize>) -> ExecOptions<'static> {
    ExecOptions {
        max_buffer: 1 << 20,
        rank,
        ..Default::default()
    }
}

/// Writes `src` (a remote prefix) resharded into `dst` with `spec`, rank by rank when
/// `ranks` (then finalized), returning the files each run wrote.
fn reshard_remote(src: &Remote, dst: &Remote, spec: &TargetSpec, ranks: bool) -> Vec<usize> {
    let rc = mirror::open(src, None, 1 << 20).unwrap();
    let p = plan(&rc.ckpt, spec).unwrap();
    let source = sink::Source::Remote(&rc);
    if !ranks {
        let r = sink::execute(&source, &p, dst, &opts(None)).unwrap();
        let fetched = r.fetched.unwrap();
        assert!(
            fetched.bytes_requested >= fetched.bytes_needed,
            "{fetched:?}"
        );
        return vec![r.files_written];
    }
    let mut written = Vec::new();
    for rank in 0..spec.world_size {
        let r = sink::execute(&source, &p, dst, &opts(Some(rank))).unwrap();
        written.push(r.files_written);
    }
    sink::finalize(&rc.ckpt, &p, dst, false, 1 << 20).unwrap();
    written
}

fn same(a: &Path, b: &Path) {
    let report = verify_paths((a, None), (b, None), |_| {}, None).unwrap();
    assert_eq!(
        report.difference,
        None,
        "{} vs {}",
        a.display(),
        b.display()
    );
}

#[test]
fn round_trips_through_the_store_are_byte_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = Rng(21);
    let tensors = random_tensors(&mut rng, 14);
    let orig = tmp.path().join("orig");
    std::fs::create_dir(&orig).unwrap();
    write_global(&orig.join("model.safetensors"), &tensors);
    for (n, m) in [(1, 3), (2, 5), (5, 2), (8, 3)] {
        // N ranks on the store, from the local original.
        let a = Remote::local_dir(&tmp.path().join(format!("a{n}{m}"))).unwrap();
        let src = remat_reshard::Checkpoint::open(&orig, None).unwrap();
        let p = plan(
            &src,
            &spec(n, Format::Remat, random_rules(&mut rng, &tensors, n)),
        )
        .unwrap();
        sink::execute(&sink::Source::Local(&src), &p, &a, &opts(None)).unwrap();
        // N -> M -> N, store to store; the second leg rank by rank.
        let b = Remote::local_dir(&tmp.path().join(format!("b{n}{m}"))).unwrap();
        let c = Remote::local_dir(&tmp.path().join(format!("c{n}{m}"))).unwrap();
        let rules = random_rules(&mut rng, &tensors, m);
        reshard_remote(&a, &b, &spec(m, Format::Dcp, rules), false);
        reshard_remote(&b, &c, &spec(n, Format::Remat, Vec::new()), true);
        for dir in ["b", "c"] {
            same(&orig, &tmp.path().join(format!("{dir}{n}{m}")));
        }
    }
}

#[test]
fn rank_runs_leave_no_index_until_finalize_and_reruns_skip_certified_files() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = Rng(7);
    let tensors = random_tensors(&mut rng, 10);
    let orig = tmp.path().join("orig");
    std::fs::create_dir(&orig).unwrap();
    write_global(&orig.join("model.safetensors"), &tensors);
    let src = Remote::local_dir(&orig).unwrap();
    let dst_dir = tmp.path().join("out");
    let dst = Remote::local_dir(&dst_dir).unwrap();
    let rc = mirror::open(&src, None, 1 << 20).unwrap();
    let p = plan(&rc.ckpt, &spec(3, Format::Remat, Vec::new())).unwrap();
    let source = sink::Source::Remote(&rc);
    for rank in 0..3 {
        let r = sink::execute(&source, &p, &dst, &opts(Some(rank))).unwrap();
        assert_eq!((r.files_written, r.files_resumed), (1, 0));
        assert!(
            !dst_dir.join("remat.index.json").exists(),
            "index before finalize"
        );
    }
    // Finalize refuses while a file is not certified: rank 1's marker removed.
    let marker = dst_dir
        .join(".remat-parts")
        .join(format!("{}.json", p.files[1].name));
    std::fs::remove_file(&marker).unwrap();
    let err = sink::finalize(&rc.ckpt, &p, &dst, false, 1 << 20).unwrap_err();
    assert!(
        matches!(err, ReshardError::Part { .. })
            && err.to_string().contains("rank 1 has not finished"),
        "{err}"
    );
    assert!(!dst_dir.join("remat.index.json").exists());
    // A re-run of every rank writes rank 1 again and nothing else: the files certified
    // stay the very objects uploaded first.
    let inode = |i: usize| {
        std::fs::metadata(dst_dir.join(&p.files[i].name))
            .unwrap()
            .ino()
    };
    let before: Vec<u64> = (0..3).map(inode).collect();
    for rank in 0..3 {
        let r = sink::execute(&source, &p, &dst, &opts(Some(rank))).unwrap();
        let expected = if rank == 1 { (1, 0) } else { (0, 1) };
        assert_eq!((r.files_written, r.files_resumed), expected, "rank {rank}");
    }
    assert_eq!(inode(0), before[0]);
    assert_eq!(inode(2), before[2]);
    assert_ne!(inode(1), before[1]);
    sink::finalize(&rc.ckpt, &p, &dst, false, 1 << 20).unwrap();
    same(&orig, &dst_dir);
    assert!(
        !dst_dir
            .join(".remat-parts")
            .join(format!("{}.json", p.files[0].name))
            .exists()
    );
    // Complete now: another run refuses to replace it without overwrite.
    let err = sink::execute(&source, &p, &dst, &opts(None)).unwrap_err();
    assert!(matches!(err, ReshardError::OutputExists { .. }), "{err}");
}

#[test]
fn finalize_reads_back_every_chunk_and_refuses_a_changed_file() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = Rng(99);
    let tensors = random_tensors(&mut rng, 8);
    let orig = tmp.path().join("orig");
    std::fs::create_dir(&orig).unwrap();
    write_global(&orig.join("model.safetensors"), &tensors);
    let src = remat_reshard::Checkpoint::open(&orig, None).unwrap();
    let p = plan(&src, &spec(2, Format::Remat, Vec::new())).unwrap();
    let dst_dir = tmp.path().join("out");
    let dst = Remote::local_dir(&dst_dir).unwrap();
    for rank in 0..2 {
        sink::execute(&sink::Source::Local(&src), &p, &dst, &opts(Some(rank))).unwrap();
    }
    // Flip the last byte of rank 0's file, keeping its size and modification time: only
    // reading the chunks back can find it.
    let f = &p.files[0];
    let path = dst_dir.join(&f.name);
    let meta = std::fs::metadata(&path).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let mtime = std::fs::File::options().write(true).open(&path).unwrap();
    mtime.set_modified(meta.modified().unwrap()).unwrap();
    let err = sink::finalize(&src, &p, &dst, false, 1 << 20).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("hashes to") || text.contains("changed after it was certified"),
        "{text}"
    );
    assert!(!dst_dir.join("remat.index.json").exists());
}
