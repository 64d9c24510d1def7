//! The safetensors container, read and written by hand so that every error can name the
//! file and the tensor: `u64` little-endian header length, a JSON header, then the data.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::dtype::Dtype;
use crate::error::{ReshardError, Result};

/// The key safetensors reserves for string metadata.
pub const METADATA_KEY: &str = "__metadata__";

/// One tensor entry of a header. Offsets are relative to the start of the data section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub start: u64,
    pub end: u64,
}

/// A parsed and validated header.
#[derive(Clone, Debug)]
pub struct Header {
    /// Entries in the order of their data offsets.
    pub entries: Vec<Entry>,
    pub metadata: BTreeMap<String, String>,
    /// Absolute file offset where the data section starts (8 + header length).
    pub data_start: u64,
    /// Length of the whole file.
    pub file_len: u64,
    /// Position in `entries` of each tensor name.
    by_name: HashMap<String, usize>,
}

impl Header {
    /// Finds an entry by tensor name, in constant time.
    pub fn entry(&self, name: &str) -> Option<&Entry> {
        self.by_name.get(name).and_then(|&i| self.entries.get(i))
    }
}

/// Number of elements of a shape, `None` on overflow.
pub fn volume(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

/// Parses and validates the header of a safetensors file whose full contents are `bytes`.
/// `path` only names the file in errors.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header> {
    let file_len = bytes.len() as u64;
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(ReshardError::Truncated {
            path: path.into(),
            len: file_len,
        });
    };
    let mut le = [0u8; 8];
    le.copy_from_slice(len_bytes);
    let header_len = u64::from_le_bytes(le);
    if header_len > file_len - 8 {
        return Err(ReshardError::HeaderBeyondFile {
            path: path.into(),
            header_len,
            file_len,
        });
    }
    let data_start = 8 + header_len;
    let json = &bytes[8..data_start as usize];
    let raw: RawHeader = serde_json::from_slice(json).map_err(|e| ReshardError::HeaderJson {
        path: path.into(),
        message: e.to_string(),
    })?;
    let data_len = file_len - data_start;
    let mut metadata = None;
    let mut entries = Vec::with_capacity(raw.tensors.len());
    for (name, value) in raw.metadata {
        if metadata.is_some() {
            return Err(json_err(path, format!("`{name}` appears twice")));
        }
        metadata = Some(parse_metadata(path, value)?);
    }
    for (name, raw) in raw.tensors {
        entries.push(parse_entry(path, name, raw, data_len)?);
    }
    entries.sort_by_key(|e| (e.start, e.end));
    check_contiguous(path, &entries, data_len)?;
    let mut by_name = HashMap::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        if by_name.insert(e.name.clone(), i).is_some() {
            return Err(bad(path, &e.name, "the header names this tensor twice"));
        }
    }
    Ok(Header {
        entries,
        metadata: metadata.unwrap_or_default(),
        data_start,
        file_len,
        by_name,
    })
}

/// A tensor entry as written, before validation.
#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: Vec<u64>,
}

/// The header object, keys in file order and duplicates kept (so that they can be
/// refused), tensor entries parsed straight into typed fields: headers of tens of
/// thousands of tensors parse without building a JSON tree.
struct RawHeader {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, RawEntry)>,
}

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_map(RawHeaderVisitor)
    }
}

struct RawHeaderVisitor;

impl<'de> serde::de::Visitor<'de> for RawHeaderVisitor {
    type Value = RawHeader;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<RawHeader, A::Error> {
        use serde::de::Error;
        let mut out = RawHeader {
            metadata: Vec::new(),
            tensors: Vec::with_capacity(map.size_hint().unwrap_or(0)),
        };
        while let Some(key) = map.next_key::<String>()? {
            if key == METADATA_KEY {
                let value = map.next_value()?;
                out.metadata.push((key, value));
            } else {
                let entry = map
                    .next_value::<RawEntry>()
                    .map_err(|e| A::Error::custom(format!("tensor `{key}`: {e}")))?;
                out.tensors.push((key, entry));
            }
        }
        Ok(out)
    }
}

