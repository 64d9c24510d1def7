//! The cover bound with the link in a window: swaps out cannot hide behind compute that is
//! not there.
//!
//! The cover of [`super`] pays a swap `(1 - theta) s(t)` against `(1 - theta) base`: the
//! copy stream may use the whole step. But a tensor swapped out and absent at a point `v`
//! left in a window. Fix `v` and a node `u` that is `v` or an ancestor of it. In any
//! schedule:
//! - a tensor `t` that is `u` or a descendant of `u`, absent at `v`'s first computation and
//!   brought back by a swap-in, has a host copy whose copy started after `t`'s first
//!   computation ended (the simulator starts a swap-out no earlier than the compute clock
//!   at its issue), so after `u`'s first computation ended; and it ended before `v`'s first
//!   computation started (a `Free` waits for the copy of its tensor in flight, and `t` was
//!   freed before `v`'s output was allocated);
//! - the device-to-host copies run one after another on one stream, so their sum is at
//!   most that stretch of the compute clock: the computations in it and the waits in it;
//! - the first computations in it are of nodes neither `u`, its ancestors, `v` nor `v`'s
//!   descendants: at most `B(u, v)`, the base time of the others. The rest (recomputations,
//!   waits) is overhead.
//!
//! So `overhead >= sum_{t swapped} s(t) - B(u, v)`, and `overhead >= R >= sum_{t
//! recomputed} c(t)`; for `theta` in [0, 1], `overhead >= theta R + (1 - theta) (S -
//! B(u, v))`. The absent tensors of `L(v)` cover `v`'s deficit, each recomputed (`theta
//! c(t)`; never a pinned one) or swapped (`(1 - theta) s(t)` inside the window, 0 outside
//! it, where this argument does not see its copy): the fractional knapsack over `L(v)` with
//! those weights, less `(1 - theta) B(u, v)`, is a lower bound on the overhead of every
//! schedule. [`best`] takes the largest over points, windows and `theta`s.

use std::time::Instant;

use crate::ir::Graph;

use super::{Ancestry, Cover};

/// `theta`s tried per window: the cover's, and small ones, since a short window makes a
/// swap dear against a recomputation (the value is concave in `theta`).
const WINDOW_THETAS: [f64; 13] = [
    0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.8, 0.9, 0.97, 0.99, 0.999, 0.9999,
];

/// Windows tried per point: starts spread over the point's forced-live tensors.
const WINDOWS_PER_POINT: usize = 12;

/// The largest window bound (in the graph's time unit) over the cover's points, largest
/// deficit first, until `deadline` (at least one point); `None` when none was tried.
pub(super) fn best(
    cover: &Cover,
    graph: &Graph,
    ancestry: &Ancestry,
    units_per_byte: f64,
    deadline: Instant,
) -> Option<f64> {
    let base = graph.base_time();
    let compute = |w: usize| graph.node(w).compute_time;
    let mut order: Vec<usize> = (0..cover.points.len()).collect();
    order.sort_by(|&a, &b| cover.demand[b].total_cmp(&cover.demand[a]));
    let mut best: Option<f64> = None;
    let mut items: Vec<(f64, f64)> = Vec::new();
    for (k, &p) in order.iter().enumerate() {
        if k > 0 && Instant::now() >= deadline {
            break;
        }
        let v = cover.points[p];
        let from_v = compute(v) + ancestry.sum_over(v, false, compute);
        let tensors = cover.items_of(p);
        let step = tensors.len().div_ceil(WINDOWS_PER_POINT).max(1);
        let starts = tensors
            .iter()
            .step_by(step)
            .chain(tensors.last())
            .map(|&u| u as usize);
        for u in starts {
            let to_u = compute(u) + ancestry.sum_over(u, true, compute);
            let window = (base - to_u - from_v).max(0.0);
            for theta in WINDOW_THETAS {
                items.clear();
                for &t in tensors {
                    let t = t as usize;
                    let node = graph.node(t);
                    let bytes = node.output_bytes as f64;
                    if bytes <= 0.0 {
                        continue;
                    }
                    let inside = t == u || ancestry.descends(u, t);
                    let swap = if inside {
                        (1.0 - theta) * bytes * units_per_byte
                    } else {
                        0.0
                    };
                    let weight = if graph.is_pinned(t) {
                        swap
                    } else {
                        (theta * node.compute_time).min(swap)
                    };
                    items.push((weight, bytes));
                }
                let Some(cost) = knapsack(&mut items, cover.demand[p]) else {
                    continue;
                };
                let value = cost - (1.0 - theta) * window;
                best = Some(best.map_or(value, |b: f64| b.max(value)));
            }
        }
    }
    best
}

/// The least cost of covering `demand` bytes with fractions of `items` (weight, bytes),
/// cheapest per byte first; `None` when all of them cannot cover it.
fn knapsack(items: &mut [(f64, f64)], demand: f64) -> Option<f64> {
    items.sort_by(|a, b| (a.0 / a.1).total_cmp(&(b.0 / b.1)));
    let (mut left, mut cost) = (demand, 0.0);
    for &(w, b) in items.iter() {
        if left <= 0.0 {
            break;
        }
        if b >= left {
            cost += w * left / b;
            left = 0.0;
        } else {
            cost += w;
            left -= b;
        }
    }
    (left <= 0.0).then_some(cost)
}
