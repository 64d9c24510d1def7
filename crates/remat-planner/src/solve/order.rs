//! Memory-aware topological orders: the first half of the solver.
//!
//! Why. A graph's given order is one topological order among many, and its store-all peak
//! is a property of the order, not of the graph: running a branch to completion before
//! starting the next, or running a node that frees large inputs before one that only
//! allocates, can lower the peak with no recomputation at all. FastSA (NeurIPS 2023)
//! reports zero overhead on Moccasin's random layered graphs at 0.9 and 0.8 of their given
//! order's peak for this reason. Our own search, in two steps:
//!
//! 1. **List scheduling** ([`list_schedule`]): repeatedly run, among the nodes whose
//!    predecessors have all run, the one that fits under the budget and adds the fewest net
//!    bytes (its output minus the inputs it is the last reader of), with several tie-breaks
//!    ([`TieBreak`]): each gives a different order, and the eviction pass is run on the best.
//! 2. **Local moves** ([`improve`]): move one node to another position inside its
//!    dependency window (after its last predecessor, before its first successor), keeping
//!    the move when the order's memory excess over the budget (bytes above the budget summed
//!    over steps, then the peak) does not grow. Plateau moves are accepted so the search can
//!    cross flat regions; a move that makes things worse is undone.
//! 3. **Annealing** ([`anneal`]) before either: the same moves, but a worsening one is
//!    taken with a probability that falls over the run. Plain descent stalls a few percent
//!    above the budget on Moccasin's random layered graphs (n=500 at 0.9: excess 110,086
//!    byte-steps, peak 266,889), annealing from the same list schedule gets to 7,372 and
//!    259,489 in 0.4 s.
//!
//! Constraints beyond the data edges ([`Precedence`]): a graph marked
//! [`Graph::with_fixed_order`] keeps its order; the readers of a pinned tensor keep their
//! relative order, since a pinned tensor is one later operations accumulate into in place
//! (see [`Graph::with_pinned`]) and the order of those additions is part of the result.
//!
//! Why one file of ~610 lines: precedence, the incremental peak evaluator, list scheduling and
//! the local search share the `Searched` state and form one half of the solver, read in
//! order; the tests are already in `order/tests.rs`.

use crate::ir::GraphError;
use crate::ir::{Graph, NodeId};

/// Predecessors and successors that every order must respect.
#[derive(Clone, Debug)]
pub struct Precedence {
    pub preds: Vec<Vec<NodeId>>,
    pub succs: Vec<Vec<NodeId>>,
}

impl Precedence {
    /// The data edges, the chains of each pinned tensor's readers, and, on a graph whose
    /// order is fixed, the chain of all nodes.
    pub fn of(graph: &Graph) -> Precedence {
        let n = graph.len();
        let mut preds: Vec<Vec<NodeId>> = graph.nodes().iter().map(|v| v.inputs.clone()).collect();
        for p in graph.pinned() {
            for pair in graph.users(p).windows(2) {
                preds[pair[1]].push(pair[0]);
            }
        }
        if graph.order_is_fixed() {
            for (v, list) in preds.iter_mut().enumerate().skip(1) {
                list.push(v - 1);
            }
        }
        let mut succs = vec![Vec::new(); n];
        for (v, list) in preds.iter_mut().enumerate() {
            list.sort_unstable();
            list.dedup();
            for &p in list.iter() {
                succs[p].push(v);
            }
        }
        Precedence { preds, succs }
    }
}

/// Memory of the store-all schedule of an order against a budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Profile {
    /// Bytes above the budget summed over the steps (saturating).
    pub excess: u64,
    /// The store-all peak, static bytes included.
    pub peak: u64,
}

/// Evaluates orders; holds the scratch arrays so each evaluation allocates nothing.
pub struct Evaluator<'g> {
    graph: &'g Graph,
    budget: u64,
    last: Vec<usize>,
    freed_at: Vec<u64>,
}

