//! The simulator: runs a schedule over a graph, validates it and measures it.
//!
//! Memory follows the accounting of [`crate::plan`] to the byte: static bytes plus every
//! tensor on the device; a `Compute` allocates its output before it runs (inputs and output
//! coexist), `SwapIn` allocates at issue, `Free` releases. The peak is the largest value
//! after any allocation.
//!
//! Time: one compute stream runs `Compute` steps back to back. A swap takes
//! `bytes / bandwidth` seconds on its copy stream (one stream per direction, each copy after
//! the previous one on the same stream). A `Compute` waits for the swap-ins of its inputs,
//! a `Free` waits for a swap-out of its tensor still in flight; those waits are the exposed
//! swap time. Total time = first computations + recomputations + exposed swap time.
//!
//! [`Machine`] applies one step at a time, so strategies can build schedules against the
//! same model that will judge them.

use serde::Serialize;

use crate::error::SimError;
use crate::ir::{Graph, NodeId};
use crate::plan::{Plan, PlanOrder, Step};

/// Memory after a step that changed it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TimelinePoint {
    /// Index of the step in the schedule.
    pub step: usize,
    /// Compute-stream time when the memory changed, in the graph's time unit.
    pub time: f64,
    /// Device bytes in use, static bytes included.
    pub bytes: u64,
}

/// What the schedule did to a tensor, derived from its steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fate {
    /// Computed once, never swapped.
    Kept,
    /// Swapped out at least once.
    Swapped,
    /// Computed more than once.
    Recomputed,
}

/// The simulator's measurements of a valid schedule. Times are in the graph's time unit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimReport {
    pub peak_bytes: u64,
    /// Index of the step at which the peak was first reached.
    pub peak_step: usize,
    pub total_time: f64,
    /// Sum of every node's compute time, once.
    pub base_time: f64,
    pub recompute_time: f64,
    /// Time the compute stream waited on copies: the swap traffic not hidden by compute.
    pub stall_time: f64,
    /// Bytes copied to the host, every swap-out counted (saturates at u64::MAX).
    pub swapped_out_bytes: u64,
    /// Bytes computed again, every recomputation counted (saturates at u64::MAX).
    pub recomputed_bytes: u64,
    pub timeline: Vec<TimelinePoint>,
    pub fates: Vec<Fate>,
}

impl SimReport {
    /// (recompute + exposed swap) / base time.
    pub fn overhead(&self) -> f64 {
        if self.base_time > 0.0 {
            (self.total_time - self.base_time) / self.base_time
        } else {
            0.0
        }
    }
    /// Bytes of the tensors with each fate: (kept, swapped, recomputed).
    pub fn bytes_by_fate(&self, graph: &Graph) -> (u64, u64, u64) {
        let mut sums = (0, 0, 0);
        for (id, fate) in self.fates.iter().enumerate() {
            let bytes = graph.node(id).output_bytes;
            match fate {
                Fate::Kept => sums.0 += bytes,
                Fate::Swapped => sums.1 += bytes,
                Fate::Recomputed => sums.2 += bytes,
            }
        }
        sums
    }
}

/// Simulates a plan. The plan must be for this graph (same node count). A plan that says
/// it is in the eager order ([`PlanOrder::Eager`]) is checked against the form's rules
/// first ([`crate::eager::check`]), whatever the graph's marks.
pub fn simulate(graph: &Graph, plan: &Plan) -> Result<SimReport, SimError> {
    if plan.node_count != graph.len() {
        return Err(SimError::GraphMismatch {
            plan_nodes: plan.node_count,
            graph_nodes: graph.len(),
        });
    }
    if plan.order == PlanOrder::Eager {
        crate::eager::check(graph, &plan.steps).map_err(|error| SimError::NotEager {
            error: Box::new(error),
        })?;
    }
    simulate_steps(graph, &plan.steps, plan.bandwidth_bytes_per_s)
}

/// Simulates a schedule at `bandwidth` bytes per second.
pub fn simulate_steps(
    graph: &Graph,
    steps: &[Step],
    bandwidth: f64,
) -> Result<SimReport, SimError> {
    let mut machine = Machine::new(graph, bandwidth)?;
    for &step in steps {
        machine.apply(step)?;
    }
    machine.finish()
}

