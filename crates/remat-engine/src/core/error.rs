//! Typed errors of the engine. Messages name the node, tensor or field and what is wrong.

use crate::core::category::Category;
use crate::core::dtype::DType;

/// Everything that can go wrong in the engine.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error(
        "out of memory while running node {node}: requested {} of {category} with {} live, \
         budget {} ({} short)",
        remat_units::human_bytes(*requested),
        remat_units::human_bytes(*live),
        remat_units::human_bytes(*budget),
        remat_units::human_bytes((*live + *requested).saturating_sub(*budget))
    )]
    OutOfMemory {
        node: String,
        category: Category,
        requested: u64,
        live: u64,
        budget: u64,
    },
    #[error("shape error in {node}: {message}")]
    Shape { node: String, message: String },
    #[error("{what}: dtype {dtype} is not supported")]
    UnsupportedDType { what: String, dtype: DType },
    #[error("dtype mismatch in {what}: expected {expected}, found {found}")]
    DTypeMismatch {
        what: String,
        expected: DType,
        found: DType,
    },
    #[error("tensor {name}: {numel} elements given for shape {shape:?} ({expected} expected)")]
    DataLength {
        name: String,
        shape: Vec<usize>,
        numel: usize,
        expected: usize,
    },
    #[error("unknown node id {0} in this graph")]
    UnknownNode(usize),
    #[error("node {node} has no value: {reason}")]
    NoValue { node: String, reason: String },
    #[error(
        "recompute depth exceeded: rebuilding needs a chain of {depth} nodes, more than \
         max_recompute_depth {limit} of {limited_by}; chain: {}",
        chain.join(" <- ")
    )]
    RecomputeDepthExceeded {
        depth: usize,
        limit: usize,
        limited_by: String,
        chain: Vec<String>,
    },
    #[error("cannot rebuild {}: {reason}; chain: {}", chain.first().map(String::as_str).unwrap_or("?"), chain.join(" <- "))]
    Unrebuildable { reason: String, chain: Vec<String> },
    #[error(
        "one of the tensors needed for gradient computation has been modified in place: \
         {tensor} (input {slot} of node {node}) is at version {current}; expected version \
         {saved}"
    )]
    ModifiedInPlace {
        node: String,
        tensor: String,
        slot: usize,
        saved: u64,
        current: u64,
    },
    #[error("backward of {node}: {message}")]
    Backward { node: String, message: String },
    #[error("optimizer: {0}")]
    Optimizer(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
