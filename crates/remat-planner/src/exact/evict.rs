//! `evict`: a fast general-graph strategy, eviction with look-ahead, our own.
//!
//! Reasoning. Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021) shows that a
//! greedy *online* policy (run the program, and whenever an allocation does not fit evict
//! the resident tensor with the least `h = rebuild_cost / (size * staleness)`, recomputing
//! evicted tensors on demand) comes close to Checkmate's optimum. A planner is not online:
//! the whole schedule is known, so the staleness guess (time since last use) can be
//! replaced by the truth, the time until the next use, as in Belady's optimal cache
//! replacement. A tensor that is big, cheap to rebuild and not needed for a long time is the
//! best to drop:
//!
//! ```text
//! score(t) = rebuild(t)^a / (size(t) * distance_to_next_use(t)^b)      evict the least
//! rebuild(t) = own compute time + compute time of its inputs that are not resident
//! ```
//!
//! A tensor with no further use is garbage and goes first. Rebuilding is recursive: a missing
//! input is recomputed from its own inputs, with an explicit stack, and every tensor being
//! built for a pending consumer is pinned until that consumer has run.
//!
//! A pinned tensor ([`Graph::is_pinned`]) cannot be rebuilt, so it is never a victim while
//! it still has readers (once dead it is freed like any other); neither is a tensor whose
//! rebuild could need a pinned tensor that has died by then ([`Graph::may_drop`]). When
//! nothing else can go, the pass is stuck and the budget is reported infeasible rather than
//! answered with a schedule the simulator would refuse.
//!
//! One greedy pass costs `O(evictions * resident)`, well under a millisecond for hundreds of
//! nodes. Since no single weighting is best on every graph (chains favor `b = 1`, graphs with
//! long skip connections favor a stronger distance term), the strategy runs a handful of
//! weightings and keeps the fastest plan that the simulator confirms under the budget.
//!
//! Why one file of ~620 lines: one strategy, the eviction pass with its scores, the search
//! over weightings and the refinement that reruns the pass; the tests are already in
//! `evict/tests.rs`.

use crate::error::PlanError;
use crate::ir::{Graph, NodeId};
use crate::plan::{Decision, Step};
use crate::problem::{Planned, Problem, plan_from_steps};
use crate::strategy::Strategy;

use super::chain_graph::decisions_of;

pub const NAME: &str = "evict";

/// Exponents of the eviction score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weights {
    pub cost_exp: f64,
    pub distance_exp: f64,
    /// Prefer the cheapest single tensor that covers the whole deficit, when it is no dearer
    /// than the best-ratio one: the ratio alone would drop a huge tensor when a small cheap
    /// one suffices.
    pub best_fit: bool,
}

/// The weightings the strategy tries (each with and without best fit).
pub const WEIGHTINGS: [(f64, f64); 6] = [
    (1.0, 1.0),
    (1.0, 2.0),
    (1.0, 0.5),
    (0.5, 1.0),
    (1.0, 0.0),
    (0.0, 1.0),
];

/// Every weighting the strategy tries.
pub fn weightings() -> impl Iterator<Item = Weights> {
    [true, false].into_iter().flat_map(|best_fit| {
        WEIGHTINGS
            .into_iter()
            .map(move |(cost_exp, distance_exp)| Weights {
                cost_exp,
                distance_exp,
                best_fit,
            })
    })
}

/// Outcome of one greedy pass.
#[derive(Clone, Debug)]
pub enum Pass {
    /// The schedule and its total compute time.
    Fits { steps: Vec<Step>, time: f64 },
    /// Some operation could not get its memory even with everything else evicted; the
    /// peak the pass would have needed there, and the node of the order it was at (how
    /// far it got, which the search in [`crate::solve::bias`] uses to compare stuck passes).
    Stuck { needed: u64, at: NodeId },
}

