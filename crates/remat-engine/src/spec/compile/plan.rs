//! A compiled spec: one recompute plan per layer, what each slot's disposition is, the
//! steps that rebuild slots, what to prefetch, and the bytes of it all. The runtime reads
//! these; [`super::compile`] makes them.

use std::collections::BTreeMap;

use super::resolve::Resolved;
use crate::spec::config::ModelConfig;
use crate::spec::error::{Result, SpecError};
use crate::spec::types::{BlockSpec, Dtype, RecomputePolicy, Value};

/// What is trained: every weight, or LoRA adapters on frozen weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    Full,
    Lora,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Full => "full",
            Mode::Lora => "lora",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "full" => Ok(Mode::Full),
            "lora" => Ok(Mode::Lora),
            other => Err(format!("unknown mode `{other}` (expected full or lora)")),
        }
    }
}

/// Where a slot lives between its layer's forward and backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Per-layer device storage, kept from forward to backward.
    Saved,
    /// Freed after forward; rebuilt in backward into a buffer shared by all layers.
    Recomputed,
    /// Copied to the host store after forward, prefetched before the layer's backward.
    Offloaded,
    /// Forward-only: no backward use, freed after forward.
    Transient,
    /// Its `when` is false for this config and layer.
    Absent,
}

impl Disposition {
    pub fn name(self) -> &'static str {
        match self {
            Disposition::Saved => "saved",
            Disposition::Recomputed => "recomputed",
            Disposition::Offloaded => "offloaded",
            Disposition::Transient => "transient",
            Disposition::Absent => "absent",
        }
    }
}

/// A resolved operand of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    Slot(usize),
    Input(usize),
    Param(usize),
    Global(usize),
    /// An optional operand (`?`) whose target is absent.
    Absent,
}

/// One recompute op call in a layer's plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// Index into [`Resolved::recipes`].
    pub recipe: usize,
    pub op: String,
    pub attrs: BTreeMap<String, Value>,
    pub inputs: Vec<Operand>,
    /// Op output position -> the slot it rebuilds, `None` where that output is dropped
    /// (absent, or not recomputed in this mode).
    pub outputs: Vec<Option<usize>>,
    pub lora_targets: Vec<String>,
    pub policy: RecomputePolicy,
    pub group: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SlotPlan {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    pub bytes: u64,
    pub disposition: Disposition,
    /// For recomputed slots: the buffer shared by all layers (a slot index: the root of its
    /// `shares_with` set).
    pub buffer: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct InputPlan {
    pub name: String,
    pub shape: Vec<usize>,
    pub bytes: u64,
    pub offload: bool,
}

/// Something the layer's backward reads from the host store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetch {
    Input(usize),
    Slot(usize),
}

/// Activation bytes of one layer between its forward and backward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerBytes {
    /// Per-layer device storage: saved slots and kept block inputs.
    pub saved: u64,
    /// Rebuilt in backward (into buffers shared across layers).
    pub recomputed: u64,
    /// On the host store: offloaded slots and inputs.
    pub offloaded: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    pub layer: usize,
    pub slots: Vec<SlotPlan>,
    pub inputs: Vec<InputPlan>,
    /// Parameter shapes; `None` where the parameter is absent.
    pub params: Vec<Option<Vec<usize>>>,
    pub prefetch: Vec<Prefetch>,
    pub steps: Vec<Step>,
    pub bytes: LayerBytes,
}

/// A buffer that every layer's recompute reuses.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedBuffer {
    pub slot: usize,
    pub name: String,
    pub bytes: u64,
}

/// A per-layer override of the spec's own policy (what `spec::mix` chooses under a memory
/// budget): which recompute recipes rebuild their slots in backward, which saved slots and
/// block inputs go to the host store. Everything else is saved. A slot backward does not
/// read (`save = false`) is still rebuilt wherever a rebuilt slot needs it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct LayerChoice {
    /// Recipe index ([`Resolved::recipes`]) -> rebuilt in backward.
    pub recompute: Vec<bool>,
    /// Slot index -> offloaded to the host store.
    pub offload: Vec<bool>,
    /// Block input index -> offloaded to the host store.
    pub offload_inputs: Vec<bool>,
}

impl LayerChoice {
    /// Everything saved on the device: nothing rebuilt, nothing offloaded.
    pub fn keep_all(resolved: &Resolved) -> Self {
        Self {
            recompute: vec![false; resolved.recipes.len()],
            offload: vec![false; resolved.spec.slots.len()],
            offload_inputs: vec![false; resolved.spec.inputs.len()],
        }
    }
}

/// The compiled spec: one plan per layer for one mode.
#[derive(Debug, Clone)]
pub struct Plan {
    pub resolved: Resolved,
    pub config: ModelConfig,
    pub mode: Mode,
    pub layers: Vec<LayerPlan>,
    pub shared_buffers: Vec<SharedBuffer>,
}

impl Plan {
    pub fn spec(&self) -> &BlockSpec {
        &self.resolved.spec
    }

    /// Device bytes held between forward and backward over all layers, plus the shared
    /// recompute buffers.
    /// `Plan::check_totals` has checked at compile time that none of these sums overflow;
    /// they saturate rather than wrap should a caller edit the plan afterwards.
    pub fn device_bytes(&self) -> u64 {
        self.saved_bytes()
            .saturating_add(self.shared_buffer_bytes())
    }

    pub fn saved_bytes(&self) -> u64 {
        saturating_sum(self.layers.iter().map(|l| l.bytes.saved))
    }

    pub fn offloaded_bytes(&self) -> u64 {
        saturating_sum(self.layers.iter().map(|l| l.bytes.offloaded))
    }

    pub fn recomputed_bytes(&self) -> u64 {
        saturating_sum(self.layers.iter().map(|l| l.bytes.recomputed))
    }

    pub fn shared_buffer_bytes(&self) -> u64 {
        saturating_sum(self.shared_buffers.iter().map(|b| b.bytes))
    }

    /// Every total the plan reports fits in a u64, or an error naming the total.
    pub(super) fn check_totals(&self) -> Result<()> {
        let overflow = |what: &str| SpecError::BadShape {
            block: self.spec().name.clone(),
            owner: format!("the {what} bytes of all {} layers", self.layers.len()),
            dim: "(total)".into(),
            reason: "overflows a 64-bit byte count".into(),
        };
        let saved = checked_sum(self.layers.iter().map(|l| l.bytes.saved))
            .ok_or_else(|| overflow("saved"))?;
        checked_sum(self.layers.iter().map(|l| l.bytes.offloaded))
            .ok_or_else(|| overflow("offloaded"))?;
        checked_sum(self.layers.iter().map(|l| l.bytes.recomputed))
            .ok_or_else(|| overflow("recomputed"))?;
        checked_sum(self.shared_buffers.iter().map(|b| b.bytes))
            .and_then(|shared| shared.checked_add(saved))
            .ok_or_else(|| overflow("device (saved plus shared buffer)"))?;
        Ok(())
    }
}

fn checked_sum(mut values: impl Iterator<Item = u64>) -> Option<u64> {
    values.try_fold(0u64, |sum, b| sum.checked_add(b))
}

fn saturating_sum(values: impl Iterator<Item = u64>) -> u64 {
    values.fold(0, u64::saturating_add)
}
