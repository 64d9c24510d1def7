//! Simulated annealing over the sequence itself: the order's copies (recomputations) added,
//! deleted and moved, judged by their compute time plus a penalty on the memory above the
//! budget whose weight rises over the run, so the end state fits.
//!
//! Why. The greedy of [`super::recompute`] takes the copy that removes the most excess per
//! unit of time and never revisits a choice but for a few remove-and-refit tries; on
//! Moccasin's random layered graphs at 0.9 of the peak its sets of copies stay a few times
//! costlier than FastSA's (NeurIPS 2023), which anneals the sequence with the copies in it.
//! This phase does the same from the solver's best sequence: with a low penalty weight the
//! search may cross over-budget sequences to reach cheaper sets of copies, and as the
//! weight grows it is pushed back under the budget. The best fitting sequence seen is kept.
//!
//! Semantics as in [`super::recompute`]: each appearance reads the latest earlier
//! appearance of each input and is freed right after its last reader. Adding or deleting a
//! copy changes lifetimes on one stretch only (the copied node's earlier appearance and
//! the copy's inputs, between their last readers and the copy), so those moves are
//! evaluated over that stretch (`State::insert_delta`, `State::delete_delta`); a moved
//! copy is judged by a full replay. An accepted move rebuilds the state in one pass.
//!
//! Why one file of ~660 lines: one annealing run; the state with its incremental memory
//! profile, the moves, their evaluation and the penalty and temperature schedule change
//! together and read best together.

use std::time::Instant;

use crate::error::PlanError;
use crate::ir::{Graph, NodeId};
use crate::plan::Step;
use crate::problem::{Planned, Problem, plan_from_steps};

use super::order::Rng;
use super::recompute::{Sequence, steps_of};

/// A sequence with its lifetimes, profile and copies.
struct State<'g> {
    graph: &'g Graph,
    budget: u64,
    seq: Vec<NodeId>,
    /// Position of the last reader of each appearance (itself when none).
    last: Vec<usize>,
    /// Live bytes while each step runs, and after its frees.
    live: Vec<u64>,
    after: Vec<u64>,
    /// Readers of each appearance (positions), as a flat list with `reader_start`.
    reader_start: Vec<usize>,
    readers: Vec<usize>,
    /// Positions of each node's appearances, ascending, flat with `appear_start`.
    appear_start: Vec<usize>,
    appears: Vec<usize>,
    /// Positions of the copies (appearances after a node's first).
    copies: Vec<usize>,
    /// Steps above the budget.
    over_steps: Vec<usize>,
    excess: u64,
    copy_time: f64,
    /// Scratch: per node, the latest appearance during the rebuild.
    latest: Vec<usize>,
    /// Scratch of the rebuild: counts, fill cursors, appearances read, bytes freed.
    count: Vec<usize>,
    fill: Vec<usize>,
    reads: Vec<usize>,
    freed_at: Vec<u64>,
    nodes: Nodes,
}

/// The graph's nodes as flat arrays: what the rebuild reads per step, without chasing
/// each node's own allocations.
struct Nodes {
    bytes: Vec<u64>,
    time: Vec<f64>,
    /// Distinct inputs of each node, flat with `input_start`.
    input_start: Vec<usize>,
    input_list: Vec<NodeId>,
}

impl Nodes {
    fn of(graph: &Graph) -> Nodes {
        let mut input_start = vec![0];
        let mut input_list = Vec::new();
        for node in graph.nodes() {
            for (n, &i) in node.inputs.iter().enumerate() {
                if !node.inputs[..n].contains(&i) {
                    input_list.push(i);
                }
            }
            input_start.push(input_list.len());
        }
        Nodes {
            bytes: graph.nodes().iter().map(|x| x.output_bytes).collect(),
            time: graph.nodes().iter().map(|x| x.compute_time).collect(),
            input_start,
            input_list,
        }
    }