struct Evictor<'g> {
    graph: &'g Graph,
    weights: Weights,
    protected: &'g [bool],
    /// Per-tensor multipliers of the eviction score (empty: all 1), set by the search over
    /// them in [`crate::solve::bias`]: a large one keeps a tensor, a small one drops it first.
    bias: &'g [f64],
    cap: u64,
    live: u64,
    resident: Vec<bool>,
    pins: Vec<u32>,
    /// Resident tensors, for the eviction scan.
    pool: Vec<NodeId>,
    /// Tensors computed while materializing the current node (itself included).
    fresh: Vec<NodeId>,
    /// prefix[v]: compute time of nodes before v, to measure distances in time.
    prefix: Vec<f64>,
    now: NodeId,
    steps: Vec<Step>,
    time: f64,
    /// When the pass gives up; checked every [`DEADLINE_EVERY`] computations, since one
    /// node's rebuild chain can run to thousands of them on graphs where rebuilds thrash.
    deadline: Option<std::time::Instant>,
    out_of_time: bool,
    computes: usize,
    /// With swaps ([`evict_pass_with_swaps`]): copy time per byte, in the graph's time unit.
    swap_time_per_byte: Option<f64>,
    /// `swapped[t]`: evicted by a swap, its host copy current; a reader brings it back.
    swapped: Vec<bool>,
    /// `touched[t]`: the length of `steps` right after `t` was last computed, read or
    /// brought back; a swap-out inserted there copies its final value, the earliest such.
    touched: Vec<usize>,
    /// Swap-outs to insert into `steps` at the end: (position in `steps`, tensor).
    swap_outs: Vec<(usize, NodeId)>,
}

/// Whether `deadline` (none: no limit) has passed.
fn past(deadline: Option<std::time::Instant>) -> bool {
    deadline.is_some_and(|d| std::time::Instant::now() >= d)
}

/// Computations between two looks at the clock in a pass.
const DEADLINE_EVERY: usize = 256;

/// One greedy pass under `budget_bytes` (static memory included).
pub fn evict_pass(graph: &Graph, budget_bytes: u64, weights: Weights) -> Pass {
    evict_pass_protecting(graph, budget_bytes, weights, &vec![false; graph.len()])
}

/// One greedy pass that evicts a `protected` tensor only when nothing else can go.
pub fn evict_pass_protecting(
    graph: &Graph,
    budget_bytes: u64,
    weights: Weights,
    protected: &[bool],
) -> Pass {
    evict_pass_until(graph, budget_bytes, weights, protected, None)
}

/// [`evict_pass_protecting`] that gives up at `deadline` (reported as stuck at the
/// store-all peak): on graphs where rebuilds chain, one pass can take seconds.
pub fn evict_pass_until(
    graph: &Graph,
    budget_bytes: u64,
    weights: Weights,
    protected: &[bool],
    deadline: Option<std::time::Instant>,
) -> Pass {
    evict_pass_biased(graph, budget_bytes, weights, protected, &[], deadline)
}

/// [`evict_pass_until`] with each tensor's eviction score multiplied by `bias[t]` (an empty
/// slice: no bias). The greedy choice is myopic; a search over these multipliers steers it
/// to schedules its scores alone would not pick.
pub fn evict_pass_biased(
    graph: &Graph,
    budget_bytes: u64,
    weights: Weights,
    protected: &[bool],
    bias: &[f64],
    deadline: Option<std::time::Instant>,
) -> Pass {
    run_pass(
        graph,
        budget_bytes,
        weights,
        protected,
        bias,
        deadline,
        None,
    )
}

/// [`evict_pass_until`] over a host link of `bandwidth` bytes/s: a victim whose copy back
/// costs less than its rebuild, or that cannot be rebuilt at all (a pinned gradient buffer,
/// below the recompute floor), is swapped rather than dropped. Its swap-out is issued right
/// after its last use before the eviction (memory is unchanged by when a copy starts, so the
/// copy runs behind the computations in between), its swap-in right before its reader;
/// then [`hoist_swap_ins`] moves each swap-in earlier where memory allows, so that the copy
/// back hides behind compute too. In the eager order a victim is only what the form lets
/// leave (a forward value past its last forward reader), and the plan made of the steps is
/// put into the form ([`crate::problem::plan_from_steps`]), where each copy out starts
/// right after its producer instead: earlier, so the tensor's memory is the same, but the
/// copies queue in their producers' order.
pub fn evict_pass_with_swaps(
    graph: &Graph,
    budget_bytes: u64,
    weights: Weights,
    protected: &[bool],
    bandwidth: f64,
    deadline: Option<std::time::Instant>,
) -> Pass {
    let per_byte = 1.0 / (bandwidth * graph.time_unit_s());
    let swaps = per_byte.is_finite().then_some(per_byte);
    let pass = run_pass(
        graph,
        budget_bytes,
        weights,
        protected,
        &[],
        deadline,
        swaps,
    );
    match (pass, swaps) {
        (Pass::Fits { steps, time }, Some(per_byte)) => Pass::Fits {
            steps: hoist_swap_ins(graph, budget_bytes, steps, per_byte),
            time,
        },
        (pass, _) => pass,
    }
}

