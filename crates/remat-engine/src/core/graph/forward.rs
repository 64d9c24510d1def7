//! Forward execution: runs recorded nodes in index order and frees every value at its last
//! forward use unless backward will read it and its retention keeps it.

use std::time::Instant;

use super::{Graph, NodeEvent, NodeId, Plan};
use crate::core::checkpoint::Retention;
use crate::core::error::{EngineError, Result};
use crate::core::op::{OpCtx, Phase, RngSource, Saved};
use crate::core::tensor::Tensor;

impl Graph {
    /// Computes every node recorded so far. May be called again after recording more
    /// nodes; a value freed meanwhile is rebuilt for its new consumer.
    pub fn forward(&mut self) -> Result<()> {
        self.check_not_spent("forward")?;
        let ctx = self.ctx.clone();
        ctx.install(|| self.forward_inner())
    }

    fn forward_inner(&mut self) -> Result<()> {
        self.make_plan();
        for i in 0..self.nodes.len() {
            let node = &mut self.nodes[i];
            if node.executed {
                continue;
            }
            if node.is_leaf() {
                // A leaf's version is stamped when forward first reads it: a write after
                // this point and before backward is an in-place modification.
                node.value_version = node.value.as_ref().map_or(0, Tensor::version);
                node.executed = true;
                continue;
            }
            self.run_forward(i)?;
        }
        Ok(())
    }

    /// Counts forward consumers still to run and backward reads of every value.
    pub(crate) fn make_plan(&mut self) {
        let n = self.nodes.len();
        let mut plan = Plan {
            fwd_remaining: vec![0; n],
            bwd_remaining: vec![0; n],
            pinned: vec![false; n],
        };
        for (c, node) in self.nodes.iter().enumerate() {
            if node.is_leaf() {
                continue;
            }
            if !node.executed {
                for i in &node.inputs {
                    plan.fwd_remaining[i.0] += 1;
                }
            }
            for j in self.backward_reads(c) {
                plan.bwd_remaining[j] += 1;
            }
            for j in self.pinned_inputs(c) {
                plan.pinned[j] = true;
            }
        }
        self.plan = plan;
    }

    /// Inputs node `c` pins until its backward: a checkpoint with `save_inputs` keeps them
    /// so its rebuild is one step (unless an input is itself a `force`d checkpoint).
    pub(crate) fn pinned_inputs(&self, c: usize) -> Vec<usize> {
        let node = &self.nodes[c];
        let save_inputs = matches!(node.retention, Retention::Recompute(o) if o.save_inputs);
        if !save_inputs {
            return Vec::new();
        }
        node.inputs
            .iter()
            .map(|j| j.0)
            .filter(|&j| !self.nodes[j].retention.options().is_some_and(|o| o.force))
            .collect()
    }

    /// Values held for node `c`'s backward, one entry per read: the inputs its op saves,
    /// its own output if the op saves it, and the inputs it pins. Empty when `c` needs no
    /// gradient.
    pub(crate) fn backward_reads(&self, c: usize) -> Vec<usize> {
        let node = &self.nodes[c];
        let Some(op) = node.op() else {
            return Vec::new();
        };
        if !node.requires_grad {
            return Vec::new();
        }
        let mut reads: Vec<usize> = node
            .inputs
            .iter()
            .enumerate()
            .filter(|(slot, _)| op.saves_input(*slot))
            .map(|(_, j)| j.0)
            .collect();
        if op.saves_output() {
            reads.push(c);
        }
        reads.extend(self.pinned_inputs(c));
        reads
    }

    /// Whether the node's value is held from forward to backward.
    pub(crate) fn retained(&self, i: usize) -> bool {
        match self.nodes[i].retention {
            Retention::Keep => true,
            Retention::Recompute(_) => self.plan.pinned.get(i).copied().unwrap_or(false),
        }
    }

    fn run_forward(&mut self, i: usize) -> Result<()> {
        let missing: Vec<usize> = self.nodes[i]
            .inputs
            .iter()
            .filter(|j| self.nodes[j.0].value.is_none())
            .map(|j| j.0)
            .collect();
        if !missing.is_empty() {
            self.rebuild(&missing, &[])?;
        }
        self.execute(i, Phase::Forward)?;
        let inputs = self.nodes[i].inputs.clone();
        for j in inputs {
            self.plan.fwd_remaining[j.0] -= 1;
            self.free_if_done_in_forward(j.0);
        }
        let node = &self.nodes[i];
        if !(node.requires_grad && self.retained(i)) {
            // Aux tensors serve only this node's backward; a rebuild recreates them.
            self.nodes[i].aux.clear();
        }
        Ok(())
    }

