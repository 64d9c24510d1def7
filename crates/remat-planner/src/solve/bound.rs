//! A lower bound on the time overhead of every schedule at a budget.
//!
//! What it bounds. The least `total_time - base_time` (as the simulator counts it) of any
//! schedule of the graph that stays within the budget, whatever it keeps, frees, recomputes
//! or swaps, and in whatever order it runs the operations, as long as the operations' first
//! computations respect [`Precedence`] (the data edges, which every schedule respects; plus,
//! where the graph asks for them, the order of a pinned tensor's readers and a fixed order).
//!
//! Proof. Fix such a schedule S and a node v. When S first computes v, v's inputs and its
//! output are on the device. Let `L(v)` be the tensors t other than v's inputs that are
//! ancestors of v and have a reader that is a descendant of v (both in the precedence
//! order): t was computed before v's first computation, and must be on the device again
//! when that reader is first computed, after v's. At v's first computation each t in `L(v)`
//! is either on the device or absent, so the absent ones hold at least
//!
//! ```text
//! d(v) = static + out(v) + inputs(v) + sum_{t in L(v)} bytes(t) - budget      bytes.
//! ```
//!
//! Let `x_t = 1` when S has t absent at the first computation of some node v with t in
//! `L(v)`. Then `sum_{t in L(v)} bytes(t) x_t >= d(v)` for every v, and for each t with
//! `x_t = 1`, S brings t back before that reader: it recomputes t (at least `c(t)`, t's
//! compute time, added to the recompute time R; a pinned t cannot be recomputed) or swaps
//! it in (its copy time `s(t)` added to the host-to-device stream's busy time H). The
//! compute stream runs every computation in turn, so `total >= base + R`; every swap-in
//! the schedule needs ends before its reader runs, so `total >= H`. Hence, for any
//! `theta` in [0, 1],
//!
//! ```text
//! overhead >= max(R, H - base) >= theta R + (1 - theta) H - (1 - theta) base
//!          >= sum_t x_t min(theta c(t), (1 - theta) s(t)) - (1 - theta) base,
//! ```
//!
//! so the overhead is at least the optimum of the covering LP `min sum_t w_t x_t` subject to
//! `sum_{t in L(v)} bytes(t) x_t >= d(v)`, `0 <= x <= 1`, with `w_t = min(theta c(t),
//! (1 - theta) s(t))`, less `(1 - theta) base`. By weak duality every `y >= 0` gives
//!
//! ```text
//! LP >= g(y) = sum_v d(v) y_v - sum_t max(0, bytes(t) Y_t - w_t),    Y_t = sum_{v: t in L(v)} y_v
//! ```
//!
//! (the LP dual with `z_t = max(0, bytes(t) Y_t - w_t)` for the `x <= 1` rows).
//!
//! The link's room. Only the rows with `y_v > 0` (the priced points) enter `g(y)`, so it
//! bounds the LP of those rows alone, whose `x_t = 1` are tensors absent at a priced point
//! and restored after it. Every strict ancestor of every priced point (the set `A`) is
//! first computed before the first priced point starts, so those restorations, swap-ins
//! included, begin after at least `c(A)` of compute: `total >= c(A) + H` for their swap-ins,
//! and the `(1 - theta) base` above may be `(1 - theta) (base - c(A))`: the copy stream
//! cannot use the part of the step that every schedule spends before the points. Near the
//! floor the priced points lie in the backward pass, and `c(A)` is the forward's time.
//!
//! The copies out. A tensor absent at a priced point `v` and swapped back after it has a host
//! copy, made by a copy out while it was on the device, so before the `Free` that made it
//! absent; that `Free` waits for the copy (the simulator's rule), and comes before `v`'s
//! first computation. So the copies out of those tensors (one per tensor at least, on the
//! device-to-host stream, from time 0) end before the last priced point starts, and every
//! node that is a priced point or a descendant of every priced point (the set `C`) computes
//! after that: `total >= s_out + c(C)`. With the copies out as long as the copies back, the
//! room may be `base - max(c(A), c(C))`, whichever stream has less compute to hide behind.
//! For a single priced point `v` the two streams add: the copies out end before `v` starts,
//! the copies back begin after it ends, so `total >= 2 H + c(v)` and a swap may be charged
//! both copies, `min(theta c(t), 2 (1 - theta) s(t))`, less `(1 - theta) (base - c(v))`
//! (`LinkTerm::OutAndBack`); several priced points may overlap the two streams, so that
//! term prices one point only.
//!
//! Copies out, then rebuilds (`LinkTerm::OutThenRebuild`). For a single priced point `v`,
//! the copies out above end before `v` starts (`T_v >= s_out`), and every restoration of a
//! tensor absent at `v` that is a recomputation runs on the compute stream after `v`
//! starts, as do `v` and its strict descendants (`after(v)` of compute); those are
//! distinct computations, so `total >= s_out + after(v) + R` with `R` the recomputations
//! the cover charges, and `overhead >= R + s_out - (base - after(v))`: the stream of
//! copies out and the recomputations add up instead of overlapping. With `overhead >= R`
//! and any `theta`, `overhead >= R + (1 - theta) (s_out - (base - after(v)))`: a tensor's
//! recomputation is charged its whole `c(t)` and its swap `(1 - theta) s(t)`, less
//! `(1 - theta) (base - after(v))`. Near the floor of a transformer the point is the
//! backward's first step, `base - after(v)` the forward's compute, and this term is the
//! one that binds (8 layers + 5% at 32 GB/s: 25.08 -> 27.03%).
//!
//! `theta` is any number in [0, 1]; the bound tries a grid (`THETAS`, `THETAS_WITH_SWAPS`)
//! and, with swaps, a finer one around the best copies-out-then-rebuilds start
//! (`Cover::refine_theta`): with the rebuild chains the value is piecewise linear in
//! `theta`, jumping where a tensor enters or leaves their `Q`, and its tops fall between
//! the grid's points (8 layers + 10% at 32 GB/s: 26.33% -> 26.73%).
//!
//! We start from the best single node (where `g` is maximised by a fractional knapsack) and climb
//! `g` by projected subgradient steps; any `y` reached is a valid bound, so stopping early
//! (at the deadline) only makes it weaker.
//!
//! Rebuild chains (`rebuild`): a recomputation reads its inputs, and an input not forced
//! live at the point is held there or restored too; the same dual with those rows, tried at
//! the climbed `y` and the single-point ones (and multiples of them), raises the bound where
//! swaps are dear (recompute-only requests plan at 1 B/s).
//!
//! Rebuilds before a late point, then its copies back (`late`): under the recompute floor
//! a late point of the backward forces pinned tensors (gradient buffers) out, and their
//! copies back start after it; the recomputations the backward's first point forces run
//! before it. Two points, one term: the rebuild LP at the first, restricted to what is
//! rebuilt before the second, plus the second's forced copies back.
//!
//! The link in a window (`window`): a tensor swapped out and absent at a point was copied
//! after its first computation and before the point, so swaps out of the tensors computed
//! in a stretch cost at least their copy time less the compute in that stretch; single
//! points, their deficit covered by a fractional knapsack.
//!
//! Weak points, stated: when the host link is fast enough to hide every copy, swapping is
//! free in this model and the bound is 0; and one absence per tensor is charged however
//! often the tensor is really restored.

