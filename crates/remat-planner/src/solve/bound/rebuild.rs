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
//! tensors that are not pinned and whose swap costs at least their recomputation plus `S_t`
//! (`(1 - theta) s_t >= theta c_t + S_t`), where `S_t` is at least the `w` of every tensor
//! the rows can then ask to be restored: `t`'s unpinned inputs, and for those in `Q` theirs,
//! and so on (`q_set`: the smaller of every unpinned tensor's `w` and that chain's sum).
//! When the schedule swaps a tensor of `Q` in instead, count it as recomputed with those
//! inputs restored (the rows name no pinned input); the extra `X`s cost at most `S_t`,
//! which its swap paid already. (Recompute-only requests plan at 1 B/s:
//! every tensor of a byte or more is in `Q`; over a fast link, the steps of a chain whose
//! swap is dear against its own recomputation and its inputs' `w`: the softmax chain of an
//! attention block at 32 GB/s and `theta` up to about 0.9.)
//!
//! **Outside `Q`.** An unpinned tensor outside `Q` may still be recomputed, and then its
//! inputs were present or restored; or swapped back. Its rows split the two:
//! `a_{t,v} <= X^r_t + X^s_t` (recomputed at least once, cost `theta c_t`; swapped back at
//! least once, cost `(1 - theta)` times its copies) and `a_{t,v} <= p_{i,v} + r_{i,v} +
//! X^s_t` (the same for `r_{t,v}`), with `a, r <= 1`. A schedule that swaps `t` back sets
//! `X^s_t`; one that recomputes it had the inputs. In the dual a tensor outside `Q` is
//! charged `z + max(0, C_t - z - theta c_t) + max(0, C_t + P_t - z - (1 - theta) s_t)`,
//! with `P_t` all it received and `0 <= z <= C_t` (the `<= 1` rows; [`split_penalty`]
//! takes the least): with nothing received it is `max(0, C_t - w_t)`, as before, and a
//! gift lowers only the recomputation side, so inputs give to it only where its swap is
//! the dearer side (over a fast link: the matmuls whose rebuild chain is long).
//!
//! **Other link terms.** The rows above are written with the room's charges, `theta c_t`
//! and `(1 - theta) s_t`. A link term of [`super`] that bounds the overhead by a sum of a
//! recomputation side `r_t` per tensor recomputed and a swap side `sigma_t` per tensor
//! swapped back, less an offset, puts its own `r_t` and `sigma_t` in their places
//! ([`Sides::scaled`]); the rows, `Q` and the proofs are unchanged.
//!
//! **The dual.** With `y >= 0` and donations `pi >= 0` (input `i` pays part of `t`'s
//! charge at `v`), choosing the other multipliers to zero every per-point term leaves
//!
//! ```text
//! g = sum_v y_v d(v) - sum_t max(0, C_t - w_t),
//! C_t = sum_{v: t in L(v)} max(0, y_v b_t - P_{t,v}) + sum_{v: t in E(v)} max(0, D_{t,v} - P_{t,v})
//! ```
//!
//! for a tensor of `Q` or a pinned one (outside `Q`, the charge above), where `P_{t,v}` is
//! what `t` received at `v` from its inputs and `D_{t,v}` what it gave there (at most
//! `y_v b_t`, or the `p` term turns negative). Every `(y, pi)` gives a valid
//! bound; [`value`] computes `g` exactly for the donations its greedy chose, so the greedy
//! only decides how strong the bound is, never whether it holds.

use std::collections::HashMap;

use crate::ir::Graph;

use super::Cover;