impl<'g> Evaluator<'g> {
    pub fn new(graph: &'g Graph, budget: u64) -> Evaluator<'g> {
        Evaluator {
            graph,
            budget,
            last: vec![0; graph.len()],
            freed_at: vec![0; graph.len()],
        }
    }

    /// The store-all profile of `order`, whose positions are `pos` (`pos[order[k]] == k`).
    /// Accounting as [`Graph::store_all_peak`]: an output lives from its computation until
    /// its last reader in this order has run.
    pub fn profile(&mut self, order: &[NodeId], pos: &[usize]) -> Profile {
        let g = self.graph;
        for (k, &v) in order.iter().enumerate() {
            self.last[v] = g.users(v).iter().map(|&u| pos[u]).max().unwrap_or(k);
            self.freed_at[k] = 0;
        }
        for v in 0..g.len() {
            self.freed_at[self.last[v]] += g.node(v).output_bytes;
        }
        let mut live = g.static_bytes();
        let (mut peak, mut excess) = (live, 0u64);
        for (k, &v) in order.iter().enumerate() {
            live += g.node(v).output_bytes;
            peak = peak.max(live);
            excess = excess.saturating_add(live.saturating_sub(self.budget));
            live -= self.freed_at[k];
        }
        Profile { excess, peak }
    }
}

/// Positions of an order: `pos[order[k]] == k`.
pub fn positions(order: &[NodeId]) -> Vec<usize> {
    let mut pos = vec![0; order.len()];
    for (k, &v) in order.iter().enumerate() {
        pos[v] = k;
    }
    pos
}

/// How list scheduling breaks ties between ready nodes adding the same net bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TieBreak {
    /// The earliest in the given order: stays close to it.
    GivenOrder,
    /// The node that became ready last: finishes one branch before starting the next.
    LastReady,
    /// The node freeing the most bytes.
    MostFreed,
    /// The smallest output.
    SmallestOutput,
}

pub const TIE_BREAKS: [TieBreak; 4] = [
    TieBreak::GivenOrder,
    TieBreak::LastReady,
    TieBreak::MostFreed,
    TieBreak::SmallestOutput,
];

/// A memory-aware topological order (see the module docs). `budget` steers the first key:
/// a node whose computation stays under the budget goes before one that would pass it.
pub fn list_schedule(graph: &Graph, prec: &Precedence, budget: u64, tie: TieBreak) -> Vec<NodeId> {
    let n = graph.len();
    let mut waiting: Vec<usize> = prec.preds.iter().map(Vec::len).collect();
    let mut readers_left: Vec<usize> = (0..n).map(|v| graph.users(v).len()).collect();
    let mut ready: Vec<(NodeId, usize)> = Vec::new();
    let mut stamp = 0usize;
    for v in (0..n).filter(|&v| waiting[v] == 0) {
        ready.push((v, stamp));
        stamp += 1;
    }
    let mut live = graph.static_bytes();
    let mut order = Vec::with_capacity(n);
    while !ready.is_empty() {
        let at = pick(graph, &ready, &readers_left, live, budget, tie);
        let (v, _) = ready.swap_remove(at);
        order.push(v);
        live += graph.node(v).output_bytes;
        for &i in &graph.node(v).inputs {
            readers_left[i] -= 1;
            if readers_left[i] == 0 {
                live -= graph.node(i).output_bytes;
            }
        }
        if graph.users(v).is_empty() {
            live -= graph.node(v).output_bytes;
        }
        for &s in &prec.succs[v] {
            waiting[s] -= 1;
            if waiting[s] == 0 {
                ready.push((s, stamp));
                stamp += 1;
            }
        }
    }
    order
}

/// Index in `ready` of the node to run next.
fn pick(
    graph: &Graph,
    ready: &[(NodeId, usize)],
    readers_left: &[usize],
    live: u64,
    budget: u64,
    tie: TieBreak,
) -> usize {
    let key = |&(v, stamp): &(NodeId, usize)| {
        let node = graph.node(v);
        let out = node.output_bytes;
        let mut freed: u64 = node
            .inputs
            .iter()
            .filter(|&&i| readers_left[i] == 1)
            .map(|&i| graph.node(i).output_bytes)
            .sum();
        if graph.users(v).is_empty() {
            freed += out;
        }
        let over = live + out > budget;
        let net = out as i128 - freed as i128;
        let tie_key: i128 = match tie {
            TieBreak::GivenOrder => v as i128,
            TieBreak::LastReady => -(stamp as i128),
            TieBreak::MostFreed => -(freed as i128),
            TieBreak::SmallestOutput => out as i128,
        };
        (over, net, tie_key, v)
    };
    let mut best = 0;
    let mut best_key = key(&ready[0]);
    for (i, entry) in ready.iter().enumerate().skip(1) {
        let k = key(entry);
        if k < best_key {
            best = i;
            best_key = k;
        }
    }
    best
}