    fn inputs(&self, v: NodeId) -> &[NodeId] {
        &self.input_list[self.input_start[v]..self.input_start[v + 1]]
    }
}

impl<'g> State<'g> {
    fn new(graph: &'g Graph, budget: u64, seq: Vec<NodeId>) -> State<'g> {
        let mut s = State {
            graph,
            budget,
            seq,
            last: Vec::new(),
            live: Vec::new(),
            after: Vec::new(),
            reader_start: Vec::new(),
            readers: Vec::new(),
            appear_start: Vec::new(),
            appears: Vec::new(),
            copies: Vec::new(),
            over_steps: Vec::new(),
            excess: 0,
            copy_time: 0.0,
            latest: vec![usize::MAX; graph.len()],
            count: Vec::new(),
            fill: Vec::new(),
            reads: Vec::new(),
            freed_at: Vec::new(),
            nodes: Nodes::of(graph),
        };
        s.rebuild();
        s
    }

    /// Recomputes every array from `seq` in one pass (plus counting sorts).
    fn rebuild(&mut self) {
        let len = self.seq.len();
        let nodes = &self.nodes;
        self.latest.fill(usize::MAX);
        self.last.clear();
        self.last.extend(0..len);
        self.copies.clear();
        self.copy_time = 0.0;
        self.count.clear();
        self.count.resize(len + 1, 0);
        self.appear_start.clear();
        self.appear_start.resize(nodes.bytes.len() + 1, 0);
        // First pass: which appearance each step reads, kept flat for the second.
        self.reads.clear();
        for k in 0..len {
            let v = self.seq[k];
            for &i in nodes.inputs(v) {
                let a = self.latest[i];
                self.last[a] = k;
                self.count[a] += 1;
                self.reads.push(a);
            }
            if self.latest[v] != usize::MAX {
                self.copies.push(k);
                self.copy_time += nodes.time[v];
            }
            self.latest[v] = k;
            self.appear_start[v] += 1;
        }
        prefix(&mut self.count);
        self.reader_start.clone_from(&self.count);
        self.readers.clear();
        self.readers.resize(self.reader_start[len], 0);
        let mut r = 0;
        for k in 0..len {
            for _ in 0..nodes.inputs(self.seq[k]).len() {
                let a = self.reads[r];
                r += 1;
                self.readers[self.count[a]] = k;
                self.count[a] += 1;
            }
        }
        prefix(&mut self.appear_start);
        self.fill.clone_from(&self.appear_start);
        self.appears.clear();
        self.appears.resize(len, 0);
        for (k, &v) in self.seq.iter().enumerate() {
            self.appears[self.fill[v]] = k;
            self.fill[v] += 1;
        }
        self.freed_at.clear();
        self.freed_at.resize(len, 0);
        for k in 0..len {
            self.freed_at[self.last[k]] += nodes.bytes[self.seq[k]];
        }
        self.live.clear();
        self.after.clear();
        self.over_steps.clear();
        self.excess = 0;
        let mut live = self.graph.static_bytes();
        for k in 0..len {
            live += nodes.bytes[self.seq[k]];
            if live > self.budget {
                self.over_steps.push(k);
                self.excess = self.excess.saturating_add(live - self.budget);
            }
            self.live.push(live);
            live -= self.freed_at[k];
            self.after.push(live);
        }
    }

    fn readers_of(&self, a: usize) -> &[usize] {
        &self.readers[self.reader_start[a]..self.reader_start[a + 1]]
    }

    /// The latest appearance of `v` before position `p`.
    fn latest_before(&self, v: NodeId, p: usize) -> Option<usize> {
        let list = &self.appears[self.appear_start[v]..self.appear_start[v + 1]];
        let n = list.partition_point(|&x| x < p);
        n.checked_sub(1).map(|m| list[m])
    }

    /// The last reader of appearance `a` before position `p`, or `a` when none.
    fn last_reader_before(&self, a: usize, p: usize) -> usize {
        self.readers_of(a)
            .iter()
            .copied()
            .filter(|&r| r < p)
            .max()
            .unwrap_or(a)
    }

    fn over(&self, live: i128) -> i128 {
        (live - self.budget as i128).max(0)
    }

    /// Sum of the excess change over steps `lo + 1 .. end` when each change `(from, bytes)`
    /// adds `bytes` to every step after `from`.
    fn stretch_change(&self, mut changes: Vec<(usize, i128)>, end: usize) -> i128 {
        let Some(lo) = changes.iter().map(|c| c.0).min() else {
            return 0;
        };
        changes.sort_unstable_by_key(|c| c.0);
        let (mut delta, mut next, mut total) = (0i128, 0, 0i128);
        for k in lo + 1..end {
            while next < changes.len() && changes[next].0 < k {
                delta += changes[next].1;
                next += 1;
            }
            if delta != 0 {
                let live = self.live[k] as i128;
                total += self.over(live + delta) - self.over(live);
            }
        }
        total
    }

    /// The excess change of inserting a copy of the node of appearance `j` before position
    /// `p` (`j < p`), serving the readers of `j` from `p` on.
    fn insert_delta(&self, j: usize, p: usize) -> i128 {
        let g = self.graph;
        let v = self.seq[j];
        let mut changes = vec![(
            self.last_reader_before(j, p),
            -(g.node(v).output_bytes as i128),
        )];
        let mut extended = 0i128;
        for (n, &i) in g.node(v).inputs.iter().enumerate() {
            if g.node(v).inputs[..n].contains(&i) {
                continue;
            }
            let a = self
                .latest_before(i, p)
                .expect("inputs appear before a copy");
            if self.last[a] < p {
                let b = g.node(i).output_bytes as i128;
                changes.push((self.last[a], b));
                extended += b;
            }
        }
        self.stretch_change(changes, p) + self.over(self.after[p - 1] as i128 + extended)
    }

    /// The excess change of deleting the copy at `q`.
    fn delete_delta(&self, q: usize) -> i128 {
        let g = self.graph;
        let v = self.seq[q];
        let j = self
            .latest_before(v, q)
            .expect("a copy has an earlier appearance");
        let mut changes = Vec::new();
        if self.last[q] > q {
            changes.push((self.last[j], g.node(v).output_bytes as i128));
        }
        for (n, &i) in g.node(v).inputs.iter().enumerate() {
            if g.node(v).inputs[..n].contains(&i) {
                continue;
            }
            let a = self
                .latest_before(i, q)
                .expect("inputs appear before a copy");
            if self.last[a] == q {
                changes.push((
                    self.last_reader_before(a, q),
                    -(g.node(i).output_bytes as i128),
                ));
            }
        }
        self.stretch_change(changes, q) - self.over(self.live[q] as i128)
    }
}

fn prefix(count: &mut [usize]) {
    let mut sum = 0;
    for c in count.iter_mut() {
        let here = *c;
        *c = sum;
        sum += here;
    }
}

/// Scratch arrays for replaying a trial sequence's excess without allocating.
struct Replay {
    latest: Vec<usize>,
    last: Vec<usize>,
    freed_at: Vec<u64>,
    trial: Vec<NodeId>,
}

impl Replay {
    fn new(graph: &Graph) -> Replay {
        Replay {
            latest: vec![0; graph.len()],
            last: Vec::new(),
            freed_at: Vec::new(),
            trial: Vec::new(),
        }
    }

