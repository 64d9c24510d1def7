//! The shared lowering from per-tensor [`Decision`]s to an explicit schedule.
//!
//! Nodes run in graph order. Around each node `v` the lowering emits, in this order:
//! 1. `Free` for swapped-out tensors whose copy has completed by now (the device bytes of a
//!    swap are released as soon as the copy is done, never earlier, so nothing waits);
//! 2. `SwapIn` for the tensors whose prefetch prompt is `v` (a tensor whose copy-out is
//!    still running is simply kept: there is nothing to fetch);
//! 3. for each input of `v` not on the device, its rematerialization: a swap-in if it has a
//!    host copy, else the recomputation of it and of every missing ancestor, in graph order,
//!    freeing each helper right after its last read inside the chain;
//! 4. `Compute(v)`;
//! 5. `Free` for the tensors whose last use is `v` and for Recompute tensors dropped after
//!    `v`, and `SwapOut` for Swap tensors swapped out after `v`.
//!
//! It drives a [`Machine`] while it emits, so the completion times it reads are the
//! simulator's own.

use crate::error::{PlanError, SimError};
use crate::ir::{Graph, NodeId};
use crate::plan::{Decision, Step};
use crate::sim::Machine;

/// A lowered schedule, with the recompute sources filled in from what the chains used.
#[derive(Clone, Debug)]
pub struct Lowered {
    pub steps: Vec<Step>,
    pub decisions: Vec<Decision>,
}

/// Lowers decisions (one per tensor) into a schedule at `bandwidth` bytes per second.
pub fn lower(graph: &Graph, decisions: &[Decision], bandwidth: f64) -> Result<Lowered, PlanError> {
    lower_with(graph, decisions, bandwidth, Helpers::Free)
}

/// What happens to a tensor recomputed only as a helper of another recomputation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Helpers {
    /// Freed right after its last read in the chain, recomputed again when needed: the
    /// accounting of MuTWO's recomp_cnt (least memory).
    #[default]
    Free,
    /// Kept until its own last use when it is itself a dropped tensor needed later: a
    /// checkpointed segment is replayed once and its activations serve the segment's whole
    /// backward, as in Chen et al. and PyTorch's checkpoint (least time).
    KeepNeeded,
}

/// [`lower`] with a choice of what happens to recompute helpers.
pub fn lower_with(
    graph: &Graph,
    decisions: &[Decision],
    bandwidth: f64,
    helpers: Helpers,
) -> Result<Lowered, PlanError> {
    if decisions.len() != graph.len() {
        return Err(PlanError::BadDecision {
            tensor: graph.name().to_string(),
            why: format!("{} decisions for {} tensors", decisions.len(), graph.len()),
        });
    }
    let mut lowerer = Lowerer::new(graph, decisions, bandwidth)?;
    lowerer.helpers = helpers;
    for v in 0..graph.len() {
        lowerer
            .node(v)
            .map_err(|error| PlanError::InvalidSchedule {
                strategy: "lowering".into(),
                error,
            })?;
    }
    Ok(Lowered {
        steps: lowerer.steps,
        decisions: lowerer.decisions,
    })
}

struct Lowerer<'g> {
    graph: &'g Graph,
    machine: Machine<'g>,
    steps: Vec<Step>,
    decisions: Vec<Decision>,
    /// Tensors swapped out whose device bytes are still held.
    pending_frees: Vec<NodeId>,
    prefetch_at: Vec<Vec<NodeId>>,
    swap_out_after: Vec<Vec<NodeId>>,
    drop_after: Vec<Vec<NodeId>>,
    /// `freed_after[v]`: tensors whose last use is `v`.
    freed_after: Vec<Vec<NodeId>>,
    scratch: Scratch,
    helpers: Helpers,
    /// The node whose inputs are being prepared.
    current: NodeId,
}

