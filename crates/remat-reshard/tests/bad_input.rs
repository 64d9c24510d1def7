//! Every kind of bad input is a clear error naming the file and tensor, raised before
//! anything is written: no output is left behind.
//!
//! Why one file of ~990 lines: one case per kind of bad input, all sharing the same helpers
//! (a checkpoint written, one thing broken, the error and the empty output checked); each
//! integration-test file is a binary of its own, so they share one.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use remat_reshard::safetensors::{TensorData, write_file};
use remat_reshard::{Checkpoint, Dtype, ExecOptions, Format, TargetSpec, execute, plan};

type DcpPiece<'a> = (&'a str, Dtype, Vec<u64>, Vec<u64>);

/// Writes a DCP shard file holding `(name, dtype, shape, offsets)` pieces.
fn dcp_file(dir: &Path, rank: usize, pieces: &[DcpPiece]) {
    let name = format!("shard-{:05}-model-00001-of-00001.safetensors", rank + 1);
    dcp_file_named(dir, &name, pieces, Some(pieces));
}

/// Writes `name` holding `pieces`, with `DCP_SHARDING_INFO` listing `info` (none: no
/// sharding info at all).
fn dcp_file_named(dir: &Path, name: &str, pieces: &[DcpPiece], info: Option<&[DcpPiece]>) {
    let mut meta = BTreeMap::new();
    if let Some(info) = info {
        let info: serde_json::Map<String, serde_json::Value> = info
            .iter()
            .map(|(n, _, _, o)| (n.to_string(), serde_json::json!({ "saved_offsets": o })))
            .collect();
        meta.insert(
            "DCP_SHARDING_INFO".to_string(),
            serde_json::Value::Object(info).to_string(),
        );
    }
    let data: Vec<Vec<u8>> = pieces
        .iter()
        .map(|(_, d, s, _)| vec![7u8; d.bytes_for(s.iter().product()).unwrap() as usize])
        .collect();
    let tensors: Vec<TensorData> = pieces
        .iter()
        .zip(&data)
        .map(|((n, d, s, _), bytes)| TensorData {
            name: n,
            dtype: *d,
            shape: s,
            data: bytes,
        })
        .collect();
    write_file(&dir.join(name), &tensors, &meta).unwrap();
}

/// Runs open + plan + execute and returns the error text; checks nothing was written.
fn fails(src: &Path) -> String {
    fails_onto(src, 2)
}

/// [`fails`] onto `m` ranks.
fn fails_onto(src: &Path, m: usize) -> String {
    let dst = src.parent().unwrap().join("out");
    let err = (|| {
        let ck = Checkpoint::open(src, None)?;
        let p = plan(&ck, &TargetSpec::new(m, Format::Remat))?;
        execute(&ck, &p, &dst, &ExecOptions::default())
    })()
    .expect_err("bad input must fail")
    .to_string();
    assert!(!dst.exists(), "output left behind for: {err}");
    let leftovers: Vec<_> = std::fs::read_dir(src.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".out"))
        .collect();
    assert!(leftovers.is_empty(), "staging left behind for: {err}");
    err
}

/// A good two-rank checkpoint to corrupt.
fn good(dir: &Path) -> std::path::PathBuf {
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    dcp_file(
        &src,
        0,
        &[
            ("w", Dtype::F32, vec![2, 4], vec![0, 0]),
            ("b", Dtype::BF16, vec![3], vec![0]),
        ],
    );
    dcp_file(&src, 1, &[("w", Dtype::F32, vec![2, 4], vec![2, 0])]);
    src
}

