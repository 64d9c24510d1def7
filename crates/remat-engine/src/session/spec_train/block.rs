//! Which block a spec-driven run stacks, and the spec and config it runs: `--spec FILE`
//! names its block, `--block` names a shipped one, `--block-set` may set only the keys the
//! model, its config or its spec reads.

use std::path::Path;

use crate::session::error::{Result, SessionError};
use crate::spec::models::mamba;
use crate::spec::models::qwen3::{self, BlockKind};
use crate::spec::shipped::ShippedBlock;
use crate::spec::{BlockSpec, ModelConfig};

/// The block a spec-driven run stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    Qwen3(BlockKind),
    Mamba,
    /// A block type per layer (`layer_types`), each under its shipped spec.
    Hybrid,
}

impl Block {
    pub fn name(self) -> &'static str {
        match self {
            Block::Qwen3(kind) => kind.spec_name(),
            Block::Mamba => mamba::BLOCK,
            Block::Hybrid => "hybrid",
        }
    }

    /// The block named exactly `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            mamba::BLOCK => Some(Block::Mamba),
            "hybrid" => Some(Block::Hybrid),
            _ => BlockKind::from_name(name).map(Block::Qwen3),
        }
    }

    /// The block a spec is written for: its name exactly, or with `-derived` / `-save-all`.
    pub fn of_spec(spec_name: &str) -> Option<Self> {
        let base = ["-derived", "-save-all"]
            .iter()
            .find_map(|suffix| spec_name.strip_suffix(suffix))
            .unwrap_or(spec_name);
        // A hybrid is a config of several specs, never one spec's name.
        Self::from_name(base).filter(|b| *b != Block::Hybrid)
    }

    /// Whether `--block-set` may set `key`: one the model reads; for a hybrid, a common
    /// key or `TYPE.KEY` with a key that block type reads.
    pub fn reads_key(self, key: &str) -> bool {
        match self {
            Block::Qwen3(_) => qwen3::CONFIG_KEYS.contains(&key),
            Block::Mamba => mamba::CONFIG_KEYS.contains(&key),
            Block::Hybrid => match key.split_once('.') {
                Some(("mamba", k)) => mamba::CONFIG_KEYS.contains(&k),
                Some(("qwen3" | "qwen3-moe", k)) => qwen3::CONFIG_KEYS.contains(&k),
                Some(_) => false,
                None => ["layer_types", "hidden_size", "rms_norm_eps"].contains(&key),
            },
        }
    }

    /// The keys [`Block::reads_key`] accepts, for a message.
    pub fn config_keys(self) -> String {
        match self {
            Block::Qwen3(_) => qwen3::CONFIG_KEYS.join(", "),
            Block::Mamba => mamba::CONFIG_KEYS.join(", "),
            Block::Hybrid => "layer_types, hidden_size, rms_norm_eps, and TYPE.KEY for a key of block TYPE (mamba, qwen3, qwen3-moe)".into(),
        }
    }

    /// The projections LoRA adapts in this block.
    pub fn lora_targets(self) -> &'static [&'static str] {
        match self {
            Block::Qwen3(_) => &["q", "k", "v", "o", "gate", "up", "down"],
            Block::Mamba => mamba::LORA_TARGETS,
            Block::Hybrid => &["q", "k", "v", "o", "gate", "up", "down", "in", "x", "out"],
        }
    }
}

/// The block `--block NAME` names.
pub fn block_kind(name: &str) -> Result<Block> {
    Block::from_name(name).ok_or_else(|| {
        SessionError::invalid(format!(
            "unknown --block `{name}` (expected exactly qwen3, qwen3-moe or mamba)"
        ))
    })
}

/// The block and spec to train, and how the spec is named in messages: `spec` (`--spec
/// FILE`) names its block (exactly `qwen3`, `qwen3-moe` or `mamba`, or those with
/// `-derived`); `block` (`--block`), when also given, must agree.
pub fn resolve_block(
    spec: Option<&Path>,
    block: Option<&str>,
) -> Result<(Block, Option<BlockSpec>, String)> {
    let Some(path) = spec else {
        let block = block.unwrap_or("qwen3");
        return Ok((block_kind(block)?, None, block.to_string()));
    };
    let source = path.display().to_string();
    let spec = BlockSpec::load(path)?;
    let Some(kind) = Block::of_spec(&spec.name) else {
        return Err(SessionError::invalid(format!(
            "spec {source} is for block `{}`; remat trains qwen3, qwen3-moe and mamba (a spec's `name` must be exactly one of them, or end in -derived)",
            spec.name
        )));
    };
    if let Some(block) = block
        && block_kind(block)? != kind
    {
        return Err(SessionError::invalid(format!(
            "--block {block} but spec {source} is for block `{}`; drop --block (it is inferred from the spec) or pass --block {}",
            spec.name,
            kind.name()
        )));
    }
    Ok((kind, Some(spec), source))
}

