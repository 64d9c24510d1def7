//! The eager-order plan form: the plans PyTorch's autograd runs as they are (issue 30,
//! item 4), checked step by step ([`check`]), their floor ([`floor`]), and any node-order
//! schedule put into the form ([`conform`]).
//!
//! Eager autograd runs the forward ops in their order and the backward in its own; a
//! runtime (saved-tensor hooks, `torch.utils.checkpoint`) decides only what happens to the
//! values autograd saves. So in the eager order, beyond the simulator's rules:
//!
//! 1. **Node order**: the first computations follow the graph's node order.
//! 2. **Held values**: a forward tensor stays on the device from its computation until its
//!    last forward reader has run (the model's code holds it until then); a backward
//!    tensor until its last reader (autograd holds it, nothing rebuilds or offloads it).
//!    [`crate::ir::Graph::eager_holds`] gives, per tensor, the node that releases it.
//! 3. **Recomputation only in the backward**: a recomputed node is a forward node, and its
//!    recomputation belongs to a *rebuild run*: recomputations (with frees and copies back
//!    between them) right before the first computation of a backward node, each read by
//!    that node, by a later backward node (a rebuild group, as `checkpoint` replays a
//!    segment at its first unpack), or by a later recomputation of the run (a producer
//!    replayed for it).
//! 4. **Offload right after the value is made**: a tensor's one copy to the host starts
//!    right after its first computation (no compute in between); backward tensors are not
//!    offloaded. A copy back (prefetch) may start any time after the value left, so it is
//!    ready before its backward reader.
//!
//! Rules 2 and 4 imply the rest of what the form needs: a value comes back only after its
//! forward readers (so only for backward readers or rebuilds), and nothing is rebuilt or
//! copied back during the forward for a forward reader.
//!
//! [`conform`] rewrites a valid node-order schedule into the form without changing what it
//! keeps, offloads or rebuilds where the form allows: it replays the schedule while holding
//! every held value, starts each offloaded value's copy at its producer, and rebuilds a
//! value it lacks right before the backward node that needs it. The result may need more
//! memory than the schedule it came from (the held values), which the simulator then
//! judges against the budget: strategies that plan with the form's holds in mind (the
//! eviction, the swaps of [`crate::solve::offload`]) lose nothing there.

use thiserror::Error;

use crate::ir::{Graph, NodeId, Phase};
use crate::plan::Step;

/// A schedule that breaks the eager form: the first broken step, the node or tensor and the
/// rule.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum EagerError {
    #[error(
        "step {step}: `{node}` is computed before `{expected}`: the eager order runs the operations in node order"
    )]
    OutOfOrder {
        step: usize,
        node: String,
        expected: String,
    },
    #[error(
        "step {step}: `{node}` is recomputed during the forward pass: the eager order recomputes only in the backward, right before a backward node that reads it"
    )]
    RecomputeInForward { step: usize, node: String },
    #[error(
        "step {step}: `{node}` is a backward node recomputed: the eager order recomputes only forward nodes (autograd runs each backward node once)"
    )]
    RecomputeBackwardNode { step: usize, node: String },
    #[error(
        "step {step}: `{node}` is recomputed before `{next}`, which is not a backward node: the eager order rebuilds values only right before a backward node that reads them"
    )]
    RebuildBeforeForwardNode {
        step: usize,
        node: String,
        next: String,
    },
    #[error(
        "step {step}: `{node}` is recomputed before `{next}`, but neither that node, a later backward node nor a later recomputation of the rebuild reads it"
    )]
    RebuildNotForReader {
        step: usize,
        node: String,
        next: String,
    },
    #[error(
        "step {step}: `{node}` is recomputed, but no backward node follows the rebuild: the eager order rebuilds values only right before a backward node that reads them"
    )]
    RebuildWithoutReader { step: usize, node: String },
    #[error(
        "step {step}: `{tensor}` leaves the device before `{holder}` has run: in the eager order a forward value stays until its last forward reader, a backward value until its last reader"
    )]
    HeldTensorFreed {
        step: usize,
        tensor: String,
        holder: String,
    },
    #[error(
        "step {step}: `{tensor}` is a backward value copied to the host: in the eager order only forward values are offloaded"
    )]
    BackwardOffloaded { step: usize, tensor: String },
    #[error(
        "step {step}: `{tensor}` is copied to the host, but not right after its first computation: in the eager order the copy starts right after the value is made, once"
    )]
    OffloadNotAtProducer { step: usize, tensor: String },
    #[error(
        "step {step}: `{node}` cannot be brought back for `{reader}` in the eager order: {why}"
    )]
    CannotRebuild {
        step: usize,
        node: String,
        reader: String,
        why: &'static str,
    },
    #[error("step {step}: names node {node}, which the graph does not have")]
    UnknownNode { step: usize, node: NodeId },
}