/// Rewrites text in a file's JSON header, fixing the length prefix, keeping the data.
fn patch_header(path: &Path, edits: &[(&str, &str)]) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut json = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    for (from, to) in edits {
        assert!(json.contains(from), "{from} not in {json}");
        json = json.replace(from, to);
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

fn shard(src: &Path, rank: usize) -> std::path::PathBuf {
    src.join(format!(
        "shard-{:05}-model-00001-of-00001.safetensors",
        rank + 1
    ))
}

#[test]
fn the_good_checkpoint_works() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let ck = Checkpoint::open(&src, None).unwrap();
    assert_eq!(ck.tensor("w").unwrap().shape, vec![4, 4]);
}

#[test]
fn truncated_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    std::fs::write(shard(&src, 1), [1u8, 2, 3]).unwrap();
    let e = fails(&src);
    assert!(e.contains("shard-00002") && e.contains("truncated"), "{e}");
}

#[test]
fn data_cut_short() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let bytes = std::fs::read(shard(&src, 0)).unwrap();
    std::fs::write(shard(&src, 0), &bytes[..bytes.len() - 4]).unwrap();
    let e = fails(&src);
    assert!(
        e.contains("shard-00001") && e.contains("outside the data section"),
        "{e}"
    );
}

#[test]
fn header_length_beyond_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let mut bytes = std::fs::read(shard(&src, 1)).unwrap();
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(shard(&src, 1), &bytes).unwrap();
    let e = fails(&src);
    assert!(
        e.contains("shard-00002")
            && e.contains("header length 1099511627776 goes beyond the end of the file"),
        "{e}"
    );
}

#[test]
fn invalid_header_json() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let mut bytes = std::fs::read(shard(&src, 0)).unwrap();
    bytes[8] = b'[';
    std::fs::write(shard(&src, 0), &bytes).unwrap();
    let e = fails(&src);
    assert!(
        e.contains("shard-00001") && e.contains("invalid header JSON"),
        "{e}"
    );
}

#[test]
fn unknown_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    patch_header(&shard(&src, 0), &[("\"BF16\"", "\"BF17\"")]);
    let e = fails(&src);
    assert!(
        e.contains("shard-00001") && e.contains("tensor `b`") && e.contains("unknown dtype `BF17`"),
        "{e}"
    );
}

#[test]
fn dtype_differs_across_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    dcp_file(&src, 1, &[("w", Dtype::F16, vec![2, 4], vec![2, 0])]);
    let e = fails(&src);
    assert!(
        e.contains("tensor `w`")
            && e.contains("dtype differs")
            && e.contains("F32")
            && e.contains("F16")
            && e.contains("shard-00002"),
        "{e}"
    );
}

#[test]
fn overlapping_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    dcp_file(&src, 1, &[("w", Dtype::F32, vec![2, 4], vec![1, 0])]);
    let e = fails(&src);
    assert!(
        e.contains("tensor `w`")
            && e.contains("overlap")
            && e.contains("shard-00001")
            && e.contains("shard-00002"),
        "{e}"
    );
}

#[test]
fn chunks_leaving_a_hole() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    dcp_file(&src, 1, &[("w", Dtype::F32, vec![2, 4], vec![3, 0])]);
    let e = fails(&src);
    assert!(
        e.contains("tensor `w`") && e.contains("hole") && e.contains("16 of the 20 elements"),
        "{e}"
    );
}

#[test]
fn data_offsets_outside_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    patch_header(
        &shard(&src, 1),
        &[("[0,32]", "[0,96]"), ("\"shape\":[2,4]", "\"shape\":[6,4]")],
    );
    let e = fails(&src);
    assert!(
        e.contains("shard-00002")
            && e.contains("tensor `w`")
            && e.contains("outside the data section"),
        "{e}"
    );
}

#[test]
fn shape_whose_byte_size_overflows() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    patch_header(
        &shard(&src, 1),
        &[("\"shape\":[2,4]", "\"shape\":[4611686018427387904,4]")],
    );
    let e = fails(&src);
    assert!(
        e.contains("shard-00002") && e.contains("tensor `w`") && e.contains("overflows"),
        "{e}"
    );
}