    /// The excess of `self.trial`, by full replay (as [`State::rebuild`] counts it).
    fn excess(&mut self, graph: &Graph, budget: u64) -> u64 {
        let len = self.trial.len();
        self.last.clear();
        self.last.extend(0..len);
        for (k, &v) in self.trial.iter().enumerate() {
            for &i in &graph.node(v).inputs {
                self.last[self.latest[i]] = k;
            }
            self.latest[v] = k;
        }
        self.freed_at.clear();
        self.freed_at.resize(len, 0);
        for k in 0..len {
            self.freed_at[self.last[k]] += graph.node(self.trial[k]).output_bytes;
        }
        let (mut live, mut excess) = (graph.static_bytes(), 0u64);
        for k in 0..len {
            live += graph.node(self.trial[k]).output_bytes;
            excess = excess.saturating_add(live.saturating_sub(budget));
            live -= self.freed_at[k];
        }
        excess
    }
}

/// A proposed move.
enum Move {
    /// A copy of appearance `j`'s node before position `p`.
    Insert { j: usize, p: usize },
    /// The copy at `q` removed.
    Delete { q: usize },
    /// The copy at `q` moved to just before position `p` (of the sequence without it).
    Shift { q: usize, p: usize },
}

/// Anneals `start` (a sequence with copies, each appearance's inputs appearing before it)
/// until `deadline`; the cheapest fitting sequence found (copies' compute time), if any.
pub fn anneal(
    graph: &Graph,
    budget: u64,
    start: Vec<NodeId>,
    deadline: Instant,
    seed: u64,
    reorder: bool,
) -> Option<(Vec<NodeId>, f64)> {
    if graph.is_empty() || start.is_empty() {
        return None;
    }
    let mut state = State::new(graph, budget, start);
    let mut rng = Rng::new(seed);
    let mut replay = Replay::new(graph);
    let scale = Scale::of(graph);
    let mut best = (state.excess == 0).then(|| (state.seq.clone(), state.copy_time));
    let began = Instant::now();
    let total = deadline.saturating_duration_since(began).as_secs_f64();
    let mut moves = 0u64;
    let (mut weight, mut temp) = scale.at(0.0);
    loop {
        if moves.is_multiple_of(128) {
            let now = Instant::now();
            if now >= deadline || total <= 0.0 {
                break;
            }
            let f = (now - began).as_secs_f64() / total;
            (weight, temp) = scale.at(f);
        }
        moves += 1;
        let Some(mv) = propose(&state, &mut rng, reorder) else {
            continue;
        };
        let (d_time, d_excess) = evaluate(&state, &mv, &mut replay);
        let delta = d_time + weight * d_excess as f64;
        if delta > 0.0 && rng.unit() >= (-delta / temp).exp() {
            continue;
        }
        apply(&mut state, &mv);
        if state.excess == 0 && best.as_ref().is_none_or(|b| state.copy_time < b.1 - 1e-12) {
            best = Some((state.seq.clone(), state.copy_time));
        }
    }
    best
}

/// Penalty weight and temperature over the run, in units of the graph's typical node.
struct Scale {
    time: f64,
    bytes: f64,
}

impl Scale {
    fn of(graph: &Graph) -> Scale {
        let n = graph.len().max(1) as f64;
        let time: f64 = graph.nodes().iter().map(|x| x.compute_time).sum::<f64>() / n;
        let bytes: f64 = graph
            .nodes()
            .iter()
            .map(|x| x.output_bytes as f64)
            .sum::<f64>()
            / n;
        Scale {
            time: if time > 0.0 { time } else { 1.0 },
            bytes: bytes.max(1.0),
        }
    }