/// Checks `steps` against the eager form's rules (see the module docs), naming the first
/// broken step. The simulator's own rules (inputs resident, memory) are its business: run
/// both. Works on any graph with phases, marked eager or not.
pub fn check(graph: &Graph, steps: &[Step]) -> Result<(), EagerError> {
    Checker::new(graph).run(steps)
}

struct Checker<'g> {
    graph: &'g Graph,
    held_until: Vec<NodeId>,
    first_done: Vec<bool>,
    swapped_out: Vec<bool>,
    /// The next node whose first computation the node order expects.
    next_first: NodeId,
    backward_started: bool,
    /// The step of the last `Compute`, and whether it was a first computation.
    last_compute: Option<(NodeId, bool)>,
    /// The recomputations of the rebuild run in progress: (step, node).
    run: Vec<(usize, NodeId)>,
    /// `read_later[v] == stamp`: a recomputation after the one being checked reads `v`.
    read_later: Vec<usize>,
    stamp: usize,
}

impl<'g> Checker<'g> {
    fn new(graph: &'g Graph) -> Checker<'g> {
        let n = graph.len();
        Checker {
            graph,
            held_until: graph.eager_holds(),
            first_done: vec![false; n],
            swapped_out: vec![false; n],
            next_first: 0,
            backward_started: false,
            last_compute: None,
            run: Vec::new(),
            read_later: vec![0; n],
            stamp: 0,
        }
    }

    fn name(&self, id: NodeId) -> String {
        self.graph.node(id).name.clone()
    }

    fn run(mut self, steps: &[Step]) -> Result<(), EagerError> {
        for (step, &s) in steps.iter().enumerate() {
            let id = match s {
                Step::Compute { node } => node,
                Step::Free { tensor } | Step::SwapOut { tensor } | Step::SwapIn { tensor } => {
                    tensor
                }
            };
            if id >= self.graph.len() {
                return Err(EagerError::UnknownNode { step, node: id });
            }
            match s {
                Step::Compute { node } if !self.first_done[node] => self.first(step, node)?,
                Step::Compute { node } => self.recompute(step, node)?,
                Step::Free { tensor } => self.free(step, tensor)?,
                Step::SwapOut { tensor } => self.swap_out(step, tensor)?,
                Step::SwapIn { .. } => {}
            }
        }
        match self.run.first() {
            Some(&(step, node)) => Err(EagerError::RebuildWithoutReader {
                step,
                node: self.name(node),
            }),
            None => Ok(()),
        }
    }

    fn first(&mut self, step: usize, node: NodeId) -> Result<(), EagerError> {
        if node != self.next_first {
            return Err(EagerError::OutOfOrder {
                step,
                node: self.name(node),
                expected: self.name(self.next_first),
            });
        }
        let backward = self.graph.node(node).phase == Phase::Backward;
        self.backward_started |= backward;
        let run = std::mem::take(&mut self.run);
        if let Some(&(at, x)) = run.first()
            && !backward
        {
            return Err(EagerError::RebuildBeforeForwardNode {
                step: at,
                node: self.name(x),
                next: self.name(node),
            });
        }
        // Walked from its end, so that "read by a later recomputation of the run" is one
        // mark per input (runs thousands long rebuild whole chains); the first offender
        // in step order is the one reported.
        self.stamp += 1;
        let mut offender = None;
        for &(at, x) in run.iter().rev() {
            // Read by this node or a later backward node (first computations are in node
            // order, so a reader at or after `node` has not run yet), or by a later
            // recomputation of the run.
            let for_backward = self
                .graph
                .users(x)
                .iter()
                .any(|&u| u >= node && self.graph.node(u).phase == Phase::Backward);
            if !(for_backward || self.read_later[x] == self.stamp) {
                offender = Some((at, x));
            }
            for &i in &self.graph.node(x).inputs {
                self.read_later[i] = self.stamp;
            }
        }
        if let Some((at, x)) = offender {
            return Err(EagerError::RebuildNotForReader {
                step: at,
                node: self.name(x),
                next: self.name(node),
            });
        }
        self.first_done[node] = true;
        self.next_first += 1;
        self.last_compute = Some((node, true));
        Ok(())
    }

    fn recompute(&mut self, step: usize, node: NodeId) -> Result<(), EagerError> {
        if self.graph.node(node).phase == Phase::Backward {
            return Err(EagerError::RecomputeBackwardNode {
                step,
                node: self.name(node),
            });
        }
        if !self.backward_started {
            return Err(EagerError::RecomputeInForward {
                step,
                node: self.name(node),
            });
        }
        self.run.push((step, node));
        self.last_compute = Some((node, false));
        Ok(())
    }

    fn free(&mut self, step: usize, tensor: NodeId) -> Result<(), EagerError> {
        let holder = self.held_until[tensor];
        // Held from its first computation until the holder's; a free before the tensor's
        // first computation is the simulator's to refuse.
        if self.first_done[tensor] && holder != tensor && !self.first_done[holder] {
            return Err(EagerError::HeldTensorFreed {
                step,
                tensor: self.name(tensor),
                holder: self.name(holder),
            });
        }
        Ok(())
    }

    fn swap_out(&mut self, step: usize, tensor: NodeId) -> Result<(), EagerError> {
        if self.graph.node(tensor).phase == Phase::Backward {
            return Err(EagerError::BackwardOffloaded {
                step,
                tensor: self.name(tensor),
            });
        }
        if self.swapped_out[tensor] || self.last_compute != Some((tensor, true)) {
            return Err(EagerError::OffloadNotAtProducer {
                step,
                tensor: self.name(tensor),
            });
        }
        self.swapped_out[tensor] = true;
        Ok(())
    }
}

/// The least peak any eager-order schedule reaches: at each node's first computation, its
/// inputs and output and every tensor held then (computed before it, released by a node
/// after it; see [`Graph::eager_holds`]), plus static memory. Exact as a bound on what the
/// holds force; a budget under it has no eager plan, whatever is recomputed or offloaded.
pub fn floor(graph: &Graph) -> u64 {
    let n = graph.len();
    let held_until = graph.eager_holds();
    // held[k]: bytes of the tensors u < k < held_until[u], by a difference array.
    let mut delta = vec![0i128; n + 1];
    for (u, &h) in held_until.iter().enumerate() {
        if h > u + 1 {
            let bytes = i128::from(graph.node(u).output_bytes);
            delta[u + 1] += bytes;
            delta[h] -= bytes;
        }
    }
    let mut held = 0i128;
    let mut most = 0u64;
    for (k, node) in graph.nodes().iter().enumerate() {
        held += delta[k];
        // Held tensors are counted above; inputs that are not held yet are added here.
        let inputs: u64 = node
            .inputs
            .iter()
            .filter(|&&i| held_until[i] <= k)
            .map(|&i| graph.node(i).output_bytes)
            .sum();
        // The graph bounds the sum of every output plus static bytes by 2^64.
        let at = u64::try_from(held).unwrap_or(u64::MAX) + inputs + node.output_bytes;
        most = most.max(at);
    }
    graph.static_bytes() + most
}

/// Rewrites a valid node-order schedule of `graph` into the eager form (see the module
/// docs). The eager schedule follows `steps`, except that it frees no held value (a value
/// the schedule dropped while held leaves when its holder has run, unless the schedule has
/// it back by then), starts the copy of every value the schedule copies back at the
/// value's producer, skips recomputations and copies back that the held values make
/// unneeded, and rebuilds a value it lacks (replaying its producers from what is on the
/// device or on the host) right before the backward node that reads it. A value it holds
/// or rebuilt that the schedule does not have leaves at the next first computation.
///
/// Fails, naming the node, where the form has no answer: a schedule not in node order, or
/// a value needed that only a recomputation of a backward or pinned node could give.
pub fn conform(graph: &Graph, steps: &[Step]) -> Result<Vec<Step>, EagerError> {
    let mut shadow = Shadow::new(graph, steps);
    for (step, &s) in steps.iter().enumerate() {
        shadow.step(step, s)?;
    }
    shadow.trim();
    Ok(shadow.out)
}

/// Per-tensor summary of an eager schedule, for people and for runtimes that act per saved
/// value (`remat.torch`): a tensor computed more than once is recomputed (as
/// [`crate::exact::chain_graph::decisions_of`] says it), one copied to the host is swapped
/// (out right after its producer; prefetched when the first computation after its first copy
/// back starts, for its first backward reader), every other tensor kept.
pub fn decisions(graph: &Graph, steps: &[Step]) -> Vec<crate::plan::Decision> {
    use crate::plan::Decision;
    let mut decisions = crate::exact::chain_graph::decisions_of(graph, steps);
    // The first computation after each tensor's first copy back.
    let mut waiting: Vec<NodeId> = Vec::new();
    let mut prefetch_at: Vec<Option<NodeId>> = vec![None; graph.len()];
    let mut first_done = vec![false; graph.len()];
    for s in steps {
        match *s {
            Step::SwapIn { tensor } if tensor < graph.len() && prefetch_at[tensor].is_none() => {
                waiting.push(tensor);
            }
            Step::Compute { node } if node < graph.len() && !first_done[node] => {
                first_done[node] = true;
                for t in waiting.drain(..) {
                    prefetch_at[t].get_or_insert(node);
                }
            }
            _ => {}
        }
    }
    for (v, at) in prefetch_at.iter().enumerate() {
        if let (Some(at), Decision::Keep) = (*at, &decisions[v]) {
            let use_at = graph
                .users(v)
                .iter()
                .copied()
                .find(|&u| graph.node(u).phase == Phase::Backward)
                .unwrap_or_else(|| graph.last_use(v));
            decisions[v] = Decision::Swap {
                swap_out_after: v,
                prefetch_at: at,
                use_at,
            };
        }
    }
    decisions
}

/// The state of [`conform`]: the given schedule's residency (`theirs`) beside the eager
/// schedule's (`ours`).
struct Shadow<'g> {
    graph: &'g Graph,
    held_until: Vec<NodeId>,
    /// Forward tensors the given schedule copies back somewhere: offloaded at their producer.
    offloaded: Vec<bool>,
    theirs: Vec<bool>,
    ours: Vec<bool>,
    on_host: Vec<bool>,
    first_done: Vec<bool>,
    next_first: NodeId,
    backward_started: bool,
    /// Tensors we may hold that the given schedule does not (checked again at each trim).
    extra: Vec<NodeId>,
    /// Reads of each tensor still ahead in the rebuild in progress.
    pending: Vec<u32>,
    out: Vec<Step>,
}

