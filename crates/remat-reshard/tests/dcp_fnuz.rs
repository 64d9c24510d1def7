//! PyTorch's `float8_e4m3fnuz` and `float8_e5m2fnuz` tensors: `safetensors` 0.8 (and so
//! DCP's Hugging Face writer) stores them as `F8_E4M3FNUZ` and `F8_E5M2FNUZ`, and PyTorch
//! reads them back. A hand-made two-rank DCP checkpoint laid out as PyTorch 2.15 writes one
//! (`DCP_SHARDING_INFO`, `DCP_VERSION`, headers padded with spaces) is consolidated and
//! resharded byte for byte. Files are built and parsed here without remat's own encoder.

use std::collections::BTreeMap;
use std::path::Path;

use remat_reshard::{Checkpoint, ExecOptions, Format, TargetSpec, execute, plan};

/// `(name, dtype, shape, offsets, bytes)` of one piece.
type RawPiece = (&'static str, &'static str, Vec<u64>, Vec<u64>, Vec<u8>);

/// A safetensors file as PyTorch's DCP writer lays it out.
fn write_torch_like(path: &Path, pieces: &[RawPiece]) {
    let mut header = serde_json::Map::new();
    let mut info = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, offsets, bytes) in pieces {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
        info.insert(
            name.to_string(),
            serde_json::json!({ "saved_offsets": offsets }),
        );
    }
    header.insert(
        "__metadata__".into(),
        serde_json::json!({
            "DCP_SHARDING_INFO": serde_json::Value::Object(info).to_string(),
            "DCP_VERSION": "1.0",
            "format": "pt",
        }),
    );
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

/// Every tensor of a safetensors file: name to (dtype, shape, bytes), parsed by hand.
fn parse(path: &Path) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, v)| {
            let range: Vec<usize> = serde_json::from_value(v["data_offsets"].clone()).unwrap();
            let shape: Vec<u64> = serde_json::from_value(v["shape"].clone()).unwrap();
            let dtype = v["dtype"].as_str().unwrap().to_string();
            (k, (dtype, shape, data[range[0]..range[1]].to_vec()))
        })
        .collect()
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed))
        .collect()
}

/// Rows `rows` of a row-major `[_, cols]` byte matrix.
fn rows(g: &[u8], cols: usize, rows: std::ops::Range<usize>) -> Vec<u8> {
    g[rows.start * cols..rows.end * cols].to_vec()
}

/// Columns `c` of a row-major `[r, cols]` byte matrix.
fn cols(g: &[u8], cols: usize, c: std::ops::Range<usize>) -> Vec<u8> {
    g.chunks(cols)
        .flat_map(|row| row[c.clone()].to_vec())
        .collect()
}

fn reshard(src: &Path, dst: &Path, m: usize, format: Format) {
    let ck = Checkpoint::open(src, Some(Format::Dcp)).unwrap();
    let p = plan(&ck, &TargetSpec::new(m, format)).unwrap();
    execute(&ck, &p, dst, &ExecOptions::default()).unwrap();
}

#[test]
fn fnuz_float8_pieces_written_by_pytorch_consolidate_byte_for_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("torch");
    std::fs::create_dir(&src).unwrap();
    // [5, 6] F8_E4M3FNUZ on Shard(0) of 2 ranks (3 + 2 rows); [4, 5] F8_E5M2FNUZ on
    // Shard(1) (3 + 2 columns); a replicated [3] F8_E4M3FNUZ written once, by rank 1.
    let a = pattern(30, 1);
    let b = pattern(20, 101);
    let r = pattern(3, 201);
    write_torch_like(
        &src.join("shard-00001-model-00001-of-00001.safetensors"),
        &[
            (
                "a",
                "F8_E4M3FNUZ",
                vec![3, 6],
                vec![0, 0],
                rows(&a, 6, 0..3),
            ),
            (
                "b",
                "F8_E5M2FNUZ",
                vec![4, 3],
                vec![0, 0],
                cols(&b, 5, 0..3),
            ),
        ],
    );
    write_torch_like(
        &src.join("shard-00002-model-00001-of-00001.safetensors"),
        &[
            (
                "a",
                "F8_E4M3FNUZ",
                vec![2, 6],
                vec![3, 0],
                rows(&a, 6, 3..5),
            ),
            (
                "b",
                "F8_E5M2FNUZ",
                vec![4, 2],
                vec![0, 3],
                cols(&b, 5, 3..5),
            ),
            ("r", "F8_E4M3FNUZ", vec![3], vec![0], r.clone()),
        ],
    );
    let want: BTreeMap<String, (String, Vec<u64>, Vec<u8>)> = [
        ("a", ("F8_E4M3FNUZ", vec![5, 6], a)),
        ("b", ("F8_E5M2FNUZ", vec![4, 5], b)),
        ("r", ("F8_E4M3FNUZ", vec![3], r)),
    ]
    .into_iter()
    .map(|(n, (d, s, bytes))| (n.to_string(), (d.to_string(), s, bytes)))
    .collect();

    let one = tmp.path().join("one");
    reshard(&src, &one, 1, Format::Hf);
    assert_eq!(parse(&one.join("model.safetensors")), want);

    // Through three DCP ranks (as PyTorch would read them) and back to one file.
    let three = tmp.path().join("three");
    reshard(&src, &three, 3, Format::Dcp);
    let mut seen = BTreeMap::new();
    for rank in 1..=3 {
        let f = three.join(format!("shard-{rank:05}-model-00001-of-00001.safetensors"));
        for (name, (dtype, _, _)) in parse(&f) {
            seen.insert(name, dtype);
        }
    }
    assert_eq!(seen.get("a").map(String::as_str), Some("F8_E4M3FNUZ"));
    assert_eq!(seen.get("b").map(String::as_str), Some("F8_E5M2FNUZ"));
    let back = tmp.path().join("back");
    reshard(&three, &back, 1, Format::Hf);
    assert_eq!(parse(&back.join("model.safetensors")), want);
}
