//! Compiling a spec against a model config into one recompute plan per layer.
//!
//! Per layer: evaluate `when` conditions (model config plus `layer`), give each slot its
//! disposition in the training mode, resolve each step's operands (dropping absent optional
//! ones), order the steps topologically, list what to prefetch from the host store, and size
//! every byte.

mod resolve;
mod shape;
mod sort;

use std::collections::{BTreeMap, HashMap};

pub use resolve::{Recipe, Ref, RefKind, Resolved};

use super::config::ModelConfig;
use super::error::{Result, SpecError};
use super::types::{BlockSpec, Dtype, RecomputePolicy, Value};
use shape::ShapeResolver;

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
    pub fn device_bytes(&self) -> u64 {
        self.saved_bytes() + self.shared_buffer_bytes()
    }

    pub fn saved_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes.saved).sum()
    }

    pub fn offloaded_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes.offloaded).sum()
    }

    pub fn recomputed_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes.recomputed).sum()
    }

    pub fn shared_buffer_bytes(&self) -> u64 {
        self.shared_buffers.iter().map(|b| b.bytes).sum()
    }
}

/// Compiles `spec` for `config` (its `config_defaults` fill unset keys) in `mode`.
///
/// A recompute cycle is an error in every mode: a cycle through `lora_only` slots is
/// invisible under full fine-tuning (they are saved there) but would break the first LoRA
/// run of the same spec, so both modes' steps are ordered.
pub fn compile(spec: &BlockSpec, config: &ModelConfig, mode: Mode) -> Result<Plan> {
    let resolved = Resolved::new(spec.clone())?;
    let plan = resolved.plan(config, mode)?;
    let other = match mode {
        Mode::Full => Mode::Lora,
        Mode::Lora => Mode::Full,
    };
    for layer in 0..plan.layers.len() {
        if let Err(cycle @ SpecError::Cycle { .. }) =
            resolved.plan_layer(&plan.config, other, layer)
        {
            return Err(cycle);
        }
    }
    Ok(plan)
}

impl Resolved {
    pub fn plan(&self, config: &ModelConfig, mode: Mode) -> Result<Plan> {
        let config = config.clone().with_defaults(&self.spec.config_defaults);
        let num_layers = config.num_layers()?;
        let mut layers = Vec::with_capacity(num_layers);
        for layer in 0..num_layers {
            layers.push(self.plan_layer(&config, mode, layer)?);
        }
        let shared_buffers = shared_buffers(&self.spec, &layers);
        Ok(Plan {
            resolved: self.clone(),
            config,
            mode,
            layers,
            shared_buffers,
        })
    }

    fn eval(
        &self,
        owner: String,
        text: &Option<String>,
        cond: &Option<super::expr::Condition>,
        config: &ModelConfig,
        layer: usize,
    ) -> Result<bool> {
        let Some(cond) = cond else { return Ok(true) };
        let lookup = |name: &str| {
            if name == "layer" {
                Some(Value::Int(layer as i64))
            } else {
                config.get(name).cloned()
            }
        };
        cond.eval(&lookup)
            .map_err(|reason| SpecError::BadCondition {
                block: self.spec.name.clone(),
                owner,
                condition: text.clone().unwrap_or_default(),
                reason,
            })
    }