impl<'g> Shadow<'g> {
    fn new(graph: &'g Graph, steps: &[Step]) -> Shadow<'g> {
        let n = graph.len();
        let mut offloaded = vec![false; n];
        for s in steps {
            if let Step::SwapIn { tensor } = *s
                && tensor < n
                && graph.node(tensor).phase == Phase::Forward
            {
                offloaded[tensor] = true;
            }
        }
        Shadow {
            graph,
            held_until: graph.eager_holds(),
            offloaded,
            theirs: vec![false; n],
            ours: vec![false; n],
            on_host: vec![false; n],
            first_done: vec![false; n],
            next_first: 0,
            backward_started: false,
            extra: Vec::new(),
            pending: vec![0; n],
            out: Vec::with_capacity(steps.len()),
        }
    }

    fn name(&self, id: NodeId) -> String {
        self.graph.node(id).name.clone()
    }

    fn held(&self, t: NodeId) -> bool {
        let h = self.held_until[t];
        self.first_done[t] && h != t && !self.first_done[h]
    }

    fn step(&mut self, step: usize, s: Step) -> Result<(), EagerError> {
        match s {
            Step::Compute { node } if node >= self.graph.len() => {
                Err(EagerError::UnknownNode { step, node })
            }
            Step::Free { tensor } | Step::SwapOut { tensor } | Step::SwapIn { tensor }
                if tensor >= self.graph.len() =>
            {
                Err(EagerError::UnknownNode { step, node: tensor })
            }
            Step::Compute { node } if !self.first_done[node] => self.first(step, node),
            // A recomputation: ours comes lazily, when a first computation needs it.
            Step::Compute { node } => {
                self.theirs[node] = true;
                Ok(())
            }
            Step::Free { tensor } => {
                self.theirs[tensor] = false;
                if self.ours[tensor] {
                    if self.held(tensor) {
                        self.extra.push(tensor);
                    } else {
                        self.release(tensor);
                    }
                }
                Ok(())
            }
            // Ours start at the producer.
            Step::SwapOut { .. } => Ok(()),
            Step::SwapIn { tensor } => {
                self.theirs[tensor] = true;
                if !self.ours[tensor] && self.on_host[tensor] {
                    self.out.push(Step::SwapIn { tensor });
                    self.ours[tensor] = true;
                }
                Ok(())
            }
        }
    }

    fn release(&mut self, t: NodeId) {
        self.out.push(Step::Free { tensor: t });
        self.ours[t] = false;
    }

    fn first(&mut self, step: usize, node: NodeId) -> Result<(), EagerError> {
        if node != self.next_first {
            return Err(EagerError::OutOfOrder {
                step,
                node: self.name(node),
                expected: self.name(self.next_first),
            });
        }
        let graph = self.graph;
        self.backward_started |= graph.node(node).phase == Phase::Backward;
        for &i in &graph.node(node).inputs {
            if !self.ours[i] {
                self.bring_back(step, i, node)?;
            }
        }
        self.out.push(Step::Compute { node });
        self.ours[node] = true;
        self.theirs[node] = true;
        self.first_done[node] = true;
        self.next_first += 1;
        if self.offloaded[node] {
            self.out.push(Step::SwapOut { tensor: node });
            self.on_host[node] = true;
        }
        self.trim();
        Ok(())
    }

    /// Brings `root` back for `reader`: copied back when on the host, else rebuilt from its
    /// inputs (brought back the same way), with an explicit stack. A rebuilt helper that the
    /// given schedule does not hold leaves after its last read in the rebuild.
    fn bring_back(&mut self, step: usize, root: NodeId, reader: NodeId) -> Result<(), EagerError> {
        let graph = self.graph;
        let mut stack: Vec<(NodeId, bool)> = vec![(root, false)];
        while let Some(&(x, expanded)) = stack.last() {
            if self.ours[x] {
                stack.pop();
                continue;
            }
            if self.on_host[x] {
                self.out.push(Step::SwapIn { tensor: x });
                self.ours[x] = true;
                self.extra.push(x);
                stack.pop();
                continue;
            }
            let why = if !self.backward_started || graph.node(reader).phase != Phase::Backward {
                Some("it is gone during the forward, where eager autograd rebuilds nothing")
            } else if graph.node(x).phase == Phase::Backward {
                Some("it is a backward value, which eager autograd never recomputes")
            } else if graph.is_pinned(x) {
                Some("it is pinned (computed exactly once) and not on the host")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(EagerError::CannotRebuild {
                    step,
                    node: self.name(x),
                    reader: self.name(reader),
                    why,
                });
            }
            if !expanded {
                if let Some(top) = stack.last_mut() {
                    top.1 = true;
                }
                // Every input of x is read once more before x is made: counted so that a
                // helper leaves after its last read in this rebuild, in constant time.
                for &i in &graph.node(x).inputs {
                    self.pending[i] += 1;
                    if !self.ours[i] {
                        stack.push((i, false));
                    }
                }
                continue;
            }
            stack.pop();
            self.out.push(Step::Compute { node: x });
            self.ours[x] = true;
            self.extra.push(x);
            // Helpers read for the last time in this rebuild leave now: not read by the
            // reader or by what is left to make, nor held by the given schedule.
            for &i in &graph.node(x).inputs {
                self.pending[i] -= 1;
                let needed = self.pending[i] > 0
                    || self.theirs[i]
                    || self.held(i)
                    || graph.node(reader).inputs.contains(&i);
                if self.ours[i] && !needed {
                    self.release(i);
                }
            }
        }
        Ok(())
    }

    /// Frees what we hold that the given schedule does not, once nothing holds it.
    fn trim(&mut self) {
        let extra = std::mem::take(&mut self.extra);
        for t in extra {
            if !self.ours[t] || self.theirs[t] {
                continue;
            }
            if self.held(t) {
                self.extra.push(t);
            } else {
                self.release(t);
            }
        }
    }
}

#[cfg(test)]
mod tests;
