//! Executing a compiled spec: the forward recorder that runs a block's ops and remembers how
//! each slot was produced, the per-layer storage the plan asks for (saved, offloaded to the
//! host store, or dropped), and the backward-side slot access that prefetches and recomputes
//! through the layer's plan.
//!
//! This file holds what both passes share and the forward; the backward side is in
//! `backward.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::core::kernels::RopeTable;
use crate::core::swap::{HostStore, SlotId};
use crate::spec::compile::{Disposition, LayerPlan, Plan};
use crate::spec::{ModelConfig, Value};

use super::act::Act;
use super::error::{RunError, RunResult};
use super::fingerprint::fingerprint;
use super::lora::{self, LayerAdapters, LoraConfig, MaskKey};
use super::meter::{Hold, Meter, Use};
use super::ops::{OpEnv, execute};

mod backward;

pub use backward::{Backward, SharedBuffers};

/// An operand of a forward op call.
#[derive(Debug, Clone, Copy)]
pub enum Src<'a> {
    Slot(&'a str),
    Input(&'a str),
    Param(&'a str),
    /// A parameter that may be absent (a bias).
    OptParam(&'a str),
    Global(&'a str),
}

/// How the forward produced a group of slots: what a replay runs again.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub op: String,
    pub attrs: BTreeMap<String, Value>,
    /// Operand names as the spec writes them (`ln1`, `@input:x`, `@param:q_bias`), `-` for an
    /// absent optional operand.
    pub operands: Vec<String>,
    pub outputs: Vec<String>,
    pub output_shapes: Vec<Vec<usize>>,
    /// LoRA target applied to each output (`None`: no adapter).
    pub lora: Vec<Option<String>>,
    /// LoRA target the block declares for each output, whether or not adapters exist.
    pub lora_declared: Vec<Option<String>>,
    /// Operands as a spec would write them (`@param:q_bias?` for an optional one).
    pub declared: Vec<String>,
    /// [`fingerprint`] of each output as the forward produced it (LoRA included): every
    /// rebuild in backward must reproduce it.
    pub fingerprints: Vec<u64>,
}

/// What every layer shares: config, RoPE table, adapters' settings, stores.
pub struct Shared<'a> {
    pub plan: &'a Plan,
    pub config: &'a ModelConfig,
    /// Models without attention (Mamba) have none.
    pub rope: Option<&'a RopeTable<f32>>,
    pub lora: Option<&'a LoraConfig>,
    pub meter: &'a Arc<Meter>,
    pub host: &'a HostStore,
    /// The training step: LoRA dropout draws its masks from it.
    pub step: u64,
}

impl Shared<'_> {
    fn mask(&self, layer: usize) -> MaskKey {
        MaskKey {
            step: self.step,
            layer,
        }
    }
}

/// A runtime value with the pool bytes it holds.
pub type Held = (Act, Hold);

/// Compares a produced tensor with the slot the compiled plan declares for this layer:
/// same byte size and same row width (a declared `[B*T, E]` may come out as `[B, T, E]`,
/// the same buffer). Slots the spec does not declare, or declares absent, are not checked.
fn check_shape(plan: &LayerPlan, name: &str, act: &Act) -> RunResult<()> {
    let Some(slot) = plan
        .slots
        .iter()
        .find(|s| s.name == name && s.disposition != Disposition::Absent)
    else {
        return Ok(());
    };
    let row = |shape: &[usize]| shape.last().copied().unwrap_or(1);
    if slot.bytes != act.bytes() || row(&slot.shape) != row(&act.shape) {
        return Err(RunError::ShapeMismatch {
            layer: plan.layer,
            slot: name.into(),
            declared: slot.shape.clone(),
            declared_bytes: slot.bytes,
            actual: act.shape.clone(),
            actual_bytes: act.bytes(),
        });
    }
    Ok(())
}

/// Checks a block input against the plan's declared input.
fn check_input(plan: &LayerPlan, name: &str, act: &Act) -> RunResult<()> {
    match plan.inputs.iter().find(|x| x.name == name) {
        Some(x) if x.bytes != act.bytes() || x.shape.last() != act.shape.last() => {
            Err(RunError::ShapeMismatch {
                layer: plan.layer,
                slot: format!("@input:{name}"),
                declared: x.shape.clone(),
                declared_bytes: x.bytes,
                actual: act.shape.clone(),
                actual_bytes: act.bytes(),
            })
        }
        _ => Ok(()),
    }
}

/// Backward scratch (an activation gradient, say) whose bytes the pool holds.
pub struct Scratch {
    pub data: Vec<f32>,
    _hold: Hold,
}

impl std::ops::Deref for Scratch {
    type Target = Vec<f32>;
    fn deref(&self) -> &Vec<f32> {
        &self.data
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut Vec<f32> {
        &mut self.data
    }
}

impl Scratch {
    /// Zeros of `len` elements, charged to `meter` as scratch named `what`.
    pub fn zeros(meter: &Arc<Meter>, len: usize, what: impl FnOnce() -> String) -> RunResult<Self> {
        Self::hold(meter, vec![0.0; len], what)
    }

    /// Charges an existing buffer.
    pub fn hold(
        meter: &Arc<Meter>,
        data: Vec<f32>,
        what: impl FnOnce() -> String,
    ) -> RunResult<Self> {
        let hold = meter.hold(data.len() as u64 * 4, Use::Scratch, what)?;
        Ok(Self { data, _hold: hold })
    }
}

/// One layer's weights and adapters.
pub struct LayerWeights<'a> {
    pub params: &'a BTreeMap<String, Act>,
    pub adapters: Option<&'a LayerAdapters>,
}

fn env<'a>(shared: &'a Shared, slot: &'a str) -> OpEnv<'a> {
    OpEnv {
        config: shared.config,
        rope: shared.rope,
        slot,
    }
}

/// Runs one layer's forward, op by op.
pub struct Forward<'a> {
    pub layer: usize,
    shared: &'a Shared<'a>,
    weights: LayerWeights<'a>,
    inputs: BTreeMap<String, Held>,
    values: HashMap<String, Held>,
    records: Vec<Record>,
}