/// When one step ran, in the graph's time unit (see [`simulate_traced`]).
///
/// - `Compute`: the compute stream waited `wait` for its inputs' copies, then ran the node
///   from `start` to `end`.
/// - `Free`: it waited `wait` for a swap-out still copying; `start == end` is then.
/// - `SwapOut` / `SwapIn`: the copy ran on its stream from `start` to `end`; `wait` is 0
///   (a copy never holds up the compute stream when it is issued).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepTime {
    pub start: f64,
    pub end: f64,
    pub wait: f64,
}

/// [`simulate_steps`], also returning when each step ran (one [`StepTime`] per step), for
/// reports that say which computations overlapped which copy.
pub fn simulate_traced(
    graph: &Graph,
    steps: &[Step],
    bandwidth: f64,
) -> Result<(SimReport, Vec<StepTime>), SimError> {
    let mut machine = Machine::new(graph, bandwidth)?;
    machine.trace = Some(Vec::with_capacity(steps.len()));
    for &step in steps {
        machine.apply(step)?;
    }
    let trace = machine.trace.take().unwrap_or_default();
    Ok((machine.finish()?, trace))
}

/// Where a tensor is and when its copies complete.
#[derive(Clone, Copy, Debug, Default)]
struct TensorState {
    on_device: bool,
    /// Time its device bytes are usable (a swap-in completes then).
    ready_at: f64,
    /// Completion time of its latest swap-out, if it has a host copy.
    host_copy_at: Option<f64>,
    computed: u32,
}

/// The simulator's state, one step at a time.
#[derive(Clone, Debug)]
pub struct Machine<'g> {
    graph: &'g Graph,
    /// Graph time units per byte copied.
    units_per_byte: f64,
    tensors: Vec<TensorState>,
    now: f64,
    d2h_free_at: f64,
    h2d_free_at: f64,
    live: u64,
    peak: u64,
    peak_step: usize,
    step: usize,
    recompute_time: f64,
    stall_time: f64,
    swapped_out_bytes: u64,
    swapped: Vec<bool>,
    timeline: Vec<TimelinePoint>,
    /// When set, each applied step's [`StepTime`] is pushed here.
    trace: Option<Vec<StepTime>>,
}