fn run_pass(
    graph: &Graph,
    budget_bytes: u64,
    weights: Weights,
    protected: &[bool],
    bias: &[f64],
    deadline: Option<std::time::Instant>,
    swap_time_per_byte: Option<f64>,
) -> Pass {
    let Some(cap) = budget_bytes.checked_sub(graph.static_bytes()) else {
        return Pass::Stuck {
            needed: graph.memory_floor(),
            at: 0,
        };
    };
    let mut prefix = Vec::with_capacity(graph.len() + 1);
    prefix.push(0.0);
    for node in graph.nodes() {
        prefix.push(prefix[prefix.len() - 1] + node.compute_time);
    }
    let mut ev = Evictor {
        graph,
        weights,
        protected,
        bias,
        cap,
        live: 0,
        resident: vec![false; graph.len()],
        pins: vec![0; graph.len()],
        pool: Vec::new(),
        fresh: Vec::new(),
        prefix,
        now: 0,
        steps: Vec::new(),
        time: 0.0,
        deadline,
        out_of_time: false,
        computes: 0,
        swap_time_per_byte,
        swapped: vec![false; graph.len()],
        touched: vec![0; graph.len()],
        swap_outs: Vec::new(),
    };
    for v in 0..graph.len() {
        ev.now = v;
        let built = ev.materialize(v);
        if ev.out_of_time {
            return Pass::Stuck {
                needed: graph.store_all_peak(),
                at: v,
            };
        }
        if let Err(needed) = built {
            return Pass::Stuck {
                needed: needed + graph.static_bytes(),
                at: v,
            };
        }
        ev.free_dead();
    }
    let steps = ev.steps_with_swap_outs();
    Pass::Fits {
        steps,
        time: ev.time,
    }
}