use std::time::Instant;

use crate::ir::{Graph, NodeId};
use crate::problem::Problem;

use super::order::Precedence;

mod late;
mod rebuild;
mod window;

/// A lower bound on the time overhead of every schedule of a problem.
#[derive(Clone, Debug, PartialEq)]
pub struct Bound {
    /// Least possible (total time - base time) / base time.
    pub overhead: f64,
    /// What proved it, e.g. `cover` (this module) or a MILP's dual bound.
    pub source: String,
    /// The schedules it holds for, in words.
    pub holds_for: String,
}

impl Bound {
    /// How far a plan with `overhead` can at most be above the optimum, relative to the
    /// optimum's time: `(1 + overhead) / (1 + bound) - 1`.
    pub fn gap(&self, overhead: f64) -> f64 {
        ((1.0 + overhead) / (1.0 + self.overhead) - 1.0).max(0.0)
    }

    /// The stronger of two bounds on the same problem.
    pub fn max(self, other: Bound) -> Bound {
        if other.overhead > self.overhead {
            other
        } else {
            self
        }
    }
}

/// The covering bound of the module docs for `problem`, climbing until `deadline`.
/// `upper` is the overhead (fraction of the base time) of a known plan, used to size the
/// steps; pass `None` when none is known.
pub fn cover_bound(problem: &Problem, deadline: Instant, upper: Option<f64>) -> Bound {
    let graph = problem.graph;
    let holds_for = if graph.order_is_fixed() {
        "every schedule that computes the nodes for the first time in the graph's order"
    } else {
        "every schedule, with any order of the operations that respects the dependencies"
    };
    let bound = |overhead: f64| Bound {
        overhead,
        source: "cover".into(),
        holds_for: holds_for.into(),
    };
    let base = graph.base_time();
    // A known plan without overhead is optimal: nothing to climb.
    if problem.budget_bytes >= graph.store_all_peak() || base <= 0.0 || upper == Some(0.0) {
        return bound(0.0);
    }
    let ancestry = Ancestry::of(graph);
    let cover = Cover::build(problem, &ancestry);
    if cover.points.is_empty() {
        return bound(0.0);
    }
    let units_per_byte = 1.0 / (problem.bandwidth * graph.time_unit_s());
    // Each `theta`'s best single point under each link term, kept: the rebuild chains
    // start from them too.
    let mut singles: Vec<Start> = Vec::new();
    // The best under the room's term: the climb starts there (the other term holds for
    // single points only); and the best value under any term.
    let mut best: Option<(f64, f64, Vec<f64>)> = None;
    let mut best_value = f64::NEG_INFINITY;
    // In `THETAS` order (the largest first: near the floor without swaps it gives the most;
    // then those that weigh a swap against a recomputation over a fast link; with swaps,
    // `THETAS_WITH_SWAPS`, those first), one at least,
    // then none past half the time: on 5,000 nodes each takes ~0.15 s, and all eight ran
    // 1.3 s past a 0.5 s share; on 32 layers all eleven took the bound's whole time, and
    // the rebuild chains below, whose best start over a fast link is the second or fourth
    // `theta`, had none left.
    let start = Instant::now();
    let singles_until = start + deadline.saturating_duration_since(start) / 2;
    let terms: &[LinkTerm] = if problem.recompute_only() {
        // A swap costs more than anything it could save: one term is enough.
        &[LinkTerm::Room]
    } else {
        &[
            LinkTerm::Room,
            LinkTerm::OutThenRebuild,
            LinkTerm::OutAndBack,
        ]
    };
    let thetas = if problem.recompute_only() {
        THETAS
    } else {
        THETAS_WITH_SWAPS
    };
    'thetas: for theta in thetas {
        for &term in terms {
            if !singles.is_empty() && Instant::now() >= singles_until {
                break 'thetas;
            }
            let weights = term.sides(graph, theta, units_per_byte, false).weights;
            let (value, y) = cover.best_single_point(&weights, theta, base, term);
            best_value = best_value.max(value);
            // Ties go to the smaller theta.
            if term == LinkTerm::Room
                && best
                    .as_ref()
                    .is_none_or(|b| value > b.0 || (value == b.0 && theta < b.1))
            {
                best = Some((value, theta, y.clone()));
            }
            singles.push(Start { theta, term, y });
        }
    }
    let Some((_, theta, y)) = best else {
        return bound(0.0);
    };
    let mut value = best_value;
    if value.is_infinite() {
        return bound(f64::INFINITY);
    }
    // The rebuild chains ([`rebuild`]) from each `theta`'s single point first (a fraction
    // of a millisecond each on 1,000 nodes, and near the floor most of the bound), then the
    // subgradient climb of the plain cover, the rebuild chains from where it ended, and the
    // link's windows ([`window`]) in what is left; each tries one start at least.
    let now = Instant::now();
    let left = deadline.saturating_duration_since(now);
    let until = now + left.mul_f64(0.25);
    let link = Link {
        graph,
        ancestry: &ancestry,
        base,
        units_per_byte,
        recompute_only: problem.recompute_only(),
    };
    let single_values = cover.each_with_rebuilds(&link, &singles, true, until);
    value = single_values.iter().copied().fold(value, f64::max);
    // With swaps, the copies-out-then-rebuilds term on a finer grid of `theta`s around the
    // best; its starts go first to the late points' term.
    let mut starts = Vec::new();
    if !problem.recompute_only() {
        let (refined, best_starts) =
            cover.refine_theta(&link, &singles, &single_values, now + left.mul_f64(0.5));
        value = value.max(refined);
        starts = best_starts;
    }
    let others: Vec<Start> = singles
        .iter()
        .filter(|s| {
            s.term == LinkTerm::OutThenRebuild && !starts.iter().any(|t| t.theta == s.theta)
        })
        .cloned()
        .collect();
    starts.extend(others);
    // Under the recompute floor: the rebuilds before a late point, then the copies back it
    // forces ([`late`]).
    if !problem.recompute_only()
        && let Some(late) = late::best(&cover, &link, &starts, now + left.mul_f64(0.6))
    {
        value = value.max(late);
    }
    // `w_t = min(theta c(t), (1 - theta) s(t))`: the room's term, the only one that holds
    // for several points.
    let weights = LinkTerm::Room
        .sides(graph, theta, units_per_byte, false)
        .weights;
    let offset = (1.0 - theta) * cover.room(&link, &y);
    let target = upper.map(|u| u * base + offset);
    let (climbed, climbed_y) = cover.climb(&weights, y, target, now + left.mul_f64(0.7));
    value = value.max(climbed - (1.0 - theta) * cover.room(&link, &climbed_y));
    let climbed = [Start {
        theta,
        term: LinkTerm::Room,
        y: climbed_y,
    }];
    let until = now + left.mul_f64(0.85);
    value = value.max(cover.with_rebuilds(&link, &climbed, false, until));
    if let Some(windowed) = window::best(&cover, graph, &ancestry, units_per_byte, deadline) {
        value = value.max(windowed);
    }
    bound((value / base).max(0.0))
}

