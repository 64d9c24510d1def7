//! The specs and example configs under the repository's `specs/` directory, embedded so the
//! binary works without the files.

use super::config::ModelConfig;
use super::error::Result;
use super::types::BlockSpec;

/// A block shipped with remat: its spec and a small example model config.
#[derive(Debug, Clone, Copy)]
pub struct ShippedBlock {
    pub name: &'static str,
    pub spec_file: &'static str,
    pub spec_text: &'static str,
    pub config_file: &'static str,
    pub config_text: &'static str,
}

pub const QWEN3: ShippedBlock = ShippedBlock {
    name: "qwen3",
    spec_file: "specs/qwen3.toml",
    spec_text: include_str!("../../../../specs/qwen3.toml"),
    config_file: "specs/qwen3.config.toml",
    config_text: include_str!("../../../../specs/qwen3.config.toml"),
};

pub const QWEN3_MOE: ShippedBlock = ShippedBlock {
    name: "qwen3-moe",
    spec_file: "specs/qwen3-moe.toml",
    spec_text: include_str!("../../../../specs/qwen3-moe.toml"),
    config_file: "specs/qwen3-moe.config.toml",
    config_text: include_str!("../../../../specs/qwen3-moe.config.toml"),
};

pub const MAMBA: ShippedBlock = ShippedBlock {
    name: "mamba",
    spec_file: "specs/mamba.toml",
    spec_text: include_str!("../../../../specs/mamba.toml"),
    config_file: "specs/mamba.config.toml",
    config_text: include_str!("../../../../specs/mamba.config.toml"),
};

/// The example hybrid model config (`remat train --block hybrid`): a block type per layer,
/// each running through its shipped spec.
pub const HYBRID_CONFIG_FILE: &str = "specs/hybrid.config.toml";
pub const HYBRID_CONFIG_TEXT: &str = include_str!("../../../../specs/hybrid.config.toml");

pub const BLOCKS: &[ShippedBlock] = &[QWEN3, QWEN3_MOE, MAMBA];

impl ShippedBlock {
    pub fn by_name(name: &str) -> Option<Self> {
        BLOCKS.iter().copied().find(|b| b.name == name)
    }

    pub fn spec(&self) -> Result<BlockSpec> {
        BlockSpec::parse(self.spec_text, self.spec_file)
    }

    pub fn config(&self) -> Result<ModelConfig> {
        ModelConfig::parse(self.config_text, self.config_file)
    }
}