impl Evictor<'_> {
    /// Computes `root` (the current node) and, first, every missing tensor it depends on.
    /// Each stack entry is built for the entry below it, which holds one pin on it.
    fn materialize(&mut self, root: NodeId) -> Result<(), u64> {
        let mut stack: Vec<(NodeId, bool)> = vec![(root, false)];
        while let Some(&(x, expanded)) = stack.last() {
            let is_root = stack.len() == 1;
            if self.resident[x] && !is_root {
                stack.pop();
                self.pins[x] += 1;
                continue;
            }
            if self.swapped[x] && !is_root {
                stack.pop();
                self.swap_in(x)?;
                self.pins[x] += 1;
                continue;
            }
            if !expanded {
                if let Some(last) = stack.last_mut() {
                    last.1 = true;
                }
                let first = stack.len();
                let lazy = !self.bias.is_empty();
                for &i in &self.graph.node(x).inputs {
                    if self.resident[i] && !lazy {
                        self.pins[i] += 1;
                    } else {
                        stack.push((i, false));
                    }
                }
                if lazy {
                    // With biases, inputs are taken highest bias first (the stack pops the
                    // last pushed), resident ones first among equals, and a resident input
                    // is pinned only when its turn comes (see the top of the loop). With
                    // equal biases this is the plain pass; other biases let the search set
                    // the rebuild order (Sethi-Ullman: what a rebuild holds at once) and let
                    // a resident input go during another's rebuild, to be rebuilt after.
                    let key = |&(i, _): &(NodeId, bool)| (self.bias[i], self.resident[i]);
                    stack[first..].sort_by(|a, b| {
                        let (ka, kb) = (key(a), key(b));
                        ka.0.total_cmp(&kb.0).then(ka.1.cmp(&kb.1))
                    });
                }
                continue;
            }
            stack.pop();
            self.compute(x)?;
            if !is_root {
                self.pins[x] += 1;
            }
        }
        Ok(())
    }

    /// Allocates and computes `x`, whose inputs are resident and pinned, then unpins them.
    fn compute(&mut self, x: NodeId) -> Result<(), u64> {
        let look = self.computes.is_multiple_of(DEADLINE_EVERY);
        self.computes += 1;
        if look && past(self.deadline) {
            self.out_of_time = true;
            return Err(0);
        }
        let bytes = self.graph.node(x).output_bytes;
        self.make_room(x, bytes)?;
        self.live += bytes;
        self.resident[x] = true;
        self.pool.push(x);
        self.fresh.push(x);
        self.steps.push(Step::Compute { node: x });
        self.time += self.graph.node(x).compute_time;
        let after = self.steps.len();
        self.touched[x] = after;
        for &i in &self.graph.node(x).inputs {
            self.pins[i] -= 1;
            self.touched[i] = after;
        }
        Ok(())
    }

    /// Evicts until `bytes` more fit beside what is resident, or says how much the step
    /// would need.
    fn make_room(&mut self, building: NodeId, bytes: u64) -> Result<(), u64> {
        while self.live + bytes > self.cap {
            let deficit = self.live + bytes - self.cap;
            let Some(victim) = self.victim(building, deficit) else {
                return Err(self.live + bytes);
            };
            if self.swaps_out(victim) {
                self.swap_outs.push((self.touched[victim], victim));
                self.swapped[victim] = true;
            }
            self.evict(victim);
        }
        Ok(())
    }

    /// Brings the swapped-out `x` back for a reader, room made for it as for a computation.
    fn swap_in(&mut self, x: NodeId) -> Result<(), u64> {
        let bytes = self.graph.node(x).output_bytes;
        self.make_room(x, bytes)?;
        self.live += bytes;
        self.resident[x] = true;
        self.swapped[x] = false;
        self.pool.push(x);
        self.fresh.push(x);
        self.steps.push(Step::SwapIn { tensor: x });
        self.touched[x] = self.steps.len();
        Ok(())
    }

    /// Whether evicting `t` (still to be read) swaps it: with swaps, when it cannot be
    /// rebuilt or its copy back costs less than the rebuild.
    fn swaps_out(&self, t: NodeId) -> bool {
        let Some(per_byte) = self.swap_time_per_byte else {
            return false;
        };
        self.next_need(t).is_some()
            && (!self.graph.may_drop(t)
                || self.protected[t]
                || self.graph.node(t).output_bytes as f64 * per_byte < self.rebuild(t))
    }

    /// The steps with the recorded swap-outs inserted where they were issued.
    fn steps_with_swap_outs(&mut self) -> Vec<Step> {
        let steps = std::mem::take(&mut self.steps);
        if self.swap_outs.is_empty() {
            return steps;
        }
        // Two swap-outs at one position keep their eviction order.
        let swap_outs = self
            .swap_outs
            .iter()
            .map(|&(at, tensor)| (at, Step::SwapOut { tensor }))
            .collect();
        crate::plan::splice(&steps, |_| false, swap_outs)
    }

    /// The unpinned resident tensor with the least score (garbage first), or with best fit
    /// the cheapest one covering `deficit` alone when it costs no more than the best-ratio one.
    fn victim(&self, building: NodeId, deficit: u64) -> Option<NodeId> {
        self.victim_among(building, deficit, false)
            .or_else(|| self.victim_among(building, deficit, true))
    }

    fn victim_among(&self, building: NodeId, deficit: u64, with_protected: bool) -> Option<NodeId> {
        let mut best: Option<(f64, NodeId)> = None;
        let mut fit: Option<(f64, NodeId)> = None;
        for &t in &self.pool {
            if self.pins[t] > 0
                || t == building
                || t == self.now
                || (self.protected[t] && !with_protected && self.swap_time_per_byte.is_none())
                || !self.may_evict(t)
            {
                continue;
            }
            let (score, cost) = self.score(t);
            if best.is_none_or(|(s, _)| score < s) {
                best = Some((score, t));
            }
            if self.weights.best_fit
                && self.graph.node(t).output_bytes >= deficit
                && fit.is_none_or(|(c, _)| cost < c)
            {
                fit = Some((cost, t));
            }
        }
        let (_, ratio_pick) = best?;
        match fit {
            Some((cost, t)) if cost <= self.score(ratio_pick).1 => Some(t),
            _ => Some(ratio_pick),
        }
    }

    /// (eviction score, weighted rebuild cost): the cost is `rebuild^a / distance^b`, the
    /// score divides it by the bytes freed.
    fn score(&self, t: NodeId) -> (f64, f64) {
        let Some(next) = self.next_need(t) else {
            return (f64::NEG_INFINITY, f64::NEG_INFINITY);
        };
        let node = self.graph.node(t);
        let mut rebuild = self.rebuild(t);
        if let Some(per_byte) = self.swap_time_per_byte {
            let swap = node.output_bytes as f64 * per_byte;
            rebuild = if self.graph.may_drop(t) && !self.protected[t] {
                rebuild.min(swap)
            } else {
                swap
            };
        }
        let distance = (self.prefix[next] - self.prefix[self.now + 1]).max(0.0) + 1e-9;
        let cost = rebuild.powf(self.weights.cost_exp) / distance.powf(self.weights.distance_exp)
            * self.bias.get(t).copied().unwrap_or(1.0);
        (cost / node.output_bytes.max(1) as f64, cost)
    }

    /// The compute time of rebuilding `t` now: its own and its missing inputs'.
    fn rebuild(&self, t: NodeId) -> f64 {
        let node = self.graph.node(t);
        let missing_inputs: f64 = node
            .inputs
            .iter()
            .filter(|&&i| !self.resident[i])
            .map(|&i| self.graph.node(i).compute_time)
            .sum();
        node.compute_time + missing_inputs
    }

    /// Garbage may always go. A tensor still to be read may go once no node that holds it
    /// in the eager order is ahead ([`Graph::eager_may_leave`]; always in other orders), and
    /// then with swaps (a swap needs no rebuild) or when rebuilding it never has to compute
    /// a pinned tensor again. The holds keep the pass's schedule in the eager form but for
    /// where its copies out start: nothing is rebuilt or copied back during the forward,
    /// and a backward value stays until its last reader.
    fn may_evict(&self, t: NodeId) -> bool {
        self.next_need(t).is_none()
            || (self.graph.eager_may_leave(t, self.now)
                && (self.swap_time_per_byte.is_some() || self.graph.may_drop(t)))
    }

    /// While the current node is being built: the first reader of `t` after it, and with
    /// swaps from it on. There the current node counts: an input of it that is not resident
    /// when its inputs are taken is restored later in the build and must not look dead in
    /// between (a pinned one, swapped back, would be dropped and computed again). Without
    /// swaps such an input is only rebuilt twice; the plain pass keeps its choices (the
    /// U-Net's search against the MILP was tuned with them: 4.45% at 0.6 of the peak, 4.52%
    /// with the current node counted).
    fn next_need(&self, t: NodeId) -> Option<NodeId> {
        let users = self.graph.users(t);
        let at = if self.swap_time_per_byte.is_some() {
            users.partition_point(|&u| u < self.now)
        } else {
            users.partition_point(|&u| u <= self.now)
        };
        users.get(at).copied()
    }

    /// The first reader of `t` after the current node.
    fn next_use(&self, t: NodeId) -> Option<NodeId> {
        let users = self.graph.users(t);
        let at = users.partition_point(|&u| u <= self.now);
        users.get(at).copied()
    }

    /// Drops `t` from the device (a swap's caller has marked it swapped first).
    fn evict(&mut self, t: NodeId) {
        self.resident[t] = false;
        self.live -= self.graph.node(t).output_bytes;
        if let Some(at) = self.pool.iter().position(|&p| p == t) {
            self.pool.swap_remove(at);
        }
        self.steps.push(Step::Free { tensor: t });
    }

    /// After the current node: free every resident tensor no later node reads. Only the
    /// node's inputs, the node itself and the tensors computed for it can have just become
    /// dead (any other tensor's last reader is still ahead or already freed it).
    fn free_dead(&mut self) {
        let now = self.now;
        let mut candidates = std::mem::take(&mut self.fresh);
        candidates.extend(self.graph.node(now).inputs.iter().copied());
        for t in candidates {
            if self.resident[t] && self.pins[t] == 0 && self.next_use(t).is_none() {
                self.evict(t);
            }
        }
    }
}