impl<'a> Forward<'a> {
    pub fn new(
        shared: &'a Shared<'a>,
        layer: usize,
        weights: LayerWeights<'a>,
        inputs: BTreeMap<String, Held>,
    ) -> RunResult<Self> {
        let plan = shared.plan.layers.get(layer).ok_or_else(|| {
            RunError::Model(format!(
                "layer {layer}: the plan has only {} layers",
                shared.plan.layers.len()
            ))
        })?;
        for (name, (act, _)) in &inputs {
            check_input(plan, name, act)?;
        }
        Ok(Self {
            layer,
            shared,
            weights,
            inputs,
            values: HashMap::new(),
            records: Vec::new(),
        })
    }

    pub fn value(&self, slot: &str) -> RunResult<&Act> {
        self.values
            .get(slot)
            .map(|(a, _)| a)
            .ok_or_else(|| RunError::Slot {
                layer: self.layer,
                slot: slot.into(),
                reason: "read before the forward produced it".into(),
            })
    }

    pub fn has(&self, slot: &str) -> bool {
        self.values.contains_key(slot)
    }

    fn operand(&self, src: Src) -> RunResult<(String, Option<&Act>)> {
        Ok(match src {
            Src::Slot(s) => (s.to_string(), Some(self.value(s)?)),
            Src::Input(name) => (
                format!("@input:{name}"),
                Some(self.inputs.get(name).map(|(a, _)| a).ok_or_else(|| {
                    RunError::Model(format!("layer {}: no block input `{name}`", self.layer))
                })?),
            ),
            Src::Param(name) => (
                format!("@param:{name}"),
                Some(self.weights.params.get(name).ok_or_else(|| {
                    RunError::Model(format!("layer {}: no parameter `{name}`", self.layer))
                })?),
            ),
            Src::OptParam(name) => match self.weights.params.get(name) {
                Some(p) => (format!("@param:{name}"), Some(p)),
                None => ("-".into(), None),
            },
            Src::Global(name) => (format!("@global:{name}"), None),
        })
    }

    /// Runs `op` and stores its outputs under `outputs`; `lora[i]` names the adapter added
    /// to output `i` (its input is operand 0).
    pub fn call(
        &mut self,
        op: &str,
        attrs: &[(&str, Value)],
        operands: &[Src],
        outputs: &[&str],
        lora: &[Option<&str>],
    ) -> RunResult<()> {
        let attrs: BTreeMap<String, Value> = attrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let mut names = Vec::with_capacity(operands.len());
        let mut values = Vec::with_capacity(operands.len());
        let mut declared = Vec::with_capacity(operands.len());
        for &src in operands {
            let (name, value) = self.operand(src)?;
            declared.push(match src {
                Src::OptParam(p) => format!("@param:{p}?"),
                _ => name.clone(),
            });
            names.push(name);
            values.push(value);
        }
        let mut produced = execute(&env(self.shared, outputs[0]), op, &attrs, &values)?;
        let mut applied = vec![None; outputs.len()];
        if let (Some(cfg), Some(adapters)) = (self.shared.lora, self.weights.adapters) {
            let x = values.first().copied().flatten();
            for (i, target) in lora.iter().enumerate() {
                let (Some(target), Some(x)) = (target, x) else {
                    continue;
                };
                if let Some(adapter) = adapters.get(*target) {
                    lora::apply(
                        cfg,
                        self.shared.mask(self.layer),
                        target,
                        adapter,
                        &x.data,
                        &mut produced[i].data,
                    );
                    applied[i] = Some(target.to_string());
                }
            }
        }
        let plan = &self.shared.plan.layers[self.layer];
        let output_shapes = produced.iter().map(|a| a.shape.clone()).collect();
        let fingerprints = produced.iter().map(fingerprint).collect();
        for (name, value) in outputs.iter().zip(produced) {
            check_shape(plan, name, &value)?;
            let hold = self.shared.meter.hold(value.bytes(), Use::Forward, || {
                format!("layer {} forward slot `{name}`", self.layer)
            })?;
            self.values.insert(name.to_string(), (value, hold));
        }
        let mut lora_declared: Vec<Option<String>> =
            lora.iter().map(|t| t.map(str::to_string)).collect();
        lora_declared.resize(outputs.len(), None);
        self.records.push(Record {
            op: op.into(),
            attrs,
            operands: names,
            outputs: outputs.iter().map(|s| s.to_string()).collect(),
            output_shapes,
            lora: applied,
            lora_declared,
            declared,
            fingerprints,
        });
        Ok(())
    }

