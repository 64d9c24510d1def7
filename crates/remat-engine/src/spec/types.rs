//! The spec's data model: one [`BlockSpec`] per block type, read from TOML or JSON, or built
//! in Rust with the chaining methods on [`BlockSpec`] and [`SlotSpec`].

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::{Result, SpecError};

/// A scalar used for model-config entries and op attributes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Value {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Bool(b) => write!(f, "{b}"),
            Value::Int(i) => write!(f, "{i}"),
            Value::Float(x) => write!(f, "{x}"),
            Value::Str(s) => write!(f, "{s:?}"),
        }
    }
}

/// Element type of a slot; sizes every byte count of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    F32,
    Bf16,
    F16,
    I32,
    I64,
    U8,
}

impl Dtype {
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::I64 => 8,
            Dtype::U8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::I32 => "i32",
            Dtype::I64 => "i64",
            Dtype::U8 => "u8",
        }
    }
}

/// When a slot with `recompute = true` is actually recomputed.
///
/// `lora_only` slots are recomputed only when training LoRA adapters; under full fine-tuning
/// they are saved (per-layer storage), because there the frozen-weight shortcut that makes
/// recomputing them worthwhile does not apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecomputePolicy {
    #[default]
    Always,
    LoraOnly,
    Never,
}

impl RecomputePolicy {
    pub fn name(self) -> &'static str {
        match self {
            RecomputePolicy::Always => "always",
            RecomputePolicy::LoraOnly => "lora_only",
            RecomputePolicy::Never => "never",
        }
    }
}

/// A block input, reachable from slots as `@input:NAME`. Layer 0's input is the embedding
/// output; layer `l`'s is layer `l - 1`'s output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputSpec {
    pub name: String,
    #[serde(deserialize_with = "shape_entries")]
    pub shape: Vec<String>,
    #[serde(default)]
    pub dtype: Dtype,
    /// Keep on the host store between forward and backward; prefetched before the layer's
    /// recompute.
    #[serde(default)]
    pub offload: bool,
    #[serde(default)]
    pub description: String,
}

/// A weight of the block, reachable as `@param:NAME` (`@param:NAME?` when it may be absent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamSpec {
    pub name: String,
    #[serde(deserialize_with = "shape_entries")]
    pub shape: Vec<String>,
    #[serde(default)]
    pub dtype: Dtype,
    /// Condition on the model config (and `layer`) for the parameter to exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<String>,
    #[serde(default)]
    pub description: String,
}

/// A tensor shared by all layers, reachable as `@global:NAME` (RoPE tables, say).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GlobalSpec {
    pub name: String,
    #[serde(default, deserialize_with = "shape_entries")]
    pub shape: Vec<String>,
    #[serde(default)]
    pub description: String,
}

/// A shape entry as written: a string (`"384"`, `"B"`, `"H*Dh"`) or a bare non-negative
/// integer (`384`), kept as its string.
struct ShapeEntry(String);

