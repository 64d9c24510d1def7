//! The plan fingerprint that `--finalize` compares: the same for the same checkpoint seen
//! at another path, different for another checkpoint of the same tensor names and shapes.

mod common;

use common::{Rng, random_tensors, reshard, spec, write_global};
use remat_reshard::{Checkpoint, Format, plan};

fn fingerprint(dir: &std::path::Path) -> u64 {
    let ckpt = Checkpoint::open(dir, None).unwrap();
    plan(&ckpt, &spec(3, Format::Remat, Vec::new()))
        .unwrap()
        .fingerprint
}

#[test]
fn fingerprint_follows_the_source_not_its_path() {
    let tmp = tempfile::tempdir().unwrap();
    let tensors = random_tensors(&mut Rng(7), 12);
    let mut other = random_tensors(&mut Rng(7), 12);
    // Same names, dtypes and shapes; different bytes.
    for t in &mut other {
        for b in &mut t.data {
            *b ^= 0x5a;
        }
    }
    let nonempty = other.iter().any(|t| !t.data.is_empty());
    assert!(nonempty);
    for (name, ts) in [("a", &tensors), ("b", &other)] {
        let file = tmp.path().join(format!("{name}.safetensors"));
        write_global(&file, ts);
        reshard(
            &file,
            &tmp.path().join(name),
            &spec(2, Format::Remat, Vec::new()),
        );
    }
    // The same checkpoint copied elsewhere plans the same.
    let copy = tmp.path().join("copy");
    std::fs::create_dir(&copy).unwrap();
    for entry in std::fs::read_dir(tmp.path().join("a")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    let a = fingerprint(&tmp.path().join("a"));
    assert_eq!(a, fingerprint(&copy));
    // Another checkpoint with the same layout (its index checksums differ) does not.
    assert_ne!(a, fingerprint(&tmp.path().join("b")));
}
