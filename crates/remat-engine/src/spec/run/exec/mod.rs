//! Executing a compiled spec: the forward recorder that runs a block's ops and remembers how
//! each slot was produced, the per-layer storage the plan asks for (saved, offloaded to the
//! host store, or dropped), and the backward-side slot access that prefetches and recomputes
//! through the layer's plan.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::core::kernels::RopeTable;
use crate::core::swap::{HostStore, SlotId};
use crate::spec::compile::{Disposition, LayerPlan, Mode, Operand, Plan, Prefetch, Step};
use crate::spec::ops::REPLAY;
use crate::spec::{ModelConfig, Value};

use super::act::Act;
use super::error::{RunError, RunResult};
use super::fingerprint::fingerprint;
use super::lora::{self, LayerAdapters, LoraConfig, MaskKey};
use super::meter::{Hold, Meter, Use};
use super::ops::{OpEnv, execute};

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

/// Backward-side access to one layer's slots: saved ones, prefetched ones, and ones rebuilt
/// by the layer's plan into the buffers shared by all layers.
pub struct Backward<'a> {
    pub layer: usize,
    shared: &'a Shared<'a>,
    weights: LayerWeights<'a>,
    plan: &'a LayerPlan,
    state: LayerState,
    prefetched: HashMap<String, (Act, Hold)>,
    buffers: &'a mut SharedBuffers,
    /// Slot index -> index of the plan step that rebuilds it.
    step_of: HashMap<usize, usize>,
    pub recomputed_ops: usize,
}

/// The layer's rebuilt slots die with its backward: a buffer holds nothing another layer
/// could read, so keeping it until the next layer's rebuild would only add its bytes to
/// every phase in between (and make a layer's peak depend on which layers ran before it,
/// which the mixed plans' predicted peak must not).
impl Drop for Backward<'_> {
    fn drop(&mut self) {
        self.buffers.held.clear();
    }
}

/// The recompute buffers shared by every layer: one per `shares_with` root, each holding
/// the slot most recently rebuilt into it during one layer's backward (released when that
/// backward ends), tagged with its layer.
#[derive(Default)]
pub struct SharedBuffers {
    held: HashMap<usize, (Occupant, Act, Hold)>,
}

/// Which layer's slot a shared buffer currently holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Occupant {
    layer: usize,
    slot: usize,
}

impl SharedBuffers {
    pub fn new() -> Self {
        Self::default()
    }
}

impl<'a> Backward<'a> {
    /// Starts layer `state.layer`'s backward: prefetches its offloaded slots and inputs.
    pub fn new(
        shared: &'a Shared<'a>,
        weights: LayerWeights<'a>,
        state: LayerState,
        buffers: &'a mut SharedBuffers,
    ) -> RunResult<Self> {
        let plan = &shared.plan.layers[state.layer];
        let mut step_of = HashMap::new();
        for (i, step) in plan.steps.iter().enumerate() {
            for s in step.outputs.iter().flatten() {
                step_of.insert(*s, i);
            }
        }
        let mut this = Self {
            layer: state.layer,
            shared,
            weights,
            plan,
            state,
            prefetched: HashMap::new(),
            buffers,
            step_of,
            recomputed_ops: 0,
        };
        this.prefetch()?;
        Ok(this)
    }

    fn prefetch(&mut self) -> RunResult<()> {
        let spec = self.shared.plan.spec();
        for p in &self.plan.prefetch {
            let key = match *p {
                Prefetch::Input(i) => format!("@input:{}", spec.inputs[i].name),
                Prefetch::Slot(s) => spec.slots[s].name.clone(),
            };
            let start = std::time::Instant::now();
            let Some((id, shape)) = self.state.host.remove(&key) else {
                return Err(RunError::Slot {
                    layer: self.layer,
                    slot: key,
                    reason: "marked offload but not in the host store".into(),
                });
            };
            let len = self
                .shared
                .host
                .len_of(id)
                .map_err(|e| RunError::Model(e.to_string()))?;
            let mut bytes = vec![0u8; len as usize];
            self.shared
                .host
                .read(id, &mut bytes)
                .map_err(|e| RunError::Model(e.to_string()))?;
            self.shared
                .host
                .release(id)
                .map_err(|e| RunError::Model(e.to_string()))?;
            let act = Act::new(from_bytes(&bytes), shape);
            self.shared
                .meter
                .record_transfer(self.layer, &key, start.elapsed().as_secs_f64());
            let hold = self.shared.meter.hold(act.bytes(), Use::Prefetched, || {
                format!("layer {} prefetched `{key}`", self.layer)
            })?;
            self.prefetched.insert(key, (act, hold));
        }
        Ok(())
    }