impl<'de> Deserialize<'de> for ShapeEntry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ShapeEntry;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "a dimension: a non-negative integer, or a string like \"384\", a dim name or a product like \"H*Dh\"",
                )
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<ShapeEntry, E> {
                Ok(ShapeEntry(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<ShapeEntry, E> {
                Ok(ShapeEntry(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<ShapeEntry, E> {
                u64::try_from(v)
                    .map(|v| ShapeEntry(v.to_string()))
                    .map_err(|_| E::custom(format!("dimension {v} is negative")))
            }
        }
        d.deserialize_any(Visitor)
    }
}

fn shape_entries<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<String>, D::Error> {
    let entries = Vec::<ShapeEntry>::deserialize(d)?;
    Ok(entries.into_iter().map(|e| e.0).collect())
}

fn default_true() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_always(p: &RecomputePolicy) -> bool {
    *p == RecomputePolicy::Always
}

/// One activation slot of the block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotSpec {
    pub name: String,
    /// Named dims (`B`, `T`, `D`...), config keys, integers, or products like `H*Dh`.
    #[serde(deserialize_with = "shape_entries")]
    pub shape: Vec<String>,
    #[serde(default)]
    pub dtype: Dtype,
    /// Backward reads this slot: keep it unless it is recomputed or offloaded. `false` marks
    /// a forward-only intermediate.
    #[serde(default = "default_true", skip_serializing_if = "is_true")]
    pub save: bool,
    /// The slot may be freed after forward and rebuilt in backward (see `recompute_policy`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub recompute: bool,
    /// Reuse this other slot's buffer: both are never live at once in backward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shares_with: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// Operands of the recompute op: slot names (or aliases), `@input:NAME`, `@param:NAME`,
    /// `@global:NAME`; a trailing `?` marks an operand that may be absent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recompute_from: Vec<String>,
    /// A registered op; absent means "replay the forward op that produced the slot".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_op: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub recompute_attrs: BTreeMap<String, Value>,
    #[serde(default, skip_serializing_if = "is_always")]
    pub recompute_policy: RecomputePolicy,
    /// Slots of one group are rebuilt by one call of a multi-output op.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_group: Option<String>,
    /// Output order of the group's op (slot names); absent outputs are dropped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recompute_outputs: Vec<String>,
    /// LoRA adapters (q, k, v, o, up, gate, down) whose contribution is re-applied after the
    /// recomputed base matmul, in output order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lora_targets: Vec<String>,
    /// Condition on the model config (and `layer`) for the slot to exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub offload: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
}

/// A block type: its inputs, parameters, globals, slots and outputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Config values used when the model config does not set them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub config_defaults: BTreeMap<String, Value>,
    /// Named dims: each maps to a product of config keys and integers.
    #[serde(default)]
    pub dims: BTreeMap<String, String>,
    #[serde(default)]
    pub inputs: Vec<InputSpec>,
    #[serde(default)]
    pub params: Vec<ParamSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub globals: Vec<GlobalSpec>,
    /// Slots forming the block's output (the next layer's inputs, in input order).
    #[serde(default)]
    pub outputs: Vec<String>,
    #[serde(default)]
    pub slots: Vec<SlotSpec>,
}

impl BlockSpec {
    /// Parses TOML (`.toml`) or JSON (anything else) text; `file` names the source in errors.
    pub fn parse(text: &str, file: &str) -> Result<Self> {
        if file.ends_with(".json") {
            Self::from_json(text, file)
        } else {
            Self::from_toml(text, file)
        }
    }

    pub fn from_toml(text: &str, file: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| SpecError::Parse {
            file: file.to_string(),
            format: "TOML",
            message: e.to_string(),
        })
    }

    pub fn from_json(text: &str, file: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| SpecError::Parse {
            file: file.to_string(),
            format: "JSON",
            message: e.to_string(),
        })
    }

    pub fn load(path: &Path) -> Result<Self> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| SpecError::Io {
            file: file.clone(),
            error: source,
        })?;
        Self::parse(&text, &file)
    }

    pub fn to_toml(&self) -> Result<String> {
        toml::to_string_pretty(self).map_err(|e| SpecError::Parse {
            file: self.name.clone(),
            format: "TOML",
            message: e.to_string(),
        })
    }

    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| SpecError::Parse {
            file: self.name.clone(),
            format: "JSON",
            message: e.to_string(),
        })
    }

    /// The same block with nothing recomputed or offloaded: every slot backward reads is
    /// saved (the reference a spec-driven step must equal bit for bit).
    pub fn save_everything(&self) -> Self {
        let mut spec = self.clone();
        spec.name = format!("{}-save-all", self.name);
        for input in &mut spec.inputs {
            input.offload = false;
        }
        for slot in &mut spec.slots {
            if slot.recompute {
                slot.save = true;
            }
            slot.recompute = false;
            slot.offload = false;
            slot.recompute_from.clear();
            slot.recompute_op = None;
            slot.recompute_attrs.clear();
            slot.recompute_group = None;
            slot.recompute_outputs.clear();
            slot.recompute_policy = RecomputePolicy::Always;
            slot.lora_targets.clear();
        }
        spec
    }

    // Builder: the same structure as the file formats, for specs written in Rust.

    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            description: String::new(),
            config_defaults: BTreeMap::new(),
            dims: BTreeMap::new(),
            inputs: Vec::new(),
            params: Vec::new(),
            globals: Vec::new(),
            outputs: Vec::new(),
            slots: Vec::new(),
        }
    }

    pub fn description(mut self, text: impl Into<String>) -> Self {
        self.description = text.into();
        self
    }

    pub fn config_default(mut self, key: impl Into<String>, value: Value) -> Self {
        self.config_defaults.insert(key.into(), value);
        self
    }

    pub fn dim(mut self, name: impl Into<String>, expr: impl Into<String>) -> Self {
        self.dims.insert(name.into(), expr.into());
        self
    }

    pub fn input(mut self, name: impl Into<String>, shape: &[&str], offload: bool) -> Self {
        self.inputs.push(InputSpec {
            name: name.into(),
            shape: strings(shape),
            dtype: Dtype::F32,
            offload,
            description: String::new(),
        });
        self
    }

    pub fn param(mut self, name: impl Into<String>, shape: &[&str], when: Option<&str>) -> Self {
        self.params.push(ParamSpec {
            name: name.into(),
            shape: strings(shape),
            dtype: Dtype::F32,
            when: when.map(str::to_string),
            description: String::new(),
        });
        self
    }

    pub fn global(mut self, name: impl Into<String>, shape: &[&str]) -> Self {
        self.globals.push(GlobalSpec {
            name: name.into(),
            shape: strings(shape),
            description: String::new(),
        });
        self
    }

    pub fn output(mut self, slot: impl Into<String>) -> Self {
        self.outputs.push(slot.into());
        self
    }

    pub fn slot(mut self, slot: SlotSpec) -> Self {
        self.slots.push(slot);
        self
    }
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

