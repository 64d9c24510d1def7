//! Recomputations inserted into an order: the solver's answer when an order comes close to
//! the budget but not under it.
//!
//! Why. The annealed orders of [`super::order`] often end a percent or two above the budget
//! (Moccasin's random layered n=500 at 0.9: peak 1.4% over), and the eviction passes,
//! which decide step by step which resident tensor to drop and rebuild every missing
//! ancestor on demand, thrash there: one drop forces a rebuild chain that forces more
//! drops. FastSA (NeurIPS 2023) instead treats a recomputation as one more operation in
//! the sequence: a copy of a node, placed somewhere after its first run, that reads the
//! latest copies of its inputs and serves every later reader. Its lifetime and its inputs'
//! lifetimes then follow from the sequence like any other node's, so a candidate is judged
//! by the exact memory profile of the sequence it makes, with no cascade: a copy only ever
//! reads tensors that are resident at its position, extended if need be.
//!
//! The search here is greedy and ours: at the step of highest memory, every tensor resident
//! there but not read there is a candidate; it is recomputed just before its next reader
//! (or earlier, where its inputs are still resident), and the candidate removing the most
//! excess (bytes above the budget summed over steps) per unit of compute time is taken.
//! Repeat until the sequence fits; then drop the copies that turn out unneeded, costliest
//! first.
//!
//! Where the profile is above the budget over most of the sequence (random layered n=5,000
//! at 0.8 of its peak: every tensor read by readers thousands of steps apart), single
//! copies stick 12% over the budget: a copy's inputs were freed long before, so keeping
//! them costs more than the copy saves, and the copy's own step is above the budget too.
//! There, and wherever single copies stick, the greedy takes `Group`s (a copy with the
//! copies of the inputs it misses, two levels back) and counts first appearances' steps
//! only until those fit, then every step (see `Counted`). The sequence becomes explicit `compute` / `free` steps: every copy is freed right
//! after its last reader, so a node is never resident twice.
//!
//! Why one file of ~930 lines: one greedy with its repairs; the fit, its batches, the swaps
//! and the drops all work on the same `Copies` and the same incremental excess accounting
//! (`Index`, `Group`), so apart each part would reach into the others' internals.

use std::collections::HashSet;
use std::time::Instant;

use crate::ir::{Graph, NodeId};
use crate::plan::Step;

use super::order::Profile;

/// An operation sequence in which a node may appear more than once (its recomputations).
/// Each appearance reads the latest earlier appearance of each of its inputs.
pub struct Sequence {
    pub nodes: Vec<NodeId>,
}

/// Lifetimes of the appearances of a sequence: what [`Scratch::lifetimes`] fills in.
struct Lifetimes {
    /// Position of the last reader of the appearance at each position (itself when none).
    last: Vec<usize>,
    /// Live bytes while the operation at each position runs (its output included).
    live: Vec<u64>,
    /// Live bytes once the operation at each position has run and its frees are done.
    after: Vec<u64>,
    /// Whether the appearance at each position is a copy (a later appearance of its node).
    copy: Vec<bool>,
    /// What `profile.excess` counts.
    counted: Counted,
    profile: Profile,
}

/// What the greedy's excess counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Counted {
    /// Every step: the sequence fits when this excess is zero.
    AllSteps,
    /// The steps of first appearances only. A copy's own step holds what is resident
    /// before its reader, so where the profile is above the budget over long stretches
    /// (random layered n=5,000 at 0.8) every copy's step is over it too, and counting it
    /// makes every single copy raise the excess: the greedy stops with the peak 12% over.
    /// Counting first appearances only, copies are taken for what they relieve; the steps
    /// they add are then fitted under [`Counted::AllSteps`].
    Originals,
}

impl Counted {
    fn counts(self, copy: bool) -> bool {
        self == Counted::AllSteps || !copy
    }
}

/// Scratch arrays, so evaluating a candidate sequence allocates nothing.
struct Scratch<'g> {
    graph: &'g Graph,
    budget: u64,
    greedy: Greedy,
    counted: Counted,
    latest: Vec<usize>,
    /// Per node, the stamp of the last run that saw it (first appearances without clearing).
    seen: Vec<u32>,
    stamp: u32,
    copy: Vec<bool>,
    last: Vec<usize>,
    freed_at: Vec<u64>,
}

