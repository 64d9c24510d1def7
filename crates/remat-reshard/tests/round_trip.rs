//! N -> M -> N round trips for N, M in 1..=8 with random shapes, dtypes (sub-byte F4 and F6
//! included) and placements:
//! every byte of every tensor must survive.

mod common;

use common::*;
use remat_reshard::{Checkpoint, Dtype, Format, NameRule, verify};

#[test]
fn every_n_to_m_to_n_round_trip_is_byte_exact() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(0x5EED);
    for n in 1..=8usize {
        for m in 1..=8usize {
            let tensors = random_tensors(&mut rng, 6);
            let base = dir.path().join(format!("g-{n}-{m}.safetensors"));
            write_global(&base, &tensors);
            let a = dir.path().join(format!("a-{n}-{m}"));
            let b = dir.path().join(format!("b-{n}-{m}"));
            let c = dir.path().join(format!("c-{n}-{m}"));
            let format_b = if (n + m) % 2 == 0 {
                Format::Remat
            } else {
                Format::Dcp
            };
            reshard(
                &base,
                &a,
                &spec(n, Format::Remat, random_rules(&mut rng, &tensors, n)),
            );
            reshard(
                &a,
                &b,
                &spec(m, format_b, random_rules(&mut rng, &tensors, m)),
            );
            reshard(
                &b,
                &c,
                &spec(n, Format::Remat, random_rules(&mut rng, &tensors, n)),
            );
            let a_ck = Checkpoint::open(&a, None).unwrap();
            let c_ck = Checkpoint::open(&c, None).unwrap();
            let report = verify(&a_ck, &c_ck, None).unwrap();
            assert_eq!(report.difference, None, "{n} -> {m} -> {n}");
            let b_ck = open_as_reader_would(&b);
            let report = verify(&a_ck, &b_ck, None).unwrap();
            assert_eq!(report.difference, None, "{n} -> {m} as {}", format_b.name());
            let one = dir.path().join(format!("one-{n}-{m}"));
            reshard(&c, &one, &spec(1, Format::Hf, vec![]));
            let got = read_global(&one.join("model.safetensors"));
            assert_eq!(got.len(), tensors.len());
            for t in &tensors {
                let (dtype, shape, data) = &got[&t.name];
                assert_eq!((*dtype, shape), (t.dtype, &t.shape), "{}", t.name);
                if data != &t.data {
                    eprintln!(
                        "{} {:?} {:?}\n got {:?}\n want {:?}",
                        t.name,
                        t.dtype,
                        t.shape,
                        &data[..data.len().min(40)],
                        &t.data[..t.data.len().min(40)]
                    );
                }
                assert!(
                    data == &t.data,
                    "{n} -> {m} -> {n}: bytes of {} differ",
                    t.name
                );
            }
            for p in [&base, &a, &b, &c, &one] {
                let _ = std::fs::remove_dir_all(p);
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// Tensors large enough for multi-window fills, direct writes from the map and chunks
/// split across checksum blocks' worth of windows, through tiny buffers.
#[test]
fn large_tensors_through_small_windows_are_byte_exact() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(77);
    let shapes: [(&str, Dtype, Vec<u64>); 3] = [
        ("rows", Dtype::F32, vec![700, 300]),
        ("cols", Dtype::BF16, vec![300, 1100]),
        ("cube", Dtype::U8, vec![37, 61, 129]),
    ];
    let tensors: Vec<Tensor> = shapes
        .into_iter()
        .map(|(name, dtype, shape)| {
            let n = dtype.bytes_for(shape.iter().product()).unwrap() as usize;
            Tensor {
                name: name.into(),
                dtype,
                shape,
                data: rng.bytes(n),
            }
        })
        .collect();
    let base = dir.path().join("g.safetensors");
    write_global(&base, &tensors);
    let rule = |p: &str, r: &str| NameRule::parse(&format!("{p}={r}")).unwrap();
    let a = dir.path().join("a");
    reshard(
        &base,
        &a,
        &spec(
            3,
            Format::Remat,
            vec![
                rule("rows", "shard(0)"),
                rule("cols", "shard(1)"),
                rule("cube", "shard(2)"),
            ],
        ),
    );
    let b = dir.path().join("b");
    reshard(
        &a,
        &b,
        &spec(
            2,
            Format::Dcp,
            vec![
                rule("rows", "shard(1)"),
                rule("cols", "shard(0)"),
                rule("cube", "shard(1)"),
            ],
        ),
    );
    let one = dir.path().join("one");
    reshard(&b, &one, &spec(1, Format::Hf, vec![]));
    let got = read_global(&one.join("model.safetensors"));
    for t in &tensors {
        assert!(got[&t.name].2 == t.data, "bytes of {} differ", t.name);
    }
    let report = verify(
        &Checkpoint::open(&a, None).unwrap(),
        &open_as_reader_would(&b),
        None,
    )
    .unwrap();
    assert_eq!(report.difference, None);
    assert!(report.chunks_checksummed > 0);
}

/// An empty tensor keeps its global shape through DCP, read back from the shard files'
/// `DCP_SHARDING_INFO` alone, whatever its placement.
#[test]
fn empty_tensors_keep_their_shape_through_dcp() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = vec![
        Tensor {
            name: "e".into(),
            dtype: Dtype::F32,
            shape: vec![0, 3],
            data: Vec::new(),
        },
        Tensor {
            name: "f".into(),
            dtype: Dtype::BF16,
            shape: vec![4, 0, 2],
            data: Vec::new(),
        },
        Tensor {
            name: "w".into(),
            dtype: Dtype::U8,
            shape: vec![5],
            data: vec![1, 2, 3, 4, 5],
        },
    ];
    let base = dir.path().join("g.safetensors");
    write_global(&base, &tensors);
    for place in ["shard(0)", "shard(1)", "replicate", "whole"] {
        for w in [1usize, 3] {
            let out = dir.path().join(format!("dcp-{place}-{w}"));
            let rules = ["e", "f"]
                .iter()
                .map(|n| NameRule::parse(&format!("{n}={place}")).unwrap())
                .collect();
            reshard(&base, &out, &spec(w, Format::Dcp, rules));
            let back = Checkpoint::open(&out, Some(Format::Dcp)).unwrap();
            for t in &tensors {
                let got = back.tensor(&t.name).expect("tensor read back");
                assert_eq!(got.shape, t.shape, "{} placed {place} on {w}", t.name);
            }
        }
    }
}

/// `verify` streams: however large a tensor, what it keeps mapped at once (as counted by
/// its page walks) stays within a few MiB, for contiguous and for strided comparisons
/// and for the checksums.
#[test]
fn verify_keeps_a_bounded_working_set() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(3);
    let tensors = vec![Tensor {
        name: "big".into(),
        dtype: Dtype::F32,
        shape: vec![1536, 4096],
        data: rng.bytes(1536 * 4096 * 4),
    }];
    let base = dir.path().join("g.safetensors");
    write_global(&base, &tensors);
    let whole = Checkpoint::open(&base, None).unwrap();
    for place in ["shard(0)", "shard(1)"] {
        let out = dir.path().join(place);
        let rule = NameRule::parse(&format!("big={place}")).unwrap();
        reshard(&base, &out, &spec(3, Format::Remat, vec![rule]));
        let sharded = Checkpoint::open(&out, None).unwrap();
        let report = verify(&whole, &sharded, None).unwrap();
        assert_eq!(report.difference, None);
        assert_eq!(report.bytes_compared, 24 << 20);
        assert!(report.chunks_checksummed == 3);
        println!("{place}: peak held {} bytes", report.peak_held_bytes);
        assert!(
            report.peak_held_bytes > 0 && report.peak_held_bytes <= 12 << 20,
            "{place}: verify held {} bytes of a 24 MiB tensor at once",
            report.peak_held_bytes
        );
    }
}