/// A small deterministic generator (SplitMix64), so searches repeat exactly.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// An order under local search: the order, its positions and its profile, with the
/// per-step memory kept so that a move is judged over the stretch it changes.
///
/// Why a move changes only its window. Moving node `v` from position `f` to `t` keeps the
/// relative order of every other node, so every other node's lifetime keeps its ends, but
/// for the inputs of `v`, whose last reader may become or stop being `v`. A step outside
/// `min(f, t) ..= max(f, t)` runs with the same tensors live as before (the nodes before it
/// are the same set, and a lifetime that changed ends inside the window). So a move
/// recomputes the live bytes of its window only, from the bytes live before it
/// ([`Searched::try_shift`]); on Moccasin's n=1000 graph that is some ten times fewer steps
/// than a replay of the whole order.
pub struct Searched {
    pub order: Vec<NodeId>,
    pub pos: Vec<usize>,
    pub profile: Profile,
    /// The node whose run frees each node's output: its last reader, or itself.
    last_reader: Vec<NodeId>,
    /// Bytes freed once each node has run.
    freed_by: Vec<u64>,
    /// Live bytes while each step runs (its output included), and after its frees.
    live: Vec<u64>,
    after: Vec<u64>,
    /// What [`Searched::undo`] restores: the window's first position and its memory, and
    /// the last readers changed.
    undo_lo: usize,
    undo_live: Vec<u64>,
    undo_after: Vec<u64>,
    undo_readers: Vec<(NodeId, NodeId, u64)>,
    undo_move: (usize, usize),
    undo_profile: Profile,
}

impl Searched {
    pub fn new(order: Vec<NodeId>, eval: &mut Evaluator) -> Searched {
        let mut s = Searched {
            pos: Vec::new(),
            order,
            profile: Profile { excess: 0, peak: 0 },
            last_reader: Vec::new(),
            freed_by: Vec::new(),
            live: Vec::new(),
            after: Vec::new(),
            undo_lo: 0,
            undo_live: Vec::new(),
            undo_after: Vec::new(),
            undo_readers: Vec::new(),
            undo_move: (0, 0),
            undo_profile: Profile { excess: 0, peak: 0 },
        };
        s.rebuild(eval);
        s
    }

    /// Live bytes while each step of the order runs (its output included, static bytes
    /// too): the store-all profile.
    pub fn live(&self) -> &[u64] {
        &self.live
    }

    /// Replaces the order and recomputes everything from it.
    pub fn set_order(&mut self, order: Vec<NodeId>, eval: &mut Evaluator) {
        self.order = order;
        self.rebuild(eval);
    }

    /// Positions, last readers and the memory of every step, from `order` (the accounting
    /// of [`Evaluator::profile`], which also gives the profile).
    fn rebuild(&mut self, eval: &mut Evaluator) {
        let g = eval.graph;
        self.pos = positions(&self.order);
        self.profile = eval.profile(&self.order, &self.pos);
        self.last_reader = (0..g.len()).map(|v| self.last_reader_of(g, v)).collect();
        self.freed_by.clear();
        self.freed_by.resize(g.len(), 0);
        for v in 0..g.len() {
            self.freed_by[self.last_reader[v]] += g.node(v).output_bytes;
        }
        self.live.clear();
        self.after.clear();
        let mut live = g.static_bytes();
        for &v in &self.order {
            live += g.node(v).output_bytes;
            self.live.push(live);
            live -= self.freed_by[v];
            self.after.push(live);
        }
    }

    /// The reader of `v` that runs last in the current order, or `v` when none.
    fn last_reader_of(&self, g: &Graph, v: NodeId) -> NodeId {
        g.users(v)
            .iter()
            .copied()
            .max_by_key(|&u| self.pos[u])
            .unwrap_or(v)
    }

