//! Backward: walks the arena in reverse index order, rebuilding dropped values on demand,
//! accumulating gradients in a fixed order, and freeing every value right after its last
//! backward use (under [`RebuildMode::FreeAfterUse`], a rebuilt checkpoint value right after
//! the node that read it).
//!
//! [`RebuildMode::FreeAfterUse`]: crate::core::checkpoint::RebuildMode::FreeAfterUse

use std::time::Instant;

use super::forward::saved_view;
use super::{Graph, NodeId};
use crate::core::dtype::Element;
use crate::core::elementwise;
use crate::core::error::{EngineError, Result};
use crate::core::op::{OpCtx, Phase, RngSource};
use crate::core::pool::Category;
use crate::core::tensor::Tensor;
use crate::float_dispatch;

impl Graph {
    /// Backpropagates from `loss`, seeding its gradient with ones.
    pub fn backward(&mut self, loss: NodeId) -> Result<()> {
        self.check_not_spent("backward")?;
        let seed = self.ones_seed(loss)?;
        self.backward_with(loss, seed)
    }

    /// Backpropagates from several losses at once (K models recorded into one graph, each
    /// with its own loss), seeding each with ones. No sum node joins them: each loss is its
    /// own root, so a node receives gradients only from the losses it feeds, accumulated
    /// in the order one model's backward alone would use.
    pub fn backward_many(&mut self, losses: &[NodeId]) -> Result<()> {
        self.check_not_spent("backward")?;
        let mut seen = std::collections::HashSet::new();
        let mut seeds = Vec::with_capacity(losses.len());
        for &loss in losses {
            if !seen.insert(loss) {
                return Err(EngineError::Invalid(format!(
                    "{} is given twice as a loss of one backward",
                    self.node(loss)?.name
                )));
            }
            self.check_root(loss, &self.node(loss)?.shape.clone())?;
            seeds.push((loss.0, self.ones_seed(loss)?));
        }
        let Some(last) = seeds.iter().map(|s| s.0).max() else {
            return Err(EngineError::Invalid(
                "backward needs at least one loss".into(),
            ));
        };
        let ctx = self.ctx.clone();
        self.spent = true;
        ctx.install(|| self.backward_roots(last, seeds))
    }

    /// A tensor of ones shaped like `loss` (the seed of its gradient).
    fn ones_seed(&self, loss: NodeId) -> Result<Tensor> {
        let node = self.node(loss)?;
        let seed = Tensor::zeros(
            self.ctx.pool(),
            &node.shape,
            node.dtype,
            Category::Temporaries,
            Some(loss.0),
        )
        .map_err(|e| e.at(&node.name))?;
        float_dispatch!(node.dtype, "backward seed", T => {
            seed.write().as_mut_slice::<T>()?.fill(T::ONE);
            Ok(())
        })?;
        Ok(seed)
    }

    /// A root must have run forward, and its seed must match its shape.
    fn check_root(&self, node: NodeId, seed_shape: &[usize]) -> Result<()> {
        let root = self.node(node)?;
        if !root.executed {
            return Err(EngineError::NoValue {
                node: root.name.clone(),
                reason: "forward has not run it".into(),
            });
        }
        if seed_shape != root.shape.as_slice() {
            return Err(EngineError::Shape {
                node: root.name.clone(),
                message: format!(
                    "seed gradient has shape {:?}, node has {:?}",
                    seed_shape, root.shape
                ),
            });
        }
        Ok(())
    }

    /// Backpropagates from `node` with the given gradient of its output.
    pub fn backward_with(&mut self, node: NodeId, grad: Tensor) -> Result<()> {
        self.check_not_spent("backward")?;
        self.check_root(node, grad.shape())?;
        let ctx = self.ctx.clone();
        self.spent = true;
        ctx.install(|| self.backward_roots(node.0, vec![(node.0, grad)]))
    }

    /// Seeds every root, then walks back from the last one.
    fn backward_roots(&mut self, last: usize, seeds: Vec<(usize, Tensor)>) -> Result<()> {
        let result = (|| {
            for (root, seed) in seeds {
                self.accumulate(root, seed)?;
            }
            (0..=last).rev().try_for_each(|c| self.backward_node(c))
        })();
        // Whatever the outcome, no activation outlives backward.
        for node in self.nodes.iter_mut().filter(|n| !n.is_leaf()) {
            node.value = None;
            node.aux.clear();
            node.grad = None;
        }
        result
    }