#[test]
fn index_pointing_at_a_mismatched_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let remat = dir.path().join("remat");
    common::reshard(&src, &remat, &TargetSpec::new(2, Format::Remat));
    let index = remat.join("remat.index.json");
    let text = std::fs::read_to_string(&index)
        .unwrap()
        .replacen("\"F32\"", "\"I32\"", 1);
    std::fs::write(&index, text).unwrap();
    let e = fails(&remat);
    assert!(
        e.contains("rank-0000") && e.contains("tensor `w`") && e.contains("the index says I32"),
        "{e}"
    );
}

#[test]
fn existing_output_is_not_overwritten_unless_asked() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let dst = dir.path().join("out");
    std::fs::create_dir(&dst).unwrap();
    std::fs::write(dst.join("keep.txt"), b"mine").unwrap();
    let ck = Checkpoint::open(&src, None).unwrap();
    let p = plan(&ck, &TargetSpec::new(2, Format::Remat)).unwrap();
    let e = execute(&ck, &p, &dst, &ExecOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("already exists"), "{e}");
    assert_eq!(std::fs::read(dst.join("keep.txt")).unwrap(), b"mine");
    execute(
        &ck,
        &p,
        &dst,
        &ExecOptions {
            overwrite: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(!dst.join("keep.txt").exists());
    assert!(dst.join("remat.index.json").exists());
    let e = execute(
        &ck,
        &p,
        &src,
        &ExecOptions {
            overwrite: true,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("overlaps the source"), "{e}");
}

#[test]
fn a_stale_staging_directory_from_an_interrupted_run_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let dst = dir.path().join("out");
    let stale = dir.path().join(".out.remat-staging");
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("rank-00000-of-00002.safetensors"), b"half").unwrap();
    common::reshard(&src, &dst, &TargetSpec::new(2, Format::Remat));
    assert!(!stale.exists());
    assert!(dst.join("remat.index.json").exists());
}

#[test]
fn sub_byte_dtypes_split_on_byte_boundaries_only() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("f4.safetensors");
    let data: Vec<u8> = (0..12).collect();
    let t = [TensorData {
        name: "q",
        dtype: Dtype::F4,
        shape: &[4, 6],
        data: &data,
    }];
    write_file(&src, &t, &BTreeMap::new()).unwrap();
    let ck = Checkpoint::open(&src, None).unwrap();
    let rows = remat_reshard::NameRule::parse("q=shard(0)").unwrap();
    let spec = TargetSpec {
        world_size: 4,
        format: Format::Remat,
        rules: vec![rows],
        preset: None,
    };
    let out = dir.path().join("rows");
    execute(
        &ck,
        &plan(&ck, &spec).unwrap(),
        &out,
        &ExecOptions::default(),
    )
    .unwrap();
    let back = Checkpoint::open(&out, None).unwrap();
    assert_eq!(
        remat_reshard::verify(&ck, &back, None).unwrap().difference,
        None
    );
    let cols = remat_reshard::NameRule::parse("q=shard(1)").unwrap();
    // Columns of 3 four-bit elements end inside a byte.
    let spec = TargetSpec {
        world_size: 2,
        format: Format::Remat,
        rules: vec![cols],
        preset: None,
    };
    let e = plan(&ck, &spec).unwrap_err().to_string();
    assert!(
        e.contains("tensor `q`") && e.contains("inside a byte"),
        "{e}"
    );
}

#[test]
fn hf_weight_map_naming_the_wrong_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let hf = dir.path().join("hf");
    common::reshard(
        &src,
        &hf,
        &TargetSpec {
            world_size: 2,
            format: Format::Hf,
            rules: vec![],
            preset: Some(remat_reshard::Preset::Simple),
        },
    );
    let index = hf.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    let swapped = text
        .replace("model-00001-of-00002", "TMP")
        .replace("model-00002-of-00002", "model-00001-of-00002")
        .replace("TMP", "model-00002-of-00002");
    std::fs::write(&index, swapped).unwrap();
    let e = Checkpoint::open(&hf, Some(Format::Hf))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("model.safetensors.index.json") && e.contains("is mapped to"),
        "{e}"
    );
}