/// Moves each swap-in of `steps` earlier, over the computations before its reader, until
/// those take as long as its copy (the copy then hides behind them) or one step more would
/// pass the budget or the tensor's own free. Memory only grows between the new and the old
/// place, by the tensor's bytes, and every step there is checked against the budget, so a
/// schedule within the budget stays within it.
pub fn hoist_swap_ins(
    graph: &Graph,
    budget_bytes: u64,
    mut steps: Vec<Step>,
    per_byte: f64,
) -> Vec<Step> {
    let Some(cap) = budget_bytes.checked_sub(graph.static_bytes()) else {
        return steps;
    };
    // live[k]: device bytes (static excluded) once step k has run.
    let mut live = crate::plan::live_bytes_after(graph, &steps);
    let mut j = 0;
    while j < steps.len() {
        let Step::SwapIn { tensor } = steps[j] else {
            j += 1;
            continue;
        };
        let bytes = graph.node(tensor).output_bytes;
        let copy = bytes as f64 * per_byte;
        let mut hidden = 0.0;
        let mut to = j;
        while to > 0 && hidden < copy {
            let k = to - 1;
            if !swap_in_may_cross(&steps, &live, k, tensor, bytes, cap) {
                break;
            }
            if let Step::Compute { node } = steps[k] {
                hidden += graph.node(node).compute_time;
            }
            to = k;
        }
        move_swap_in(&mut steps, &mut live, j, to, bytes);
        j += 1;
    }
    steps
}