    fn slot_index(&self, name: &str) -> RunResult<usize> {
        self.shared
            .plan
            .spec()
            .slots
            .iter()
            .position(|s| s.name == name)
            .ok_or_else(|| RunError::Slot {
                layer: self.layer,
                slot: name.into(),
                reason: "is not a slot of the spec".into(),
            })
    }

    fn occupant(&self, slot: usize) -> Occupant {
        Occupant {
            layer: self.layer,
            slot,
        }
    }

    fn available(&self, slot: usize) -> bool {
        let name = &self.plan.slots[slot].name;
        self.state.saved.contains_key(name)
            || self.prefetched.contains_key(name)
            || self.plan.slots[slot].buffer.is_some_and(|root| {
                self.buffers
                    .held
                    .get(&root)
                    .is_some_and(|h| h.0 == self.occupant(slot))
            })
    }

    /// Makes every named slot (or `@input:NAME`) readable, rebuilding what the plan
    /// recomputes; then [`Backward::get`] borrows them.
    pub fn ensure(&mut self, names: &[&str]) -> RunResult<()> {
        for name in names {
            if name.starts_with('@') {
                continue;
            }
            let slot = self.slot_index(name)?;
            if self.available(slot) {
                continue;
            }
            if self.plan.slots[slot].disposition != Disposition::Recomputed {
                return Err(RunError::Slot {
                    layer: self.layer,
                    slot: name.to_string(),
                    reason: format!(
                        "backward reads it but the plan has it {} in {} mode",
                        self.plan.slots[slot].disposition.name(),
                        self.shared.plan.mode.name()
                    ),
                });
            }
            self.rebuild(slot)?;
        }
        for name in names {
            self.get(name)?;
        }
        Ok(())
    }

    /// Runs, in plan order, the steps needed to rebuild `slot` from what is available.
    fn rebuild(&mut self, slot: usize) -> RunResult<()> {
        let mut needed = vec![false; self.plan.steps.len()];
        let first = self
            .step_of
            .get(&slot)
            .copied()
            .ok_or_else(|| RunError::Slot {
                layer: self.layer,
                slot: self.plan.slots[slot].name.clone(),
                reason: "is recomputed but no step of the plan rebuilds it".into(),
            })?;
        let mut stack = vec![first];
        while let Some(i) = stack.pop() {
            if needed[i] {
                continue;
            }
            needed[i] = true;
            for operand in &self.plan.steps[i].inputs {
                if let Operand::Slot(d) = *operand
                    && !self.available(d)
                    && let Some(&j) = self.step_of.get(&d)
                {
                    stack.push(j);
                }
            }
        }
        for i in (0..needed.len()).filter(|&i| needed[i]) {
            self.run_step(&self.plan.steps[i])?;
        }
        Ok(())
    }

    pub fn get(&self, name: &str) -> RunResult<&Act> {
        if let Some((a, _)) = self
            .state
            .saved
            .get(name)
            .or_else(|| self.prefetched.get(name))
        {
            return Ok(a);
        }
        let missing = || RunError::Slot {
            layer: self.layer,
            slot: name.into(),
            reason:
                "is not available (evicted from a shared buffer by a slot declared shares_with it?)"
                    .into(),
        };
        let slot = self.slot_index(name).map_err(|_| missing())?;
        let root = self.plan.slots[slot].buffer.ok_or_else(missing)?;
        match self.buffers.held.get(&root) {
            Some((o, act, _)) if *o == self.occupant(slot) => Ok(act),
            _ => Err(missing()),
        }
    }

    fn operand_name(&self, operand: &Operand) -> String {
        let spec = self.shared.plan.spec();
        match *operand {
            Operand::Slot(s) => spec.slots[s].name.clone(),
            Operand::Input(i) => format!("@input:{}", spec.inputs[i].name),
            Operand::Param(p) => format!("@param:{}", spec.params[p].name),
            Operand::Global(g) => format!("@global:{}", spec.globals[g].name),
            Operand::Absent => "-".into(),
        }
    }