/// Multiples of a dual vector tried with rebuild chains: their items cost more than the
/// cover's, so the best price per byte is higher.
const REBUILD_SCALES: [f64; 11] = [1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 4.0, 6.0, 8.0];

/// The finer grid of `theta`s around the best single start with swaps
/// ([`Cover::refine_theta`]): this far apart, and this many on each side.
const THETA_STEP: f64 = 0.01;
const THETA_STEPS: usize = 6;
/// Halvings of the step around the best `theta` found on that grid.
const THETA_HALVINGS: usize = 3;

/// Golden-section steps (one evaluation each, after the first two) around the best of
/// [`REBUILD_SCALES`].
const REFINE_STEPS: usize = 10;

/// The golden section's inner ratio, `(sqrt 5 - 1) / 2`.
const GOLDEN: f64 = 0.618_033_988_749_895;

/// The largest `at(scale)` over [`REBUILD_SCALES`] and a golden-section search between the
/// best one's neighbours (the value is not smooth in the multiple, and the grid's steps can
/// miss its top: 8 layers, recompute-only, + 10%: 33.90% on the grid, 34.14% with finer
/// steps), and whether `deadline` stopped it. With `watch` the clock is checked between
/// evaluations (after the first): one evaluation passes over the (tensor, point) pairs
/// with a price, few for a single point's vector, millions for a climbed one on 10,000
/// nodes.
fn best_multiple(mut at: impl FnMut(f64) -> f64, watch: bool, deadline: Instant) -> (f64, bool) {
    let mut best = f64::NEG_INFINITY;
    let late = |j: usize| watch && j > 0 && Instant::now() >= deadline;
    let mut values = Vec::with_capacity(REBUILD_SCALES.len());
    for (j, scale) in REBUILD_SCALES.into_iter().enumerate() {
        if late(j) {
            return (best, true);
        }
        values.push(at(scale));
        best = best.max(values[j]);
    }
    let top = (0..values.len())
        .max_by(|&a, &b| values[a].total_cmp(&values[b]))
        .unwrap_or(0);
    let (mut lo, mut hi) = (
        REBUILD_SCALES[top.saturating_sub(1)],
        REBUILD_SCALES[(top + 1).min(REBUILD_SCALES.len() - 1)],
    );
    // Each step keeps one inner point and its value, and evaluates one new one.
    let (mut a, mut b) = (hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo));
    let (mut va, mut vb) = (at(a), at(b));
    best = best.max(va).max(vb);
    for _ in 0..REFINE_STEPS {
        if late(1) {
            return (best, true);
        }
        if va >= vb {
            (hi, b, vb) = (b, a, va);
            a = hi - GOLDEN * (hi - lo);
            va = at(a);
        } else {
            (lo, a, va) = (a, b, vb);
            b = lo + GOLDEN * (hi - lo);
            vb = at(b);
        }
        best = best.max(va).max(vb);
    }
    (best, false)
}

