//! An item's op run on the engine: a forward op, or a backward op with the gradients it
//! sums into the gradient buffers; each item's tensor made to own its bytes.

use super::{Held, Runner};
use crate::core::error::EngineError;
use crate::core::op::{OpCtx, Phase, RngSource, Saved};
use crate::core::pool::Category;
use crate::core::tensor::Tensor;
use crate::plan_exec::PlanExecError;
use crate::plan_exec::grads::{add_in_place, fill_ones};
use crate::plan_exec::layout::ItemKind;

impl Runner<'_> {
    pub(super) fn forward(&mut self, v: usize, first: bool) -> Result<Held, PlanExecError> {
        let input_ids: Vec<usize> = self.graph.nodes[v].inputs.iter().map(|j| j.0).collect();
        let inputs: Vec<Tensor> = input_ids
            .iter()
            .map(|&j| self.value_of(j))
            .collect::<Result<_, _>>()?;
        let graph = &mut *self.graph;
        let node = &graph.nodes[v];
        let mut drawn = Vec::new();
        let rng = if first {
            RngSource::Record {
                streams: &mut graph.rng,
                stream: node.rng_stream,
                drawn: &mut drawn,
            }
        } else {
            RngSource::Replay {
                saved: &self.rng[v],
                next: 0,
            }
        };
        let mut cx = OpCtx {
            pool: &self.pool,
            node: v,
            node_name: &node.name,
            phase: if first {
                Phase::Forward
            } else {
                Phase::Recompute
            },
            threads: graph.ctx.threads(),
            rng,
            grad_slots: &[],
        };
        let out = node.run_forward(&mut cx, &inputs)?;
        let mut tensors = Vec::with_capacity(1 + out.aux.len());
        for t in std::iter::once(out.value).chain(out.aux) {
            tensors.push(own_storage(
                t,
                &inputs,
                &tensors,
                Category::Activations,
                &node.name,
            )?);
        }
        if first {
            self.rng[v] = drawn;
            if let Ok(k) = self.layout.losses.binary_search(&v) {
                let values = tensors[0].to_f64_vec();
                let value = values.first().copied();
                self.report.losses[k] = value;
                self.report.loss_values[k] = values;
                if v == self.layout.loss {
                    self.report.loss = value;
                }
            }
        }
        Ok(Held {
            tensors,
            ..Held::default()
        })
    }

    /// The gradient of node `c`'s output: the seed for the loss, else the sum of what its
    /// users' backward items produced for it, in the engine's accumulation order.
    pub(super) fn grad_out(&self, c: usize) -> Result<Option<Tensor>, PlanExecError> {
        let node = &self.graph.nodes[c];
        if self.layout.is_loss(c) {
            let seed = Tensor::zeros(
                &self.pool,
                &node.shape,
                node.dtype,
                Category::Temporaries,
                Some(c),
            )
            .map_err(|e| e.at(&node.name))?;
            fill_ones(&seed)?;
            return Ok(Some(seed));
        }
        let mut parts: Vec<Tensor> = Vec::new();
        for &w in self.layout.users[c].iter().rev() {
            let Some(bw) = self.layout.bwd[w] else {
                continue;
            };
            let Some(held) = self.states[bw].held.as_ref() else {
                continue;
            };
            let user_inputs = &self.graph.nodes[w].inputs;
            for (t, &slot) in held.tensors.iter().zip(&held.grad_slots) {
                if user_inputs[slot].0 == c {
                    parts.push(t.clone());
                }
            }
        }
        let mut parts = parts.into_iter();
        let Some(first) = parts.next() else {
            return Ok(None);
        };
        let Some(second) = parts.next() else {
            return Ok(Some(first));
        };
        // Summed in a fresh buffer: the contributions belong to bundles the plan may still
        // read (a recomputed backward item must see them unchanged).
        let acc = first
            .deep_copy(Category::Temporaries)
            .map_err(|e| e.at(&node.name))?;
        for part in std::iter::once(second).chain(parts) {
            add_in_place(&acc, &part, &node.name)?;
        }
        Ok(Some(acc))
    }

    pub(super) fn backward(&mut self, c: usize, first: bool) -> Result<Held, PlanExecError> {
        let Some(grad_out) = self.grad_out(c)? else {
            return Ok(Held::default());
        };
        let node = &self.graph.nodes[c];
        let op = node
            .op()
            .ok_or_else(|| PlanExecError::Invalid(format!("{} is a leaf", node.name)))?;
        let input_ids: Vec<usize> = node.inputs.iter().map(|j| j.0).collect();
        let mut saved_inputs: Vec<Option<Tensor>> = Vec::with_capacity(input_ids.len());
        for (slot, &j) in input_ids.iter().enumerate() {
            saved_inputs.push(if op.saves_input(slot) {
                Some(self.value_of(j)?)
            } else {
                None
            });
        }
        let own: Vec<Tensor> = match self.layout.fwd[c].and_then(|i| self.states[i].held.as_ref()) {
            Some(h) => h.tensors.clone(),
            None => Vec::new(),
        };
        if op.saves_output() && own.is_empty() {
            return Err(PlanExecError::Invalid(format!(
                "output of {} is not on the device for its backward",
                node.name
            )));
        }
        let shapes: Vec<&[usize]> = input_ids
            .iter()
            .map(|&j| self.graph.nodes[j].shape.as_slice())
            .collect();
        let saved = Saved {
            inputs: saved_inputs.iter().map(Option::as_ref).collect(),
            input_shapes: shapes,
            input_dtypes: input_ids
                .iter()
                .map(|&j| self.graph.nodes[j].dtype)
                .collect(),
            output: if op.saves_output() { own.first() } else { None },
            aux: own.get(1..).unwrap_or(&[]),
            output_shape: &node.shape,
        };
        // A recomputation rebuilds only the gradients that flow on: the leaves' were summed
        // the first time, so the op is not asked for them (the simulator counts no buffer
        // for them either, and computing one would be a transient the plan never saw).
        let grad_slots: Vec<(bool, bool)> = input_ids
            .iter()
            .map(|&j| {
                let input = &self.graph.nodes[j];
                (
                    input.requires_grad && (first || !input.is_leaf()),
                    input.is_leaf(),
                )
            })
            .collect();
        let mut cx = OpCtx {
            pool: &self.pool,
            node: c,
            node_name: &node.name,
            phase: Phase::Backward,
            threads: self.graph.ctx.threads(),
            rng: RngSource::Backward {
                saved: &self.rng[c],
            },
            grad_slots: &grad_slots,
        };
        let grads = op.backward(&mut cx, &saved, &grad_out)?;
        if grads.len() != input_ids.len() {
            return Err(EngineError::Backward {
                node: node.name.clone(),
                message: format!("{} gradients for {} inputs", grads.len(), input_ids.len()),
            }
            .into());
        }
        let name = node.name.clone();
        let mut held = Held::default();
        let mut leaf_parts: Vec<(usize, Tensor)> = Vec::new();
        let mut others: Vec<Tensor> = saved_inputs.into_iter().flatten().collect();
        others.extend(own);
        others.push(grad_out);
        for (slot, g) in grads.into_iter().enumerate() {
            let Some(g) = g else { continue };
            let j = input_ids[slot];
            let input = &self.graph.nodes[j];
            if g.shape() != input.shape.as_slice() {
                return Err(EngineError::Backward {
                    node: name,
                    message: format!(
                        "gradient of input {slot} ({}) has shape {:?}, expected {:?}",
                        input.name,
                        g.shape(),
                        input.shape
                    ),
                }
                .into());
            }
            if input.is_leaf() {
                // A recomputation's contributions were summed the first time.
                if first && let Some(gi) = self.layout.grad[j] {
                    leaf_parts.push((gi, g));
                }
            } else if self.layout.bwd[j].is_some() {
                let g = own_storage(g, &others, &held.tensors, Category::Temporaries, &name)?;
                held.tensors.push(g);
                held.grad_slots.push(slot);
            }
        }
        others.extend(held.tensors.iter().cloned());
        for (gi, g) in leaf_parts {
            self.write_gradient(gi, g, &others, &name)?;
        }
        Ok(held)
    }

    /// Sums a contribution into a gradient buffer. The first one becomes the buffer (moved
    /// in, or copied when it is not the op's own gradient tensor), as in the engine's
    /// backward; the next ones are added in place, in the engine's order. A host copy of the
    /// buffer is stale afterwards and is released.
    pub(super) fn write_gradient(
        &mut self,
        gi: usize,
        g: Tensor,
        others: &[Tensor],
        name: &str,
    ) -> Result<(), PlanExecError> {
        self.drop_host_copy(gi)?;
        let state = &mut self.states[gi];
        let held = state.held.as_mut().ok_or_else(|| {
            PlanExecError::Invalid(format!(
                "{} is not on the device for {name}'s backward",
                self.layout.items[gi].name
            ))
        })?;
        match held.tensors.first() {
            Some(acc) => add_in_place(acc, &g, &self.layout.items[gi].name)?,
            None => {
                let shared = others.iter().any(|o| o.same_storage(&g));
                let g = if shared || g.category() != Category::Gradients {
                    g.deep_copy(Category::Gradients)
                        .map_err(|e| e.at(&self.layout.items[gi].name))?
                } else {
                    g
                };
                held.reservation = None;
                held.tensors.push(g);
            }
        }
        state.written = true;
        Ok(())
    }

    /// Moves a written gradient buffer's tensor to the leaf's finished gradient.
    pub(super) fn take_gradient(&mut self, gi: usize) {
        let ItemKind::Grad { leaf } = self.layout.items[gi].kind else {
            return;
        };
        let state = &mut self.states[gi];
        if !state.written {
            return;
        }
        if let Some(t) = state.held.as_mut().and_then(|h| h.tensors.pop()) {
            self.leaf_grads[leaf] = Some(t);
        }
    }
}

/// `t` itself when its storage is its own, else a copy: an op may return a view of an input
/// (reshape) or the incoming gradient (add's backward), but every item's tensor must own
/// its bytes so that freeing it frees exactly them.
fn own_storage(
    t: Tensor,
    inputs: &[Tensor],
    earlier: &[Tensor],
    category: Category,
    name: &str,
) -> Result<Tensor, PlanExecError> {
    let shared = inputs.iter().chain(earlier).any(|o| o.same_storage(&t));
    if !shared {
        return Ok(t);
    }
    Ok(t.deep_copy(category).map_err(|e| e.at(name))?)
}
