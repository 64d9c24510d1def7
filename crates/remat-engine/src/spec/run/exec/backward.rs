//! The backward side of a compiled spec's execution: access to one layer's slots, saved
//! ones, prefetched ones from the host store, and ones rebuilt by the layer's plan into the
//! recompute buffers every layer shares.

use std::collections::{BTreeMap, HashMap};

use super::{LayerState, LayerWeights, Record, Scratch, Shared, check_shape, env, from_bytes};
use crate::spec::Value;
use crate::spec::compile::{Disposition, LayerPlan, Mode, Operand, Prefetch, Step};
use crate::spec::ops::REPLAY;
use crate::spec::run::act::Act;
use crate::spec::run::error::{RunError, RunResult};
use crate::spec::run::fingerprint::fingerprint;
use crate::spec::run::lora::{self, LoraConfig, MaskKey};
use crate::spec::run::meter::{Hold, Use};
use crate::spec::run::ops::execute;

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