/// Values of `theta` tried (see the module docs; 1 would make swaps free), in the order
/// tried: recompute-only requests gain most from the largest; over a fast link (the
/// transformers near the floor at 32 GB/s) 0.85-0.95 gave the most, and on graphs of
/// thousands of nodes the deadline may leave time for only the first few.
const THETAS: [f64; 11] = [
    0.9999, 0.9, 0.95, 0.85, 0.999, 0.99, 0.97, 0.93, 0.8, 0.5, 0.0,
];

/// [`THETAS`] in the order tried when swaps are allowed: near the floor of the
/// transformers at 32 GB/s the copies-out-then-rebuilds term gives the most at 0.85 (8
/// layers + 5%: 0.8 / 0.85 / 0.9 / 0.95 give 26.4 / 27.0 / 26.2 / 12.6%) and the room's
/// at 0.9, while 0.9999 gives nothing; on 32 layers the singles have time for two or
/// three `theta`s.
const THETAS_WITH_SWAPS: [f64; 11] = [
    0.85, 0.9, 0.8, 0.93, 0.95, 0.97, 0.5, 0.99, 0.999, 0.9999, 0.0,
];

/// The covering problem: points (nodes with a positive deficit) and the tensors that can
/// cover them, in both directions as compressed lists.
struct Cover {
    /// Deficit bytes per point.
    demand: Vec<f64>,
    /// Node of each point.
    points: Vec<NodeId>,
    /// Tensors of `L(point)`, as ranges of `point_items`.
    point_start: Vec<usize>,
    point_items: Vec<u32>,
    /// Points each tensor covers, as ranges of `item_points`.
    item_start: Vec<usize>,
    item_points: Vec<u32>,
    /// Bytes of each tensor.
    item_bytes: Vec<f64>,
    /// Per point, the compute time of its strict ancestors: spent before it in every
    /// schedule (the link's room, see the module docs).
    before: Vec<f64>,
    /// Per point, the compute time of the point and its strict descendants: spent after
    /// its start in every schedule (the room of the copies out, see the module docs).
    after: Vec<f64>,
    /// Per point, its own compute time.
    own: Vec<f64>,
}

/// What the link's room needs: the graph, its ancestry, its base time, the link's speed.
struct Link<'a> {
    graph: &'a Graph,
    ancestry: &'a Ancestry,
    base: f64,
    units_per_byte: f64,
    /// A recompute-only request ([`Problem::recompute_only`]).
    recompute_only: bool,
}

/// How a bound charges the host link (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LinkTerm {
    /// A swap costs its copy back, less the room ([`Cover::room`]): any dual vector.
    Room,
    /// A swap costs its copy out, before the point, and its copy back, after it, less the
    /// base time but the point's own compute: a vector that prices one point only.
    OutAndBack,
    /// A recomputation costs its whole compute time and a swap its copy out, less the
    /// compute of the point's strict ancestors and the nodes unrelated to it: the copies
    /// out end before the point and the recomputations it forces run after it (the module
    /// docs, "Copies out, then rebuilds"); a vector that prices one point only.
    OutThenRebuild,
}

impl LinkTerm {
    /// Each tensor's recomputation and swap sides under this term at `theta`, a copy
    /// costing `units_per_byte` a byte.
    fn sides(self, graph: &Graph, theta: f64, units_per_byte: f64, split: bool) -> rebuild::Sides {
        match self {
            LinkTerm::Room => rebuild::Sides::of(graph, theta, units_per_byte, split),
            LinkTerm::OutAndBack => rebuild::Sides::of(graph, theta, 2.0 * units_per_byte, split),
            LinkTerm::OutThenRebuild => {
                rebuild::Sides::scaled(graph, 1.0, (1.0 - theta) * units_per_byte, split)
            }
        }
    }
}