    /// Plans one layer; `config` must already carry the spec's defaults.
    pub fn plan_layer(&self, config: &ModelConfig, mode: Mode, layer: usize) -> Result<LayerPlan> {
        let spec = &self.spec;
        let shapes = ShapeResolver {
            block: &spec.name,
            dims: &spec.dims,
            config,
        };
        let mut slots = Vec::with_capacity(spec.slots.len());
        for (i, s) in spec.slots.iter().enumerate() {
            let present = self.eval(
                format!("slot `{}`", s.name),
                &s.when,
                &self.slot_when[i],
                config,
                layer,
            )?;
            let disposition = if !present {
                Disposition::Absent
            } else if s.offload {
                Disposition::Offloaded
            } else if s.recompute && policy_applies(self.slot_policy(i), mode) {
                Disposition::Recomputed
            } else if s.recompute || s.save {
                Disposition::Saved
            } else {
                Disposition::Transient
            };
            let shape = if present {
                shapes.shape(&format!("slot `{}`", s.name), &s.shape)?
            } else {
                Vec::new()
            };
            let bytes = if present {
                numel(&shape) * s.dtype.bytes()
            } else {
                0
            };
            let buffer = (disposition == Disposition::Recomputed).then_some(self.share_root[i]);
            slots.push(SlotPlan {
                name: s.name.clone(),
                shape,
                dtype: s.dtype,
                bytes,
                disposition,
                buffer,
            });
        }
        self.prune_unneeded(&mut slots);
        let mut params = Vec::with_capacity(spec.params.len());
        for (i, p) in spec.params.iter().enumerate() {
            let owner = format!("parameter `{}`", p.name);
            let present = self.eval(owner.clone(), &p.when, &self.param_when[i], config, layer)?;
            params.push(if present {
                Some(shapes.shape(&owner, &p.shape)?)
            } else {
                None
            });
        }
        let mut inputs = Vec::with_capacity(spec.inputs.len());
        for x in &spec.inputs {
            let shape = shapes.shape(&format!("input `{}`", x.name), &x.shape)?;
            let bytes = numel(&shape) * x.dtype.bytes();
            inputs.push(InputPlan {
                name: x.name.clone(),
                shape,
                bytes,
                offload: x.offload,
            });
        }
        for &o in &self.outputs {
            if slots[o].disposition == Disposition::Absent {
                return Err(SpecError::BadSlot {
                    block: spec.name.clone(),
                    slot: slots[o].name.clone(),
                    reason: format!("is a block output but absent in layer {layer}"),
                });
            }
        }
        let steps = self.steps(&slots, &params, mode, layer)?;
        let prefetch = inputs
            .iter()
            .enumerate()
            .filter(|(_, x)| x.offload)
            .map(|(i, _)| Prefetch::Input(i))
            .chain(
                slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.disposition == Disposition::Offloaded)
                    .map(|(i, _)| Prefetch::Slot(i)),
            )
            .collect();
        let bytes = layer_bytes(&slots, &inputs);
        Ok(LayerPlan {
            layer,
            slots,
            inputs,
            params,
            prefetch,
            steps,
            bytes,
        })
    }

    /// A slot backward does not read (`save = false`) is rebuilt only while some other
    /// rebuilt slot needs it; otherwise it is forward-only. Repeats until stable because
    /// dropping one rebuild can make its own inputs unneeded.
    fn prune_unneeded(&self, slots: &mut [SlotPlan]) {
        loop {
            let mut changed = false;
            for i in 0..slots.len() {
                if slots[i].disposition != Disposition::Recomputed || self.spec.slots[i].save {
                    continue;
                }
                let needed = self.recipes.iter().any(|recipe| {
                    recipe
                        .outputs
                        .iter()
                        .any(|&o| o != i && slots[o].disposition == Disposition::Recomputed)
                        && recipe
                            .from
                            .iter()
                            .any(|r| r.alternatives.contains(&RefKind::Slot(i)))
                });
                if !needed {
                    slots[i].disposition = Disposition::Transient;
                    slots[i].buffer = None;
                    changed = true;
                }
            }
            if !changed {
                return;
            }
        }
    }

    fn slot_policy(&self, slot: usize) -> RecomputePolicy {
        match self.producer[slot] {
            Some(r) => self.recipes[r].policy,
            None => self.spec.slots[slot].recompute_policy,
        }
    }

    fn steps(
        &self,
        slots: &[SlotPlan],
        params: &[Option<Vec<usize>>],
        mode: Mode,
        layer: usize,
    ) -> Result<Vec<Step>> {
        let mut steps = Vec::new();
        let mut step_of_slot: HashMap<usize, usize> = HashMap::new();
        for (r, recipe) in self.recipes.iter().enumerate() {
            let outputs: Vec<Option<usize>> = recipe
                .outputs
                .iter()
                .map(|&s| (slots[s].disposition == Disposition::Recomputed).then_some(s))
                .collect();
            let Some(first) = outputs.iter().flatten().next().copied() else {
                continue;
            };
            let inputs = recipe
                .from
                .iter()
                .map(|r| self.operand(r, slots, params, mode, layer, first))
                .collect::<Result<Vec<_>>>()?;
            for s in outputs.iter().flatten() {
                step_of_slot.insert(*s, steps.len());
            }
            steps.push(Step {
                recipe: r,
                op: recipe.op.clone(),
                attrs: recipe.attrs.clone(),
                inputs,
                outputs,
                lora_targets: recipe.lora_targets.clone(),
                policy: recipe.policy,
                group: recipe.group.clone(),
            });
        }
        let edges: Vec<Vec<usize>> = (0..steps.len())
            .map(|p| {
                (0..steps.len())
                    .filter(|&c| {
                        steps[c].inputs.iter().any(
                            |o| matches!(o, Operand::Slot(s) if step_of_slot.get(s) == Some(&p)),
                        )
                    })
                    .collect()
            })
            .collect();
        match sort::topo_order(&edges) {
            Ok(order) => {
                let mut slots_by_index: Vec<Option<Step>> = steps.into_iter().map(Some).collect();
                Ok(order
                    .into_iter()
                    .filter_map(|i| slots_by_index[i].take())
                    .collect())
            }
            Err(cycle) => Err(SpecError::Cycle {
                block: self.spec.name.clone(),
                cycle: cycle
                    .iter()
                    .map(|&i| {
                        let names: Vec<&str> = steps[i]
                            .outputs
                            .iter()
                            .flatten()
                            .map(|&s| slots[s].name.as_str())
                            .collect();
                        names.join("+")
                    })
                    .collect(),
            }),
        }
    }

    fn operand(
        &self,
        r: &Ref,
        slots: &[SlotPlan],
        params: &[Option<Vec<usize>>],
        mode: Mode,
        layer: usize,
        consumer: usize,
    ) -> Result<Operand> {
        let missing = |dependency: String, reason: &str| SpecError::MissingDependency {
            block: self.spec.name.clone(),
            layer,
            mode: mode.name(),
            slot: slots[consumer].name.clone(),
            dependency,
            reason: reason.into(),
        };
        let present = r.alternatives.iter().find(|kind| match kind {
            RefKind::Param(p) => params[*p].is_some(),
            RefKind::Slot(s) => slots[*s].disposition != Disposition::Absent,
            RefKind::Input(_) | RefKind::Global(_) => true,
        });
        match present {
            Some(RefKind::Input(i)) => Ok(Operand::Input(*i)),
            Some(RefKind::Global(g)) => Ok(Operand::Global(*g)),
            Some(RefKind::Param(p)) => Ok(Operand::Param(*p)),
            Some(RefKind::Slot(s)) if slots[*s].disposition == Disposition::Transient => {
                Err(missing(
                    slots[*s].name.clone(),
                    "is neither saved, offloaded nor recomputed in this mode",
                ))
            }
            Some(RefKind::Slot(s)) => Ok(Operand::Slot(*s)),
            None if r.optional => Ok(Operand::Absent),
            None => {
                let names: Vec<String> = r
                    .alternatives
                    .iter()
                    .map(|kind| match kind {
                        RefKind::Param(p) => format!("@param:{}", self.spec.params[*p].name),
                        RefKind::Slot(s) => slots[*s].name.clone(),
                        RefKind::Input(i) => format!("@input:{}", self.spec.inputs[*i].name),
                        RefKind::Global(g) => format!("@global:{}", self.spec.globals[*g].name),
                    })
                    .collect();
                Err(missing(
                    names.join("|"),
                    "is absent (its `when` is false) and not marked optional with `?`",
                ))
            }
        }
    }
}