    fn resolve(&self, name: &str) -> RunResult<Option<&Act>> {
        if name == "-" || name.starts_with("@global:") {
            return Ok(None);
        }
        if let Some(p) = name.strip_prefix("@param:") {
            return self.weights.params.get(p).map(Some).ok_or_else(|| {
                RunError::Model(format!("layer {}: no parameter `{p}`", self.layer))
            });
        }
        self.get(name).map(Some)
    }

    fn record_of(&self, slot: &str) -> RunResult<&Record> {
        self.state
            .records
            .iter()
            .find(|r| r.outputs.iter().any(|o| o == slot))
            .ok_or_else(|| RunError::Slot {
                layer: self.layer,
                slot: slot.into(),
                reason: "the forward never produced it, so it cannot be replayed".into(),
            })
    }

    fn run_step(&mut self, step: &Step) -> RunResult<()> {
        let spec = self.shared.plan.spec();
        let first = step
            .outputs
            .iter()
            .flatten()
            .next()
            .copied()
            .ok_or_else(|| RunError::Model("empty step".into()))?;
        let first_name = spec.slots[first].name.clone();
        let spec_operands: Vec<String> = step.inputs.iter().map(|o| self.operand_name(o)).collect();
        // Output position -> slot name, in the op's own output order.
        let (op, attrs, operands, out_names): (
            String,
            BTreeMap<String, Value>,
            Vec<String>,
            Vec<Option<String>>,
        ) = if step.op == REPLAY {
            let record = self.record_of(&first_name)?;
            if record.operands != spec_operands {
                return Err(RunError::Drift {
                    layer: self.layer,
                    slot: first_name,
                    spec: format!("recompute_from [{}]", spec_operands.join(", ")),
                    forward: format!("`{}` on [{}]", record.op, record.operands.join(", ")),
                });
            }
            let outs = record.outputs.iter().map(|o| Some(o.clone())).collect();
            (
                record.op.clone(),
                record.attrs.clone(),
                record.operands.clone(),
                outs,
            )
        } else {
            let outs = step
                .outputs
                .iter()
                .map(|o| o.map(|s| spec.slots[s].name.clone()))
                .collect();
            (step.op.clone(), step.attrs.clone(), spec_operands, outs)
        };
        self.check_lora(step, &out_names)?;
        let started = std::time::Instant::now();
        let produced = {
            let values = operands
                .iter()
                .map(|n| self.resolve(n))
                .collect::<RunResult<Vec<_>>>()?;
            let mut produced = execute(&env(self.shared, &first_name), &op, &attrs, &values)?;
            self.reapply_lora(
                step,
                &out_names,
                values.first().copied().flatten(),
                &mut produced,
            );
            produced
        };
        // Every output exists in memory until placed (or dropped, when this mode keeps it
        // elsewhere): scratch in the pool.
        let mut produced = produced
            .into_iter()
            .map(|act| {
                let hold = self.shared.meter.hold(act.bytes(), Use::Scratch, || {
                    format!("layer {} recompute of `{first_name}`", self.layer)
                })?;
                Ok(Some((act, hold)))
            })
            .collect::<RunResult<Vec<_>>>()?;
        self.recomputed_ops += 1;
        self.shared.meter.record_recompute(
            self.layer,
            step.recipe,
            started.elapsed().as_secs_f64(),
        );
        for (pos, name) in out_names.iter().enumerate() {
            let Some(name) = name else { continue };
            let slot = self.slot_index(name)?;
            if !step.outputs.contains(&Some(slot)) {
                continue;
            }
            let (value, scratch) =
                produced
                    .get_mut(pos)
                    .and_then(Option::take)
                    .ok_or_else(|| RunError::BadOperands {
                        op: op.clone(),
                        slot: name.clone(),
                        reason: format!("produced no output at position {pos}"),
                    })?;
            check_shape(self.plan, name, &value)?;
            self.check_fingerprint(&op, &operands, name, &value)?;
            let root = self.plan.slots[slot]
                .buffer
                .ok_or_else(|| RunError::Model(format!("slot {name} rebuilt without a buffer")))?;
            // The previous occupant dies first: the buffer is reused, never doubled.
            self.buffers.held.remove(&root);
            let hold = self.shared.meter.hold(value.bytes(), Use::Shared, || {
                format!("layer {} shared recompute buffer for `{name}`", self.layer)
            })?;
            drop(scratch);
            let occupant = self.occupant(slot);
            self.buffers.held.insert(root, (occupant, value, hold));
        }
        Ok(())
    }