/// A dual vector to evaluate, with the `theta` and link term it was found under.
#[derive(Clone)]
struct Start {
    theta: f64,
    term: LinkTerm,
    y: Vec<f64>,
}

impl Start {
    /// The cover point this vector prices, when it prices exactly one.
    fn single_point(&self) -> Option<usize> {
        let mut priced = self.y.iter().enumerate().filter(|&(_, &y)| y > 0.0);
        match (priced.next(), priced.next()) {
            (Some((p, _)), None) => Some(p),
            _ => None,
        }
    }
}

/// Sum of `cost` over the set bits of `bits`.
fn sum_bits(bits: &[u64], cost: impl Fn(usize) -> f64) -> f64 {
    let mut sum = 0.0;
    for (w, &word) in bits.iter().enumerate() {
        let mut rest = word;
        while rest != 0 {
            sum += cost(w * 64 + rest.trailing_zeros() as usize);
            rest &= rest - 1;
        }
    }
    sum
}

impl Cover {
    /// The best rebuild-aware value ([`rebuild::value`], less `(1 - theta)` times the link's
    /// room, [`Cover::room`]) over the `(theta, y)` starts and multiples of each, until
    /// `deadline` (at least the first evaluation; with `first_whole`, every multiple of the
    /// first start: cheap for a single point's vector).
    fn with_rebuilds(
        &self,
        link: &Link,
        starts: &[Start],
        first_whole: bool,
        deadline: Instant,
    ) -> f64 {
        self.each_with_rebuilds(link, starts, first_whole, deadline)
            .into_iter()
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// [`Cover::with_rebuilds`] per start (`NEG_INFINITY` where it was not evaluated).
    fn each_with_rebuilds(
        &self,
        link: &Link,
        starts: &[Start],
        first_whole: bool,
        deadline: Instant,
    ) -> Vec<f64> {
        let (graph, units_per_byte) = (link.graph, link.units_per_byte);
        let mut values = vec![f64::NEG_INFINITY; starts.len()];
        for (k, Start { theta, term, y }) in starts.iter().enumerate() {
            if k > 0 && Instant::now() >= deadline {
                break;
            }
            if y.len() != self.points.len() {
                continue;
            }
            let sides = term.sides(graph, *theta, units_per_byte, !link.recompute_only);
            let in_q = rebuild::q_set(graph, &sides);
            // Multiples of `y` price the same points: the same room.
            let room = self.offset(link, y, *term);
            if !in_q.iter().any(|&q| q) {
                continue;
            }
            let mut scaled = y.clone();
            let at = |scale: f64| {
                for (s, y) in scaled.iter_mut().zip(y) {
                    *s = y * scale;
                }
                rebuild::value(self, graph, &sides, &in_q, &scaled) - (1.0 - theta) * room
            };
            let watch = k > 0 || !first_whole;
            let (value, stopped) = best_multiple(at, watch, deadline);
            values[k] = value;
            if stopped {
                break;
            }
        }
        values
    }

    /// The copies-out-then-rebuilds term ([`LinkTerm::OutThenRebuild`]) with rebuild
    /// chains at the point of its best single start (`values`: each start's, from
    /// [`Cover::each_with_rebuilds`]), on a grid of `theta`s
    /// [`THETA_STEP`] apart around that start's `theta`, nearest first, until `deadline`
    /// (one at least); the best value and the starts tried, the best single's among them,
    /// best first. Its value is
    /// piecewise linear in `theta`, with jumps where a tensor enters or leaves `Q` (8
    /// layers + 10% at 32 GB/s: 6,639 units at 0.85, 5,742 at 0.88, 6,739 at 0.89, 6,433
    /// at 0.9), so the grid of [`THETAS_WITH_SWAPS`] misses its tops.
    fn refine_theta(
        &self,
        link: &Link,
        singles: &[Start],
        values: &[f64],
        deadline: Instant,
    ) -> (f64, Vec<Start>) {
        let graph = link.graph;
        let term = LinkTerm::OutThenRebuild;
        let mut items = Vec::new();
        // The single start at point `vq` for `theta`, priced at its knapsack's ratio.
        let start_at = |theta: f64, vq: usize, items: &mut Vec<(f64, f64)>| -> Option<Start> {
            let weights = term.sides(graph, theta, link.units_per_byte, false).weights;
            let (_, ratio) = self.knapsack_at(&weights, vq, items)?;
            let mut y = vec![0.0; self.points.len()];
            y[vq] = ratio;
            Some(Start { theta, term, y })
        };
        let Some((mut best, centre, vq)) = singles
            .iter()
            .zip(values)
            .filter(|&(start, value)| start.term == term && value.is_finite())
            .filter_map(|(start, &value)| Some((value, start, start.single_point()?)))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(value, start, vq)| (value, start.clone(), vq))
        else {
            return (f64::NEG_INFINITY, Vec::new());
        };
        let centre_theta = centre.theta;
        // The best start is the grid's centre, and a candidate for the halvings' top.
        let mut tried: Vec<(f64, Start)> = vec![(best, centre)];
        let mut evaluate = |theta: f64, tried: &mut Vec<(f64, Start)>| {
            if !(0.0..1.0).contains(&theta) || tried.iter().any(|(_, s)| s.theta == theta) {
                return;
            }
            if let Some(start) = start_at(theta, vq, &mut items) {
                let value = self.with_rebuilds(link, std::slice::from_ref(&start), false, deadline);
                best = best.max(value);
                tried.push((value, start));
            }
        };
        // A grid THETA_STEP apart around the best start, nearest first; then halving
        // steps around the best point found, where a jump's top may lie.
        'grid: for k in 1..=THETA_STEPS {
            for sign in [-1.0, 1.0] {
                if Instant::now() >= deadline {
                    break 'grid;
                }
                evaluate(centre_theta + sign * k as f64 * THETA_STEP, &mut tried);
            }
        }
        let mut step = THETA_STEP / 2.0;
        for _ in 0..THETA_HALVINGS {
            let Some(top) = tried
                .iter()
                .max_by(|a, b| a.0.total_cmp(&b.0))
                .map(|(_, s)| s.theta)
            else {
                break;
            };
            for theta in [top - step, top + step] {
                if Instant::now() >= deadline {
                    break;
                }
                evaluate(theta, &mut tried);
            }
            step /= 2.0;
        }
        tried.sort_by(|a, b| b.0.total_cmp(&a.0));
        (best, tried.into_iter().map(|(_, start)| start).collect())
    }

    /// The fractional knapsack that covers point `p`'s deficit with its tensors at
    /// `weights`: its cost and the ratio (weight per byte) of the last item taken, the
    /// point's price in the dual; `None` when its tensors cannot cover it. `items` is
    /// scratch space.
    fn knapsack_at(
        &self,
        weights: &[f64],
        p: usize,
        items: &mut Vec<(f64, f64)>,
    ) -> Option<(f64, f64)> {
        items.clear();
        // A tensor of no bytes covers nothing.
        items.extend(
            self.items_of(p)
                .iter()
                .map(|&t| (weights[t as usize], self.bytes_of(t as usize)))
                .filter(|&(_, b)| b > 0.0),
        );
        items.sort_by(|a, b| (a.0 / a.1.max(1.0)).total_cmp(&(b.0 / b.1.max(1.0))));
        let (mut left, mut cost, mut ratio) = (self.demand[p], 0.0, 0.0);
        for &(w, b) in items.iter() {
            if left <= 0.0 {
                break;
            }
            ratio = w / b.max(1.0);
            if b >= left {
                cost += w * left / b.max(1.0);
                left = 0.0;
            } else {
                cost += w;
                left -= b;
            }
        }
        (left <= 0.0).then_some((cost, ratio))
    }

    fn build(problem: &Problem, ancestry: &Ancestry) -> Cover {
        let graph = problem.graph;
        let n = graph.len();
        let sets = live_sets(graph, ancestry);
        let mut demand = Vec::new();
        let mut points = Vec::new();
        let mut point_start = vec![0];
        let mut point_items = Vec::new();
        for (v, set) in sets.iter().enumerate() {
            let node = graph.node(v);
            let resident: u64 = node.output_bytes
                + node
                    .inputs
                    .iter()
                    .map(|&i| graph.node(i).output_bytes)
                    .sum::<u64>();
            let optional: u64 = set
                .iter()
                .map(|&t| graph.node(t as usize).output_bytes)
                .sum();
            let need = graph.static_bytes() as f64 + resident as f64 + optional as f64
                - problem.budget_bytes as f64;
            if need > 0.0 {
                demand.push(need);
                points.push(v);
                point_items.extend_from_slice(set);
                point_start.push(point_items.len());
            }
        }
        let mut count = vec![0usize; n];
        for &t in &point_items {
            count[t as usize] += 1;
        }
        let mut item_start = vec![0; n + 1];
        for t in 0..n {
            item_start[t + 1] = item_start[t] + count[t];
        }
        let mut fill = item_start.clone();
        let mut item_points = vec![0u32; point_items.len()];
        for p in 0..points.len() {
            for &t in &point_items[point_start[p]..point_start[p + 1]] {
                item_points[fill[t as usize]] = p as u32;
                fill[t as usize] += 1;
            }
        }
        let before = points
            .iter()
            .map(|&v| ancestry.sum_over(v, true, |w| graph.node(w).compute_time))
            .collect();
        let after = points
            .iter()
            .map(|&v| {
                graph.node(v).compute_time
                    + ancestry.sum_over(v, false, |w| graph.node(w).compute_time)
            })
            .collect();
        let own = points.iter().map(|&v| graph.node(v).compute_time).collect();
        Cover {
            before,
            after,
            own,
            demand,
            points,
            point_start,
            point_items,
            item_start,
            item_points,
            item_bytes: graph
                .nodes()
                .iter()
                .map(|v| v.output_bytes as f64)
                .collect(),
        }
    }

    fn items_of(&self, p: usize) -> &[u32] {
        &self.point_items[self.point_start[p]..self.point_start[p + 1]]
    }

    /// The largest fractional-knapsack cover cost over single points less `(1 - theta)`
    /// times the point's room (the base time but its strict ancestors'), and the dual
    /// vector that attains it (`y` at that point = the ratio of the last item taken).
    fn best_single_point(
        &self,
        weights: &[f64],
        theta: f64,
        base: f64,
        term: LinkTerm,
    ) -> (f64, Vec<f64>) {
        let mut best = (f64::NEG_INFINITY, 0, 0.0);
        let mut items: Vec<(f64, f64)> = Vec::new();
        for p in 0..self.points.len() {
            let Some((cost, ratio)) = self.knapsack_at(weights, p, &mut items) else {
                return (f64::INFINITY, Vec::new());
            };
            let value = cost - (1.0 - theta) * self.point_offset(p, base, term);
            if cost > 0.0 && value > best.0 {
                best = (value, p, ratio);
            }
        }
        let mut y = vec![0.0; self.points.len()];
        if best.0 > f64::NEG_INFINITY {
            y[best.1] = best.2;
        }
        // The knapsack's cost equals g(y) in exact arithmetic; the bound is g(y) itself,
        // which weak duality makes valid for any y >= 0 whatever the rounding.
        let room = if best.0 > f64::NEG_INFINITY {
            self.point_offset(best.1, base, term)
        } else {
            base
        };
        (self.dual(weights, &y).0 - (1.0 - theta) * room, y)
    }

    /// [`Cover::offset`] of a vector that prices point `p` alone.
    fn point_offset(&self, p: usize, base: f64, term: LinkTerm) -> f64 {
        match term {
            LinkTerm::Room => (base - self.before[p].max(self.after[p])).max(0.0),
            LinkTerm::OutAndBack => (base - self.own[p]).max(0.0),
            LinkTerm::OutThenRebuild => (base - self.after[p]).max(0.0),
        }
    }

    /// What `(1 - theta)` times is subtracted from the dual value of `y` under `term`:
    /// [`Cover::room`], or for [`LinkTerm::OutAndBack`] the base time less the priced
    /// point's own compute, for [`LinkTerm::OutThenRebuild`] less the point's and its
    /// descendants' (infinite when `y` prices several points: those terms do not hold
    /// there).
    fn offset(&self, link: &Link, y: &[f64], term: LinkTerm) -> f64 {
        match term {
            LinkTerm::Room => self.room(link, y),
            LinkTerm::OutAndBack | LinkTerm::OutThenRebuild => {
                let mut priced = y.iter().enumerate().filter(|&(_, &price)| price > 0.0);
                match (priced.next(), priced.next()) {
                    (Some((p, _)), None) => self.point_offset(p, link.base, term),
                    (None, _) => link.base,
                    (Some(_), Some(_)) => f64::INFINITY,
                }
            }
        }
    }

    /// The link's room for `y` (see the module docs): the base time less the larger of the
    /// compute of the tensors that are strict ancestors of every priced point (before the
    /// copies back) and of those that are every priced point or its descendant (after the
    /// copies out); the whole base time when nothing is priced.
    fn room(&self, link: &Link, y: &[f64]) -> f64 {
        let mut priced = y
            .iter()
            .enumerate()
            .filter(|&(_, &price)| price > 0.0)
            .map(|(p, _)| self.points[p]);
        let Some(first) = priced.next() else {
            return link.base;
        };
        let ancestry = link.ancestry;
        let mut before = ancestry.row(&ancestry.anc, first).to_vec();
        let mut after = ancestry.row(&ancestry.desc, first).to_vec();
        after[first / 64] |= 1 << (first % 64);
        for v in priced {
            for (c, a) in before.iter_mut().zip(ancestry.row(&ancestry.anc, v)) {
                *c &= a;
            }
            for (w, (c, d)) in after
                .iter_mut()
                .zip(ancestry.row(&ancestry.desc, v))
                .enumerate()
            {
                let own = if w == v / 64 { 1 << (v % 64) } else { 0 };
                *c &= d | own;
            }
        }
        let compute = |w: usize| link.graph.node(w).compute_time;
        let before = sum_bits(&before, compute);
        let after = sum_bits(&after, compute);
        (link.base - before.max(after)).max(0.0)
    }

    /// `g(y)` of the module docs, and `x_t = [bytes(t) Y_t > w_t]`, its minimiser.
    fn dual(&self, weights: &[f64], y: &[f64]) -> (f64, Vec<bool>) {
        let mut value: f64 = self.demand.iter().zip(y).map(|(d, y)| d * y).sum();
        let mut x = vec![false; self.item_bytes.len()];
        for (t, taken) in x.iter_mut().enumerate() {
            let points = &self.item_points[self.item_start[t]..self.item_start[t + 1]];
            if points.is_empty() {
                continue;
            }
            let covered: f64 = points.iter().map(|&p| y[p as usize]).sum();
            let excess = self.item_bytes[t] * covered - weights[t];
            if excess > 0.0 {
                value -= excess;
                *taken = true;
            }
        }
        (value, x)
    }

    /// Projected subgradient ascent of `g` from `y` (Polyak steps towards `target`, an
    /// upper bound on the LP when known), until `deadline` or [`CLIMB_STEPS`]. Returns the
    /// best `g` met and the `y` that met it.
    fn climb(
        &self,
        weights: &[f64],
        mut y: Vec<f64>,
        target: Option<f64>,
        deadline: Instant,
    ) -> (f64, Vec<f64>) {
        let mut best = self.dual(weights, &y).0;
        let mut best_y = y.clone();
        let mut scale = 1.0;
        let mut since_better = 0;
        for _ in 0..CLIMB_STEPS {
            if Instant::now() >= deadline {
                break;
            }
            let (value, x) = self.dual(weights, &y);
            if value > best {
                best = value;
                best_y.clone_from(&y);
                since_better = 0;
            } else {
                since_better += 1;
                if since_better >= 5 {
                    scale /= 2.0;
                    since_better = 0;
                }
            }
            let slope: Vec<f64> = (0..self.points.len())
                .map(|p| {
                    let covered: f64 = self
                        .items_of(p)
                        .iter()
                        .filter(|&&t| x[t as usize])
                        .map(|&t| self.item_bytes[t as usize])
                        .sum();
                    let s = self.demand[p] - covered;
                    if y[p] > 0.0 || s > 0.0 { s } else { 0.0 }
                })
                .collect();
            let norm: f64 = slope.iter().map(|s| s * s).sum();
            if norm <= 0.0 || scale < 1e-6 {
                break;
            }
            let room = match target {
                Some(t) if t > value => t - value,
                _ => 0.1 * best.abs().max(f64::MIN_POSITIVE),
            };
            let step = scale * room / norm;
            for (yp, s) in y.iter_mut().zip(&slope) {
                *yp = (*yp + step * s).max(0.0);
            }
        }
        (best, best_y)
    }

    fn bytes_of(&self, t: usize) -> f64 {
        self.item_bytes.get(t).copied().unwrap_or(0.0)
    }
}