/// Whether the swap-in of `tensor` (`bytes`) may move before step `k`: not before the
/// tensor's own `Free` or `SwapOut`, and only where it fits under `cap` (device bytes,
/// static excluded) beside what was live before the step (a free's peak) and after it (a
/// computation's). `live[k]`: bytes once step `k` has run.
pub(crate) fn swap_in_may_cross(
    steps: &[Step],
    live: &[u64],
    k: usize,
    tensor: NodeId,
    bytes: u64,
    cap: u64,
) -> bool {
    let own =
        matches!(steps[k], Step::Free { tensor: t } | Step::SwapOut { tensor: t } if t == tensor);
    let before = if k == 0 { 0 } else { live[k - 1] };
    !own && before.max(live[k]) + bytes <= cap
}

/// Moves the swap-in at step `j` (`bytes`) to step `to <= j`, keeping `live` (bytes once
/// each step has run) right: the steps it now runs before hold its bytes too.
pub(crate) fn move_swap_in(
    steps: &mut Vec<Step>,
    live: &mut Vec<u64>,
    j: usize,
    to: usize,
    bytes: u64,
) {
    if to >= j {
        return;
    }
    let step = steps.remove(j);
    steps.insert(to, step);
    let before = if to == 0 { 0 } else { live[to - 1] };
    live.remove(j);
    live.insert(to, before + bytes);
    for held in &mut live[to + 1..=j] {
        *held += bytes;
    }
}

/// `decisions` with each tensor that `steps` swap out marked swapped (its first swap: out
/// after the computation before the `SwapOut`, prefetched as the first computation after
/// its `SwapIn` starts, for its first reader from there). A summary, as
/// [`super::chain_graph::decisions_of`] is for recomputations; the steps are the plan.
pub(crate) fn with_swap_decisions(
    graph: &Graph,
    steps: &[Step],
    mut decisions: Vec<Decision>,
) -> Vec<Decision> {
    let computes_from = |from: usize| {
        steps[from..].iter().filter_map(|s| match *s {
            Step::Compute { node } => Some(node),
            _ => None,
        })
    };
    for (i, step) in steps.iter().enumerate() {
        let Step::SwapOut { tensor } = *step else {
            continue;
        };
        if matches!(decisions[tensor], Decision::Swap { .. }) {
            continue;
        }
        let out_after = steps[..i].iter().rev().find_map(|s| match *s {
            Step::Compute { node } => Some(node),
            _ => None,
        });
        let back = steps[i..]
            .iter()
            .position(|s| *s == Step::SwapIn { tensor })
            .map(|k| i + k);
        let (Some(swap_out_after), Some(j)) = (out_after, back) else {
            continue;
        };
        let prefetch_at = computes_from(j).next();
        let use_at = computes_from(j).find(|&u| graph.node(u).inputs.contains(&tensor));
        if let (Some(prefetch_at), Some(use_at)) = (prefetch_at, use_at) {
            decisions[tensor] = Decision::Swap {
                swap_out_after,
                prefetch_at,
                use_at,
            };
        }
    }
    decisions
}

/// Running time in linear passes at 1,000 nodes, growing as n^2 (see
/// [`crate::strategy::SearchCost`]): measured 16,000 on a random layered DAG of 1,000
/// nodes whose budget no pass fits (the search for a smaller budget), rounded up.
const PASSES: f64 = 20_000.0;

/// The strategy: the best of [`WEIGHTINGS`] under the simulator.
pub struct Evict;

impl Strategy for Evict {
    fn name(&self) -> String {
        NAME.into()
    }
    fn summary(&self) -> &'static str {
        "greedy eviction with look-ahead (DTR-style, Belady distance), best of 12 weightings on profiled and on unit costs"
    }
    fn search_cost(&self) -> crate::strategy::SearchCost {
        crate::strategy::SearchCost {
            passes: PASSES,
            exponent: 2,
            why: "24 greedy passes plus a local search, each O(evictions * resident)",
        }
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        plan_by_weightings(problem, None)
    }
    /// Stops at `deadline`: a pass still running there is abandoned (a pass that thrashes,
    /// rebuilding chains of ancestors over and over, can run for minutes on a 5,000-node
    /// random layered graph), as are the search for a smaller budget and the refinement.
    fn plan_until(
        &self,
        problem: &Problem,
        deadline: std::time::Instant,
    ) -> Result<Planned, PlanError> {
        plan_by_weightings(problem, Some(deadline))
    }
}