impl<'g> Scratch<'g> {
    fn new(graph: &'g Graph, budget: u64) -> Scratch<'g> {
        Scratch {
            graph,
            budget,
            greedy: Greedy::Singles,
            counted: Counted::AllSteps,
            latest: vec![0; graph.len()],
            seen: vec![0; graph.len()],
            stamp: 0,
            copy: Vec::new(),
            last: Vec::new(),
            freed_at: Vec::new(),
        }
    }

    /// Fills `last` and `freed_at` for `seq` with `extra` inserted before position `at`
    /// (none when `extra` is `None`), and returns the profile; `live`, when given, receives
    /// the live bytes at each position.
    fn run(
        &mut self,
        seq: &[NodeId],
        insert: Option<(usize, NodeId)>,
        mut live_out: Option<(&mut Vec<u64>, &mut Vec<u64>)>,
    ) -> Profile {
        let g = self.graph;
        let len = seq.len() + usize::from(insert.is_some());
        let at = |k: usize| -> NodeId {
            match insert {
                Some((p, v)) if k == p => v,
                Some((p, _)) if k > p => seq[k - 1],
                _ => seq[k],
            }
        };
        self.last.clear();
        self.last.resize(len, 0);
        self.freed_at.clear();
        self.freed_at.resize(len, 0);
        self.copy.clear();
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.seen.fill(0);
            self.stamp = 1;
        }
        for k in 0..len {
            let v = at(k);
            self.copy.push(self.seen[v] == self.stamp);
            self.seen[v] = self.stamp;
            self.last[k] = k;
            for &i in &g.node(v).inputs {
                self.last[self.latest[i]] = k;
            }
            self.latest[v] = k;
        }
        for k in 0..len {
            self.freed_at[self.last[k]] += g.node(at(k)).output_bytes;
        }
        if let Some((during, after)) = live_out.as_mut() {
            during.clear();
            after.clear();
        }
        let mut live = g.static_bytes();
        let (mut peak, mut excess) = (live, 0u64);
        for k in 0..len {
            live += g.node(at(k)).output_bytes;
            peak = peak.max(live);
            if self.counted.counts(self.copy[k]) {
                excess = excess.saturating_add(live.saturating_sub(self.budget));
            }
            let during = live;
            live -= self.freed_at[k];
            if let Some((during_out, after_out)) = live_out.as_mut() {
                during_out.push(during);
                after_out.push(live);
            }
        }
        Profile { excess, peak }
    }

    fn lifetimes(&mut self, seq: &[NodeId]) -> Lifetimes {
        let mut live = Vec::with_capacity(seq.len());
        let mut after = Vec::with_capacity(seq.len());
        let profile = self.run(seq, None, Some((&mut live, &mut after)));
        Lifetimes {
            last: self.last.clone(),
            live,
            after,
            copy: self.copy.clone(),
            counted: self.counted,
            profile,
        }
    }
}

/// Where the search ended.
pub enum Outcome {
    /// The sequence fits the budget.
    Fits(Sequence),
    /// No candidate lowers the excess any more (or the deadline passed); the peak reached.
    Stuck { peak: u64 },
}

/// Inserts recomputations into `order` (a topological order of `graph`) until its
/// store-all profile fits `budget` (see the module docs), stopping at `deadline`.
pub fn insert_recomputations(
    graph: &Graph,
    order: &[NodeId],
    budget: u64,
    deadline: Instant,
) -> Outcome {
    let mut scratch = Scratch::new(graph, budget);
    let start = Copies {
        seq: order.to_vec(),
        inserted: vec![false; order.len()],
    };
    // Below BATCH_FROM_NODES the single copies come first: their choices are the ones
    // measured against FastSA's figures there. Groups are the fallback when they stick,
    // and the only search above (see [`Greedy`]).
    let mut copies = start.clone();
    let mut fitted = Err(0);
    if graph.len() < BATCH_FROM_NODES {
        scratch.greedy = Greedy::Singles;
        fitted = fit_greedy(graph, &mut copies, None, &mut scratch, deadline);
    }
    if fitted.is_err() {
        scratch.greedy = Greedy::Groups;
        copies = start;
        fitted = fit_greedy(graph, &mut copies, None, &mut scratch, deadline);
    }
    if let Err(peak) = fitted {
        return Outcome::Stuck { peak };
    }
    drop_unneeded(graph, &mut copies, &mut scratch, deadline);
    swap_costliest(graph, &mut copies, &mut scratch, deadline);
    Outcome::Fits(Sequence { nodes: copies.seq })
}