/// Subgradient steps at most.
const CLIMB_STEPS: usize = 300;

/// `L(v)` of the module docs for every node, from ancestor and descendant bit sets over
/// [`Precedence`] (whose edges all go from lower to higher node ids): t is in `L(v)` when
/// v is a descendant of t, v is an ancestor of one of t's readers, and v does not read t.
fn live_sets(graph: &Graph, ancestry: &Ancestry) -> Vec<Vec<u32>> {
    let n = graph.len();
    let Ancestry { words, anc, desc } = ancestry;
    let words = *words;
    let mut sets = vec![Vec::new(); n];
    let mut covers = vec![0u64; words];
    for t in 0..n {
        let users = graph.users(t);
        if users.is_empty() {
            continue;
        }
        covers.fill(0);
        for &u in users {
            for (c, a) in covers.iter_mut().zip(&anc[u * words..(u + 1) * words]) {
                *c |= a;
            }
        }
        for (c, d) in covers.iter_mut().zip(&desc[t * words..(t + 1) * words]) {
            *c &= d;
        }
        for &u in users {
            covers[u / 64] &= !(1 << (u % 64));
        }
        for (w, &word) in covers.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let v = w * 64 + bits.trailing_zeros() as usize;
                sets[v].push(t as u32);
                bits &= bits - 1;
            }
        }
    }
    sets
}