    fn backward_node(&mut self, c: usize) -> Result<()> {
        let node = &self.nodes[c];
        if node.is_leaf() || !node.requires_grad {
            return Ok(());
        }
        let Some(grad_out) = self.nodes[c].grad.take() else {
            self.release_backward_uses(c);
            return Ok(());
        };
        let node = &self.nodes[c];
        let Some(op) = node.op() else { return Ok(()) };
        let mut needed: Vec<usize> = node
            .inputs
            .iter()
            .enumerate()
            .filter(|(slot, _)| op.saves_input(*slot))
            .map(|(_, j)| j.0)
            .collect();
        if op.saves_output() {
            needed.push(c);
        }
        let needed_aux: Vec<usize> = if node.aux_count > 0 {
            vec![c]
        } else {
            Vec::new()
        };
        self.rebuild(&needed, &needed_aux)?;
        self.run_backward(c, &grad_out)?;
        drop(grad_out);
        self.release_backward_uses(c);
        Ok(())
    }

    fn run_backward(&mut self, c: usize, grad_out: &Tensor) -> Result<()> {
        let node = &self.nodes[c];
        let op = node.op_or_leaf_error()?;
        for (slot, j) in node.inputs.iter().enumerate() {
            if op.saves_input(slot) {
                self.check_value_version(c, j.0, slot)?;
            }
        }
        if op.saves_output() {
            self.check_value_version(c, c, 0)?;
        }
        if let Some(obs) = self.observer.as_mut() {
            obs.before_node(Phase::Backward, NodeId(c));
        }
        let start = Instant::now();
        let grad_slots: Vec<(bool, bool)> = node
            .inputs
            .iter()
            .map(|j| {
                let n = &self.nodes[j.0];
                (n.requires_grad, n.is_leaf())
            })
            .collect();
        let saved = saved_view(self, c)?;
        let mut cx = OpCtx {
            pool: self.ctx.pool(),
            node: c,
            node_name: &node.name,
            phase: Phase::Backward,
            threads: self.ctx.threads(),
            rng: RngSource::Backward { saved: &node.rng },
            grad_slots: &grad_slots,
        };
        let grads = op.backward(&mut cx, &saved, grad_out)?;
        if grads.len() != node.inputs.len() {
            return Err(EngineError::Backward {
                node: node.name.clone(),
                message: format!("{} gradients for {} inputs", grads.len(), node.inputs.len()),
            });
        }
        let inputs = node.inputs.clone();
        let elapsed = start.elapsed();
        drop(saved);
        for (slot, (j, g)) in inputs.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let input = &self.nodes[j.0];
            if g.shape() != input.shape.as_slice() {
                return Err(EngineError::Backward {
                    node: self.nodes[c].name.clone(),
                    message: format!(
                        "gradient of input {slot} ({}) has shape {:?}, expected {:?}",
                        input.name,
                        g.shape(),
                        input.shape
                    ),
                });
            }
            self.accumulate(j.0, g)?;
        }
        self.stats.backward_nodes += 1;
        self.notify_after(c, Phase::Backward, elapsed);
        Ok(())
    }

    /// Adds `g` to node `j`'s gradient. The first contribution is moved in; a leaf's
    /// gradient is always charged as [`Category::Gradients`].
    fn accumulate(&mut self, j: usize, g: Tensor) -> Result<()> {
        let node = &self.nodes[j];
        if !node.requires_grad {
            return Ok(());
        }
        let category = if node.is_leaf() {
            Category::Gradients
        } else {
            Category::Temporaries
        };
        let g = if g.category() != category && node.grad.is_none() {
            g.deep_copy(category).map_err(|e| e.at(&node.name))?
        } else {
            g
        };
        let name = node.name.clone();
        let sum = match self.nodes[j].grad.take() {
            None => g,
            Some(acc) => add_grads(acc, &g, &name)?,
        };
        self.nodes[j].grad = Some(sum);
        Ok(())
    }

    /// One backward read of each value node `c` declared is done; free those with none left.
    fn release_backward_uses(&mut self, c: usize) {
        for j in self.backward_reads(c) {
            let left = self.plan.bwd_remaining[j].saturating_sub(1);
            self.plan.bwd_remaining[j] = left;
            if self.frees_after_use(j) {
                // Its own backward (later) rebuilds it, aux tensors included.
                self.nodes[j].value = None;
                self.nodes[j].aux.clear();
            } else if left == 0 && !self.nodes[j].is_leaf() {
                self.nodes[j].value = None;
            }
        }
        self.nodes[c].aux.clear();
        if self.plan.bwd_remaining[c] == 0 {
            self.nodes[c].value = None;
        }
    }
}

/// `acc + g`, in place when `acc` owns its storage.
fn add_grads(acc: Tensor, g: &Tensor, name: &str) -> Result<Tensor> {
    let out = if acc.storage_refs() == 1 {
        acc
    } else {
        acc.deep_copy(acc.category()).map_err(|e| e.at(name))?
    };
    float_dispatch!(out.dtype(), "gradient accumulation", T => {
        let src = g.read();
        let src = src.as_slice::<T>()?;
        let mut dst = out.write();
        elementwise::update(dst.as_mut_slice::<T>()?, src, |a: T, b: T| a + b);
        Ok::<(), EngineError>(())
    })?;
    Ok(out)
}