/// A sequence under search and which of its appearances are inserted copies.
#[derive(Clone)]
struct Copies {
    seq: Vec<NodeId>,
    inserted: Vec<bool>,
}

impl Copies {
    fn cost(&self, graph: &Graph) -> f64 {
        self.seq
            .iter()
            .zip(&self.inserted)
            .filter(|&(_, &ins)| ins)
            .map(|(&v, _)| graph.node(v).compute_time)
            .sum()
    }
}

/// Which greedy [`fit_greedy`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Greedy {
    /// Single copies, every step counted: the sequence's excess is the guide.
    Singles,
    /// Copies with the inputs they miss (`Group`), first counting the first appearances'
    /// steps only, then every step (see `Counted`): what fits where the profile is above
    /// the budget over most of the sequence (random layered n=5,000 at 0.8).
    Groups,
}

/// [`fit`] as `scratch.greedy` says. With groups, the second phase starts from wherever
/// the first stopped, fitted or not.
fn fit_greedy(
    graph: &Graph,
    copies: &mut Copies,
    banned: Option<NodeId>,
    scratch: &mut Scratch,
    deadline: Instant,
) -> Result<(), u64> {
    if scratch.greedy == Greedy::Groups {
        scratch.counted = Counted::Originals;
        let _ = fit(graph, copies, banned, scratch, deadline);
    }
    scratch.counted = Counted::AllSteps;
    fit(graph, copies, banned, scratch, deadline)
}

/// Greedy insertions until the sequence fits (`Ok`) or nothing helps (`Err(peak)`);
/// `banned` is a node not to copy. On graphs of [`BATCH_FROM_NODES`] nodes or more, each
/// round takes a batch of copies that change disjoint stretches of the profile (see
/// [`independent`]) instead of the best one alone: one round costs a scan of every
/// candidate, and at 5,000 nodes a fit needs some 200 copies one by one (6 s).
fn fit(
    graph: &Graph,
    copies: &mut Copies,
    banned: Option<NodeId>,
    scratch: &mut Scratch,
    deadline: Instant,
) -> Result<(), u64> {
    loop {
        let life = scratch.lifetimes(&copies.seq);
        if life.profile.excess == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(life.profile.peak);
        }
        let batched = graph.len() >= BATCH_FROM_NODES;
        let floor = if batched { BATCH_SCORE_FLOOR } else { 1.0 };
        let depth = match scratch.greedy {
            Greedy::Singles => 0,
            Greedy::Groups => GROUP_DEPTH,
        };
        let search = Search {
            banned,
            budget: scratch.budget,
            floor,
            depth,
        };
        let ranked = ranked_insertions(graph, &copies.seq, &life, &search);
        let Some(top) = ranked.first().cloned() else {
            return Err(life.profile.peak);
        };
        if !batched {
            apply(copies, &[top]);
            continue;
        }
        // The batch's gains add up when the stretches they change are disjoint, and nearly
        // so where they overlap on steps far above the budget (the excess is linear there);
        // the full profile judges each batch, and the best copy alone stays the fallback.
        let mut best = (life.profile.excess - top.gain, vec![top.clone()]);
        for batch in [independent(&ranked), overlapping(&ranked)] {
            if batch.len() <= 1 {
                continue;
            }
            let mut trial = copies.clone();
            apply(&mut trial, &batch);
            let excess = scratch.run(&trial.seq, None, None).excess;
            if excess < best.0 {
                best = (excess, batch);
            }
        }
        apply(copies, &best.1);
    }
}

