//! Typed errors of spec parsing, compilation and execution. Every variant names the slot,
//! parameter or file involved and what is wrong with it.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SpecError {
    #[error("spec {file}: cannot read: {error}")]
    Io { file: String, error: std::io::Error },
    #[error("spec {file}: invalid {format}: {message}")]
    Parse {
        file: String,
        format: &'static str,
        message: String,
    },
    #[error("spec {block}: slot `{slot}` is declared twice")]
    DuplicateSlot { block: String, slot: String },
    #[error("spec {block}: name `{name}` is both {first} and {second}")]
    NameClash {
        block: String,
        name: String,
        first: String,
        second: String,
    },
    #[error("spec {block}: slot `{slot}` refers to unknown slot `{unknown}` in {field}")]
    UnknownSlot {
        block: String,
        slot: String,
        unknown: String,
        field: &'static str,
    },
    #[error("spec {block}: slot `{slot}` refers to unknown parameter `@param:{param}`")]
    UnknownParam {
        block: String,
        slot: String,
        param: String,
    },
    #[error("spec {block}: slot `{slot}` refers to unknown block input `@input:{input}`")]
    UnknownInput {
        block: String,
        slot: String,
        input: String,
    },
    #[error("spec {block}: slot `{slot}` refers to unknown global `@global:{global}`")]
    UnknownGlobal {
        block: String,
        slot: String,
        global: String,
    },
    #[error("spec {block}: slot `{slot}`: bad reference `{reference}`: {reason}")]
    BadReference {
        block: String,
        slot: String,
        reference: String,
        reason: String,
    },
    #[error("spec {block}: recompute cycle through slots {}", cycle.join(" -> "))]
    Cycle { block: String, cycle: Vec<String> },
    #[error("spec {block}: slot `{slot}` has two producers: {first} and {second}")]
    TwoProducers {
        block: String,
        slot: String,
        first: String,
        second: String,
    },
    #[error(
        "spec {block}, layer {layer}, {mode} mode: recompute of slot `{slot}` needs `{dependency}`, which {reason}"
    )]
    MissingDependency {
        block: String,
        layer: usize,
        mode: &'static str,
        slot: String,
        dependency: String,
        reason: String,
    },
    #[error("spec {block}: slot `{slot}` uses unknown recompute op `{op}` (known: {known})")]
    UnknownOp {
        block: String,
        slot: String,
        op: String,
        known: String,
    },
    #[error("spec {block}: slot `{slot}`: op `{op}` {reason}")]
    BadOpUse {
        block: String,
        slot: String,
        op: String,
        reason: String,
    },
    #[error("spec {block}: {owner}: bad condition `{condition}`: {reason}")]
    BadCondition {
        block: String,
        owner: String,
        condition: String,
        reason: String,
    },
    /// `first` and `second` read "slot `NAME` says VALUE".
    #[error("spec {block}: recompute group `{group}` conflicts on {field}: {second}, but {first}")]
    GroupConflict {
        block: String,
        group: String,
        field: &'static str,
        first: String,
        second: String,
    },
    #[error("spec {block}: slot `{slot}`: {reason}")]
    BadSlot {
        block: String,
        slot: String,
        reason: String,
    },
    #[error("spec {block}: {owner}: bad shape `{dim}`: {reason}")]
    BadShape {
        block: String,
        owner: String,
        dim: String,
        reason: String,
    },
    #[error("model config {source_name}: {reason}")]
    BadConfig { source_name: String, reason: String },
    #[error(
        "spec {block}: slot `{slot}` has LoRA target `{target}`; known targets: q, k, v, o, up, gate, down"
    )]
    UnknownLoraTarget {
        block: String,
        slot: String,
        target: String,
    },
}

pub type Result<T> = std::result::Result<T, SpecError>;
