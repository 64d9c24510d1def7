//! Runs a training step by a plan: the plan's steps, in order, on the engine's ops. This
//! file holds the runner and its dispatch; an item's forward and backward op are in
//! [`passes`], its moves to and from the host store in [`swap`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use remat_planner::Step;

use super::PlanExecError;
use super::layout::{ItemKind, Layout};
use crate::core::dtype::DType;
use crate::core::error::EngineError;
use crate::core::graph::Graph;
use crate::core::pool::{Category, MemoryPool, Reservation};
use crate::core::rng::RngState;
use crate::core::swap::{CopyEngine, SlotId, Transfer};
use crate::core::tensor::Tensor;

mod passes;
mod swap;

/// Measurements of one item in one run (the profiler reads them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ItemMeasure {
    /// Wall time of the item's first computation in this run.
    pub time: Duration,
    /// Bytes of the item's tensor(s) after it ran.
    pub output_bytes: u64,
    /// Pool bytes beyond the inputs and the output at the peak of the run of the item.
    pub workspace_bytes: u64,
    /// How many tensors the item holds (a forward's value plus its aux tensors).
    pub tensors: usize,
    pub computed: bool,
}

/// What one executed step reports.
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    /// The loss value (its first computation; the last loss when the step has several).
    pub loss: Option<f64>,
    /// Every loss root's value, in [`super::Layout::losses`] order.
    pub losses: Vec<Option<f64>>,
    /// Every element of every loss root, in [`super::Layout::losses`] order (a fused unit
    /// of K models has a `[K]` loss, one element per model).
    pub loss_values: Vec<Vec<f64>>,
    /// The pool's peak during the step, static memory included.
    pub peak_bytes: u64,
    /// Pool bytes live when the step started (parameters, inputs, optimizer state, ...).
    pub static_bytes: u64,
    pub step_time: Duration,
    /// Time the compute thread waited for copies (a prefetch not done, a swap-out to finish).
    pub stall: Duration,
    /// Each wait behind `stall`: the item waited for (a prefetch or a swap-out) and how
    /// long, in the order they happened.
    pub stalls: Vec<(usize, Duration)>,
    /// Computations beyond the first of each item.
    pub recomputed_items: usize,
    pub swapped_out_bytes: u64,
    pub swapped_in_bytes: u64,
    /// Per item (profiling runs only).
    pub items: Vec<ItemMeasure>,
    /// Pool bytes live after each plan step (when asked for).
    pub timeline: Vec<u64>,
}

impl StepReport {
    /// The stall time per owner (`owners[item]`, as [`super::Layout::item_owners`] gives
    /// them): entry `k` is what the step waited for copies of model `k`'s tensors; the last
    /// entry, index `models`, is the waits on shared tensors (no owner, or one >= `models`).
    pub fn stall_by_owner(&self, owners: &[Option<usize>], models: usize) -> Vec<Duration> {
        let mut out = vec![Duration::ZERO; models + 1];
        for &(item, stall) in &self.stalls {
            let k = owners
                .get(item)
                .copied()
                .flatten()
                .filter(|&k| k < models)
                .unwrap_or(models);
            out[k] += stall;
        }
        out
    }
}

/// How to run.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunOptions {
    /// Measure every item's time and workspace (resets the pool's peak around each item).
    pub measure_items: bool,
    /// Record the pool's live bytes after every step ([`StepReport::timeline`]).
    pub timeline: bool,
}

/// Where a swapped tensor's pieces live on the host.
#[derive(Debug)]
struct HostCopy {
    slots: Vec<SlotId>,
    metas: Vec<(Vec<usize>, DType, Category)>,
    grad_slots: Vec<usize>,
}

/// The device-side tensor(s) of an item.
#[derive(Debug, Default)]
struct Held {
    tensors: Vec<Tensor>,
    /// Backward items: the input slot of each gradient in `tensors`.
    grad_slots: Vec<usize>,
    /// Workspace items: the reserved bytes (taken away while their op runs).
    reservation: Option<Reservation>,
}