impl SlotSpec {
    /// A saved f32 slot with no recompute recipe; chain the methods below to fill it in.
    pub fn new(name: impl Into<String>, shape: &[&str]) -> Self {
        Self {
            name: name.into(),
            shape: strings(shape),
            dtype: Dtype::F32,
            save: true,
            recompute: false,
            shares_with: None,
            aliases: Vec::new(),
            recompute_from: Vec::new(),
            recompute_op: None,
            recompute_attrs: BTreeMap::new(),
            recompute_policy: RecomputePolicy::Always,
            recompute_group: None,
            recompute_outputs: Vec::new(),
            lora_targets: Vec::new(),
            when: None,
            offload: false,
            description: String::new(),
        }
    }

    pub fn dtype(mut self, dtype: Dtype) -> Self {
        self.dtype = dtype;
        self
    }

    pub fn save(mut self, save: bool) -> Self {
        self.save = save;
        self
    }

    /// Marks the slot recomputable from `from` (replaying the forward op unless `op` is set).
    pub fn recompute(mut self, from: &[&str]) -> Self {
        self.recompute = true;
        self.recompute_from = strings(from);
        self
    }

    pub fn op(mut self, op: impl Into<String>) -> Self {
        self.recompute_op = Some(op.into());
        self
    }

    pub fn attr(mut self, key: impl Into<String>, value: Value) -> Self {
        self.recompute_attrs.insert(key.into(), value);
        self
    }

    pub fn policy(mut self, policy: RecomputePolicy) -> Self {
        self.recompute_policy = policy;
        self
    }

    pub fn group(mut self, group: impl Into<String>, outputs: &[&str]) -> Self {
        self.recompute_group = Some(group.into());
        self.recompute_outputs = strings(outputs);
        self
    }

    pub fn shares_with(mut self, other: impl Into<String>) -> Self {
        self.shares_with = Some(other.into());
        self
    }

    pub fn alias(mut self, alias: impl Into<String>) -> Self {
        self.aliases.push(alias.into());
        self
    }

    pub fn lora(mut self, targets: &[&str]) -> Self {
        self.lora_targets = strings(targets);
        self
    }

    pub fn when(mut self, condition: impl Into<String>) -> Self {
        self.when = Some(condition.into());
        self
    }

    pub fn offload(mut self, offload: bool) -> Self {
        self.offload = offload;
        self
    }

    pub fn describe(mut self, text: impl Into<String>) -> Self {
        self.description = text.into();
        self
    }
}
