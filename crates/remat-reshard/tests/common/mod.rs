//! Helpers shared by the integration tests: a seeded generator and random checkpoints.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use remat_reshard::safetensors::{TensorData, write_file};
use remat_reshard::{
    Checkpoint, Dtype, ExecOptions, Format, NameRule, Placement, Rule, TargetSpec, execute, plan,
};

/// splitmix64: small, seeded, good enough for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A random global tensor.
pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// Random tensors: 0-d, empty and odd sizes included, every dtype. A sub-byte dtype (F4,
/// F6) gets two or three dimensions with the last a multiple of 8 elements, so that a split
/// of any other dimension falls on a byte boundary (see [`random_rules`]).
pub fn random_tensors(rng: &mut Rng, count: usize) -> Vec<Tensor> {
    let dtypes: Vec<Dtype> = Dtype::all().collect();
    let dim = |rng: &mut Rng| match rng.below(10) {
        0 => 0,
        1 => 1,
        _ => 1 + rng.below(13),
    };
    (0..count)
        .map(|i| {
            let dtype = dtypes[rng.below(dtypes.len() as u64) as usize];
            let shape: Vec<u64> = if is_sub_byte(dtype) {
                let outer = 1 + rng.below(2) as usize;
                let mut shape: Vec<u64> = (0..outer).map(|_| dim(rng)).collect();
                shape.push(8 * (1 + rng.below(3)));
                shape
            } else {
                let ndim = rng.below(4) as usize;
                (0..ndim).map(|_| dim(rng)).collect()
            };
            let n = dtype.bytes_for(shape.iter().product()).unwrap() as usize;
            Tensor {
                name: format!("t{i}.w"),
                dtype,
                shape,
                data: rng.bytes(n),
            }
        })
        .collect()
}

/// Whether elements of `dtype` are narrower than a byte (packed).
pub fn is_sub_byte(dtype: Dtype) -> bool {
    !dtype.bits().is_multiple_of(8)
}

/// Writes tensors as one Hugging Face file.
pub fn write_global(path: &Path, tensors: &[Tensor]) {
    let data: Vec<TensorData> = tensors
        .iter()
        .map(|t| TensorData {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            data: &t.data,
        })
        .collect();
    write_file(path, &data, &BTreeMap::new()).unwrap();
}

/// A random rule per tensor valid for its rank count.
pub fn random_rules(rng: &mut Rng, tensors: &[Tensor], world: usize) -> Vec<NameRule> {
    tensors
        .iter()
        .map(|t| {
            // A sub-byte tensor is split only outside its last dimension (byte boundaries).
            let shardable = if is_sub_byte(t.dtype) {
                t.shape.len().saturating_sub(1)
            } else {
                t.shape.len()
            };
            let rule = match rng.below(5) {
                0 | 1 if shardable > 0 => {
                    Rule::Place(Placement::Shard(rng.below(shardable as u64) as usize))
                }
                2 => Rule::Place(Placement::Replicate),
                3 => Rule::Rank(rng.below(world as u64) as usize),
                4 => Rule::Source,
                _ => Rule::Place(Placement::Whole),
            };
            NameRule {
                pattern: t.name.clone(),
                rule,
            }
        })
        .collect()
}

/// Opens a checkpoint the way a reader of its layout would: a directory of DCP shard
/// files is read from their `DCP_SHARDING_INFO` alone, as PyTorch does, ignoring the
/// `remat.index.json` beside them, so that what PyTorch would load is what is tested.
pub fn open_as_reader_would(path: &Path) -> Checkpoint {
    let detected = remat_reshard::open::detect(path).unwrap();
    let dcp_inside = path
        .join("shard-00001-model-00001-of-00001.safetensors")
        .is_file();
    let format = if dcp_inside { Format::Dcp } else { detected };
    Checkpoint::open(path, Some(format)).unwrap()
}

/// Reshards `src` into `dst` with the given spec, reading `src` as [`open_as_reader_would`].
pub fn reshard(src: &Path, dst: &Path, spec: &TargetSpec) {
    let ckpt = open_as_reader_would(src);
    let p = plan(&ckpt, spec).unwrap();
    execute(
        &ckpt,
        &p,
        dst,
        &ExecOptions {
            max_buffer: 1 << 16,
            ..Default::default()
        },
    )
    .unwrap();
}

/// The bytes of every tensor of a consolidated file, by name, read with our parser.
pub fn read_global(path: &Path) -> BTreeMap<String, (Dtype, Vec<u64>, Vec<u8>)> {
    let f = remat_reshard::safetensors::MappedFile::open(path).unwrap();
    let base = f.header.data_start as usize;
    f.header
        .entries
        .iter()
        .map(|e| {
            (
                e.name.clone(),
                (
                    e.dtype,
                    e.shape.clone(),
                    f.map.bytes()[base + e.start as usize..base + e.end as usize].to_vec(),
                ),
            )
        })
        .collect()
}

/// The same with the reference `safetensors` crate (which knows the classic dtypes only).
pub fn read_global_reference(path: &Path) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                (
                    format!("{:?}", view.dtype()),
                    view.shape().iter().map(|&s| s as u64).collect(),
                    view.data().to_vec(),
                ),
            )
        })
        .collect()
}

pub fn spec(world: usize, format: Format, rules: Vec<NameRule>) -> TargetSpec {
    TargetSpec {
        world_size: world,
        format,
        rules,
        preset: None,
    }
}
