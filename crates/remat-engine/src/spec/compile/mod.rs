//! Compiling a spec against a model config into one recompute plan per layer.
//!
//! Per layer: evaluate `when` conditions (model config plus `layer`), give each slot its
//! disposition in the training mode, resolve each step's operands (dropping absent optional
//! ones), order the steps topologically, list what to prefetch from the host store, and size
//! every byte.
//!
//! What a compile produces (the per-layer plan the runtime reads) is in `plan.rs`; this
//! file holds the compiler.
//!
//! Why one file of ~630 lines: the compiler is one pass per layer (conditions, dispositions,
//! operands, order, prefetch, bytes) over the resolved spec, read best in order; what it
//! produces (`plan.rs`), resolution, shapes and sorting are already apart.

mod plan;
mod resolve;
mod shape;
mod sort;

use std::collections::{BTreeMap, HashMap};

pub use plan::{
    Disposition, InputPlan, LayerBytes, LayerChoice, LayerPlan, Mode, Operand, Plan, Prefetch,
    SharedBuffer, SlotPlan, Step,
};
pub use resolve::{Recipe, Ref, RefKind, Resolved};

use super::config::ModelConfig;
use super::error::{Result, SpecError};
use super::types::{BlockSpec, Dtype, RecomputePolicy, Value};
use shape::ShapeResolver;