fn json_err(path: &Path, message: String) -> ReshardError {
    ReshardError::HeaderJson {
        path: path.into(),
        message,
    }
}

/// `__metadata__`: string values only; `null` means none, as the reference reader has it.
fn parse_metadata(path: &Path, value: Value) -> Result<BTreeMap<String, String>> {
    let map = match value {
        Value::Null => return Ok(BTreeMap::new()),
        Value::Object(map) => map,
        _ => return Err(json_err(path, format!("`{METADATA_KEY}` is not an object"))),
    };
    map.into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            _ => Err(json_err(
                path,
                format!("`{METADATA_KEY}` value `{k}` is not a string"),
            )),
        })
        .collect()
}

fn bad(path: &Path, tensor: &str, what: impl Into<String>) -> ReshardError {
    ReshardError::BadTensor {
        path: path.into(),
        tensor: tensor.into(),
        what: what.into(),
    }
}

fn parse_entry(path: &Path, name: String, raw: RawEntry, data_len: u64) -> Result<Entry> {
    let dtype = Dtype::from_name(&raw.dtype).ok_or_else(|| ReshardError::UnknownDtype {
        path: path.into(),
        tensor: name.clone(),
        dtype: raw.dtype.clone(),
    })?;
    let shape = raw.shape;
    let [start, end] = raw.data_offsets[..] else {
        return Err(bad(
            path,
            &name,
            format!(
                "`data_offsets` has {} values, not 2",
                raw.data_offsets.len()
            ),
        ));
    };
    if start > end {
        return Err(bad(
            path,
            &name,
            format!("data_offsets [{start}, {end}): the start is after the end"),
        ));
    }
    if end > data_len {
        return Err(ReshardError::DataOutOfFile {
            path: path.into(),
            tensor: name,
            start,
            end,
            data_len,
        });
    }
    let nbytes = tensor_bytes(path, &name, dtype, &shape)?;
    if end - start != nbytes {
        return Err(bad(
            path,
            &name,
            format!(
                "data_offsets [{start}, {end}) hold {} bytes but shape {shape:?} of {dtype} needs {nbytes}",
                end - start
            ),
        ));
    }
    Ok(Entry {
        name,
        dtype,
        shape,
        start,
        end,
    })
}

/// Byte size of a tensor, with overflow and sub-byte alignment reported against its name.
pub fn tensor_bytes(path: &Path, name: &str, dtype: Dtype, shape: &[u64]) -> Result<u64> {
    let overflow = || ReshardError::ShapeOverflow {
        path: path.into(),
        tensor: name.into(),
        shape: shape.to_vec(),
        dtype: dtype.name().into(),
    };
    let elements = volume(shape).ok_or_else(overflow)?;
    elements.checked_mul(dtype.bits()).ok_or_else(overflow)?;
    dtype.bytes_for(elements).ok_or_else(|| {
        bad(
            path,
            name,
            format!("{elements} elements of {dtype} do not fill a whole number of bytes"),
        )
    })
}

/// The entries, sorted by offsets, tile the data section exactly, as the reference
/// reader requires: no overlap, no gap, no bytes after the last tensor.
fn check_contiguous(path: &Path, sorted: &[Entry], data_len: u64) -> Result<()> {
    let mut at = 0u64;
    let mut prev: Option<&Entry> = None;
    for e in sorted {
        if e.start < at {
            let p = prev.map_or_else(String::new, |p| {
                format!(" those of `{}` [{}, {})", p.name, p.start, p.end)
            });
            return Err(bad(
                path,
                &e.name,
                format!("data_offsets [{}, {}) overlap{p}", e.start, e.end),
            ));
        }
        if e.start > at {
            return Err(bad(
                path,
                &e.name,
                format!(
                    "data_offsets [{}, {}) leave a gap of {} bytes before them in the data section",
                    e.start,
                    e.end,
                    e.start - at
                ),
            ));
        }
        at = e.end;
        prev = Some(e);
    }
    if at != data_len {
        let what = format!(
            "the data section holds {data_len} bytes but the tensors end at byte {at}: {} trailing bytes belong to no tensor",
            data_len - at
        );
        return Err(match prev {
            Some(p) => bad(path, &p.name, what),
            None => json_err(path, what),
        });
    }
    Ok(())
}