/// The best candidates, in rank order, of distinct nodes, whatever stretches they change.
fn overlapping(ranked: &[Insertion]) -> Vec<Insertion> {
    let mut batch: Vec<Insertion> = Vec::new();
    for c in ranked {
        if batch.len() >= MAX_BATCH {
            break;
        }
        if batch.iter().all(|b| b.v != c.v) {
            batch.push(c.clone());
        }
    }
    batch
}

/// Graphs from this many nodes on take copies in batches (see [`fit`]); below, one copy a
/// round, as the greedy's choices there are measured against FastSA's figures.
const BATCH_FROM_NODES: usize = 2000;

/// A batch takes copies scoring at least this share of the best one's score: the
/// sequential greedy would not take a much worse copy while a better one remains.
const BATCH_SCORE_FLOOR: f64 = 0.3;

/// Copies a batch takes at most.
const MAX_BATCH: usize = 64;

/// Inserts the copies, the latest position first so earlier positions stay valid.
fn apply(copies: &mut Copies, batch: &[Insertion]) {
    let mut batch = batch.to_vec();
    batch.sort_by_key(|c| std::cmp::Reverse(c.at));
    for c in batch {
        // Inserted last first, so the group runs in its order: inputs before readers.
        for &v in c.group.iter().rev() {
            copies.seq.insert(c.at, v);
            copies.inserted.insert(c.at, true);
        }
    }
}

/// The best candidates, in rank order, whose changed stretches (`from`, `at`] are
/// pairwise disjoint and whose nodes differ: each one's gain was computed on the profile
/// the others leave untouched.
fn independent(ranked: &[Insertion]) -> Vec<Insertion> {
    let mut batch: Vec<Insertion> = Vec::new();
    for c in ranked {
        if batch.len() >= MAX_BATCH {
            break;
        }
        let apart = batch
            .iter()
            .all(|b| b.v != c.v && (c.at <= b.from || b.at <= c.from));
        if apart {
            batch.push(c.clone());
        }
    }
    batch
}

/// Tries each copy, costliest first, removed and the sequence refitted without copying
/// that node; keeps the result when the copies cost less in all. The greedy choice of the
/// first copies is the one most often wrong: a cheaper set appears once one is ruled out.
fn swap_costliest(graph: &Graph, copies: &mut Copies, scratch: &mut Scratch, deadline: Instant) {
    let mut tried: Vec<NodeId> = Vec::new();
    while Instant::now() < deadline && tried.len() < SWAP_TRIES {
        let Some(k) = (0..copies.seq.len())
            .filter(|&k| copies.inserted[k] && !tried.contains(&copies.seq[k]))
            .max_by(|&a, &b| {
                let t = |k: usize| graph.node(copies.seq[k]).compute_time;
                t(a).total_cmp(&t(b))
            })
        else {
            return;
        };
        let v = copies.seq[k];
        tried.push(v);
        let mut trial = copies.clone();
        trial.seq.remove(k);
        trial.inserted.remove(k);
        if fit_greedy(graph, &mut trial, Some(v), scratch, deadline).is_err() {
            continue;
        }
        drop_unneeded(graph, &mut trial, scratch, deadline);
        if trial.cost(graph) < copies.cost(graph) {
            *copies = trial;
        }
    }
}

/// A candidate copy: of the appearance at `j` (node `v`), inserted before position `at`
/// with the copies of its inputs in `group` (see `Group`; `v` last); it changes the
/// profile over steps `from + 1 ..= at` only, removing `gain` bytes of excess, `score`
/// per unit of the group's compute time.
#[derive(Clone, Debug)]
struct Insertion {
    at: usize,
    v: NodeId,
    group: Vec<NodeId>,
    from: usize,
    gain: u64,
    score: f64,
}

/// The insertion `(position, node)` removing the most excess per unit of compute time (see
/// [`ranked_insertions`]); `None` when none lowers the excess.
#[cfg(test)]
fn best_insertion(
    graph: &Graph,
    seq: &[NodeId],
    life: &Lifetimes,
    banned: Option<NodeId>,
    budget: u64,
) -> Option<(usize, NodeId)> {
    let search = Search {
        banned,
        budget,
        floor: 1.0,
        depth: 0,
    };
    ranked_insertions(graph, seq, life, &search)
        .first()
        .map(|c| (c.at, c.v))
}