#[derive(Default)]
struct ItemState {
    held: Option<Held>,
    /// A prefetch in flight, with the gradient slots of its tensors (backward items).
    incoming: Option<(Vec<Transfer<Tensor>>, Vec<usize>)>,
    outgoing: Option<Vec<Transfer<(SlotId, Tensor)>>>,
    host: Option<HostCopy>,
    computations: u32,
    /// Gradient buffers: a contribution has been summed in (it cannot be recomputed now).
    written: bool,
}

/// The executor of one step.
struct Runner<'a> {
    graph: &'a mut Graph,
    layout: &'a Layout,
    copy: Option<&'a CopyEngine>,
    pool: Arc<MemoryPool>,
    states: Vec<ItemState>,
    rng: Vec<Vec<RngState>>,
    /// Finished gradients of the leaves, taken from their buffers at the end of the step.
    leaf_grads: Vec<Option<Tensor>>,
    /// Whether the end-of-step item has run (gradient buffers are complete then).
    ended: bool,
    /// Step index of the last `SwapIn` of each item (its host copy is released with it).
    last_swap_in: Vec<Option<usize>>,
    report: StepReport,
    peak: u64,
    opts: RunOptions,
}

/// Runs one training step of `graph` by `steps` (a plan's schedule over `layout`'s items).
/// Leaf gradients end up in the graph (`Graph::grad`), as after `Graph::backward`.
pub fn run_steps(
    graph: &mut Graph,
    layout: &Layout,
    steps: &[Step],
    copy: Option<&CopyEngine>,
    opts: RunOptions,
) -> Result<StepReport, PlanExecError> {
    let ctx = graph.ctx.clone();
    ctx.install(|| {
        let mut runner = Runner::new(graph, layout, steps, copy, opts)?;
        let result = runner.run(steps);
        let finished = runner.finish();
        result.and(finished)
    })
}

impl<'a> Runner<'a> {
    fn new(
        graph: &'a mut Graph,
        layout: &'a Layout,
        steps: &[Step],
        copy: Option<&'a CopyEngine>,
        opts: RunOptions,
    ) -> Result<Self, PlanExecError> {
        let pool = Arc::clone(graph.ctx.pool());
        let n = layout.items.len();
        let mut last_swap_in = vec![None; n];
        for (k, step) in steps.iter().enumerate() {
            if let Step::SwapIn { tensor } = *step
                && tensor < n
            {
                last_swap_in[tensor] = Some(k);
            }
        }
        super::check_plan(layout, steps)?;
        for &j in &layout.grad_leaves {
            // A step's gradients replace the previous step's (take them out before running
            // to keep them): the plan allocates their buffers as it goes.
            graph.nodes[j].grad = None;
        }
        pool.reset_peak();
        let static_bytes = pool.live();
        Ok(Runner {
            leaf_grads: vec![None; layout.fwd.len()],
            ended: false,
            graph,
            layout,
            copy,
            states: (0..n).map(|_| ItemState::default()).collect(),
            rng: vec![Vec::new(); layout.fwd.len()],
            last_swap_in,
            report: StepReport {
                static_bytes,
                items: vec![ItemMeasure::default(); if opts.measure_items { n } else { 0 }],
                losses: vec![None; layout.losses.len()],
                loss_values: vec![Vec::new(); layout.losses.len()],
                ..StepReport::default()
            },
            peak: static_bytes,
            pool,
            opts,
        })
    }

    fn run(&mut self, steps: &[Step]) -> Result<(), PlanExecError> {
        let start = Instant::now();
        for (k, &step) in steps.iter().enumerate() {
            let item = match step {
                Step::Compute { node } => node,
                Step::Free { tensor } | Step::SwapOut { tensor } | Step::SwapIn { tensor } => {
                    tensor
                }
            };
            if item >= self.layout.items.len() {
                return Err(PlanExecError::UnknownItem {
                    step: k,
                    item,
                    items: self.layout.items.len(),
                });
            }
            match step {
                Step::Compute { .. } => self.compute(k, item)?,
                Step::Free { .. } => self.free(k, item)?,
                Step::SwapOut { .. } => self.swap_out(k, item)?,
                Step::SwapIn { .. } => self.swap_in(k, item)?,
            }
            if self.opts.timeline {
                self.report.timeline.push(self.pool.live());
            }
        }
        self.report.step_time = start.elapsed();
        Ok(())
    }