/// Ancestor and descendant bit sets over [`Precedence`] (whose edges all go from lower to
/// higher node ids), `words` u64 per node, strict (a node is not its own ancestor).
struct Ancestry {
    words: usize,
    anc: Vec<u64>,
    desc: Vec<u64>,
}

impl Ancestry {
    fn of(graph: &Graph) -> Ancestry {
        let n = graph.len();
        let prec = Precedence::of(graph);
        let words = n.div_ceil(64);
        let set = |bits: &mut [u64], i: usize| bits[i / 64] |= 1 << (i % 64);
        let mut anc = vec![0u64; n * words];
        for v in 0..n {
            for &p in &prec.preds[v] {
                let (head, tail) = anc.split_at_mut(v * words);
                let row = &mut tail[..words];
                for (a, b) in row.iter_mut().zip(&head[p * words..(p + 1) * words]) {
                    *a |= b;
                }
                set(row, p);
            }
        }
        let mut desc = vec![0u64; n * words];
        for v in (0..n).rev() {
            for &s in &prec.succs[v] {
                let (head, tail) = desc.split_at_mut(s * words);
                let row = &mut head[v * words..(v + 1) * words];
                for (a, b) in row.iter_mut().zip(&tail[..words]) {
                    *a |= b;
                }
                set(row, s);
            }
        }
        Ancestry { words, anc, desc }
    }

    fn row<'a>(&self, bits: &'a [u64], v: usize) -> &'a [u64] {
        &bits[v * self.words..(v + 1) * self.words]
    }

    /// Whether `t` is a strict descendant of `u`.
    fn descends(&self, u: usize, t: usize) -> bool {
        self.row(&self.desc, u)[t / 64] >> (t % 64) & 1 == 1
    }

    /// Sum of `cost` over the strict ancestors (`ancestors`) or descendants of `v`.
    fn sum_over(&self, v: usize, ancestors: bool, cost: impl Fn(usize) -> f64) -> f64 {
        let bits = if ancestors { &self.anc } else { &self.desc };
        sum_bits(self.row(bits, v), cost)
    }
}