/// What [`ranked_insertions`] looks for: copies of nodes other than `banned`, scoring at
/// least `floor` times the best, single or in groups `depth` levels deep (0: single only).
struct Search {
    banned: Option<NodeId>,
    budget: u64,
    floor: f64,
    depth: usize,
}

/// The insertions lowering the excess, most excess removed per unit of compute time first
/// (more excess first among equals, then the order found), among the tensors resident but
/// unread at the step of highest memory and at the other steps of [`steps_to_relieve`].
/// Only those scoring at least `floor` times the best score are returned (at least the
/// best); a candidate whose bound ([`Over::gain_bound`]) rules that out is not evaluated,
/// which is what makes a round affordable at 5,000 nodes.
fn ranked_insertions(
    graph: &Graph,
    seq: &[NodeId],
    life: &Lifetimes,
    search: &Search,
) -> Vec<Insertion> {
    let &Search {
        banned,
        budget,
        floor,
        depth: group_depth,
    } = search;
    let Some(peak) = (0..seq.len()).max_by_key(|&k| (life.live[k], std::cmp::Reverse(k))) else {
        return Vec::new();
    };
    let index = Index::of(graph, seq);
    let over = Over::of(life, budget);
    // Every candidate's bound first (cheap), then the evaluations (a pass over the steps
    // the copy changes), best bound first: once a bound is below what the best found
    // already scores, so is every later one.
    let mut bounded: Vec<(f64, usize, NodeId, usize)> = Vec::new();
    let mut seen: HashSet<(usize, usize)> = HashSet::new();
    for s in steps_to_relieve(life, budget, peak) {
        let read_at_s = &graph.node(seq[s]).inputs;
        for (j, &v) in seq.iter().enumerate().take(s) {
            if life.last[j] <= s
                || read_at_s.contains(&v)
                || graph.is_pinned(v)
                || banned == Some(v)
            {
                continue;
            }
            // Only the latest appearance of v before s can be resident at s.
            if index.latest_before(v, s) != Some(j) {
                continue;
            }
            let Some(&u) = index.readers[j].iter().find(|&&r| r > s) else {
                continue;
            };
            let own_cost = graph.node(v).compute_time.max(f64::MIN_POSITIVE);
            for at in insertion_points(graph, &index, &life.last, s, u, v) {
                if !seen.insert((j, at)) {
                    continue;
                }
                let freed_from = last_reader_before(&index, j, at);
                // A group costs at least v's own time, so this bounds every group's score.
                let bound = over.gain_bound(freed_from, at, graph.node(v).output_bytes);
                if bound > 0 {
                    bounded.push((bound as f64 / own_cost, j, v, at));
                }
            }
        }
    }
    // Stable: among equal bounds the order found stays.
    bounded.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut best_score = 0.0f64;
    let mut found: Vec<Insertion> = Vec::new();
    for (bound_score, j, v, at) in bounded {
        if bound_score < best_score * floor {
            break;
        }
        let depths: &[usize] = if group_depth == 0 {
            &[0]
        } else {
            &[0, group_depth]
        };
        for &depth in depths {
            let group = Group::of(graph, &index, life, v, at, depth);
            if depth > 0 && group.nodes.len() == 1 {
                continue;
            }
            let cost = group.cost(graph);
            let own_cost = graph.node(v).compute_time.max(f64::MIN_POSITIVE);
            if bound_score * own_cost / cost < best_score * floor {
                continue;
            }
            let (gain, from) = group.change(graph, &index, life, budget, j, at);
            if gain <= 0 {
                continue;
            }
            let gain = gain as u64;
            let score = gain as f64 / cost;
            best_score = best_score.max(score);
            found.push(Insertion {
                at,
                v,
                group: group.nodes,
                from,
                gain,
                score,
            });
        }
    }
    // Stable: among exact ties the first found stays first.
    found.sort_by(|a, b| b.score.total_cmp(&a.score).then(b.gain.cmp(&a.gain)));
    found.retain(|c| c.score >= best_score * floor);
    found
}

/// Prefix sums over the profile's steps above the budget, for [`Over::gain_bound`].
struct Over {
    /// Steps above the budget among the first `k`.
    count: Vec<u64>,
    /// Bytes above the budget summed over the first `k` steps.
    excess: Vec<u128>,
}

