//! What crosses a process boundary as bytes: a stage's [`Boundary`] message (activation or
//! gradient) and lists of named f32 tensors (a stage's gradients gathered to one rank).
//!
//! Little-endian, length-prefixed, checked on the way in: a truncated or inconsistent
//! message is a typed error naming what is wrong, never a panic or a silently wrong tensor.

use super::activation::{Activation, DType, HostData, HostTensor};
use super::graph_stage::Boundary;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("message truncated: {what} needs {needed} bytes at offset {offset}, {len} in all")]
    Truncated {
        what: &'static str,
        needed: usize,
        offset: usize,
        len: usize,
    },
    #[error("unknown element type code {0} (0 is f32, 1 is i64)")]
    BadDType(u8),
    #[error("{0} bytes left over after the message")]
    Trailing(usize),
    #[error("{what}: {detail}")]
    Invalid { what: &'static str, detail: String },
}

/// A value that can be sent to another process.
pub trait Wire: Sized {
    /// Appends the encoding of `self` to `out`.
    fn encode(&self, out: &mut Vec<u8>);
    /// Reads a value written by [`Wire::encode`].
    fn decode(bytes: &[u8]) -> Result<Self, WireError>;
    /// Bytes of tensor data it carries (what the schedule moves, without framing).
    fn payload_bytes(&self) -> usize;
}