    /// Moves the node at position `from` to position `to`, shifting the nodes between.
    fn shift(&mut self, from: usize, to: usize) {
        if from < to {
            self.order[from..=to].rotate_left(1);
        } else {
            self.order[to..=from].rotate_right(1);
        }
        for k in from.min(to)..=from.max(to) {
            self.pos[self.order[k]] = k;
        }
    }

    /// Applies the move of the node at `from` to `to` (inside its dependency window) and
    /// returns the new profile; [`Searched::undo`] takes it back. `profile` is not updated:
    /// the caller decides.
    pub fn try_shift(&mut self, from: usize, to: usize, eval: &Evaluator) -> Profile {
        let g = eval.graph;
        let v = self.order[from];
        self.shift(from, to);
        self.undo_move = (from, to);
        self.undo_profile = self.profile;
        self.undo_readers.clear();
        for &i in &g.node(v).inputs {
            let last = self.last_reader_of(g, i);
            let old = self.last_reader[i];
            if last != old {
                let bytes = g.node(i).output_bytes;
                self.freed_by[old] -= bytes;
                self.freed_by[last] += bytes;
                self.last_reader[i] = last;
                self.undo_readers.push((i, old, bytes));
            }
        }
        let (lo, hi) = (from.min(to), from.max(to));
        self.undo_lo = lo;
        self.undo_live.clear();
        self.undo_live.extend_from_slice(&self.live[lo..=hi]);
        self.undo_after.clear();
        self.undo_after.extend_from_slice(&self.after[lo..=hi]);
        let over = |live: u64| live.saturating_sub(eval.budget) as i128;
        let mut live = if lo == 0 {
            g.static_bytes()
        } else {
            self.after[lo - 1]
        };
        let (mut delta, mut new_max) = (0i128, 0u64);
        for k in lo..=hi {
            let x = self.order[k];
            let running = live + g.node(x).output_bytes;
            delta += over(running) - over(self.live[k]);
            new_max = new_max.max(running);
            self.live[k] = running;
            live = running - self.freed_by[x];
            self.after[k] = live;
        }
        debug_assert_eq!(Some(&live), self.undo_after.last());
        let old = self.profile;
        let old_max = self.undo_live.iter().copied().max().unwrap_or(0);
        let peak = if new_max >= old.peak {
            new_max
        } else if old_max < old.peak {
            old.peak
        } else {
            // The old peak was inside the window and fell: the highest step anywhere.
            self.live
                .iter()
                .copied()
                .max()
                .unwrap_or(0)
                .max(g.static_bytes())
        };
        let excess = (old.excess as i128 + delta).clamp(0, u64::MAX as i128) as u64;
        Profile { excess, peak }
    }

    /// Takes back the last [`Searched::try_shift`].
    pub fn undo(&mut self) {
        let (from, to) = self.undo_move;
        self.shift(to, from);
        while let Some((i, old, bytes)) = self.undo_readers.pop() {
            let last = self.last_reader[i];
            self.freed_by[last] -= bytes;
            self.freed_by[old] += bytes;
            self.last_reader[i] = old;
        }
        let lo = self.undo_lo;
        let hi = lo + self.undo_live.len();
        self.live[lo..hi].copy_from_slice(&self.undo_live);
        self.after[lo..hi].copy_from_slice(&self.undo_after);
        self.profile = self.undo_profile;
    }
}

/// `tries` random window moves on `s` (see the module docs), stopping early when the
/// excess reaches zero or `stop()` says so. Returns whether the profile improved.
pub fn improve(
    s: &mut Searched,
    prec: &Precedence,
    eval: &mut Evaluator,
    rng: &mut Rng,
    tries: usize,
    mut stop: impl FnMut() -> bool,
) -> bool {
    let start = s.profile;
    let n = s.order.len();
    for attempt in 0..tries {
        if s.profile.excess == 0 || (attempt % 64 == 0 && stop()) {
            break;
        }
        let Some((from, to)) = random_move(s, prec, rng, n) else {
            continue;
        };
        let profile = s.try_shift(from, to, eval);
        if profile <= s.profile {
            s.profile = profile;
        } else {
            s.undo();
        }
    }
    s.profile < start
}