/// The rebuild-aware dual value `g` of the module docs at `y` (one entry per cover point),
/// with `weights` the cover's `w` at this `theta` and `in_q` the tensors of `Q`.
pub(super) fn value(cover: &Cover, graph: &Graph, sides: &Sides, in_q: &[bool], y: &[f64]) -> f64 {
    let n = graph.len();
    // Which tensors have rebuild rows: those of `Q`, and the unpinned others whose swap
    // costs at least their recomputation (elsewhere a gift only adds to the swap side).
    let rebuilds: Vec<bool> = (0..n)
        .map(|t| {
            in_q[t]
                || (sides.split
                    && sides.has_rows(t)
                    && !graph.is_pinned(t)
                    && sides.recompute[t] <= sides.swap[t])
        })
        .collect();
    let mut donations = Donations {
        cover,
        graph,
        y,
        rebuilds: &rebuilds,
        split: sides.split,
        cap: sides.weights.to_vec(),
        received: vec![0.0; n],
        flows: HashMap::new(),
        visits_left: 0,
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
        // A tensor of `Q` asks for all of it; one outside `Q` only for what its
        // recomputation side cannot pay (a gift adds to its swap side).
        let ask = if in_q[t] {
            need
        } else {
            (need - donations.cap[t].max(0.0)).max(0.0)
        };
        donations.visits_left = VISITS_PER_PAIR;
        let got = if ask > 0.0 && donations.may_ask(t) {
            donations.pull_inputs(t, p, ask, 0)
        } else {
            0.0
        };
        donations.received[t] += got;
        donations.cap[t] -= (need - got).max(0.0);
    }
    let mut g: f64 = cover.demand.iter().zip(y).map(|(d, y)| d * y).sum();
    for (t, &cap) in donations.cap.iter().enumerate() {
        let charged = sides.weights[t] - cap;
        g -= if in_q[t] || graph.is_pinned(t) {
            (charged - sides.weights[t]).max(0.0)
        } else {
            split_penalty(
                charged,
                donations.received[t],
                sides.recompute[t],
                sides.swap[t],
            )
        };
    }
    g
}

/// A tensor's costs at one `theta`: `w` (the cover's weight, the smaller side), and each
/// side apart, `theta c` (recomputed) and `(1 - theta)` times its copies (swapped).
pub(super) struct Sides {
    pub weights: Vec<f64>,
    pub recompute: Vec<f64>,
    pub swap: Vec<f64>,
    /// Whether a tensor outside `Q` gets rebuild rows (see "Outside `Q`"): not for
    /// recompute-only requests, where a swap's side is far above any recomputation and
    /// the rows only spread each tensor's room over more chains (Moccasin's n = 250 at the
    /// recompute floor + 5%: 17.0% with them, 18.6% without).
    pub split: bool,
    /// Tensors without rebuild rows whatever their sides (empty: none): a term whose
    /// restorations of some tensors are not the recomputations it counts
    /// ([`super::late`]) charges them nothing and lets them ask nothing.
    pub no_rows: Vec<bool>,
}

impl Sides {
    /// The sides of every tensor of `graph` at `theta`, a copy costing `per_byte` time
    /// units a byte; a pinned tensor can only be swapped.
    pub(super) fn of(graph: &Graph, theta: f64, per_byte: f64, split: bool) -> Sides {
        Sides::scaled(graph, theta, (1.0 - theta) * per_byte, split)
    }

    /// The sides with a recomputation charged `recompute` times its compute time and a
    /// swap `swap_per_byte` a byte (a pinned tensor can only be swapped): the link terms
    /// other than the room's weigh the two sides differently (see [`super::LinkTerm`]).
    pub(super) fn scaled(graph: &Graph, recompute: f64, swap_per_byte: f64, split: bool) -> Sides {
        let n = graph.len();
        let mut sides = Sides {
            weights: Vec::with_capacity(n),
            recompute: Vec::with_capacity(n),
            swap: Vec::with_capacity(n),
            split,
            no_rows: Vec::new(),
        };
        for t in 0..n {
            let node = graph.node(t);
            let swap = node.output_bytes as f64 * swap_per_byte;
            let rebuild = if graph.is_pinned(t) {
                f64::INFINITY
            } else {
                recompute * node.compute_time
            };
            sides.weights.push(rebuild.min(swap));
            sides.recompute.push(rebuild);
            sides.swap.push(swap);
        }
        sides
    }