/// [`Evict`]'s plan, with no pass begun after `deadline` and one running there abandoned.
fn plan_by_weightings(
    problem: &Problem,
    deadline: Option<std::time::Instant>,
) -> Result<Planned, PlanError> {
    let found = best_pass(problem.graph, problem.budget_bytes, deadline);
    let (weights, steps, time, at) = match found {
        Some((weights, steps, time)) => (weights, steps, time, problem.budget_bytes),
        // Greedy passes are not monotone in the budget: one that gets stuck at this
        // budget may fit a smaller one. The search for the smallest reachable peak finds
        // such a schedule, or the peak to report.
        None => match smallest_reachable(problem, deadline) {
            Some(reached) if reached.peak <= problem.budget_bytes => {
                (reached.weights, reached.steps, reached.time, reached.budget)
            }
            _ if past(deadline) => {
                return Err(PlanError::NotApplicable {
                    strategy: NAME.into(),
                    why: "out of time before a pass fitted the budget (its passes rebuild \
                          chains of ancestors on this graph); raise the time limit"
                        .into(),
                });
            }
            // The peak of a whole schedule: a stuck pass has none (what it needed at the
            // step it stuck on bounds its own peak from below, no schedule's from above),
            // and store-all always reaches its peak.
            reached => {
                return Err(PlanError::OverBudget {
                    strategy: NAME.into(),
                    budget: problem.budget_bytes,
                    best_peak: reached.map_or(problem.graph.store_all_peak(), |r| r.peak),
                });
            }
        },
    };
    let steps = refine(problem.graph, at, weights, (steps, time), deadline);
    let decisions = decisions_of(problem.graph, &steps);
    plan_from_steps(problem, NAME, steps, decisions)
}

/// [`Evict`]'s plan when no pass fits the budget: the search for a smaller budget whose
/// schedule fits, stopped at `deadline` (bisection steps already begun finish).
pub(crate) fn plan_smaller_budget(
    problem: &Problem,
    deadline: std::time::Instant,
) -> Result<Planned, PlanError> {
    match smallest_reachable(problem, Some(deadline)) {
        Some(reached) if reached.peak <= problem.budget_bytes => {
            let steps = refine(
                problem.graph,
                reached.budget,
                reached.weights,
                (reached.steps, reached.time),
                Some(deadline),
            );
            let decisions = decisions_of(problem.graph, &steps);
            plan_from_steps(problem, NAME, steps, decisions)
        }
        reached => Err(PlanError::OverBudget {
            strategy: NAME.into(),
            budget: problem.budget_bytes,
            best_peak: reached.map_or(problem.graph.store_all_peak(), |r| r.peak),
        }),
    }
}

/// The fastest pass over every weighting.
///
/// Every weighting runs twice: on the profiled times, and on unit times (distances and
/// rebuild costs counted in operations). Profiled times are noisy, and a greedy pass that
/// fits at a tight budget with one set of times may get stuck with another; the unit-time
/// passes give choices that depend on the graph alone. Each schedule is timed with the
/// profiled times.
///
/// No pass begins after `deadline`, and one running there is abandoned (it counts as stuck,
/// asking for the store-all peak).
fn best_pass(
    graph: &Graph,
    budget: u64,
    deadline: Option<std::time::Instant>,
) -> Option<(Weights, Vec<Step>, f64)> {
    let unit = graph.with_unit_costs();
    let unprotected = vec![false; graph.len()];
    let mut best: Option<(Weights, Vec<Step>, f64)> = None;
    for weights in weightings() {
        for on in [graph, &unit] {
            if past(deadline) {
                return best;
            }
            match evict_pass_until(on, budget, weights, &unprotected, deadline) {
                Pass::Fits { steps, .. } => {
                    let time = compute_time(graph, &steps);
                    if best.as_ref().is_none_or(|b| time < b.2) {
                        best = Some((weights, steps, time));
                    }
                }
                Pass::Stuck { .. } => {}
            }
        }
    }
    best
}

/// Total compute time of the computations in `steps`.
pub(crate) fn compute_time(graph: &Graph, steps: &[Step]) -> f64 {
    steps
        .iter()
        .map(|s| match *s {
            Step::Compute { node } => graph.node(node).compute_time,
            _ => 0.0,
        })
        .sum()
}

/// Recomputed tensors to try protecting per round, and the number of rounds.
const REFINE_CANDIDATES: usize = 16;
const REFINE_ROUNDS: usize = 3;

/// Local search on top of the greedy pass: the greedy choice is myopic (it evicts what is
/// cheapest *now*, and may then pay for recomputing it several times), so try protecting
/// each of the most expensive recomputed tensors from eviction and keep the change when the
/// whole schedule gets faster. A few dozen passes at most, none begun after `deadline`
/// (and one that reaches it is abandoned: the schedule so far stands).
pub(crate) fn refine(
    graph: &Graph,
    budget: u64,
    weights: Weights,
    found: (Vec<Step>, f64),
    deadline: Option<std::time::Instant>,
) -> Vec<Step> {
    refine_from(
        graph,
        budget,
        weights,
        vec![false; graph.len()],
        found,
        deadline,
    )
}

