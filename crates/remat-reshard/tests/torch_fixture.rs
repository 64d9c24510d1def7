//! The real PyTorch DCP checkpoint in ../shared: consolidations reproduce its unsharded
//! original byte for byte, and the DCP files we write parse back.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use remat_reshard::{Checkpoint, Format, Placement, verify};

fn fixture_dir() -> Option<PathBuf> {
    let dir = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/fixtures/torch-dcp-hf-w4"
    ));
    if dir.is_dir() {
        println!("reading the PyTorch fixture at {}", dir.display());
        Some(dir.to_path_buf())
    } else {
        println!("skipping: {} is absent", dir.display());
        None
    }
}

/// The fixture's four shard files alone in a directory of their own, and the fixture
/// directory. The fixture keeps `full.safetensors` beside the shards; a DCP reader reads
/// every `*.safetensors` of a directory (as PyTorch's does), so the shards are read from
/// a copy.
fn fixture(tmp: &Path) -> Option<(PathBuf, PathBuf)> {
    let dir = fixture_dir()?;
    let shards = tmp.join("torch-dcp-w4");
    std::fs::create_dir(&shards).unwrap();
    for rank in 1..=4 {
        let name = format!("shard-{rank:05}-model-00001-of-00001.safetensors");
        std::fs::copy(dir.join(&name), shards.join(&name)).unwrap();
    }
    Some((shards, dir))
}

/// The fixture directory as it is, `full.safetensors` beside the shards: that file has no
/// DCP sharding info, is not named like a shard and holds only tensors the shards hold, so
/// it is left out and reported, and the four shards alone reproduce it byte for byte.
#[test]
fn the_fixture_directory_skips_full_safetensors_and_says_so() {
    let Some(dir) = fixture_dir() else { return };
    let ck = Checkpoint::open(&dir, None).unwrap();
    assert_eq!((ck.format, ck.world_size), (Format::Dcp, 4));
    assert_eq!(ck.skipped.len(), 1, "{:?}", ck.skipped);
    assert!(ck.skipped[0].path.ends_with("full.safetensors"));
    assert!(
        ck.skipped[0].reason.contains("not a DCP shard"),
        "{}",
        ck.skipped[0].reason
    );
    let full = Checkpoint::open(&dir.join("full.safetensors"), None).unwrap();
    let report = verify(&ck, &full, None).unwrap();
    assert!(report.difference.is_none(), "{:?}", report.difference);
}

/// A file that is not named like a shard but carries sharding info is a piece: it is read,
/// never skipped (a byte-identical copy of another rank's pieces reads as a replica).
#[test]
fn a_stray_file_with_sharding_info_is_read_as_a_piece() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((dir, _)) = fixture(tmp.path()) else {
        return;
    };
    std::fs::copy(
        dir.join("shard-00001-model-00001-of-00001.safetensors"),
        dir.join("extra.safetensors"),
    )
    .unwrap();
    let ck = Checkpoint::open(&dir, None).unwrap();
    assert!(ck.skipped.is_empty(), "{:?}", ck.skipped);
    assert!(
        ck.files
            .iter()
            .any(|f| f.path.ends_with("extra.safetensors"))
    );
}

#[test]
fn reads_the_fixture_with_inferred_shapes_and_placements() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((dir, original)) = fixture(tmp.path()) else {
        return;
    };
    let ck = Checkpoint::open(&dir, None).unwrap();
    assert_eq!((ck.format, ck.world_size), (Format::Dcp, 4));
    let expect = [
        ("conv.weight", vec![6, 5, 3, 3], Placement::Shard(2)),
        ("embed.weight", vec![50, 16], Placement::Shard(0)),
        (
            "layers.0.attn.out.weight",
            vec![16, 16],
            Placement::Shard(1),
        ),
        (
            "layers.0.mlp.down.weight",
            vec![16, 37],
            Placement::Shard(1),
        ),
        ("layers.0.norm.weight", vec![16], Placement::Replicate),
        ("lm_head.bias", vec![7], Placement::Shard(0)),
        ("step", vec![], Placement::Replicate),
    ];
    for (name, shape, placement) in expect {
        let t = ck.tensor(name).unwrap();
        assert_eq!((&t.shape, t.placement), (&shape, Some(placement)), "{name}");
    }
    let full = Checkpoint::open(&original.join("full.safetensors"), None).unwrap();
    assert_eq!(verify(&ck, &full, None).unwrap().difference, None);
}

#[test]
fn four_to_one_and_four_to_three_to_one_reproduce_full_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((dir, original)) = fixture(tmp.path()) else {
        return;
    };
    let want = read_global_reference(&original.join("full.safetensors"));
    let one = tmp.path().join("one");
    reshard(&dir, &one, &spec(1, Format::Hf, vec![]));
    assert_eq!(read_global_reference(&one.join("model.safetensors")), want);
    for format in [Format::Dcp, Format::Remat] {
        let three = tmp.path().join(format!("three-{}", format.name()));
        let one = tmp.path().join(format!("one-{}", format.name()));
        reshard(&dir, &three, &spec(3, format, vec![]));
        reshard(&three, &one, &spec(1, Format::Hf, vec![]));
        assert_eq!(
            read_global_reference(&one.join("model.safetensors")),
            want,
            "via {}",
            format.name()
        );
    }
}

#[test]
fn dcp_written_for_m_ranks_parses_back_without_empty_pieces() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((dir, _)) = fixture(tmp.path()) else {
        return;
    };
    for m in [2usize, 3, 5, 8] {
        let out = tmp.path().join(format!("dcp-{m}"));
        reshard(&dir, &out, &spec(m, Format::Dcp, vec![]));
        // Read as PyTorch would: from the shard files' DCP_SHARDING_INFO alone.
        let back = Checkpoint::open(&out, Some(Format::Dcp)).unwrap();
        assert_eq!(back.world_size, m);
        for f in &back.files {
            assert!(
                f.path
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .ends_with("-model-00001-of-00001.safetensors")
            );
            for e in &f.header.entries {
                assert!(
                    !e.shape.contains(&0),
                    "{m} ranks: empty piece of {} in {}",
                    e.name,
                    f.path.display()
                );
            }
            assert!(f.header.metadata.contains_key("DCP_SHARDING_INFO"));
        }
        let conv = back.tensor("conv.weight").unwrap();
        assert_eq!(conv.shape, vec![6, 5, 3, 3]);
        let original = Checkpoint::open(&dir, None).unwrap();
        assert_eq!(
            verify(&original, &back, None).unwrap().difference,
            None,
            "{m} ranks"
        );
    }
}