    /// Whether `t` may have rebuild rows (see [`Sides::no_rows`]).
    pub(super) fn has_rows(&self, t: usize) -> bool {
        !self.no_rows.get(t).copied().unwrap_or(false)
    }

    /// These sides with `t` charged nothing either way and given no rows.
    pub(super) fn free_of_rows(&mut self, t: usize) {
        if self.no_rows.len() < self.weights.len() {
            self.no_rows.resize(self.weights.len(), false);
        }
        self.no_rows[t] = true;
        self.weights[t] = 0.0;
        self.recompute[t] = 0.0;
        self.swap[t] = 0.0;
    }
}

/// The dual's charge to a tensor outside `Q` (see the module docs, "Outside `Q`"): its
/// restorations' prices less what its inputs gave it (`charged`), what they gave
/// (`received`), against its recomputation side `a` and its swap side `b`, with the
/// multipliers of `a <= 1` lowering both by the same `z` (the least of the three kinks).
fn split_penalty(charged: f64, received: f64, a: f64, b: f64) -> f64 {
    let at = |z: f64| z + (charged - z - a).max(0.0) + (charged + received - z - b).max(0.0);
    [0.0, charged - a, charged + received - b]
        .into_iter()
        .map(|z| at(z.clamp(0.0, charged.max(0.0))))
        .fold(f64::INFINITY, f64::min)
}