#[test]
fn a_tensor_missing_from_the_sharding_info_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let piece = ("w", Dtype::F32, vec![2, 4], vec![2, 0]);
    let extra = ("x", Dtype::U8, vec![3], vec![0]);
    dcp_file_named(
        &src,
        "shard-00002-model-00001-of-00001.safetensors",
        &[piece.clone(), extra],
        Some(&[piece]),
    );
    let e = fails(&src);
    assert!(
        e.contains("shard-00002")
            && e.contains("tensor `x`")
            && e.contains("does not list this tensor"),
        "{e}"
    );
}

#[test]
fn every_safetensors_file_of_a_dcp_directory_is_read() {
    let dir = tempfile::tempdir().unwrap();
    // 0-based names, as some writers use, and a file with an unrelated name holding a
    // whole tensor without sharding info (placed at the origin, as PyTorch does).
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let w0 = ("w", Dtype::F32, vec![2, 4], vec![0, 0]);
    let w1 = ("w", Dtype::F32, vec![2, 4], vec![2, 0]);
    let w2 = ("w", Dtype::F32, vec![1, 4], vec![4, 0]);
    dcp_file_named(
        &src,
        "shard-00000-model-00001-of-00001.safetensors",
        std::slice::from_ref(&w0),
        Some(std::slice::from_ref(&w0)),
    );
    dcp_file_named(
        &src,
        "shard-00001-model-00001-of-00001.safetensors",
        std::slice::from_ref(&w1),
        Some(std::slice::from_ref(&w1)),
    );
    dcp_file_named(
        &src,
        "shard-00002-model-00001-of-00001.safetensors",
        std::slice::from_ref(&w2),
        Some(std::slice::from_ref(&w2)),
    );
    dcp_file_named(
        &src,
        "extra.safetensors",
        &[("z", Dtype::U8, vec![3], vec![])],
        None,
    );
    std::fs::write(src.join("notes.txt"), "not a tensor file").unwrap();
    let ck = Checkpoint::open(&src, None).unwrap();
    assert_eq!(ck.format, Format::Dcp);
    assert_eq!(ck.world_size, 4);
    assert_eq!(ck.tensor("w").unwrap().shape, vec![5, 4]);
    assert_eq!(ck.tensor("z").unwrap().shape, vec![3]);
    let mut ranks: Vec<(usize, String)> = ck
        .files
        .iter()
        .zip(&ck.file_ranks)
        .map(|(f, r)| {
            (
                *r,
                f.path.file_name().unwrap().to_string_lossy().into_owned(),
            )
        })
        .collect();
    ranks.sort();
    assert_eq!(
        ranks[0],
        (0, "shard-00000-model-00001-of-00001.safetensors".into())
    );
    assert_eq!(ranks[3], (3, "extra.safetensors".into()));
}

#[test]
fn a_dcp_file_that_cannot_be_placed_is_an_error_not_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    // A stray file without sharding info lands at the origin; its `w` collides with the
    // shards' pieces, and its `extra` keeps it from being a mere copy of them.
    dcp_file_named(
        &src,
        "stray.safetensors",
        &[
            ("w", Dtype::F32, vec![3, 4], vec![]),
            ("extra", Dtype::U8, vec![2], vec![]),
        ],
        None,
    );
    let e = fails(&src);
    assert!(
        e.contains("tensor `w`") && e.contains("overlap") && e.contains("stray.safetensors"),
        "{e}"
    );
}