/// Serializes a header (entries in data order, metadata first) padded with spaces so that
/// the data section starts 8-byte aligned, as the reference implementation does. The
/// result includes the 8-byte length prefix.
pub fn encode_header(entries: &[Entry], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut json = String::from("{");
    let mut first = true;
    let mut sep = |json: &mut String| {
        if !first {
            json.push(',');
        }
        first = false;
    };
    if !metadata.is_empty() {
        sep(&mut json);
        json.push_str(&quote(METADATA_KEY));
        json.push_str(":{");
        let pairs: Vec<String> = metadata
            .iter()
            .map(|(k, v)| format!("{}:{}", quote(k), quote(v)))
            .collect();
        json.push_str(&pairs.join(","));
        json.push('}');
    }
    for e in entries {
        sep(&mut json);
        let shape: Vec<String> = e.shape.iter().map(u64::to_string).collect();
        json.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            quote(&e.name),
            e.dtype,
            shape.join(","),
            e.start,
            e.end
        ));
    }
    json.push('}');
    while (json.len() + 8) % 8 != 0 {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out
}

fn quote(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

/// Lays out `tensors` back to back and returns their entries.
pub fn pack_entries<'a>(
    tensors: impl IntoIterator<Item = (&'a str, Dtype, &'a [u64], u64)>,
) -> Vec<Entry> {
    let mut at = 0;
    tensors
        .into_iter()
        .map(|(name, dtype, shape, nbytes)| {
            let e = Entry {
                name: name.into(),
                dtype,
                shape: shape.to_vec(),
                start: at,
                end: at + nbytes,
            };
            at += nbytes;
            e
        })
        .collect()
}

/// A tensor to write with [`write_file`].
pub struct TensorData<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [u64],
    pub data: &'a [u8],
}