    fn free_if_done_in_forward(&mut self, j: usize) {
        let node = &self.nodes[j];
        if node.is_leaf() || self.plan.fwd_remaining[j] > 0 {
            return;
        }
        let held_for_backward = self.retained(j) && self.plan.bwd_remaining[j] > 0;
        if !held_for_backward {
            self.nodes[j].value = None;
            if !(self.retained(j) && self.nodes[j].requires_grad) {
                self.nodes[j].aux.clear();
            }
        }
    }

    /// Version check of input `slot` of node `consumer` (an in-place modification since
    /// the value was produced is an error).
    pub(crate) fn check_version(&self, consumer: usize, slot: usize) -> Result<()> {
        let j = self.nodes[consumer].inputs[slot].0;
        self.check_value_version(consumer, j, slot)
    }

    pub(crate) fn check_value_version(&self, consumer: usize, j: usize, slot: usize) -> Result<()> {
        let node = &self.nodes[j];
        if let Some(v) = &node.value {
            let current = v.version();
            if current != node.value_version {
                return Err(EngineError::ModifiedInPlace {
                    node: self.nodes[consumer].name.clone(),
                    tensor: node.name.clone(),
                    slot,
                    saved: node.value_version,
                    current,
                });
            }
        }
        Ok(())
    }

    /// Runs node `i`'s op forward (first time or recompute) and stores value and aux.
    /// Every input must be resident.
    pub(crate) fn execute(&mut self, i: usize, phase: Phase) -> Result<()> {
        let node = &self.nodes[i];
        let mut inputs: Vec<Tensor> = Vec::with_capacity(node.inputs.len());
        for (slot, j) in node.inputs.iter().enumerate() {
            self.check_version(i, slot)?;
            inputs.push(
                self.nodes[j.0]
                    .value
                    .clone()
                    .ok_or_else(|| EngineError::NoValue {
                        node: self.nodes[j.0].name.clone(),
                        reason: format!("input {slot} of {} is not held", node.name),
                    })?,
            );
        }
        if let Some(obs) = self.observer.as_mut() {
            obs.before_node(phase, NodeId(i));
        }
        let start = Instant::now();
        let save_rng = node.retention.options().is_none_or(|o| o.save_rng);
        let mut drawn = Vec::new();
        let rng = match phase {
            Phase::Forward => RngSource::Record {
                streams: &mut self.rng,
                stream: node.rng_stream,
                drawn: &mut drawn,
            },
            _ if save_rng => RngSource::Replay {
                saved: &node.rng,
                next: 0,
            },
            _ => RngSource::NotSaved,
        };
        let mut cx = OpCtx {
            pool: self.ctx.pool(),
            node: i,
            node_name: &node.name,
            phase,
            threads: self.ctx.threads(),
            rng,
            grad_slots: &[],
        };
        let out = node.run_forward(&mut cx, &inputs)?;
        let elapsed = start.elapsed();
        drop(inputs);
        let node = &mut self.nodes[i];
        node.value_version = out.value.version();
        node.value = Some(out.value);
        node.aux_count = out.aux.len();
        node.aux = out.aux;
        if phase == Phase::Forward {
            node.rng = drawn;
            node.executed = true;
            self.stats.forward_nodes += 1;
        } else {
            node.recomputes += 1;
            self.stats.recomputed_nodes += 1;
        }
        self.notify_after(i, phase, elapsed);
        Ok(())
    }

    pub(crate) fn notify_after(&mut self, i: usize, phase: Phase, elapsed: std::time::Duration) {
        let Some(obs) = self.observer.as_mut() else {
            return;
        };
        let node = &self.nodes[i];
        let output_bytes = node.value.as_ref().map_or(0, Tensor::bytes);
        obs.after_node(&NodeEvent {
            phase,
            node: NodeId(i),
            name: &node.name,
            kind: node.op().map_or("leaf", |o| o.kind()),
            inputs: &node.inputs,
            output_bytes,
            elapsed,
        });
    }
}

/// Builds the [`Saved`] view backward gets for node `c`.
pub(crate) fn saved_view<'a>(g: &'a Graph, c: usize) -> Result<Saved<'a>> {
    let node = &g.nodes[c];
    let op = node
        .op()
        .ok_or_else(|| EngineError::Invalid(format!("{} is a leaf", node.name)))?;
    let mut inputs = Vec::with_capacity(node.inputs.len());
    let mut input_shapes = Vec::with_capacity(node.inputs.len());
    let mut input_dtypes = Vec::with_capacity(node.inputs.len());
    for (slot, j) in node.inputs.iter().enumerate() {
        let input = &g.nodes[j.0];
        inputs.push(if op.saves_input(slot) {
            input.value.as_ref()
        } else {
            None
        });
        input_shapes.push(input.shape.as_slice());
        input_dtypes.push(input.dtype);
    }
    Ok(Saved {
        inputs,
        input_shapes,
        input_dtypes,
        output: if op.saves_output() {
            node.value.as_ref()
        } else {
            None
        },
        aux: &node.aux,
        output_shape: &node.shape,
    })
}