impl Over {
    fn of(life: &Lifetimes, budget: u64) -> Over {
        let mut count = Vec::with_capacity(life.live.len() + 1);
        let mut excess = Vec::with_capacity(life.live.len() + 1);
        let (mut c, mut e) = (0u64, 0u128);
        count.push(c);
        excess.push(e);
        for (&live, &copy) in life.live.iter().zip(&life.copy) {
            let counted = life.counted.counts(copy);
            let above = if counted {
                live.saturating_sub(budget)
            } else {
                0
            };
            c += u64::from(above > 0);
            e += u128::from(above);
            count.push(c);
            excess.push(e);
        }
        Over { count, excess }
    }

    /// An upper bound on the excess a copy of a `bytes`-byte tensor, freed after step
    /// `freed_from` instead of staying resident to `at`, removes: at most `bytes` at each
    /// step between, and at most that step's excess. The inputs it keeps longer and the
    /// copy's own step only add memory.
    fn gain_bound(&self, freed_from: usize, at: usize, bytes: u64) -> u128 {
        if at <= freed_from + 1 {
            return 0;
        }
        let (lo, hi) = (freed_from + 1, at);
        let steps = u128::from(self.count[hi] - self.count[lo]);
        (steps * u128::from(bytes)).min(self.excess[hi] - self.excess[lo])
    }
}

/// Where the appearance at `j` is freed when a copy inserted before `at` serves every
/// later reader: after its last reader before `at` (itself when none).
fn last_reader_before(index: &Index, j: usize, at: usize) -> usize {
    index.readers[j]
        .iter()
        .copied()
        .filter(|&r| r < at)
        .max()
        .unwrap_or(j)
}

/// The steps whose resident tensors are candidates: the peak, and up to
/// [`RELIEVED_STEPS`] others above the budget spread over the sequence, so a tensor
/// resident across many of them (the cheapest fix for all at once) is seen.
fn steps_to_relieve(life: &Lifetimes, budget: u64, peak: usize) -> Vec<usize> {
    let over: Vec<usize> = (0..life.live.len())
        .filter(|&k| life.live[k] > budget)
        .collect();
    let stride = over.len().div_ceil(RELIEVED_STEPS).max(1);
    let mut steps = vec![peak];
    steps.extend(over.iter().copied().step_by(stride).filter(|&k| k != peak));
    steps
}

/// Steps besides the peak whose residents are candidates in one greedy choice.
const RELIEVED_STEPS: usize = 8;

/// Who reads what in a sequence.
struct Index {
    /// The positions reading each appearance, in order.
    readers: Vec<Vec<usize>>,
    /// The positions of each node's appearances, in order.
    appearances: Vec<Vec<usize>>,
}

impl Index {
    fn of(graph: &Graph, seq: &[NodeId]) -> Index {
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); seq.len()];
        let mut appearances: Vec<Vec<usize>> = vec![Vec::new(); graph.len()];
        for (k, &v) in seq.iter().enumerate() {
            for &i in &graph.node(v).inputs {
                if let Some(&p) = appearances[i].last() {
                    readers[p].push(k);
                }
            }
            appearances[v].push(k);
        }
        Index {
            readers,
            appearances,
        }
    }

    /// The position of the latest appearance of `v` before position `s`.
    fn latest_before(&self, v: NodeId, s: usize) -> Option<usize> {
        let list = &self.appearances[v];
        let n = list.partition_point(|&p| p < s);
        n.checked_sub(1).map(|k| list[k])
    }
}

/// The excess a copy of the appearance at `j` (of node `v`) alone, inserted before position
/// `at`, removes (negative when it adds); see [`Group::change`].
#[cfg(test)]
fn excess_removed(
    graph: &Graph,
    index: &Index,
    life: &Lifetimes,
    budget: u64,
    (j, v): (usize, NodeId),
    at: usize,
) -> i128 {
    Group::of(graph, index, life, v, at, 0)
        .change(graph, index, life, budget, j, at)
        .0
}

/// Levels of inputs a group copies back from its node (see `Group`).
const GROUP_DEPTH: usize = 2;