/// Simulated annealing on `s` until `stop()` or zero excess: the window moves of
/// [`improve`], but a move that adds excess is also taken, with probability
/// `exp(-added / temperature)`, so the search can leave the local minima where plain
/// descent stalls (on Moccasin's random layered graphs, a few percent above the budget).
/// The temperature falls geometrically over `moves` moves from the mean excess a random
/// worsening move adds. `s` ends at the best order seen.
pub fn anneal(
    s: &mut Searched,
    prec: &Precedence,
    eval: &mut Evaluator,
    rng: &mut Rng,
    moves: usize,
    mut stop: impl FnMut() -> bool,
) -> bool {
    let start = s.profile;
    let n = s.order.len();
    let mut best = (s.profile, s.order.clone());
    let mut temperature = 0.0f64;
    let (mut sampled, mut sum) = (0usize, 0f64);
    const SAMPLES: usize = 64;
    let mut cooling = 1.0;
    for attempt in 0..moves {
        if best.0.excess == 0 || (attempt % 64 == 0 && stop()) {
            break;
        }
        let Some((from, to)) = random_move(s, prec, rng, n) else {
            continue;
        };
        let profile = s.try_shift(from, to, eval);
        let added = profile.excess.saturating_sub(s.profile.excess) as f64;
        let take = if profile <= s.profile {
            true
        } else if sampled < SAMPLES {
            // Calibration: the first worsening moves set the starting temperature.
            sampled += 1;
            sum += added;
            if sampled == SAMPLES {
                temperature = (sum / SAMPLES as f64).max(1.0);
                let left = (moves - attempt).max(1) as f64;
                cooling = (1e-3f64).powf(1.0 / left);
            }
            false
        } else {
            added > 0.0 && rng.unit() < (-added / temperature).exp()
        };
        if take {
            s.profile = profile;
            if profile < best.0 {
                best = (profile, s.order.clone());
            }
        } else {
            s.undo();
        }
        temperature *= cooling;
    }
    if best.0 < s.profile {
        s.set_order(best.1, eval);
        debug_assert_eq!(s.profile, best.0);
    }
    s.profile < start
}

/// A random window move of one node, as positions `(from, to)`; `None` when the drawn node
/// cannot move.
fn random_move(s: &Searched, prec: &Precedence, rng: &mut Rng, n: usize) -> Option<(usize, usize)> {
    let v = s.order[rng.below(n)];
    let lo = prec.preds[v]
        .iter()
        .map(|&p| s.pos[p] + 1)
        .max()
        .unwrap_or(0);
    let hi = prec.succs[v]
        .iter()
        .map(|&q| s.pos[q])
        .min()
        .unwrap_or(n)
        .saturating_sub(1);
    let from = s.pos[v];
    if hi <= lo {
        return None;
    }
    let to = lo + rng.below(hi - lo + 1);
    (to != from).then_some((from, to))
}

/// The graph with its nodes renumbered in `order` (node `order[k]` becomes node `k`), pins
/// and the fixed-order mark carried over, so any strategy can plan it; map its steps back
/// with `order`.
pub fn reordered(graph: &Graph, order: &[NodeId]) -> Result<Graph, GraphError> {
    let pos = positions(order);
    let nodes = order
        .iter()
        .map(|&v| {
            let mut node = graph.node(v).clone();
            for i in &mut node.inputs {
                *i = pos[*i];
            }
            node
        })
        .collect();
    let g = Graph::new(
        graph.name(),
        nodes,
        graph.static_bytes(),
        graph.time_unit_s(),
    )?
    .with_pinned(graph.pinned().map(|p| pos[p]))?;
    Ok(if graph.order_is_fixed() {
        g.with_fixed_order()
    } else {
        g
    })
}

/// Whether `order` is a topological order respecting `prec` and naming every node once.
pub fn is_valid(order: &[NodeId], prec: &Precedence) -> bool {
    let n = prec.preds.len();
    if order.len() != n {
        return false;
    }
    let mut seen = vec![false; n];
    for &v in order {
        if v >= n || seen[v] || prec.preds[v].iter().any(|&p| !seen[p]) {
            return false;
        }
        seen[v] = true;
    }
    true
}

#[cfg(test)]
mod tests;