    /// Drops whatever the plan left on the device, hands the leaf gradients to the graph.
    fn finish(&mut self) -> Result<StepReport, PlanExecError> {
        // Gradients only from a step that ran to its end: never partial ones.
        if self.ended {
            for &j in &self.layout.grad_leaves {
                if let Some(gi) = self.layout.grad[j] {
                    self.settle_incoming(gi)?;
                    self.take_gradient(gi);
                }
            }
        }
        for i in 0..self.states.len() {
            self.release(i)?;
            if let Some(host) = self.states[i].host.take()
                && let Some(copy) = self.copy
            {
                for slot in host.slots {
                    copy.store().release(slot)?;
                }
            }
        }
        self.peak = self.peak.max(self.pool.peak());
        for (j, grad) in self.leaf_grads.iter_mut().enumerate() {
            if let Some(g) = grad.take() {
                self.graph.nodes[j].grad = Some(g);
            }
        }
        let mut report = std::mem::take(&mut self.report);
        report.peak_bytes = self.peak;
        Ok(report)
    }

    fn name(&self, item: usize) -> &str {
        &self.layout.items[item].name
    }

    fn note_stall(&mut self, item: usize, stall: Duration) {
        self.report.stall += stall;
        if !stall.is_zero() {
            self.report.stalls.push((item, stall));
        }
    }

    fn require(&mut self, k: usize, item: usize, input: usize) -> Result<(), PlanExecError> {
        self.settle_incoming(input)?;
        if self.states[input].held.is_none() {
            return Err(PlanExecError::NotResident {
                step: k,
                item: self.name(item).to_string(),
                input: self.name(input).to_string(),
            });
        }
        Ok(())
    }

    fn compute(&mut self, k: usize, item: usize) -> Result<(), PlanExecError> {
        if self.states[item].written {
            return Err(PlanExecError::GradientLost {
                step: k,
                item: self.name(item).to_string(),
                action: "recomputing",
            });
        }
        if self.states[item].held.is_some() || self.states[item].incoming.is_some() {
            return Err(PlanExecError::AlreadyResident {
                step: k,
                item: self.name(item).to_string(),
            });
        }
        let inputs = self.layout.items[item].inputs.clone();
        for &input in &inputs {
            self.require(k, item, input)?;
        }
        let measure = self.opts.measure_items;
        let live_before = self.pool.live();
        if measure {
            self.peak = self.peak.max(self.pool.peak());
            self.pool.reset_peak();
        }
        // Reserved bytes read by this item (its workspace, the gradient buffers it writes
        // first): give them to the op, which allocates its own.
        let reserved: Vec<usize> = inputs
            .iter()
            .copied()
            .filter(|&i| {
                self.states[i]
                    .held
                    .as_ref()
                    .is_some_and(|h| h.reservation.is_some())
            })
            .collect();
        for &w in &reserved {
            if let Some(held) = self.states[w].held.as_mut() {
                held.reservation = None;
            }
        }
        let start = Instant::now();
        let first = self.states[item].computations == 0;
        let held = match self.layout.items[item].kind {
            ItemKind::Forward { node } => self.forward(node, first)?,
            ItemKind::Backward { node } => self.backward(node, first)?,
            ItemKind::Workspace { .. } | ItemKind::Grad { .. } => self.reserve(item)?,
            ItemKind::End => {
                self.ended = true;
                Held::default()
            }
        };
        let elapsed = start.elapsed();
        // A workspace is reserved again until the plan frees it; a gradient buffer the op
        // did not write (no contribution) too.
        for &w in &reserved {
            let unwritten = self.states[w]
                .held
                .as_ref()
                .is_some_and(|h| h.tensors.is_empty());
            if unwritten {
                let reservation = self.reserve(w)?.reservation;
                if let Some(held) = self.states[w].held.as_mut() {
                    held.reservation = reservation;
                }
            }
        }
        let output_bytes = held.tensors.iter().map(Tensor::bytes).sum::<u64>()
            + held.reservation.as_ref().map_or(0, Reservation::bytes);
        if measure && first {
            let peak = self.pool.peak();
            self.report.items[item] = ItemMeasure {
                time: elapsed,
                output_bytes,
                workspace_bytes: peak.saturating_sub(live_before + output_bytes),
                tensors: held.tensors.len(),
                computed: true,
            };
        }
        if !first {
            self.report.recomputed_items += 1;
        }
        let state = &mut self.states[item];
        state.computations += 1;
        state.held = Some(held);
        Ok(())
    }