impl<'g> Machine<'g> {
    pub fn new(graph: &'g Graph, bandwidth: f64) -> Result<Machine<'g>, SimError> {
        if !(bandwidth.is_finite() && bandwidth > 0.0) {
            return Err(SimError::Bandwidth { value: bandwidth });
        }
        let live = graph.static_bytes();
        Ok(Machine {
            graph,
            units_per_byte: 1.0 / (bandwidth * graph.time_unit_s()),
            tensors: vec![TensorState::default(); graph.len()],
            now: 0.0,
            d2h_free_at: 0.0,
            h2d_free_at: 0.0,
            live,
            peak: live,
            peak_step: 0,
            step: 0,
            recompute_time: 0.0,
            stall_time: 0.0,
            swapped_out_bytes: 0,
            swapped: vec![false; graph.len()],
            timeline: vec![TimelinePoint {
                step: 0,
                time: 0.0,
                bytes: live,
            }],
            trace: None,
        })
    }

    /// Device bytes in use now (static included).
    pub fn live_bytes(&self) -> u64 {
        self.live
    }
    pub fn peak_bytes(&self) -> u64 {
        self.peak
    }
    /// Compute-stream clock, in the graph's time unit.
    pub fn now(&self) -> f64 {
        self.now
    }
    pub fn is_on_device(&self, tensor: NodeId) -> bool {
        self.tensors.get(tensor).is_some_and(|t| t.on_device)
    }
    pub fn has_host_copy(&self, tensor: NodeId) -> bool {
        self.tensors
            .get(tensor)
            .is_some_and(|t| t.host_copy_at.is_some())
    }
    /// When the latest swap-out of `tensor` completes (None without a host copy).
    pub fn swap_out_done_at(&self, tensor: NodeId) -> Option<f64> {
        self.tensors.get(tensor).and_then(|t| t.host_copy_at)
    }
    /// Time to copy `bytes` one way, in the graph's time unit.
    pub fn copy_time(&self, bytes: u64) -> f64 {
        bytes as f64 * self.units_per_byte
    }
    /// Number of steps applied so far.
    pub fn steps_applied(&self) -> usize {
        self.step
    }

    /// Applies one step, or names why it cannot run.
    pub fn apply(&mut self, step: Step) -> Result<(), SimError> {
        let index = self.step;
        let id = match step {
            Step::Compute { node } => node,
            Step::Free { tensor } | Step::SwapOut { tensor } | Step::SwapIn { tensor } => tensor,
        };
        if id >= self.graph.len() {
            return Err(SimError::UnknownNode {
                step: index,
                node: id,
            });
        }
        match step {
            Step::Compute { node } => self.compute(index, node)?,
            Step::Free { tensor } => self.free(index, tensor)?,
            Step::SwapOut { tensor } => self.swap_out(index, tensor)?,
            Step::SwapIn { tensor } => self.swap_in(index, tensor)?,
        }
        self.step += 1;
        Ok(())
    }

    fn name(&self, id: NodeId) -> String {
        self.graph.node(id).name.clone()
    }

    /// A pinned tensor's readers run for the first time in node order: a reader may write
    /// it in place (a gradient buffer's accumulations, the step's end reading the sum), so
    /// another order would read it before an earlier write, or sum in another order.
    fn check_pinned_reader_order(&self, step: usize, node: NodeId) -> Result<(), SimError> {
        for &input in &self.graph.node(node).inputs {
            if !self.graph.is_pinned(input) {
                continue;
            }
            let readers = self.graph.users(input);
            let at = readers.partition_point(|&r| r < node);
            if let Some(&earlier) = at.checked_sub(1).and_then(|k| readers.get(k))
                && self.tensors[earlier].computed == 0
            {
                return Err(SimError::PinnedReadOutOfOrder {
                    step,
                    node: self.name(node).into(),
                    tensor: self.name(input).into(),
                    earlier: self.name(earlier).into(),
                });
            }
        }
        Ok(())
    }

    fn compute(&mut self, step: usize, node: NodeId) -> Result<(), SimError> {
        let spec = self.graph.node(node);
        let mut start = self.now;
        for &input in &spec.inputs {
            let state = &self.tensors[input];
            if !state.on_device {
                return Err(SimError::InputMissing {
                    step,
                    node: self.name(node),
                    input: self.name(input),
                });
            }
            start = start.max(state.ready_at);
        }
        if self.tensors[node].on_device {
            return Err(SimError::AlreadyResident {
                step,
                node: self.name(node),
            });
        }
        if self.tensors[node].computed == 0 {
            self.check_pinned_reader_order(step, node)?;
        }
        if self.graph.is_pinned(node) && self.tensors[node].computed > 0 {
            return Err(SimError::PinnedRecomputed {
                step,
                node: self.name(node),
            });
        }
        self.traced(start, start + spec.compute_time, start - self.now);
        self.stall_time += start - self.now;
        self.allocate(step, node, start);
        let state = &mut self.tensors[node];
        state.computed += 1;
        state.ready_at = start;
        if state.computed > 1 {
            self.recompute_time += spec.compute_time;
        }
        self.now = start + spec.compute_time;
        Ok(())
    }

    fn free(&mut self, step: usize, tensor: NodeId) -> Result<(), SimError> {
        let state = self.tensors[tensor];
        if !state.on_device {
            return Err(SimError::FreeMissing {
                step,
                tensor: self.name(tensor),
            });
        }
        let waited_from = self.now;
        if let Some(done) = state.host_copy_at.filter(|&done| done > self.now) {
            self.stall_time += done - self.now;
            self.now = done;
        }
        self.traced(self.now, self.now, self.now - waited_from);
        self.tensors[tensor].on_device = false;
        self.live -= self.graph.node(tensor).output_bytes;
        self.record(step);
        Ok(())
    }

    fn swap_out(&mut self, step: usize, tensor: NodeId) -> Result<(), SimError> {
        let state = self.tensors[tensor];
        if !state.on_device {
            return Err(SimError::SwapOutMissing {
                step,
                tensor: self.name(tensor),
            });
        }
        let bytes = self.graph.node(tensor).output_bytes;
        let start = self.now.max(self.d2h_free_at).max(state.ready_at);
        let done = start + self.copy_time(bytes);
        self.traced(start, done, 0.0);
        self.d2h_free_at = done;
        self.tensors[tensor].host_copy_at = Some(done);
        // A tensor may be swapped out more than once, so this can pass the graph's total
        // bytes (which the graph bounds): saturate rather than wrap.
        self.swapped_out_bytes = self.swapped_out_bytes.saturating_add(bytes);
        self.swapped[tensor] = true;
        Ok(())
    }

    fn swap_in(&mut self, step: usize, tensor: NodeId) -> Result<(), SimError> {
        let state = self.tensors[tensor];
        let Some(host_ready) = state.host_copy_at else {
            return Err(SimError::SwapInWithoutSwapOut {
                step,
                tensor: self.name(tensor),
            });
        };
        if state.on_device {
            return Err(SimError::SwapInResident {
                step,
                tensor: self.name(tensor),
            });
        }
        let bytes = self.graph.node(tensor).output_bytes;
        let start = self.now.max(self.h2d_free_at).max(host_ready);
        let done = start + self.copy_time(bytes);
        self.traced(start, done, 0.0);
        self.h2d_free_at = done;
        self.allocate(step, tensor, self.now);
        self.tensors[tensor].ready_at = done;
        Ok(())
    }

    fn traced(&mut self, start: f64, end: f64, wait: f64) {
        if let Some(trace) = &mut self.trace {
            trace.push(StepTime { start, end, wait });
        }
    }

    fn allocate(&mut self, step: usize, tensor: NodeId, time: f64) {
        self.tensors[tensor].on_device = true;
        self.live += self.graph.node(tensor).output_bytes;
        if self.live > self.peak {
            self.peak = self.live;
            self.peak_step = step;
        }
        self.timeline.push(TimelinePoint {
            step,
            time,
            bytes: self.live,
        });
    }

    fn record(&mut self, step: usize) {
        self.timeline.push(TimelinePoint {
            step,
            time: self.now,
            bytes: self.live,
        });
    }

    /// Checks that every node was computed and returns the measurements.
    pub fn finish(self) -> Result<SimReport, SimError> {
        if let Some(missing) = self.tensors.iter().position(|t| t.computed == 0) {
            return Err(SimError::NeverComputed {
                node: self.name(missing),
            });
        }
        let graph = self.graph;
        let fates = self
            .tensors
            .iter()
            .zip(&self.swapped)
            .map(|(t, &swapped)| match (t.computed > 1, swapped) {
                (true, _) => Fate::Recomputed,
                (false, true) => Fate::Swapped,
                (false, false) => Fate::Kept,
            })
            .collect();
        let recomputed_bytes = self
            .tensors
            .iter()
            .enumerate()
            .map(|(id, t)| {
                u64::from(t.computed.saturating_sub(1)).saturating_mul(graph.node(id).output_bytes)
            })
            .fold(0u64, u64::saturating_add);
        Ok(SimReport {
            peak_bytes: self.peak,
            peak_step: self.peak_step,
            total_time: self.now,
            base_time: graph.base_time(),
            recompute_time: self.recompute_time,
            stall_time: self.stall_time,
            swapped_out_bytes: self.swapped_out_bytes,
            recomputed_bytes,
            timeline: self.timeline,
            fates,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Node, Phase};

    fn chain(bytes: &[u64]) -> Graph {
        let nodes = bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| Node {
                name: format!("n{i}"),
                phase: Phase::Forward,
                compute_time: 2.0,
                output_bytes: b,
                inputs: if i == 0 { vec![] } else { vec![i - 1] },
            })
            .collect();
        Graph::new("chain", nodes, 1, 1.0).unwrap()
    }

    #[test]
    fn swap_timing_and_memory_by_hand() {
        // n0(10) n1(20) n2 reads n1. Bandwidth 5 bytes/unit: copying n0 takes 2 units.
        let g = chain(&[10, 20, 30]);
        let steps = [
            Step::Compute { node: 0 },   // t 0..2, live 1+10
            Step::SwapOut { tensor: 0 }, // copy 2..4
            Step::Compute { node: 1 },   // t 2..4, live 31
            Step::Free { tensor: 0 },    // copy done at 4: no wait, live 21
            Step::SwapIn { tensor: 0 },  // live 31, copy 4..6
            Step::Compute { node: 2 },   // live 61 (peak), t 4..6
        ];
        let r = simulate_steps(&g, &steps, 5.0).unwrap();
        assert_eq!(r.peak_bytes, 61);
        assert_eq!(r.peak_step, 5);
        assert_eq!(r.total_time, 6.0);
        assert_eq!(r.stall_time, 0.0);
        assert_eq!(r.fates, vec![Fate::Swapped, Fate::Kept, Fate::Kept]);
    }

    #[test]
    fn the_trace_says_when_each_step_ran() {
        // As in exposed_swap_is_stall: the free waits for the copy-out, n1 for the copy-in.
        let g = chain(&[10, 20]);
        let steps = [
            Step::Compute { node: 0 },
            Step::SwapOut { tensor: 0 },
            Step::Free { tensor: 0 },
            Step::SwapIn { tensor: 0 },
            Step::Compute { node: 1 },
        ];
        let (report, trace) = simulate_traced(&g, &steps, 1.0).unwrap();
        assert_eq!(report, simulate_steps(&g, &steps, 1.0).unwrap());
        let at = |start, end, wait| StepTime { start, end, wait };
        assert_eq!(
            trace,
            vec![
                at(0.0, 2.0, 0.0),
                at(2.0, 12.0, 0.0),
                at(12.0, 12.0, 10.0),
                at(12.0, 22.0, 0.0),
                at(22.0, 24.0, 10.0),
            ]
        );
        let waits: f64 = trace.iter().map(|t| t.wait).sum();
        assert_eq!(waits, report.stall_time);
    }

    #[test]
    fn exposed_swap_is_stall() {
        let g = chain(&[10, 20]);
        // Free right after the swap-out waits the whole copy: 10 bytes at 1 byte/unit.
        let steps = [
            Step::Compute { node: 0 },
            Step::SwapOut { tensor: 0 },
            Step::Free { tensor: 0 },
            Step::SwapIn { tensor: 0 },
            Step::Compute { node: 1 },
        ];
        let r = simulate_steps(&g, &steps, 1.0).unwrap();
        // compute 0..2, copy-out 2..12 (free waits until 12), copy-in 12..22, n1 22..24.
        assert_eq!(r.stall_time, 20.0);
        assert_eq!(r.total_time, 24.0);
    }

    #[test]
    fn names_first_broken_step() {
        let g = chain(&[10, 20]);
        let steps = [
            Step::Compute { node: 0 },
            Step::Free { tensor: 0 },
            Step::Compute { node: 1 },
        ];
        let err = simulate_steps(&g, &steps, 1.0).unwrap_err();
        assert_eq!(
            err,
            SimError::InputMissing {
                step: 2,
                node: "n1".into(),
                input: "n0".into()
            }
        );
        let err = simulate_steps(&g, &[Step::SwapIn { tensor: 0 }], 1.0).unwrap_err();
        assert!(matches!(
            err,
            SimError::SwapInWithoutSwapOut { step: 0, .. }
        ));
        let err = simulate_steps(&g, &[Step::Compute { node: 0 }], 1.0).unwrap_err();
        assert!(matches!(err, SimError::NeverComputed { .. }));
    }

    #[test]
    fn a_pinned_node_is_computed_once_but_may_be_swapped() {
        let g = chain(&[10, 20]).with_pinned([0]).unwrap();
        let recompute = [
            Step::Compute { node: 0 },
            Step::Free { tensor: 0 },
            Step::Compute { node: 0 },
            Step::Compute { node: 1 },
        ];
        let err = simulate_steps(&g, &recompute, 1.0).unwrap_err();
        assert_eq!(
            err,
            SimError::PinnedRecomputed {
                step: 2,
                node: "n0".into()
            }
        );
        assert!(err.to_string().contains("step 2") && err.to_string().contains("`n0`"));
        // The same schedule is fine without the pin, and a swap keeps the pinned value.
        assert!(simulate_steps(&chain(&[10, 20]), &recompute, 1.0).is_ok());
        let swap = [
            Step::Compute { node: 0 },
            Step::SwapOut { tensor: 0 },
            Step::Free { tensor: 0 },
            Step::SwapIn { tensor: 0 },
            Step::Compute { node: 1 },
        ];
        let r = simulate_steps(&g, &swap, 1.0).unwrap();
        assert_eq!(r.fates, vec![Fate::Swapped, Fate::Kept]);
    }

    #[test]
    fn recompute_counts_time_and_bytes() {
        let g = chain(&[10, 20]);
        let steps = [
            Step::Compute { node: 0 },
            Step::Free { tensor: 0 },
            Step::Compute { node: 0 },
            Step::Compute { node: 1 },
        ];
        let r = simulate_steps(&g, &steps, 1.0).unwrap();
        assert_eq!(r.recompute_time, 2.0);
        assert_eq!(r.recomputed_bytes, 10);
        assert_eq!(r.total_time, 6.0);
        assert!((r.overhead() - 0.5).abs() < 1e-12);
    }
}