    /// Ends the layer's forward: takes the block output, keeps what the plan saves, sends
    /// what it offloads to the host store, drops the rest (before the kept slots move to
    /// their per-layer storage, so the forward-only values do not count twice).
    pub fn finish(mut self, output: &str) -> RunResult<(Held, LayerState)> {
        let out = self.values.remove(output).ok_or_else(|| RunError::Slot {
            layer: self.layer,
            slot: output.into(),
            reason: "the block output was never produced".into(),
        })?;
        let plan = &self.shared.plan.layers[self.layer];
        let spec = self.shared.plan.spec();
        let mut kept: Vec<(String, bool, Held)> = Vec::new();
        for (i, input) in spec.inputs.iter().enumerate() {
            let value = self.inputs.remove(&input.name).ok_or_else(|| {
                RunError::Model(format!(
                    "layer {}: no block input `{}`",
                    self.layer, input.name
                ))
            })?;
            kept.push((
                format!("@input:{}", input.name),
                plan.inputs[i].offload,
                value,
            ));
        }
        for (slot, slot_plan) in spec.slots.iter().zip(&plan.slots) {
            let disposition = slot_plan.disposition;
            if matches!(disposition, Disposition::Saved | Disposition::Offloaded) {
                let value = self
                    .values
                    .remove(&slot.name)
                    .ok_or_else(|| RunError::Slot {
                        layer: self.layer,
                        slot: slot.name.clone(),
                        reason: format!(
                            "the plan has it {} but the forward never produced it",
                            disposition.name()
                        ),
                    })?;
                kept.push((
                    slot.name.clone(),
                    disposition == Disposition::Offloaded,
                    value,
                ));
            }
        }
        self.values.clear();
        let mut state = LayerState {
            layer: self.layer,
            saved: HashMap::new(),
            host: HashMap::new(),
            records: std::mem::take(&mut self.records),
        };
        for (name, offload, (value, hold)) in kept {
            drop(hold);
            if offload {
                state.offload(self.shared, name, value)?;
            } else {
                state.keep(self.shared, name, value)?;
            }
        }
        Ok((out, state))
    }

    /// Every value produced so far, by slot name (for checking recomputes against them).
    pub fn snapshot(&self) -> HashMap<String, Act> {
        self.values
            .iter()
            .map(|(k, (a, _))| (k.clone(), a.clone()))
            .collect()
    }

    /// The forward records (for `remat spec derive`).
    pub fn records(&self) -> &[Record] {
        &self.records
    }
}

/// What one layer keeps between its forward and its backward.
pub struct LayerState {
    pub layer: usize,
    saved: HashMap<String, (Act, Hold)>,
    host: HashMap<String, (SlotId, Vec<usize>)>,
    records: Vec<Record>,
}

fn to_bytes(data: &[f32]) -> Vec<u8> {
    data.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn from_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl LayerState {
    fn keep(&mut self, shared: &Shared, name: String, value: Act) -> RunResult<()> {
        let hold = shared.meter.hold(value.bytes(), Use::Saved, || {
            format!("layer {} saved slot `{name}`", self.layer)
        })?;
        self.saved.insert(name, (value, hold));
        Ok(())
    }

    fn offload(&mut self, shared: &Shared, name: String, value: Act) -> RunResult<()> {
        let tag = format!("layer {} {name}", self.layer);
        let start = std::time::Instant::now();
        let id = shared
            .host
            .put(&to_bytes(&value.data), &tag)
            .map_err(|e| RunError::Model(format!("offloading {tag}: {e}")))?;
        shared
            .meter
            .record_transfer(self.layer, &name, start.elapsed().as_secs_f64());
        self.host.insert(name, (id, value.shape));
        Ok(())
    }

    pub fn records(&self) -> &[Record] {
        &self.records
    }
}