    /// A rebuilt slot must be the forward's value bit for bit: a replay runs the forward's
    /// own op, but a custom recompute op is only checked here, by its result.
    fn check_fingerprint(
        &self,
        op: &str,
        operands: &[String],
        name: &str,
        value: &Act,
    ) -> RunResult<()> {
        let record = self.record_of(name)?;
        let forward = record
            .outputs
            .iter()
            .position(|o| o == name)
            .and_then(|i| record.fingerprints.get(i).copied());
        let rebuilt = fingerprint(value);
        if forward == Some(rebuilt) {
            return Ok(());
        }
        Err(RunError::Drift {
            layer: self.layer,
            slot: name.into(),
            spec: format!(
                "recompute `{op}` on [{}], which rebuilt different values (fingerprint {rebuilt:016x})",
                operands.join(", ")
            ),
            forward: format!(
                "`{}` on [{}] (fingerprint {})",
                record.op,
                record.operands.join(", "),
                forward.map_or("missing".into(), |f| format!("{f:016x}"))
            ),
        })
    }

    /// The spec's `lora_targets` must be the adapters the forward applied to those outputs.
    fn check_lora(&self, step: &Step, out_names: &[Option<String>]) -> RunResult<()> {
        if self.shared.lora.is_none() {
            return Ok(());
        }
        for (pos, name) in out_names.iter().enumerate() {
            let Some(name) = name else { continue };
            let record = self.record_of(name)?;
            let rpos = record.outputs.iter().position(|o| o == name).unwrap_or(0);
            let forward = record.lora.get(rpos).cloned().flatten();
            let declared = step.lora_targets.get(pos).cloned();
            let enabled =
                declared.filter(|t| self.weights.adapters.is_some_and(|a| a.contains_key(t)));
            if forward != enabled {
                return Err(RunError::Drift {
                    layer: self.layer,
                    slot: name.clone(),
                    spec: format!("LoRA {}", enabled.as_deref().unwrap_or("none")),
                    forward: format!("LoRA {}", forward.as_deref().unwrap_or("none")),
                });
            }
        }
        Ok(())
    }

    fn reapply_lora(
        &self,
        step: &Step,
        out_names: &[Option<String>],
        x: Option<&Act>,
        produced: &mut [Act],
    ) {
        let (Some(cfg), Some(adapters), Some(x)) = (self.shared.lora, self.weights.adapters, x)
        else {
            return;
        };
        for (pos, target) in step.lora_targets.iter().enumerate() {
            if out_names.get(pos).is_some_and(Option::is_some)
                && let Some(adapter) = adapters.get(target)
            {
                lora::apply(
                    cfg,
                    self.shared.mask(self.layer),
                    target,
                    adapter,
                    &x.data,
                    &mut produced[pos].data,
                );
            }
        }
    }

    /// Names of the slots this layer's plan recomputes, in plan order.
    pub fn recomputed_slots(&self) -> Vec<String> {
        self.plan
            .steps
            .iter()
            .flat_map(|s| s.outputs.iter().flatten())
            .map(|&s| self.plan.slots[s].name.clone())
            .collect()
    }

    pub fn mode(&self) -> Mode {
        self.shared.plan.mode
    }

    pub fn weights(&self) -> &LayerWeights<'a> {
        &self.weights
    }

    pub fn lora_config(&self) -> Option<&'a LoraConfig> {
        self.shared.lora
    }

    /// The dropout mask key of this layer in this step.
    pub fn mask(&self) -> MaskKey {
        self.shared.mask(self.layer)
    }

    /// Zeroed backward scratch of `len` elements, charged to the pool.
    pub fn scratch(&self, len: usize, what: &str) -> RunResult<Scratch> {
        Scratch::zeros(self.shared.meter, len, || {
            format!("layer {} backward scratch `{what}`", self.layer)
        })
    }

    /// Charges an existing backward buffer to the pool.
    pub fn charge(&self, data: Vec<f32>, what: &str) -> RunResult<Scratch> {
        Scratch::hold(self.shared.meter, data, || {
            format!("layer {} backward scratch `{what}`", self.layer)
        })
    }
}