    /// `(weight per excess byte-step, temperature)` at fraction `f` of the run: the
    /// weight rises geometrically from 0.003 of a typical node's time per typical
    /// tensor-step to a thousand of them (starting low lets the search cross sequences
    /// over the budget: on Moccasin's n=500 at 0.9 a start at 0.1 kept the greedy's
    /// copies), the temperature falls from a tenth of a node's time to a thousandth.
    fn at(&self, f: f64) -> (f64, f64) {
        let f = f.clamp(0.0, 1.0);
        let geo = |a: f64, b: f64| a * (b / a).powf(f);
        let weight = geo(W_START, W_END) * self.time / self.bytes;
        let temp = geo(T_START, T_END) * self.time;
        (weight, temp)
    }
}

const W_START: f64 = 0.003;
const W_END: f64 = 1000.0;
const T_START: f64 = 0.1;
const T_END: f64 = 0.001;

/// A random move; first appearances move only with `reorder`.
fn propose(state: &State, rng: &mut Rng, reorder: bool) -> Option<Move> {
    let r = rng.unit();
    if r < P_INSERT {
        propose_insert(state, rng)
    } else if r < P_INSERT + P_DELETE {
        let q = *state.copies.get(rng.below(state.copies.len().max(1)))?;
        Some(Move::Delete { q })
    } else if r < P_INSERT + P_DELETE + P_SHIFT_COPY {
        let q = *state.copies.get(rng.below(state.copies.len().max(1)))?;
        let v = state.seq[q];
        let j = state.latest_before(v, q)?;
        // Between the previous appearance and the copy's last reader: the copy stays a
        // copy of the same appearance's readers or some of them.
        shift_within(q, j + 1, state.last[q].max(q + 1), rng)
    } else if reorder {
        propose_shift_first(state, rng)
    } else {
        None
    }
}

/// Shares of the moves: inserts, deletes, copies moved; the rest move first appearances.
const P_INSERT: f64 = 0.35;
const P_DELETE: f64 = 0.25;
const P_SHIFT_COPY: f64 = 0.1;

/// The appearance at `q` moved to before the element now at `at`, some `at` in `lo..=hi`.
fn shift_within(q: usize, lo: usize, hi: usize, rng: &mut Rng) -> Option<Move> {
    if hi < lo {
        return None;
    }
    let at = lo + rng.below(hi - lo + 1);
    // `at` counts positions with the appearance still in place.
    let p = if at > q { at - 1 } else { at };
    (p != q).then_some(Move::Shift { q, p })
}

/// A first appearance moved within its window: after the first appearance of each of its
/// inputs, before its first reader and its node's next appearance.
fn propose_shift_first(state: &State, rng: &mut Rng) -> Option<Move> {
    let g = state.graph;
    let q = rng.below(state.seq.len());
    let v = state.seq[q];
    let appears = &state.appears[state.appear_start[v]..state.appear_start[v + 1]];
    if appears.first() != Some(&q) {
        return None;
    }
    let lo = g
        .node(v)
        .inputs
        .iter()
        .map(|&i| state.appears[state.appear_start[i]] + 1)
        .max()
        .unwrap_or(0);
    let first_reader = state.readers_of(q).iter().copied().min();
    let next = appears.get(1).copied();
    let hi = [first_reader, next, Some(state.seq.len())]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(state.seq.len());
    shift_within(q, lo, hi, rng)
}

/// A copy of an appearance resident over an over-budget step (half the time when there is
/// one) or of any appearance, before one of its later readers.
fn propose_insert(state: &State, rng: &mut Rng) -> Option<Move> {
    let g = state.graph;
    let len = state.seq.len();
    let (j, after) = if !state.over_steps.is_empty() && rng.unit() < 0.5 {
        let s = state.over_steps[rng.below(state.over_steps.len())];
        let j = (0..INSERT_TRIES)
            .map(|_| rng.below(s.max(1)))
            .find(|&j| state.last[j] > s)?;
        (j, s)
    } else {
        (rng.below(len), 0)
    };
    if g.is_pinned(state.seq[j]) {
        return None;
    }
    let readers: Vec<usize> = state
        .readers_of(j)
        .iter()
        .copied()
        .filter(|&r| r > j + 1 && r > after)
        .collect();
    if readers.is_empty() {
        return None;
    }
    let p = if after > 0 {
        *readers.iter().min().expect("not empty")
    } else {
        readers[rng.below(readers.len())]
    };
    Some(Move::Insert { j, p })
}

/// Tries at sampling an appearance resident over a given step.
const INSERT_TRIES: usize = 24;

/// `(time change, excess change)` of a move.
fn evaluate(state: &State, mv: &Move, replay: &mut Replay) -> (f64, i128) {
    let g = state.graph;
    match *mv {
        Move::Insert { j, p } => (g.node(state.seq[j]).compute_time, state.insert_delta(j, p)),
        Move::Delete { q } => (-g.node(state.seq[q]).compute_time, state.delete_delta(q)),
        Move::Shift { q, p } => {
            replay.trial.clear();
            replay.trial.extend_from_slice(&state.seq);
            let v = replay.trial.remove(q);
            replay.trial.insert(p, v);
            let excess = replay.excess(g, state.budget);
            (0.0, excess as i128 - state.excess as i128)
        }
    }
}

fn apply(state: &mut State, mv: &Move) {
    match *mv {
        Move::Insert { j, p } => {
            let v = state.seq[j];
            state.seq.insert(p, v);
        }
        Move::Delete { q } => {
            state.seq.remove(q);
        }
        Move::Shift { q, p } => {
            let v = state.seq.remove(q);
            state.seq.insert(p, v);
        }
    }
    state.rebuild();
}

/// Share of the time left to the deadline that this phase gets, from the start of the
/// order search (the phases before it share the rest). Each accepted move rebuilds the
/// state, a pass over the sequence: on graphs up to [`SMALL`] nodes that allows some
/// 100,000 moves a second (n=500, 2 loaded cores); above, ten times fewer per node, too few to pay the time taken
/// from the other phases, so the share is smaller there.
const SHARE: f64 = 0.5;
const SHARE_LARGE: f64 = 0.3;
const SMALL: usize = 2000;

/// Until when the phases before this one may run, of the time left to `deadline`.
pub fn others_until(nodes: usize, deadline: Instant) -> Instant {
    let share = if nodes <= SMALL { SHARE } else { SHARE_LARGE };
    let now = Instant::now();
    now + deadline.saturating_duration_since(now).mul_f64(1.0 - share)
}

/// The phase in the anytime search: anneals the compute sequence of `best` (when it swaps
/// nothing) or else `order` with no copies, until `deadline`; the plan of the cheapest
/// fitting sequence, judged by the simulator (the caller keeps it only when faster).
pub fn phase(
    problem: &Problem,
    best: Option<&Planned>,
    order: &[NodeId],
    deadline: Instant,
) -> Result<Planned, PlanError> {
    let graph = problem.graph;
    // A run's length, however far the deadline (a caller with no clock to race): the
    // schedule spans the run, so it ends cooled and the phase returns.
    let cap = Instant::now() + MAX_RUN_PER_NODE * graph.len().max(1) as u32;
    let deadline = deadline.min(cap);
    let start = best
        .and_then(|b| compute_sequence(&b.plan.steps))
        .unwrap_or_else(|| order.to_vec());
    let Some((seq, _)) = anneal(
        graph,
        problem.budget_bytes,
        start,
        deadline,
        SEED,
        !graph.order_is_fixed(),
    ) else {
        return Err(PlanError::OverBudget {
            strategy: super::NAME.into(),
            budget: problem.budget_bytes,
            best_peak: graph.store_all_peak(),
        });
    };
    let steps = steps_of(graph, &Sequence { nodes: seq });
    let decisions = crate::exact::chain_graph::decisions_of(graph, &steps);
    plan_from_steps(problem, super::NAME, steps, decisions)
}

const SEED: u64 = 0xA11EA1;

/// The longest run, per node of the graph (1 s at 500 nodes).
const MAX_RUN_PER_NODE: std::time::Duration = std::time::Duration::from_millis(2);

/// The computes of a schedule in order, when it swaps nothing (a swap has no place in a
/// sequence of computations).
fn compute_sequence(steps: &[Step]) -> Option<Vec<NodeId>> {
    let mut seq = Vec::with_capacity(steps.len());
    for step in steps {
        match *step {
            Step::Compute { node } => seq.push(node),
            Step::Free { .. } => {}
            Step::SwapOut { .. } | Step::SwapIn { .. } => return None,
        }
    }
    Some(seq)
}

#[cfg(test)]
mod tests;