fn policy_applies(policy: RecomputePolicy, mode: Mode) -> bool {
    match policy {
        RecomputePolicy::Always => true,
        RecomputePolicy::LoraOnly => mode == Mode::Lora,
        RecomputePolicy::Never => false,
    }
}

fn numel(shape: &[usize]) -> u64 {
    shape.iter().map(|&d| d as u64).product()
}

fn layer_bytes(slots: &[SlotPlan], inputs: &[InputPlan]) -> LayerBytes {
    let mut bytes = LayerBytes::default();
    for s in slots {
        match s.disposition {
            Disposition::Saved => bytes.saved += s.bytes,
            Disposition::Recomputed => bytes.recomputed += s.bytes,
            Disposition::Offloaded => bytes.offloaded += s.bytes,
            Disposition::Transient | Disposition::Absent => {}
        }
    }
    for x in inputs {
        if x.offload {
            bytes.offloaded += x.bytes;
        } else {
            bytes.saved += x.bytes;
        }
    }
    bytes
}

/// One buffer per `shares_with` root among recomputed slots, as large as its largest user
/// in any layer.
fn shared_buffers(spec: &BlockSpec, layers: &[LayerPlan]) -> Vec<SharedBuffer> {
    let mut by_root: BTreeMap<usize, u64> = BTreeMap::new();
    for layer in layers {
        for s in &layer.slots {
            if let Some(root) = s.buffer {
                let entry = by_root.entry(root).or_default();
                *entry = (*entry).max(s.bytes);
            }
        }
    }
    by_root
        .into_iter()
        .map(|(slot, bytes)| SharedBuffer {
            slot,
            name: spec.slots[slot].name.clone(),
            bytes,
        })
        .collect()
}