/// A file that only repeats tensors the shards hold (a consolidated copy kept beside them)
/// is left out and reported in `skipped`, not read as colliding pieces.
#[test]
fn a_copy_beside_dcp_shards_is_skipped_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    dcp_file_named(
        &src,
        "full.safetensors",
        &[("w", Dtype::F32, vec![4, 4], vec![])],
        None,
    );
    let ck = Checkpoint::open(&src, None).unwrap();
    assert_eq!(ck.skipped.len(), 1);
    assert!(ck.skipped[0].path.ends_with("full.safetensors"));
    assert!(
        ck.files
            .iter()
            .all(|f| !f.path.ends_with("full.safetensors"))
    );
}

/// A world size no job has (a typo, a negative number wrapped around) is refused with the
/// bound in the message, before anything proportional to it is allocated.
#[test]
fn an_unreasonable_world_size_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let ck = Checkpoint::open(&src, None).unwrap();
    for m in [usize::MAX, 1_000_000_000, (1 << 20) + 1] {
        let e = plan(&ck, &TargetSpec::new(m, Format::Remat))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("world size {m}")) && e.contains("1048576 (2^20)"),
            "{e}"
        );
    }
    // Within the rank bound, a plan of more chunks than memory holds is refused too:
    // 40 tensors replicated on 2^20 ranks.
    let many = dir.path().join("many.safetensors");
    let names: Vec<String> = (0..40).map(|i| format!("n{i}")).collect();
    let data = [1u8, 2, 3, 4];
    let tensors: Vec<TensorData> = names
        .iter()
        .map(|n| TensorData {
            name: n,
            dtype: Dtype::F32,
            shape: &[1],
            data: &data,
        })
        .collect();
    write_file(&many, &tensors, &BTreeMap::new()).unwrap();
    let ck = Checkpoint::open(&many, None).unwrap();
    let spec = TargetSpec {
        world_size: 1 << 20,
        format: Format::Remat,
        rules: vec![remat_reshard::NameRule::parse("*=replicate").unwrap()],
        preset: None,
    };
    let e = plan(&ck, &spec).unwrap_err().to_string();
    assert!(
        e.contains("41943040 chunks") && e.contains("33554432 (2^25)"),
        "{e}"
    );
}

/// Two DCP files holding the same piece of `w` are copies of one box: equal bytes are
/// accepted (one copy is read), different bytes are an error naming the tensor and both
/// files, since which copy is right cannot be known.
#[test]
fn replicas_with_different_bytes_are_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let w0 = ("w", Dtype::F32, vec![2, 4], vec![0, 0]);
    dcp_file(&src, 2, std::slice::from_ref(&w0));
    let ck = Checkpoint::open(&src, None).unwrap();
    assert_eq!(ck.tensor("w").unwrap().pieces.len(), 3);
    // Same piece, one byte changed (the data follows the header).
    let copy = shard(&src, 2);
    let mut bytes = std::fs::read(&copy).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    std::fs::write(&copy, bytes).unwrap();
    let e = fails(&src);
    assert!(
        e.contains("tensor `w`")
            && e.contains("shard-00001")
            && e.contains("shard-00003")
            && e.contains("copies of one box")
            && e.contains("first at byte 29"),
        "{e}"
    );
}

/// In remat's layout a replicated tensor is listed once per rank: replicas whose index
/// checksums disagree are an error naming both rank files.
#[test]
fn remat_replicas_with_different_checksums_are_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let remat = dir.path().join("remat");
    common::reshard(&src, &remat, &TargetSpec::new(2, Format::Remat));
    let index_path = remat.join("remat.index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let b = index["tensors"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|t| t["name"] == "b")
        .unwrap();
    assert_eq!(b["placement"], "replicate");
    b["chunks"][1]["checksum"] = "0123456789abcdef".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    let e = fails(&remat);
    assert!(
        e.contains("tensor `b`")
            && e.contains("rank-00000-of-00002")
            && e.contains("rank-00001-of-00002")
            && e.contains("index checksums differ"),
        "{e}"
    );
}