    /// The reserved bytes of a workspace or of a gradient buffer not written yet.
    fn reserve(&self, item: usize) -> Result<Held, PlanExecError> {
        let it = &self.layout.items[item];
        let (category, node) = match it.kind {
            ItemKind::Grad { leaf } => (Category::Gradients, Some(leaf)),
            _ => (Category::Temporaries, None),
        };
        let reservation = self
            .pool
            .reserve(it.reserved_bytes, category, node)
            .map_err(|e| e.at(&it.name))?;
        Ok(Held {
            reservation: Some(reservation),
            ..Held::default()
        })
    }

    /// The value of engine node `j` as an input: a leaf's own, or its forward item's.
    fn value_of(&self, j: usize) -> Result<Tensor, PlanExecError> {
        let node = &self.graph.nodes[j];
        if node.is_leaf() {
            return node.value.clone().ok_or_else(|| {
                PlanExecError::Engine(EngineError::NoValue {
                    node: node.name.clone(),
                    reason: "the graph input was released".into(),
                })
            });
        }
        let item = self.layout.fwd[j]
            .ok_or_else(|| PlanExecError::Invalid(format!("{} has no forward item", node.name)))?;
        self.states[item]
            .held
            .as_ref()
            .and_then(|h| h.tensors.first().cloned())
            .ok_or_else(|| {
                PlanExecError::Invalid(format!("value of {} is not on the device", node.name))
            })
    }

    /// A plan's `Free`: a written gradient buffer is handed to its leaf once the step has
    /// ended, and may be dropped before only when a current host copy exists (a plan that
    /// would lose it is refused up front by `check_plan`; this is the executor's own guard).
    fn free(&mut self, k: usize, item: usize) -> Result<(), PlanExecError> {
        if matches!(self.layout.items[item].kind, ItemKind::Grad { .. })
            && self.states[item].written
        {
            self.settle_incoming(item)?;
            if self.ended {
                self.take_gradient(item);
            } else if self.states[item].held.is_some()
                && self.states[item].host.is_none()
                && self.states[item].outgoing.is_none()
            {
                return Err(PlanExecError::GradientLost {
                    step: k,
                    item: self.name(item).to_string(),
                    action: "freeing",
                });
            }
        }
        self.release(item)
    }

    /// Drops an item's device bytes (after its copies in flight).
    fn release(&mut self, item: usize) -> Result<(), PlanExecError> {
        self.settle_outgoing(item)?;
        self.settle_incoming(item)?;
        self.states[item].held = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stalls_are_summed_per_owner_and_shared_last() {
        let ms = Duration::from_millis;
        let report = StepReport {
            stalls: vec![(0, ms(1)), (2, ms(4)), (1, ms(2)), (0, ms(8)), (3, ms(16))],
            ..StepReport::default()
        };
        // Items 0 and 1 belong to models 0 and 1, item 2 is shared, item 3 names a model
        // beyond K (counted as shared).
        let owners = [Some(0), Some(1), None, Some(5)];
        assert_eq!(
            report.stall_by_owner(&owners, 2),
            vec![ms(9), ms(2), ms(20)]
        );
    }
}