/// Nodes a group copies at most: past it, inputs are kept resident instead.
const MAX_GROUP: usize = 12;

/// What a copy of `v` before position `at` recomputes and keeps. A copy reads the latest
/// appearances of its inputs; one freed before `at` must be kept resident until then,
/// which on a graph of long skip connections (every tensor read far apart) costs more than
/// the copy saves. A group copies such inputs too, up to `depth` levels back, just before
/// `v`, so only the inputs past that are kept longer.
struct Group {
    /// The copies, ascending ids (inputs before readers); `v` last.
    nodes: Vec<NodeId>,
    /// The appearances kept resident longer: (node, its last reader now, bytes).
    extended: Vec<(NodeId, usize, i128)>,
}

impl Group {
    fn of(
        graph: &Graph,
        index: &Index,
        life: &Lifetimes,
        v: NodeId,
        at: usize,
        depth: usize,
    ) -> Group {
        let mut nodes = vec![v];
        let mut extended: Vec<(NodeId, usize, i128)> = Vec::new();
        // Breadth first, so a node is met first at its smallest depth.
        let mut frontier = vec![(v, 0usize)];
        let mut next = 0;
        while let Some(&(x, d)) = frontier.get(next) {
            next += 1;
            for &i in &graph.node(x).inputs {
                if nodes.contains(&i) || extended.iter().any(|e| e.0 == i) {
                    continue;
                }
                let Some(p) = index.latest_before(i, at) else {
                    continue;
                };
                if life.last[p] >= at {
                    continue;
                }
                if d < depth && nodes.len() < MAX_GROUP && !graph.is_pinned(i) {
                    nodes.push(i);
                    frontier.push((i, d + 1));
                } else {
                    extended.push((i, life.last[p], graph.node(i).output_bytes as i128));
                }
            }
        }
        nodes.sort_unstable();
        Group { nodes, extended }
    }

    fn cost(&self, graph: &Graph) -> f64 {
        let total: f64 = self.nodes.iter().map(|&c| graph.node(c).compute_time).sum();
        total.max(f64::MIN_POSITIVE)
    }

    /// The excess the group, inserted before `at` to serve the later readers of the
    /// appearance at `j`, removes (negative when it adds), computed over the steps it
    /// changes only, with the step after which the profile changes (steps `from + 1 ..=
    /// at`). The original is freed after its last reader before `at` instead of staying
    /// resident to `at`; each extended input is kept until `at`; the group's own steps
    /// (counted as [`Lifetimes::counted`] says) hold what is resident after step `at - 1`
    /// plus the extended inputs and the copies made so far that a later copy still reads.
    /// From `at` on, `v`'s copy takes the original's place byte for byte.
    fn change(
        &self,
        graph: &Graph,
        index: &Index,
        life: &Lifetimes,
        budget: u64,
        j: usize,
        at: usize,
    ) -> (i128, usize) {
        let v = *self.nodes.last().expect("a group holds its node");
        let v_bytes = graph.node(v).output_bytes as i128;
        let freed_from = last_reader_before(index, j, at);
        let lo = self
            .extended
            .iter()
            .map(|&(_, l, _)| l)
            .chain(std::iter::once(freed_from))
            .min()
            .unwrap_or(freed_from);
        let over = |live: i128| (live - budget as i128).max(0);
        // The change in live bytes steps at each extended input's last reader and at
        // `freed_from`; walk the steps with the changes sorted by where they start.
        let mut starts: Vec<(usize, i128)> = self
            .extended
            .iter()
            .map(|&(_, l, b)| (l, b))
            .chain(std::iter::once((freed_from, -v_bytes)))
            .collect();
        starts.sort_unstable_by_key(|&(l, _)| l);
        let mut removed = 0i128;
        let mut delta = 0i128;
        let mut next = 0;
        for k in lo + 1..at {
            while next < starts.len() && starts[next].0 < k {
                delta += starts[next].1;
                next += 1;
            }
            if !life.counted.counts(life.copy[k]) {
                continue;
            }
            let live = life.live[k] as i128;
            removed += over(live) - over(live + delta);
        }
        if !life.counted.counts(true) {
            return (removed, lo);
        }
        (
            removed - self.own_steps_excess(graph, life, budget, v_bytes, at),
            lo,
        )
    }