/// Reads fixed-width fields off the front of a message.
struct Reader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, offset: 0 }
    }

    fn take(&mut self, what: &'static str, n: usize) -> Result<&'a [u8], WireError> {
        let end = self
            .offset
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(WireError::Truncated {
                what,
                needed: n,
                offset: self.offset,
                len: self.bytes.len(),
            });
        };
        let out = &self.bytes[self.offset..end];
        self.offset = end;
        Ok(out)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(what, 1)?[0])
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        let b = self.take(what, 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn usize(&mut self, what: &'static str) -> Result<usize, WireError> {
        let v = self.u64(what)?;
        usize::try_from(v).map_err(|_| WireError::Invalid {
            what,
            detail: format!("{v} does not fit this machine's usize"),
        })
    }

    fn finish(self) -> Result<(), WireError> {
        match self.bytes.len() - self.offset {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn encode_host(t: &HostTensor, out: &mut Vec<u8>) {
    out.push(match t.dtype() {
        DType::F32 => 0,
        DType::I64 => 1,
    });
    put_u64(out, t.shape.len() as u64);
    for &d in &t.shape {
        put_u64(out, d as u64);
    }
    match &t.data {
        HostData::F32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        HostData::I64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
    }
}

fn decode_host(r: &mut Reader<'_>) -> Result<HostTensor, WireError> {
    let dtype = match r.u8("element type")? {
        0 => DType::F32,
        1 => DType::I64,
        code => return Err(WireError::BadDType(code)),
    };
    let rank = r.usize("rank")?;
    // Each dimension takes 8 bytes: a rank the message cannot hold is caught before any
    // allocation sized by it.
    r.take("shape", 0)?;
    if rank > (r.bytes.len() - r.offset) / 8 {
        return Err(WireError::Truncated {
            what: "shape",
            needed: rank.saturating_mul(8),
            offset: r.offset,
            len: r.bytes.len(),
        });
    }
    let shape = (0..rank)
        .map(|_| r.usize("dimension"))
        .collect::<Result<Vec<_>, _>>()?;
    let numel = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| WireError::Invalid {
            what: "shape",
            detail: format!("{shape:?} has more elements than fit in memory"),
        })?;
    let width = dtype.size_bytes();
    let bytes = r.take("tensor data", numel.saturating_mul(width))?;
    let invalid = |e: super::activation::HostShapeError| WireError::Invalid {
        what: "tensor",
        detail: e.to_string(),
    };
    match dtype {
        DType::F32 => HostTensor::f32(
            shape,
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
        .map_err(invalid),
        DType::I64 => HostTensor::i64(
            shape,
            bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
        )
        .map_err(invalid),
    }
}

impl Wire for Boundary {
    fn encode(&self, out: &mut Vec<u8>) {
        put_u64(out, self.rng_offset);
        encode_host(&self.tensor, out);
    }

    fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes);
        let rng_offset = r.u64("random stream offset")?;
        let tensor = decode_host(&mut r)?;
        r.finish()?;
        Ok(Boundary { tensor, rng_offset })
    }

    fn payload_bytes(&self) -> usize {
        self.tensor.byte_size()
    }
}

/// Named tensors, in order (a stage's gradients on their way to the rank that writes them).
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensors(pub Vec<(String, HostTensor)>);

impl Wire for NamedTensors {
    fn encode(&self, out: &mut Vec<u8>) {
        put_u64(out, self.0.len() as u64);
        for (name, t) in &self.0 {
            put_u64(out, name.len() as u64);
            out.extend_from_slice(name.as_bytes());
            encode_host(t, out);
        }
    }

    fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes);
        let count = r.usize("tensor count")?;
        let mut out = Vec::new();
        for _ in 0..count {
            let len = r.usize("name length")?;
            let name = std::str::from_utf8(r.take("name", len)?)
                .map_err(|e| WireError::Invalid {
                    what: "name",
                    detail: e.to_string(),
                })?
                .to_string();
            out.push((name, decode_host(&mut r)?));
        }
        r.finish()?;
        Ok(NamedTensors(out))
    }

    fn payload_bytes(&self) -> usize {
        self.0.iter().map(|(_, t)| t.byte_size()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boundary() -> Boundary {
        Boundary {
            tensor: HostTensor::f32(vec![2, 3], vec![1.5, -0.0, f32::MIN, 7.0, 1e-30, 2.0])
                .unwrap(),
            rng_offset: 0x1234_5678_9abc,
        }
    }

    #[test]
    fn a_boundary_round_trips_bit_for_bit() {
        let b = boundary();
        let mut bytes = Vec::new();
        b.encode(&mut bytes);
        let back = Boundary::decode(&bytes).unwrap();
        assert_eq!(back.rng_offset, b.rng_offset);
        let bits = |t: &HostTensor| -> Vec<u32> {
            t.as_f32().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        assert_eq!(bits(&back.tensor), bits(&b.tensor));
        assert_eq!(back.tensor.shape, vec![2, 3]);
        assert_eq!(b.payload_bytes(), 24);
    }

    #[test]
    fn named_tensors_round_trip_with_i64() {
        let named = NamedTensors(vec![
            (
                "a.weight".into(),
                HostTensor::f32(vec![1], vec![3.0]).unwrap(),
            ),
            (
                "tokens".into(),
                HostTensor::i64(vec![2, 1], vec![-4, 9]).unwrap(),
            ),
            ("empty".into(), HostTensor::f32(vec![0, 5], vec![]).unwrap()),
        ]);
        let mut bytes = Vec::new();
        named.encode(&mut bytes);
        assert_eq!(NamedTensors::decode(&bytes).unwrap(), named);
        assert_eq!(named.payload_bytes(), 4 + 16);
    }

    #[test]
    fn damaged_messages_are_errors() {
        let mut bytes = Vec::new();
        boundary().encode(&mut bytes);
        for cut in [0, 7, 8, 9, 20, bytes.len() - 1] {
            let err = Boundary::decode(&bytes[..cut]).unwrap_err();
            assert!(matches!(err, WireError::Truncated { .. }), "{cut}: {err}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(Boundary::decode(&long), Err(WireError::Trailing(1)));
        let mut bad = bytes.clone();
        bad[8] = 9;
        assert_eq!(
            Boundary::decode(&bad).unwrap_err().to_string(),
            "unknown element type code 9 (0 is f32, 1 is i64)"
        );
        // A rank of 2^40 must not allocate: the message cannot hold that many dimensions.
        let mut huge = bytes[..9].to_vec();
        put_u64(&mut huge, 1 << 40);
        assert!(matches!(
            Boundary::decode(&huge),
            Err(WireError::Truncated { what: "shape", .. })
        ));
    }
}