/// Writes a small safetensors file in one go, crash-safe (temporary name, fsync, rename).
/// Large files go through the planner and executor instead.
pub fn write_file(
    path: &Path,
    tensors: &[TensorData<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    for t in tensors {
        let need = tensor_bytes(path, t.name, t.dtype, t.shape)?;
        if need != t.data.len() as u64 {
            return Err(bad(
                path,
                t.name,
                format!("{} data bytes given, shape needs {need}", t.data.len()),
            ));
        }
    }
    let entries = pack_entries(
        tensors
            .iter()
            .map(|t| (t.name, t.dtype, t.shape, t.data.len() as u64)),
    );
    let mut bytes = encode_header(&entries, metadata);
    for t in tensors {
        bytes.extend_from_slice(t.data);
    }
    crate::fsio::write_atomic(path, &bytes)
}

/// Reads a file into memory-mapped form together with its parsed header.
pub struct MappedFile {
    pub path: PathBuf,
    pub map: crate::fsio::Map,
    pub header: Header,
}

impl MappedFile {
    /// Maps `path` and parses its header.
    pub fn open(path: &Path) -> Result<MappedFile> {
        let map = crate::fsio::Map::open(path)?;
        let header = parse_header(path, map.bytes())?;
        Ok(MappedFile {
            path: path.into(),
            map,
            header,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(json: &str, data: &[u8]) -> Vec<u8> {
        let mut b = (json.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(json.as_bytes());
        b.extend_from_slice(data);
        b
    }

    fn err(bytes: &[u8]) -> String {
        parse_header(Path::new("x.safetensors"), bytes)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn encode_then_parse_round_trips() {
        let entries = pack_entries([
            ("a.b", Dtype::BF16, &[2u64, 3][..], 12),
            ("s", Dtype::I64, &[][..], 8),
        ]);
        let mut meta = BTreeMap::new();
        meta.insert("k".to_string(), "{\"q\": \"v\"}".to_string());
        let mut bytes = encode_header(&entries, &meta);
        assert_eq!(bytes.len() % 8, 0);
        bytes.extend_from_slice(&[7u8; 20]);
        let h = parse_header(Path::new("f"), &bytes).unwrap();
        assert_eq!(h.entries, entries);
        assert_eq!(h.metadata, meta);
    }

    #[test]
    fn each_bad_header_names_file_and_tensor() {
        assert!(err(&[1, 2, 3]).contains("truncated"));
        let mut b = 100u64.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        assert!(err(&b).contains("header length 100 goes beyond"));
        assert!(err(&file("{nope", b"")).contains("invalid header JSON"));
        let e = err(&file(
            r#"{"w":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}}"#,
            b"x",
        ));
        assert!(
            e.contains("x.safetensors") && e.contains("`w`") && e.contains("unknown dtype `Q7`"),
            "{e}"
        );
        let e = err(&file(
            r#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            b"xy",
        ));
        assert!(
            e.contains("`w`") && e.contains("outside the data section"),
            "{e}"
        );
        let e = err(&file(
            r#"{"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#,
            b"",
        ));
        assert!(e.contains("`w`") && e.contains("overflows"), "{e}");
        let e = err(&file(
            r#"{"w":{"dtype":"U8","shape":[3],"data_offsets":[0,2]}}"#,
            b"xy",
        ));
        assert!(e.contains("needs 3"), "{e}");
        let e = err(&file(
            r#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[4,0]}}"#,
            b"xyzw",
        ));
        assert!(
            e.contains("`w`") && e.contains("[4, 0): the start is after the end"),
            "{e}"
        );
        let e = err(&file(
            r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#,
            b"xyz",
        ));
        assert!(e.contains("overlap"), "{e}");
    }

    /// Headers the reference reader accepts, we accept; those it refuses for layout
    /// reasons (gaps, overlaps, trailing bytes), we refuse, naming the tensor.
    #[test]
    fn agrees_with_the_reference_reader_on_layout() {
        let cases: [(&str, &[u8], Option<&str>); 7] = [
            (
                r#"{"__metadata__":null,"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                b"xy",
                None,
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                b"xy",
                Some("gap of 1 bytes"),
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                b"xy",
                Some("1 trailing bytes"),
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#,
                b"xyz",
                Some("overlap"),
            ),
            (
                r#"{"e":{"dtype":"F32","shape":[0,3],"data_offsets":[2,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                b"xy",
                None,
            ),
            (r#"{}"#, b"", None),
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
                b"xy",
                Some("names this tensor twice"),
            ),
        ];
        for (json, data, want) in cases {
            let bytes = file(json, data);
            let ours = parse_header(Path::new("x.safetensors"), &bytes);
            match want {
                None => {
                    assert!(ours.is_ok(), "{json}: {:?}", ours.err());
                    assert!(
                        ::safetensors::SafeTensors::deserialize(&bytes).is_ok(),
                        "{json}"
                    );
                }
                Some(text) => {
                    let e = ours.expect_err(json).to_string();
                    assert!(e.contains(text) && e.contains("x.safetensors"), "{e}");
                }
            }
        }
        // The reference refuses layout errors too (duplicates it silently collapses).
        for (json, data, _) in cases.iter().filter(|c| c.2.is_some()).take(3) {
            assert!(::safetensors::SafeTensors::deserialize(&file(json, data)).is_err());
        }
    }

    #[test]
    fn a_bad_field_names_the_tensor() {
        let e = err(&file(
            r#"{"w":{"dtype":"U8","shape":"3","data_offsets":[0,3]}}"#,
            b"xyz",
        ));
        assert!(
            e.contains("tensor `w`") && e.contains("x.safetensors"),
            "{e}"
        );
        let e = err(&file(r#"{"__metadata__":{"k":1}}"#, b""));
        assert!(e.contains("not a string"), "{e}");
    }
}