/// The remat index of `dir`, and where chunk `k` of tensor `name` lies: file and bytes.
fn remat_chunk(dir: &Path, name: &str, k: usize) -> (serde_json::Value, String, [usize; 2]) {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("remat.index.json")).unwrap()).unwrap();
    let t = index["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap();
    let c = &t["chunks"][k];
    let file = index["files"][c["file"].as_u64().unwrap() as usize]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let range = [
        c["byte_range"][0].as_u64().unwrap() as usize,
        c["byte_range"][1].as_u64().unwrap() as usize,
    ];
    (index, file, range)
}

fn flip_byte(path: &Path, at: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

/// Source data that does not match the checksums of its index fails the reshard, naming
/// the file and tensor, whether the corrupt piece is copied whole (same layout: checked
/// by the checksum of the chunk written), split (onto 3 ranks: hashed before the copy)
/// or a replica the copy does not read; and so does a wrong checksum in the index.
#[test]
fn source_data_that_does_not_match_its_checksums_fails() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let remat = dir.path().join("remat");
    common::reshard(&src, &remat, &TargetSpec::new(2, Format::Remat));
    let pristine = dir.path().join("pristine");
    common::reshard(&src, &pristine, &TargetSpec::new(2, Format::Remat));
    let restore = || {
        for e in std::fs::read_dir(&pristine).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), remat.join(e.file_name())).unwrap();
        }
    };
    // A data byte of `w` in rank 0's file.
    let (_, file, range) = remat_chunk(&remat, "w", 0);
    flip_byte(&remat.join(&file), range[0] + 5);
    for m in [2, 3] {
        let e = fails_onto(&remat, m);
        assert!(
            e.contains(&file) && e.contains("tensor `w`") && e.contains("checksum mismatch"),
            "onto {m}: {e}"
        );
    }
    // The replica of `b` on rank 1, which the copy does not read.
    restore();
    let (_, file, range) = remat_chunk(&remat, "b", 1);
    assert!(file.starts_with("rank-00001"));
    flip_byte(&remat.join(&file), range[0]);
    let e = fails(&remat);
    assert!(
        e.contains(&file) && e.contains("tensor `b`") && e.contains("checksum mismatch"),
        "{e}"
    );
    // A wrong checksum in the index.
    restore();
    let (mut index, file, _) = remat_chunk(&remat, "w", 1);
    let w = index["tensors"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|t| t["name"] == "w")
        .unwrap();
    w["chunks"][1]["checksum"] = "0123456789abcdef".into();
    std::fs::write(remat.join("remat.index.json"), index.to_string()).unwrap();
    for m in [2, 3] {
        let e = fails_onto(&remat, m);
        assert!(
            e.contains(&file) && e.contains("index says 0123456789abcdef"),
            "onto {m}: {e}"
        );
    }
    // Intact, it reshards.
    restore();
    common::reshard(
        &remat,
        &dir.path().join("ok"),
        &TargetSpec::new(3, Format::Remat),
    );
}

/// A destination that is a regular file is refused up front, with or without
/// overwriting: the file stays as it was and nothing is written beside it.
#[test]
fn a_destination_that_is_a_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let dst = dir.path().join("g3");
    std::fs::write(&dst, b"data\n").unwrap();
    let ck = Checkpoint::open(&src, None).unwrap();
    let p = plan(&ck, &TargetSpec::new(2, Format::Remat)).unwrap();
    for overwrite in [false, true] {
        for rank in [None, Some(0)] {
            let opts = ExecOptions {
                overwrite,
                rank,
                ..Default::default()
            };
            let e = execute(&ck, &p, &dst, &opts).unwrap_err().to_string();
            assert!(e.contains("g3") && e.contains("is not a directory"), "{e}");
        }
        let e = remat_reshard::finalize(&ck, &p, &dst, overwrite)
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a directory"), "{e}");
    }
    assert_eq!(std::fs::read(&dst).unwrap(), b"data\n");
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["g3", "src"]);
}