    /// The excess of the group's own steps, simulated: each copy adds its output, then
    /// the copies and extended inputs it was the last in the group to read are freed.
    fn own_steps_excess(
        &self,
        graph: &Graph,
        life: &Lifetimes,
        budget: u64,
        v_bytes: i128,
        at: usize,
    ) -> i128 {
        let kept: i128 = self.extended.iter().map(|&(_, _, b)| b).sum();
        let mut live = life.after[at - 1] as i128 - v_bytes + kept;
        let mut excess = 0i128;
        for (k, &c) in self.nodes.iter().enumerate() {
            let bytes = graph.node(c).output_bytes as i128;
            live += bytes;
            excess += (live - budget as i128).max(0);
            for &i in &graph.node(c).inputs {
                let read_later = self.nodes[k + 1..]
                    .iter()
                    .any(|&r| graph.node(r).inputs.contains(&i));
                if read_later {
                    continue;
                }
                if self.nodes[..k].contains(&i) {
                    live -= graph.node(i).output_bytes as i128;
                } else if let Some(&(_, _, b)) = self.extended.iter().find(|e| e.0 == i) {
                    live -= b;
                }
            }
        }
        excess
    }
}

/// Where a copy of `v`, dropped over step `s` and next read at `u`, may go: just before
/// `u` (it lives the shortest), and just after the last of its inputs' current readers when
/// that lies between (its inputs are not kept longer).
fn insertion_points(
    graph: &Graph,
    index: &Index,
    last: &[usize],
    s: usize,
    u: usize,
    v: NodeId,
) -> Vec<usize> {
    let mut points = vec![u];
    let inputs_end = graph
        .node(v)
        .inputs
        .iter()
        .filter_map(|&i| index.latest_before(i, u).map(|p| last[p]))
        .min();
    if let Some(end) = inputs_end {
        let at = end + 1;
        if at > s && at < u {
            points.push(at);
        }
    }
    points
}

/// Copies [`swap_costliest`] tries to do without: each try is a whole refit.
const SWAP_TRIES: usize = 8;

/// Removes inserted copies, costliest first, while the sequence still fits.
fn drop_unneeded(graph: &Graph, copies: &mut Copies, scratch: &mut Scratch, deadline: Instant) {
    let mut order: Vec<usize> = (0..copies.seq.len())
        .filter(|&k| copies.inserted[k])
        .collect();
    // Costliest first; among equals the latest first, so earlier positions stay put.
    order.sort_by(|&a, &b| {
        let t = |k: usize| graph.node(copies.seq[k]).compute_time;
        t(b).total_cmp(&t(a)).then(b.cmp(&a))
    });
    let mut removed: Vec<usize> = Vec::new();
    for k in order {
        if Instant::now() >= deadline {
            return;
        }
        // Positions shift left by one for every removal before them.
        let at = k - removed.iter().filter(|&&r| r < k).count();
        let v = copies.seq.remove(at);
        copies.inserted.remove(at);
        if scratch.lifetimes(&copies.seq).profile.excess == 0 {
            removed.push(k);
        } else {
            copies.seq.insert(at, v);
            copies.inserted.insert(at, true);
        }
    }
}

/// The explicit schedule of a sequence: each appearance computed, then every appearance
/// whose last reader this was freed (an output nobody reads right after it runs).
pub fn steps_of(graph: &Graph, seq: &Sequence) -> Vec<Step> {
    let mut scratch = Scratch::new(graph, u64::MAX);
    let life = scratch.lifetimes(&seq.nodes);
    let mut frees: Vec<Vec<usize>> = vec![Vec::new(); seq.nodes.len()];
    for (k, &l) in life.last.iter().enumerate() {
        frees[l].push(k);
    }
    let mut steps = Vec::with_capacity(2 * seq.nodes.len());
    for (k, &v) in seq.nodes.iter().enumerate() {
        steps.push(Step::Compute { node: v });
        for &j in &frees[k] {
            steps.push(Step::Free {
                tensor: seq.nodes[j],
            });
        }
    }
    steps
}

#[cfg(test)]
mod tests;
