//! The cover bound with rebuild chains: a recomputation needs its inputs.
//!
//! The cover of [`super`] charges a tensor `t` absent at a point `v` only its own
//! restoration, `w_t`. But recomputing `t` after `v` reads `t`'s inputs, and an input `i`
//! that is not itself forced live at `v` (not in `L(v)`, not read by `v`, not `v`) is then
//! either on the device at `v`, taking bytes there, or absent and brought back after `v`
//! too, at `w_i` or more, and so on up the graph. On a transformer the softmax output is
//! forced live across the backward, but its input (the masked scores) is not: every
//! schedule that drops it pays the mask, the scale and `q k^T` again, or holds one of them.
//!
//! **The LP.** Per point `v`: `a_{t,v}` (t in `L(v)` absent at `v`), and for the tensors
//! `i` of `E(v)` (strict ancestors of `v` outside `L(v)`, `inputs(v)` and `v`) `p_{i,v}`
//! (on the device at `v`) and `r_{i,v}` (restored after `v`); per tensor, `X_t` (restored
//! at least once: recomputed or swapped in, cost `w_t`). Rows:
//!
//! ```text
//! sum_{t in L(v)} b_t a_{t,v} - sum_{i in E(v)} b_i p_{i,v} >= d(v)        (y_v)
//! a_{t,v} <= X_t,  r_{i,v} <= X_i
//! a_{t,v} <= p_{i,v} + r_{i,v}   for t in Q, i in inputs(t) & E(v), unpinned  (pi)
//! r_{i,v} <= p_{k,v} + r_{k,v}   for i in Q, k in inputs(i) & E(v), unpinned  (pi)
//! ```
//!
//! A schedule gives a solution of at most its cost: the memory row is its memory at `v`
//! (present tensors of `E(v)` count too); a tensor of `Q` recomputed after `v` had its
//! inputs present then, so each was present at `v` or came back after it. `Q` holds the
//! tensors that are not pinned and whose swap costs at least their recomputation plus every
//! unpinned tensor's `w` (`(1 - theta) s_t >= theta c_t + sum w`): when the schedule swaps
//! one in instead, count it as recomputed with every unpinned input it needs restored (the
//! rows name no pinned input); the extra `X`s cost at most `sum w`, which its swap paid
//! already. (Recompute-only requests plan at 1 B/s:
//! every tensor of a byte or more is in `Q`; over a fast link few are, and the bound is
//! the cover's.)
//!
//! **The dual.** With `y >= 0` and donations `pi >= 0` (input `i` pays part of `t`'s
//! charge at `v`), choosing the other multipliers to zero every per-point term leaves
//!
//! ```text
//! g = sum_v y_v d(v) - sum_t max(0, C_t - w_t),
//! C_t = sum_{v: t in L(v)} max(0, y_v b_t - P_{t,v}) + sum_{v: t in E(v)} max(0, D_{t,v} - P_{t,v})
//! ```
//!
//! where `P_{t,v}` is what `t` received at `v` from its inputs and `D_{t,v}` what it gave
//! there (at most `y_v b_t`, or the `p` term turns negative). Every `(y, pi)` gives a valid
//! bound; [`value`] computes `g` exactly for the donations its greedy chose, so the greedy
//! only decides how strong the bound is, never whether it holds.

use std::collections::HashMap;

use crate::ir::Graph;

use super::Cover;

/// The rebuild-aware dual value `g` of the module docs at `y` (one entry per cover point),
/// with `weights` the cover's `w` at this `theta` and `in_q` the tensors of `Q`.
pub(super) fn value(
    cover: &Cover,
    graph: &Graph,
    weights: &[f64],
    in_q: &[bool],
    y: &[f64],
) -> f64 {
    let mut donations = Donations {
        cover,
        graph,
        y,
        in_q,
        cap: weights.to_vec(),
        flows: HashMap::new(),
    };
    // The priced (tensor, point) pairs, tensors in id order (a topological order): a
    // tensor's own charges are settled, with what its inputs gave it, before any later
    // reader asks it to give. Only points with a price count, so a single point's vector
    // costs its own tensors, not the graph's.
    let mut pairs: Vec<(u32, u32)> = Vec::new();
    for (p, &price) in y.iter().enumerate() {
        if price > 0.0 {
            pairs.extend(cover.items_of(p).iter().map(|&t| (t, p as u32)));
        }
    }
    pairs.sort_unstable();
    for (t, p) in pairs {
        let (t, p) = (t as usize, p as usize);
        let need = y[p] * cover.item_bytes[t];
        if need <= 0.0 {
            continue;
        }
        let got = if in_q[t] {
            donations.pull_inputs(t, p, need, 0)
        } else {
            0.0
        };
        donations.cap[t] -= (need - got).max(0.0);
    }
    let mut g: f64 = cover.demand.iter().zip(y).map(|(d, y)| d * y).sum();
    for &left in &donations.cap {
        g -= (-left).max(0.0);
    }
    g
}