/// A `--rank` run that fails after creating its part (here on corrupt source data found
/// while writing) removes the part: no pre-sized, half-written file stays behind.
#[test]
fn a_failed_rank_run_leaves_no_part() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let remat = dir.path().join("remat");
    common::reshard(&src, &remat, &TargetSpec::new(2, Format::Remat));
    let (_, file, range) = remat_chunk(&remat, "w", 0);
    flip_byte(&remat.join(&file), range[0]);
    let ck = Checkpoint::open(&remat, None).unwrap();
    let p = plan(&ck, &TargetSpec::new(2, Format::Remat)).unwrap();
    let dst = dir.path().join("out");
    let opts = ExecOptions {
        rank: Some(0),
        ..Default::default()
    };
    let e = execute(&ck, &p, &dst, &opts).unwrap_err().to_string();
    assert!(e.contains("checksum mismatch"), "{e}");
    let left: Vec<_> = std::fs::read_dir(&dst)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// `finalize` re-hashes every part against the checksums its manifest lists before it
/// writes the index: a byte changed in a part after its `--rank` run is refused, naming
/// the part and tensor, and no index is written; rerunning that rank repairs it.
#[test]
fn finalize_refuses_a_part_changed_after_it_was_written() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let ck = Checkpoint::open(&src, None).unwrap();
    let p = plan(&ck, &TargetSpec::new(2, Format::Remat)).unwrap();
    let dst = dir.path().join("out");
    let run = |rank: usize| {
        let opts = ExecOptions {
            rank: Some(rank),
            overwrite: true,
            ..Default::default()
        };
        execute(&ck, &p, &dst, &opts).unwrap();
    };
    run(0);
    run(1);
    let part = dst.join("rank-00001-of-00002.safetensors.part");
    let len = std::fs::metadata(&part).unwrap().len() as usize;
    flip_byte(&part, len - 1);
    let e = remat_reshard::finalize(&ck, &p, &dst, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank-00001-of-00002.safetensors.part")
            && e.contains("tensor `w`")
            && e.contains("the manifest says")
            && e.contains("rerun rank 1"),
        "{e}"
    );
    assert!(!dst.join("remat.index.json").exists());
    run(1);
    remat_reshard::finalize(&ck, &p, &dst, false).unwrap();
    let back = Checkpoint::open(&dst, None).unwrap();
    assert_eq!(
        remat_reshard::verify(&ck, &back, None).unwrap().difference,
        None
    );
}

/// A tensor a remat rank file holds but the index does not list would vanish from the
/// output: an error naming the file and tensor.
#[test]
fn a_rank_file_tensor_missing_from_the_index_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let remat = dir.path().join("remat");
    common::reshard(&src, &remat, &TargetSpec::new(2, Format::Remat));
    let (mut index, _, _) = remat_chunk(&remat, "b", 0);
    index["tensors"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t["name"] != "b");
    std::fs::write(remat.join("remat.index.json"), index.to_string()).unwrap();
    let e = fails(&remat);
    assert!(
        e.contains("rank-00000-of-00002")
            && e.contains("tensor `b`")
            && e.contains("lists no chunk of it here"),
        "{e}"
    );
}