/// Loads `spec` (a path, or a shipped block's name when no such file exists) and its
/// config (`config`, or the shipped block's) with `overrides` (`KEY=VALUE`) applied.
pub fn load_spec_and_config(
    spec: &str,
    config: Option<&Path>,
    overrides: &[String],
) -> Result<(BlockSpec, ModelConfig)> {
    let shipped = ShippedBlock::by_name(spec);
    let block = match shipped {
        Some(b) if !Path::new(spec).exists() => b.spec()?,
        _ => BlockSpec::load(Path::new(spec))?,
    };
    let mut model = match (config, shipped) {
        (Some(path), _) => ModelConfig::load(path)?,
        (None, Some(b)) => b.config()?,
        (None, None) => {
            return Err(SessionError::invalid(format!(
                "spec {spec}: no --config given (needed for every spec but the shipped qwen3 and qwen3-moe)"
            )));
        }
    };
    for assignment in overrides {
        model.apply_override(assignment)?;
    }
    Ok((block, model))
}

/// `--block-set KEY=VALUE` may set only keys the model or the spec reads, and never the
/// ones the task decides (`vocab_size`, `batch`, `seq_len`): those would be overwritten
/// without a word.
pub fn check_block_sets(
    block: Block,
    sets: &[String],
    config: &ModelConfig,
    spec: Option<&BlockSpec>,
) -> Result<()> {
    for assignment in sets {
        let key = assignment
            .split_once('=')
            .map(|(k, _)| k.trim())
            .ok_or_else(|| {
                SessionError::invalid(format!("--block-set `{assignment}` is not KEY=VALUE"))
            })?;
        let from_task = match key {
            "vocab_size" => Some("the task's vocabulary (--digits or --data)"),
            "batch" => Some("--batch"),
            "seq_len" => {
                Some("the task's sequence length (--digits N gives 2N, or --data FILE --seq N)")
            }
            _ => None,
        };
        if let Some(flag) = from_task {
            return Err(SessionError::invalid(format!(
                "--block-set {key}: `{key}` is set by {flag}, not by --block-set"
            )));
        }
        let known = block.reads_key(key)
            || config.get(key).is_some()
            || spec.is_some_and(|s| {
                s.config_defaults.contains_key(key) || spec_names(s).any(|name| name == key)
            });
        if !known {
            return Err(SessionError::invalid(format!(
                "--block-set {key}: `{key}` is not a key the {} model, its config or spec reads (known: {})",
                block.name(),
                block.config_keys()
            )));
        }
    }
    Ok(())
}

/// Every name a spec's dims, shapes and conditions mention (a superset of the config keys
/// it reads).
fn spec_names(spec: &BlockSpec) -> impl Iterator<Item = &str> {
    let texts = spec
        .dims
        .values()
        .map(String::as_str)
        .chain(spec.slots.iter().filter_map(|s| s.when.as_deref()))
        .chain(spec.params.iter().filter_map(|p| p.when.as_deref()))
        .chain(
            spec.slots
                .iter()
                .flat_map(|s| s.shape.iter().map(String::as_str)),
        )
        .chain(
            spec.params
                .iter()
                .flat_map(|p| p.shape.iter().map(String::as_str)),
        );
    texts.flat_map(|t| {
        t.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
            .filter(|w| w.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_names_its_block_exactly_or_with_a_known_suffix() {
        assert_eq!(Block::of_spec("mamba"), Some(Block::Mamba));
        assert_eq!(Block::of_spec("mamba-derived"), Some(Block::Mamba));
        assert_eq!(Block::of_spec("mamba-save-all"), Some(Block::Mamba));
        assert_eq!(Block::of_spec("hybrid"), None);
        assert_eq!(Block::of_spec("mamba2"), None);
        let err = block_kind("llama").expect_err("unknown block");
        assert_eq!(
            err.to_string(),
            "unknown --block `llama` (expected exactly qwen3, qwen3-moe or mamba)"
        );
    }

    #[test]
    fn block_set_refuses_task_keys_and_unknown_keys_by_name() {
        let config = ModelConfig::new("test");
        let sets = ["batch=3".to_string()];
        let err = check_block_sets(Block::Mamba, &sets, &config, None).expect_err("task key");
        assert_eq!(
            err.to_string(),
            "--block-set batch: `batch` is set by --batch, not by --block-set"
        );
        let sets = ["nonsense=1".to_string()];
        let err = check_block_sets(Block::Mamba, &sets, &config, None).expect_err("unknown");
        assert!(
            err.to_string()
                .starts_with("--block-set nonsense: `nonsense` is not a key the mamba model"),
            "{err}"
        );
    }
}