/// The donations chosen so far: what each tensor may still pay (`w_t - C_t`), and per
/// `(tensor, point)` of `E` what it gave (`D`) and received (`P`).
struct Donations<'a> {
    cover: &'a Cover,
    graph: &'a Graph,
    y: &'a [f64],
    /// Tensors with rebuild rows: their inputs may give to them.
    rebuilds: &'a [bool],
    /// Whether tensors outside `Q` have rebuild rows ([`Sides::split`]): then the asks
    /// are counted.
    split: bool,
    cap: Vec<f64>,
    /// Per tensor, what its inputs gave it in all (the swap side's charge, outside `Q`).
    received: Vec<f64>,
    flows: HashMap<(u32, u32), (f64, f64)>,
    /// Gifts the current priced pair may still ask for (see [`VISITS_PER_PAIR`]).
    visits_left: usize,
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
        if want > surplus && self.may_ask(i) {
            let got = self.pull_inputs(i, p, want - surplus, depth + 1);
            received_now += got;
            self.received[i] += got;
        }
        // Largest gift whose charge `max(0, D - P)` grows by at most what `i` has left.
        let own = self.cap[i].max(0.0);
        let out = want.min(received_now - given + before + own).max(0.0);
        let after = (given + out - received_now).max(0.0);
        self.cap[i] -= after - before;
        self.flows.insert(key, (given + out, received_now));
        out
    }

    /// Whether `t` may ask its inputs to give: when it has rebuild rows, and with the rows
    /// split, while the pair's [`VISITS_PER_PAIR`] last (counting this ask).
    fn may_ask(&mut self, t: usize) -> bool {
        if !self.rebuilds[t] || self.visits_left == 0 {
            return false;
        }
        if self.split {
            self.visits_left -= 1;
        }
        true
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

/// Asks per priced `(tensor, point)` pair, down every chain together, when tensors outside
/// `Q` have rebuild rows: on graphs whose nodes read several earlier ones the chains branch
/// at every link, and through the tensors outside `Q` the asks grew as the branching to the
/// power [`MAX_DEPTH`] (Moccasin's n = 500 took 20 s for one dual vector); fewer asks only
/// weaken the bound.
const VISITS_PER_PAIR: usize = 256;

/// Links of a rebuild chain followed at most (the attention chain of a transformer is four:
/// softmax, mask, scale, `q k^T`); it also bounds the recursion.
const MAX_DEPTH: usize = 16;

/// The tensors of `Q` for these sides (see the module docs), in node order (inputs first):
/// `t` is in `Q` when its swap side is at least its recomputation side plus `S_t` (under
/// the room's term `(1 - theta) s_t >= theta c_t + S_t`), where `S_t` is at least the `w`
/// of every tensor that a swap of `t`, counted as a recomputation, can mark restored: the
/// smaller of every unpinned tensor's `w` and the sum of `w` over `t`'s unpinned inputs
/// plus, for those in `Q`, their own `S` (a tensor reached twice is summed twice, which
/// only makes `Q` smaller; over a slow link the first sum decides, over a fast one the
/// second lets a chain's steps in when the whole graph's recomputation would not).
pub(super) fn q_set(graph: &Graph, sides: &Sides) -> Vec<bool> {
    let n = graph.len();
    let weights = &sides.weights;
    let total: f64 = (0..n)
        .filter(|&t| !graph.is_pinned(t))
        .map(|t| weights[t])
        .sum();
    let mut in_q = vec![false; n];
    let mut chain = vec![0.0f64; n];
    for t in 0..n {
        if graph.is_pinned(t) {
            continue;
        }
        let node = graph.node(t);
        let inputs: f64 = node
            .inputs
            .iter()
            .filter(|&&i| !graph.is_pinned(i))
            .map(|&i| weights[i] + if in_q[i] { chain[i] } else { 0.0 })
            .sum();
        chain[t] = inputs.min(total);
        in_q[t] = sides.has_rows(t) && sides.swap[t] >= sides.recompute[t] + chain[t];
    }
    in_q
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::test_node as node;

    /// Outside `Q`: with nothing received the charge is the cover's (`max(0, C - w)`, `w`
    /// the smaller side); a gift lowers the recomputation side only, down to the swap side.
    #[test]
    fn a_split_charge_is_the_covers_without_gifts_and_falls_with_them() {
        for (charged, a, b) in [
            (5.0, 2.0, 3.0),
            (5.0, 3.0, 2.0),
            (1.0, 2.0, 3.0),
            (9.0, 1.0, 4.0),
        ] {
            let cover: f64 = (charged - f64::min(a, b)).max(0.0);
            assert!((split_penalty(charged, 0.0, a, b) - cover).abs() < 1e-12);
        }
        // Priced 8 in all, recomputation side 2, swap side 6: 6 without gifts; with 6 of it
        // given by the inputs, 8 - 6 = 2 is left, the price over the swap side (a gift
        // lowers only the recomputation side).
        assert!((split_penalty(8.0, 0.0, 2.0, 6.0) - 6.0).abs() < 1e-12);
        assert!((split_penalty(2.0, 6.0, 2.0, 6.0) - 2.0).abs() < 1e-12);
        // Priced 5, 4 given: nothing left on either side.
        assert!(split_penalty(1.0, 4.0, 2.0, 6.0).abs() < 1e-12);
    }

    /// `q -> scores -> softmax`, and a large tensor elsewhere whose `w` alone exceeds what a
    /// swap of the softmax leaves over its recomputation: the chain's own sum lets the
    /// softmax and the scores into `Q` (the whole graph's sum kept them out).
    #[test]
    fn a_chain_enters_q_on_its_own_inputs_weights() {
        let nodes = vec![
            node("q", 1, 1.0, vec![]),
            node("scores", 10, 4.0, vec![0]),
            node("softmax", 10, 1.0, vec![1]),
            node("big", 100, 1000.0, vec![]),
            node("end", 1, 1.0, vec![2, 3]),
        ];
        let graph = Graph::new("chain", nodes, 0, 1.0).expect("a valid graph");
        let (theta, units_per_byte) = (0.5, 1.0);
        let in_q = q_set(&graph, &Sides::of(&graph, theta, units_per_byte, false));
        // softmax: swap 5 >= 0.5 + w(scores) 2 + w(q) 0.5; scores: 5 >= 2 + 0.5.
        assert_eq!(in_q, vec![true, true, true, false, false]);
    }
}