impl<'g> Lowerer<'g> {
    fn new(
        graph: &'g Graph,
        decisions: &[Decision],
        bandwidth: f64,
    ) -> Result<Lowerer<'g>, PlanError> {
        let machine =
            Machine::new(graph, bandwidth).map_err(|error| PlanError::InvalidSchedule {
                strategy: "lowering".into(),
                error,
            })?;
        let n = graph.len();
        let mut lowerer = Lowerer {
            graph,
            machine,
            steps: Vec::with_capacity(3 * n),
            decisions: decisions.to_vec(),
            pending_frees: Vec::new(),
            prefetch_at: vec![Vec::new(); n],
            swap_out_after: vec![Vec::new(); n],
            drop_after: vec![Vec::new(); n],
            freed_after: vec![Vec::new(); n],
            scratch: Scratch::new(n),
            helpers: Helpers::Free,
            current: 0,
        };
        for (t, decision) in decisions.iter().enumerate() {
            lowerer.freed_after[graph.last_use(t)].push(t);
            match *decision {
                Decision::Keep => {}
                Decision::Swap {
                    swap_out_after,
                    prefetch_at,
                    use_at,
                } => {
                    check_window(graph, t, swap_out_after, use_at)?;
                    if prefetch_at <= swap_out_after || prefetch_at > use_at {
                        return Err(bad(
                            graph,
                            t,
                            format!(
                                "prefetch_at {prefetch_at} must be after swap_out_after {swap_out_after} and at most use_at {use_at}"
                            ),
                        ));
                    }
                    lowerer.swap_out_after[swap_out_after].push(t);
                    lowerer.prefetch_at[prefetch_at].push(t);
                }
                Decision::Recompute {
                    drop_after, use_at, ..
                } => {
                    check_window(graph, t, drop_after, use_at)?;
                    lowerer.drop_after[drop_after].push(t);
                }
            }
        }
        Ok(lowerer)
    }

    fn emit(&mut self, step: Step) -> Result<(), SimError> {
        self.machine.apply(step)?;
        self.steps.push(step);
        Ok(())
    }

    fn node(&mut self, v: NodeId) -> Result<(), SimError> {
        self.current = v;
        self.release_finished_swaps()?;
        for t in std::mem::take(&mut self.prefetch_at[v]) {
            if let Some(pos) = self.pending_frees.iter().position(|&p| p == t) {
                self.pending_frees.swap_remove(pos);
            } else if !self.machine.is_on_device(t) {
                self.emit(Step::SwapIn { tensor: t })?;
            }
        }
        let inputs = self.graph.node(v).inputs.clone();
        for &u in &inputs {
            self.rematerialize(u, &inputs)?;
        }
        self.emit(Step::Compute { node: v })?;
        for t in std::mem::take(&mut self.freed_after[v]) {
            if self.machine.is_on_device(t) {
                self.emit(Step::Free { tensor: t })?;
            }
        }
        for t in std::mem::take(&mut self.drop_after[v]) {
            if self.machine.is_on_device(t) {
                self.emit(Step::Free { tensor: t })?;
            }
        }
        for t in std::mem::take(&mut self.swap_out_after[v]) {
            self.emit(Step::SwapOut { tensor: t })?;
            self.pending_frees.push(t);
        }
        Ok(())
    }

    fn release_finished_swaps(&mut self) -> Result<(), SimError> {
        let now = self.machine.now();
        let mut i = 0;
        while i < self.pending_frees.len() {
            let t = self.pending_frees[i];
            if self.machine.swap_out_done_at(t).is_some_and(|d| d <= now) {
                self.pending_frees.swap_remove(i);
                self.emit(Step::Free { tensor: t })?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Brings `u` back on the device for a node whose inputs are `keep`.
    fn rematerialize(&mut self, u: NodeId, keep: &[NodeId]) -> Result<(), SimError> {
        if self.machine.is_on_device(u) {
            return Ok(());
        }
        if self.machine.has_host_copy(u) {
            return self.emit(Step::SwapIn { tensor: u });
        }
        let (chain, fetched, sources) = self.missing_ancestors(u);
        for &t in &fetched {
            self.emit(Step::SwapIn { tensor: t })?;
        }
        // Reads of each temporary tensor still to come inside the chain; a temporary (a
        // recomputed helper or a fetched tensor) is freed after its last one.
        for &x in &chain {
            for &i in &self.graph.node(x).inputs {
                self.scratch.reads_left[i] += 1;
            }
        }
        for &x in &chain {
            self.emit(Step::Compute { node: x })?;
            for &i in &self.graph.node(x).inputs {
                self.scratch.reads_left[i] -= 1;
                let temporary = self.scratch.is_temporary(i);
                let needed_later = self.helpers == Helpers::KeepNeeded
                    && matches!(self.decisions[i], Decision::Recompute { use_at, .. } if use_at > self.current);
                if self.scratch.reads_left[i] == 0
                    && temporary
                    && i != u
                    && !keep.contains(&i)
                    && !needed_later
                {
                    self.emit(Step::Free { tensor: i })?;
                }
            }
        }
        if let Decision::Recompute { from, .. } = &mut self.decisions[u] {
            *from = sources;
        }
        Ok(())
    }

    /// The nodes to recompute for `u` (ascending, `u` last), the tensors to swap in for
    /// them, and the on-device tensors they start from. Marks the first two as temporary.
    fn missing_ancestors(&mut self, u: NodeId) -> (Vec<NodeId>, Vec<NodeId>, Vec<NodeId>) {
        let scratch = &mut self.scratch;
        scratch.epoch += 1;
        let epoch = scratch.epoch;
        let mut chain = vec![u];
        let mut fetched = Vec::new();
        let mut sources = Vec::new();
        scratch.seen[u] = epoch;
        scratch.temporary[u] = epoch;
        let mut stack = vec![u];
        while let Some(x) = stack.pop() {
            for &i in &self.graph.node(x).inputs {
                if scratch.seen[i] == epoch {
                    continue;
                }
                scratch.seen[i] = epoch;
                if self.machine.is_on_device(i) {
                    sources.push(i);
                } else if self.machine.has_host_copy(i) {
                    scratch.temporary[i] = epoch;
                    fetched.push(i);
                } else {
                    scratch.temporary[i] = epoch;
                    chain.push(i);
                    stack.push(i);
                }
            }
        }
        chain.sort_unstable();
        fetched.sort_unstable();
        sources.sort_unstable();
        (chain, fetched, sources)
    }
}

/// Per-node scratch marks reused across rematerializations, so a chain costs time in its
/// own length rather than in the graph's size.
struct Scratch {
    epoch: u32,
    seen: Vec<u32>,
    temporary: Vec<u32>,
    reads_left: Vec<u32>,
}

impl Scratch {
    fn new(n: usize) -> Scratch {
        Scratch {
            epoch: 0,
            seen: vec![0; n],
            temporary: vec![0; n],
            reads_left: vec![0; n],
        }
    }
    fn is_temporary(&self, t: NodeId) -> bool {
        self.temporary[t] == self.epoch
    }
}

fn bad(graph: &Graph, t: NodeId, why: String) -> PlanError {
    PlanError::BadDecision {
        tensor: graph.node(t).name.clone(),
        why,
    }
}

/// A drop/restore window must span two consecutive accesses of the tensor.
fn check_window(graph: &Graph, t: NodeId, start: NodeId, use_at: NodeId) -> Result<(), PlanError> {
    let is_access = |v: NodeId| v == t || graph.users(t).contains(&v);
    if !is_access(start) || !graph.users(t).contains(&use_at) || use_at <= start {
        return Err(bad(
            graph,
            t,
            format!("window {start}..{use_at} does not run from an access to a later reader"),
        ));
    }
    if let Some(&inside) = graph.users(t).iter().find(|&&r| r > start && r < use_at) {
        return Err(bad(
            graph,
            t,
            format!("node {inside} reads it inside its window {start}..{use_at}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Node, Phase};
    use crate::sim::simulate_steps;

    /// f0 -> f1 -> f2 -> loss -> b2 -> b1 -> b0, each backward node reading its forward twin.
    pub(crate) fn small_training_chain() -> Graph {
        let mut nodes = Vec::new();
        for i in 0..3 {
            nodes.push(Node {
                name: format!("f{i}"),
                phase: Phase::Forward,
                compute_time: 1.0,
                output_bytes: 10,
                inputs: if i == 0 { vec![] } else { vec![i - 1] },
            });
        }
        nodes.push(Node {
            name: "loss".into(),
            phase: Phase::Backward,
            compute_time: 1.0,
            output_bytes: 1,
            inputs: vec![2],
        });
        for (k, fw) in [2usize, 1, 0].into_iter().enumerate() {
            nodes.push(Node {
                name: format!("b{fw}"),
                phase: Phase::Backward,
                compute_time: 2.0,
                output_bytes: 10,
                inputs: vec![fw, 3 + k],
            });
        }
        Graph::new("chain", nodes, 0, 1.0).unwrap()
    }

    #[test]
    fn recompute_drops_and_rebuilds_from_kept_source() {
        let g = small_training_chain();
        let mut decisions = vec![Decision::Keep; g.len()];
        // f1 (node 1): last forward access f2 (2), first backward access b1 (5).
        decisions[1] = Decision::Recompute {
            from: vec![],
            drop_after: 2,
            use_at: 5,
        };
        let lowered = lower(&g, &decisions, 1.0).unwrap();
        let r = simulate_steps(&g, &lowered.steps, 1.0).unwrap();
        assert_eq!(r.recompute_time, 1.0);
        assert_eq!(
            lowered.decisions[1],
            Decision::Recompute {
                from: vec![0],
                drop_after: 2,
                use_at: 5
            }
        );
        let store_all = lower(&g, &vec![Decision::Keep; g.len()], 1.0).unwrap();
        let base = simulate_steps(&g, &store_all.steps, 1.0).unwrap();
        assert_eq!(base.peak_bytes, g.store_all_peak());
        assert!(r.peak_bytes < base.peak_bytes);
    }

    #[test]
    fn rejects_window_with_a_reader_inside() {
        let g = small_training_chain();
        let mut decisions = vec![Decision::Keep; g.len()];
        decisions[0] = Decision::Recompute {
            from: vec![],
            drop_after: 0,
            use_at: 6,
        };
        let err = lower(&g, &decisions, 1.0).unwrap_err();
        assert!(err.to_string().contains("f0"), "{err}");
    }
}