/// A Hugging Face index whose `weight_map` is empty is an error, not an empty
/// checkpoint; a `*.safetensors` file the index does not name is left out, as Hugging
/// Face does, but reported with the tensors it holds.
#[test]
fn hugging_face_files_outside_the_weight_map() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let hf = dir.path().join("hf");
    common::reshard(
        &src,
        &hf,
        &TargetSpec {
            world_size: 2,
            format: Format::Hf,
            rules: vec![],
            preset: Some(remat_reshard::Preset::Simple),
        },
    );
    std::fs::remove_file(hf.join("remat.index.json")).unwrap();
    write_file(
        &hf.join("model-00003-of-00003.safetensors"),
        &[TensorData {
            name: "z",
            dtype: Dtype::U8,
            shape: &[2],
            data: &[1, 2],
        }],
        &BTreeMap::new(),
    )
    .unwrap();
    let ck = Checkpoint::open(&hf, None).unwrap();
    assert_eq!(ck.tensors.len(), 2);
    assert_eq!(ck.skipped.len(), 1, "{:?}", ck.skipped);
    assert!(
        ck.skipped[0]
            .path
            .ends_with("model-00003-of-00003.safetensors")
    );
    assert!(
        ck.skipped[0].reason.contains("weight_map") && ck.skipped[0].reason.contains("(z)"),
        "{}",
        ck.skipped[0].reason
    );
    let index = hf.join("model.safetensors.index.json");
    std::fs::write(&index, r#"{"metadata":{},"weight_map":{}}"#).unwrap();
    let e = fails(&hf);
    assert!(
        e.contains("model.safetensors.index.json") && e.contains("lists no tensors"),
        "{e}"
    );
}

/// A rank file replaced by a directory is named as a directory, not "No such device".
#[test]
fn a_rank_file_that_is_a_directory_is_named_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let remat = dir.path().join("remat");
    common::reshard(&src, &remat, &TargetSpec::new(2, Format::Remat));
    let rank1 = remat.join("rank-00001-of-00002.safetensors");
    std::fs::remove_file(&rank1).unwrap();
    std::fs::create_dir(&rank1).unwrap();
    let e = fails(&remat);
    assert!(
        e.contains("rank-00001-of-00002.safetensors") && e.contains("is a directory"),
        "{e}"
    );
}

/// PyTorch DCP's own format (pickled `.metadata`, torch.save-based `.distcp` files) is
/// recognised and said to be unsupported, with what is.
#[test]
fn a_torch_save_dcp_checkpoint_is_recognised_as_unsupported() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("torch");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join(".metadata"), b"\x80\x04pickle").unwrap();
    std::fs::write(src.join("__0_0.distcp"), b"PK").unwrap();
    let e = fails(&src);
    assert!(
        e.contains(".distcp")
            && e.contains("recognises but does not read")
            && e.contains("HuggingFaceStorageWriter"),
        "{e}"
    );
}

/// A placement rule that matches no tensor is an error naming the rule, not ignored.
#[test]
fn a_placement_rule_matching_no_tensor_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let ck = Checkpoint::open(&src, None).unwrap();
    let spec = TargetSpec {
        world_size: 2,
        format: Format::Remat,
        rules: ["w=shard(1)", "layers.*.norm=replicate"]
            .iter()
            .map(|r| remat_reshard::NameRule::parse(r).unwrap())
            .collect(),
        preset: None,
    };
    let e = plan(&ck, &spec).unwrap_err().to_string();
    assert!(
        e.contains("`layers.*.norm=replicate`") && e.contains("matches no tensor"),
        "{e}"
    );
}

/// Index fields that do not fit the tensor are refused rather than reinterpreted.
#[test]
fn index_placements_and_layouts_that_do_not_fit_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = good(dir.path());
    let remat = dir.path().join("remat");
    common::reshard(&src, &remat, &TargetSpec::new(2, Format::Remat));
    let index = remat.join("remat.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    for (from, to, says) in [
        (
            "\"placement\": \"shard(0)\"",
            "\"placement\": \"shard(7)\"",
            "placement `shard(7)` but the tensor has 2 dimensions",
        ),
        (
            "\"layout\": \"remat\"",
            "\"layout\": \"weird\"",
            "unknown layout `weird`",
        ),
    ] {
        assert!(text.contains(from), "{from} not in {text}");
        std::fs::write(&index, text.replacen(from, to, 1)).unwrap();
        let e = fails(&remat);
        assert!(e.contains("remat.index.json") && e.contains(says), "{e}");
    }
}