/// The donations chosen so far: what each tensor may still pay (`w_t - C_t`), and per
/// `(tensor, point)` of `E` what it gave (`D`) and received (`P`).
struct Donations<'a> {
    cover: &'a Cover,
    graph: &'a Graph,
    y: &'a [f64],
    in_q: &'a [bool],
    cap: Vec<f64>,
    flows: HashMap<(u32, u32), (f64, f64)>,
}

impl Donations<'_> {
    /// Asks `t`'s inputs that are in `E` at point `p` to give up to `need` together;
    /// returns what they gave. `depth` counts the links of the chain so far: past
    /// [`MAX_DEPTH`] nothing more is asked (fewer donations only weaken the bound).
    fn pull_inputs(&mut self, t: usize, p: usize, need: f64, depth: usize) -> f64 {
        if depth >= MAX_DEPTH {
            return 0.0;
        }
        let graph = self.graph;
        let mut got = 0.0;
        for &i in &graph.node(t).inputs {
            if got >= need {
                break;
            }
            // Rows only for unpinned inputs: a pinned one would enter the count of `Q`'s
            // slack with its swap, which at a slow link dwarfs every recomputation.
            if !graph.is_pinned(i) && self.in_e(i, p) {
                got += self.give(i, p, need - got, depth);
            }
        }
        got.min(need)
    }

    /// `i` (in `E` at point `p`) gives up to `amount` at `p`: first what its own inputs
    /// give it there (free to `i`, when `i` is in `Q`), then from what it may still pay.
    fn give(&mut self, i: usize, p: usize, amount: f64, depth: usize) -> f64 {
        let key = (i as u32, p as u32);
        let (given, received) = self.flows.get(&key).copied().unwrap_or((0.0, 0.0));
        // The `p` term: what `i` gives at `p` stays within its bytes at the point's price.
        let room = self.y[p] * self.cover.item_bytes[i] - given;
        let want = amount.min(room);
        if want <= 0.0 {
            return 0.0;
        }
        let before = (given - received).max(0.0);
        let mut received_now = received;
        let surplus = (received - given).max(0.0);
        if want > surplus && self.in_q[i] {
            received_now += self.pull_inputs(i, p, want - surplus, depth + 1);
        }
        // Largest gift whose charge `max(0, D - P)` grows by at most what `i` has left.
        let own = self.cap[i].max(0.0);
        let out = want.min(received_now - given + before + own).max(0.0);
        let after = (given + out - received_now).max(0.0);
        self.cap[i] -= after - before;
        self.flows.insert(key, (given + out, received_now));
        out
    }

    /// Whether tensor `i` is in `E(v)` at point `p`: not `v`, not read by `v`, not in
    /// `L(v)`. (Callers only ask for inputs of a strict ancestor of `v`, so `i` is one too.)
    fn in_e(&self, i: usize, p: usize) -> bool {
        let v = self.cover.points[p];
        if i == v || self.graph.node(v).inputs.contains(&i) {
            return false;
        }
        self.cover.items_of(p).binary_search(&(i as u32)).is_err()
    }
}

/// Links of a rebuild chain followed at most (the attention chain of a transformer is four:
/// softmax, mask, scale, `q k^T`); it also bounds the recursion.
const MAX_DEPTH: usize = 16;

/// The tensors of `Q` at this `theta` (see the module docs).
pub(super) fn q_set(graph: &Graph, theta: f64, units_per_byte: f64, weights: &[f64]) -> Vec<bool> {
    let total: f64 = (0..graph.len())
        .filter(|&t| !graph.is_pinned(t))
        .map(|t| weights[t])
        .sum();
    (0..graph.len())
        .map(|t| {
            let node = graph.node(t);
            let swap = (1.0 - theta) * node.output_bytes as f64 * units_per_byte;
            !graph.is_pinned(t) && swap >= theta * node.compute_time + total
        })
        .collect()
}