/// The most layers a plan is compiled for. Far beyond any real model (the largest open
/// models have around a hundred), and a bound on the plan's size: each layer's plan is a
/// few kilobytes, so `num_hidden_layers = 1000000000` must be refused, not allocated.
pub const MAX_LAYERS: usize = 4096;

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
    // Once per distinct layer configuration, as in `plan`.
    let mut checked = std::collections::HashSet::new();
    for layer in 0..plan.layers.len() {
        if !checked.insert(resolved.condition_key(&plan.config, layer)?) {
            continue;
        }
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
        let num_layers = checked_layer_count(&config)?;
        // Layers whose `when` conditions all evaluate alike get the same plan: plan each
        // distinct combination once and copy it (a uniform stack is planned once).
        let mut planned: HashMap<Vec<bool>, LayerPlan> = HashMap::new();
        let mut layers = Vec::with_capacity(num_layers);
        for layer in 0..num_layers {
            let key = self.condition_key(&config, layer)?;
            let plan = match planned.get(&key) {
                Some(same) => LayerPlan {
                    layer,
                    ..same.clone()
                },
                None => {
                    let plan = self.plan_layer(&config, mode, layer)?;
                    planned.insert(key, plan.clone());
                    plan
                }
            };
            layers.push(plan);
        }
        let shared_buffers = shared_buffers(&self.spec, &layers);
        let plan = Plan {
            resolved: self.clone(),
            config,
            mode,
            layers,
            shared_buffers,
        };
        plan.check_totals()?;
        Ok(plan)
    }

    /// The outcome of every slot and parameter `when` in `layer`: two layers with the same
    /// outcomes have the same plan (a plan depends on the layer index only through them).
    pub fn condition_key(&self, config: &ModelConfig, layer: usize) -> Result<Vec<bool>> {
        let slots = self.spec.slots.iter().enumerate().map(|(i, s)| {
            self.eval(
                format!("slot `{}`", s.name),
                &s.when,
                &self.slot_when[i],
                config,
                layer,
            )
        });
        let params = self.spec.params.iter().enumerate().map(|(i, p)| {
            self.eval(
                format!("parameter `{}`", p.name),
                &p.when,
                &self.param_when[i],
                config,
                layer,
            )
        });
        slots.chain(params).collect()
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

    /// Plans every layer under its own [`LayerChoice`] instead of the spec's policy (layers
    /// with the same conditions and choice are planned once).
    pub fn plan_with(
        &self,
        config: &ModelConfig,
        mode: Mode,
        choices: &[LayerChoice],
    ) -> Result<Plan> {
        let config = config.clone().with_defaults(&self.spec.config_defaults);
        let num_layers = checked_layer_count(&config)?;
        if choices.len() != num_layers {
            return Err(SpecError::BadConfig {
                source_name: config.source.clone(),
                reason: format!(
                    "{} layer choices for a model of {num_layers} layers",
                    choices.len()
                ),
            });
        }
        let mut planned: HashMap<(Vec<bool>, &LayerChoice), LayerPlan> = HashMap::new();
        let mut layers = Vec::with_capacity(num_layers);
        for (layer, choice) in choices.iter().enumerate() {
            let key = (self.condition_key(&config, layer)?, choice);
            let plan = match planned.get(&key) {
                Some(same) => LayerPlan {
                    layer,
                    ..same.clone()
                },
                None => {
                    let plan = self.plan_layer_with(&config, mode, layer, Some(choice))?;
                    planned.insert(key, plan.clone());
                    plan
                }
            };
            layers.push(plan);
        }
        let shared_buffers = shared_buffers(&self.spec, &layers);
        let plan = Plan {
            resolved: self.clone(),
            config,
            mode,
            layers,
            shared_buffers,
        };
        plan.check_totals()?;
        Ok(plan)
    }

    /// Plans one layer; `config` must already carry the spec's defaults.
    pub fn plan_layer(&self, config: &ModelConfig, mode: Mode, layer: usize) -> Result<LayerPlan> {
        self.plan_layer_with(config, mode, layer, None)
    }

    /// A slot's disposition under `choice`, or an error when the choice asks for what the
    /// spec does not allow (rebuilding against the slot's policy, offloading a slot that is
    /// not saved).
    fn chosen_disposition(
        &self,
        slot: usize,
        mode: Mode,
        choice: &LayerChoice,
    ) -> Result<Disposition> {
        let s = &self.spec.slots[slot];
        let bad = |reason: String| SpecError::BadSlot {
            block: self.spec.name.clone(),
            slot: s.name.clone(),
            reason,
        };
        let allowed = s.recompute && policy_applies(self.slot_policy(slot), mode);
        // A slot without `recompute` is never rebuilt, even when a rebuilt group's op also
        // produces it (attention's log-sum-exp): it stays saved, that output dropped.
        let rebuilt = s.recompute
            && self.producer[slot].is_some_and(|r| choice.recompute.get(r) == Some(&true));
        let offloaded = choice.offload.get(slot) == Some(&true);
        if rebuilt && !allowed {
            return Err(bad(format!(
                "is chosen to be recomputed, but its policy `{}` does not allow it in {} mode",
                self.slot_policy(slot).name(),
                mode.name()
            )));
        }
        if rebuilt && s.save {
            return Ok(Disposition::Recomputed);
        }
        if !s.save && allowed {
            // An intermediate: rebuilt where a rebuilt slot needs it (pruned otherwise).
            if offloaded {
                return Err(bad(
                    "is chosen to be offloaded, but backward never reads it".into(),
                ));
            }
            return Ok(Disposition::Recomputed);
        }
        let kept = s.save || s.recompute;
        match (offloaded, kept) {
            (true, true) => Ok(Disposition::Offloaded),
            (true, false) => Err(bad(
                "is chosen to be offloaded, but backward never reads it".into(),
            )),
            (false, true) => Ok(Disposition::Saved),
            (false, false) => Ok(Disposition::Transient),
        }
    }

    /// Plans one layer under `choice` (the spec's policy when `None`); `config` must
    /// already carry the spec's defaults.
    pub fn plan_layer_with(
        &self,
        config: &ModelConfig,
        mode: Mode,
        layer: usize,
        choice: Option<&LayerChoice>,
    ) -> Result<LayerPlan> {
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
            } else if let Some(choice) = choice {
                self.chosen_disposition(i, mode, choice)?
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
                shape_bytes(&spec.name, &format!("slot `{}`", s.name), &shape, s.dtype)?
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
        for (i, x) in spec.inputs.iter().enumerate() {
            let shape = shapes.shape(&format!("input `{}`", x.name), &x.shape)?;
            let bytes = shape_bytes(&spec.name, &format!("input `{}`", x.name), &shape, x.dtype)?;
            let offload = match choice {
                Some(c) => c.offload_inputs.get(i) == Some(&true),
                None => x.offload,
            };
            inputs.push(InputPlan {
                name: x.name.clone(),
                shape,
                bytes,
                offload,
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
        let bytes = layer_bytes(&slots, &inputs).ok_or_else(|| SpecError::BadShape {
            block: spec.name.clone(),
            owner: format!("layer {layer}"),
            dim: "(total)".into(),
            reason: "the bytes of its slots and inputs overflow a 64-bit byte count".into(),
        })?;
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

    /// The policy of the recipe that rebuilds `slot` (its own when it has none).
    pub fn slot_policy(&self, slot: usize) -> RecomputePolicy {
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

/// Whether a slot of `policy` may be rebuilt in `mode`.
pub fn policy_applies(policy: RecomputePolicy, mode: Mode) -> bool {
    match policy {
        RecomputePolicy::Always => true,
        RecomputePolicy::LoraOnly => mode == Mode::Lora,
        RecomputePolicy::Never => false,
    }
}

/// The layer count of `config`, refused past [`MAX_LAYERS`].
fn checked_layer_count(config: &ModelConfig) -> Result<usize> {
    let layers = config.num_layers()?;
    if layers > MAX_LAYERS {
        return Err(SpecError::BadConfig {
            source_name: config.source.clone(),
            reason: format!(
                "layer count {layers} (num_hidden_layers) is more than remat plans ({MAX_LAYERS})"
            ),
        });
    }
    Ok(layers)
}

/// Bytes of a tensor of `shape` and `dtype`, or an error naming `owner` when the count
/// does not fit in 64 bits (it would otherwise wrap, and a huge slot would print as 0 B).
fn shape_bytes(block: &str, owner: &str, shape: &[usize], dtype: Dtype) -> Result<u64> {
    shape
        .iter()
        .try_fold(dtype.bytes(), |acc, &d| acc.checked_mul(d as u64))
        .ok_or_else(|| SpecError::BadShape {
            block: block.into(),
            owner: owner.into(),
            dim: format!("{shape:?}"),
            reason: format!(
                "{} elements of {} overflow a 64-bit byte count",
                shape
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(" x "),
                dtype.name()
            ),
        })
}

/// Per-layer byte totals; `None` when one overflows.
fn layer_bytes(slots: &[SlotPlan], inputs: &[InputPlan]) -> Option<LayerBytes> {
    let mut bytes = LayerBytes::default();
    for s in slots {
        let total = match s.disposition {
            Disposition::Saved => &mut bytes.saved,
            Disposition::Recomputed => &mut bytes.recomputed,
            Disposition::Offloaded => &mut bytes.offloaded,
            Disposition::Transient | Disposition::Absent => continue,
        };
        *total = total.checked_add(s.bytes)?;
    }
    for x in inputs {
        let total = if x.offload {
            &mut bytes.offloaded
        } else {
            &mut bytes.saved
        };
        *total = total.checked_add(x.bytes)?;
    }
    Some(bytes)
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

#[cfg(test)]
mod tests;
