//! N -> M -> N round trips for N, M in 1..=8 with random shapes, dtypes and placements:
//! every byte of every tensor must survive.

mod common;

use common::*;
use remat_reshard::{Checkpoint, Format, verify};

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
