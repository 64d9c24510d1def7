//! Typed errors: every message names the file and/or tensor and what is wrong with it.

use std::path::PathBuf;

/// Everything that can go wrong while reading, planning, writing or verifying.
#[derive(Debug, thiserror::Error)]
pub enum ReshardError {
    // The I/O error is part of the message, not a `source`: printing an error with its
    // chain (anyhow's `{:#}`) would otherwise say it twice.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(
        "{path}: truncated: the file is {len} bytes, shorter than the 8-byte safetensors header length"
    )]
    Truncated { path: PathBuf, len: u64 },
    #[error(
        "{path}: header length {header_len} goes beyond the end of the file ({file_len} bytes)"
    )]
    HeaderBeyondFile {
        path: PathBuf,
        header_len: u64,
        file_len: u64,
    },
    #[error("{path}: invalid header JSON: {message}")]
    HeaderJson { path: PathBuf, message: String },
    #[error("{path}: tensor `{tensor}`: unknown dtype `{dtype}`")]
    UnknownDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error(
        "{path}: tensor `{tensor}`: shape {shape:?} of {dtype} has a byte size that overflows 64 bits"
    )]
    ShapeOverflow {
        path: PathBuf,
        tensor: String,
        shape: Vec<u64>,
        dtype: String,
    },
    #[error(
        "{path}: tensor `{tensor}`: data offsets [{start}, {end}) lie outside the data section of {data_len} bytes"
    )]
    DataOutOfFile {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
        data_len: u64,
    },
    #[error("{path}: tensor `{tensor}`: {what}")]
    BadTensor {
        path: PathBuf,
        tensor: String,
        what: String,
    },
    #[error(
        "tensor `{tensor}`: dtype differs across chunks: {first} in {first_file}, {second} in {second_file}"
    )]
    DtypeMismatch {
        tensor: String,
        first: String,
        first_file: PathBuf,
        second: String,
        second_file: PathBuf,
    },
    #[error("tensor `{tensor}`: chunks overlap: {first} and {second}")]
    Overlap {
        tensor: String,
        first: String,
        second: String,
    },
    #[error(
        "tensor `{tensor}`: the pieces at {region} in {files} are copies of one box, but {what}; which one is right is unknown"
    )]
    ReplicaMismatch {
        tensor: String,
        /// `offsets [..] sizes [..]`.
        region: String,
        /// `FIRST and SECOND`: the two files.
        files: String,
        what: String,
    },
    #[error(
        "tensor `{tensor}`: chunks leave a hole: they cover {covered} of the {total} elements of shape {shape:?}"
    )]
    Hole {
        tensor: String,
        shape: Vec<u64>,
        covered: u64,
        total: u64,
    },
    #[error("{path}: index: {what}")]
    Index { path: PathBuf, what: String },
    #[error("{path}: not a checkpoint remat can read: {what}")]
    UnknownLayout { path: PathBuf, what: String },
    #[error("tensor `{tensor}`: {what}")]
    Plan { tensor: String, what: String },
    #[error("{0}")]
    Target(String),
    /// A request's value that cannot be used (`max_buffer 0`), named as the library's
    /// field; the front ends refuse it first, in the same words, naming their flag.
    #[error("{argument} {value}: {what}")]
    Argument {
        argument: &'static str,
        value: String,
        what: String,
    },
    #[error(
        "{path}: output already exists; give --force (remat reshard) or force=True (remat.reshard) to replace it"
    )]
    OutputExists { path: PathBuf },
    #[error("{path}: part check failed: {what}")]
    Part { path: PathBuf, what: String },
    #[error(
        "{path}: checksum mismatch for tensor `{tensor}` chunk at offsets {offsets:?}: index says {expected:016x}, data hashes to {actual:016x}"
    )]
    Checksum {
        path: PathBuf,
        tensor: String,
        offsets: Vec<u64>,
        expected: u64,
        actual: u64,
    },
}

/// Short alias used across the crate.
pub type Result<T> = std::result::Result<T, ReshardError>;

/// An object-store request or URL that failed, as the I/O error it is: `url` names the
/// object or prefix (a URL only: credentials never appear in messages).
pub(crate) fn store_err(url: impl Into<String>, what: impl std::fmt::Display) -> ReshardError {
    ReshardError::Io {
        path: PathBuf::from(url.into()),
        error: std::io::Error::other(what.to_string()),
    }
}

/// Attaches a path to an I/O error.
pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ReshardError {
    let path = path.into();
    move |error| ReshardError::Io { path, error }
}