/// [`refine`] of a schedule that a pass protecting `protected` gave: the tensors it
/// protects stay protected.
pub(crate) fn refine_from(
    graph: &Graph,
    budget: u64,
    weights: Weights,
    mut protected: Vec<bool>,
    (mut steps, mut time): (Vec<Step>, f64),
    deadline: Option<std::time::Instant>,
) -> Vec<Step> {
    for _ in 0..REFINE_ROUNDS {
        let mut improved = false;
        for candidate in costliest_recomputed(graph, &steps, REFINE_CANDIDATES) {
            if past(deadline) {
                return steps;
            }
            if protected[candidate] {
                continue;
            }
            protected[candidate] = true;
            match evict_pass_until(graph, budget, weights, &protected, deadline) {
                Pass::Fits {
                    steps: better,
                    time: t,
                } if t < time => {
                    (steps, time, improved) = (better, t, true);
                }
                _ => protected[candidate] = false,
            }
        }
        if !improved {
            break;
        }
    }
    steps
}

/// Up to `limit` tensors whose recomputations cost the most in `steps`, in all and per
/// byte held.
fn costliest_recomputed(graph: &Graph, steps: &[Step], limit: usize) -> Vec<NodeId> {
    let mut computed = vec![0u32; graph.len()];
    for step in steps {
        if let Step::Compute { node } = *step {
            computed[node] += 1;
        }
    }
    let recomputed: Vec<(f64, NodeId)> = (0..graph.len())
        .filter(|&v| computed[v] > 1)
        .map(|v| (f64::from(computed[v] - 1) * graph.node(v).compute_time, v))
        .collect();
    let mut by_time = recomputed.clone();
    by_time.sort_by(|a, b| b.0.total_cmp(&a.0));
    let per_byte = |&(time, v): &(f64, NodeId)| time / graph.node(v).output_bytes.max(1) as f64;
    let mut by_time_per_byte = recomputed;
    by_time_per_byte.sort_by(|a, b| per_byte(b).total_cmp(&per_byte(a)));
    // In turn from both rankings: the costliest recomputations are often tensors too big
    // to keep (near the floor, a layer's 128 MiB attention scores), while the costliest
    // per byte are the ones that may fit (8 layers, eager order, recompute floor + 10%:
    // 35.3% against 36.0% with the first ranking alone).
    let mut out: Vec<NodeId> = Vec::with_capacity(limit);
    for (a, b) in by_time.iter().zip(&by_time_per_byte) {
        for &(_, v) in [a, b] {
            if out.len() < limit && !out.contains(&v) {
                out.push(v);
            }
        }
    }
    out
}

/// A schedule found while searching for the least reachable peak.
struct Reached {
    peak: u64,
    /// The budget the pass was run with.
    budget: u64,
    weights: Weights,
    steps: Vec<Step>,
    time: f64,
}

/// The least peak a pass reaches, by bisection on the budget between the floor and the
/// store-all peak (passes are cheap). Only run when the asked budget fails.
fn smallest_reachable(problem: &Problem, deadline: Option<std::time::Instant>) -> Option<Reached> {
    let graph = problem.graph;
    let (mut lo, mut hi) = (
        graph.memory_floor().saturating_sub(1),
        graph.store_all_peak(),
    );
    let mut best = None;
    while hi > lo + 1 + hi / 10_000 {
        if past(deadline) {
            break;
        }
        let mid = lo + (hi - lo) / 2;
        let fits = weightings().find_map(|weights| {
            if past(deadline) {
                return None;
            }
            evict_pass_result(graph, problem, mid, weights, deadline)
        });
        match fits {
            Some(reached) if reached.peak <= mid => {
                best = Some(reached);
                hi = mid;
            }
            _ => lo = mid,
        }
    }
    best
}

/// One pass at `budget`, simulated: the schedule and its peak when it fits.
fn evict_pass_result(
    graph: &Graph,
    problem: &Problem,
    mid: u64,
    weights: Weights,
    deadline: Option<std::time::Instant>,
) -> Option<Reached> {
    match evict_pass_until(graph, mid, weights, &vec![false; graph.len()], deadline) {
        Pass::Fits { steps, time } => {
            let report = crate::sim::simulate_steps(graph, &steps, problem.bandwidth).ok()?;
            Some(Reached {
                peak: report.peak_bytes,
                budget: mid,
                weights,
                steps,
                time,
            })
        }
        Pass::Stuck { .. } => None,
    }
}

#[cfg(test)]
mod tests;
