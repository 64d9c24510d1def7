//! Rebuilds before a late point, then the copies back that point forces.
//!
//! Why. Under the recompute floor a pinned tensor (a gradient buffer, written in place and
//! read by the step's end) can only be swapped: at a late point of the backward the bytes
//! that must be absent can exceed every unpinned tensor held there, and the rest are copies
//! back that start after the point and end before the step does. Single-point terms see
//! either the point early in the backward (where the recomputations are forced) or the late
//! one (where the copies back are), never both: the plans wait for those copies at the
//! step's end (32 layers at today's floor + 5%: 4% of the step) while the bound prices the
//! recomputations alone.
//!
//! Proof. Fix a schedule S, a cover point `v` and a point `p` that is a strict descendant
//! of `v` (in [`super::Precedence`]). Let `T_x` be the start of `x`'s first computation.
//! - Before `p`, the compute stream runs every strict ancestor of `p` once at least, and
//!   every recomputation S schedules between `v` and `p`, among them `R_{v,p}`: the
//!   restorations by recomputation of the tensors absent at `v` that have a reader in
//!   `desc(v) & (anc(p) + p)` (that reader runs after `v` and no later than `p`, and the
//!   tensor is on the device then), with the inputs their recomputations need (a rebuild
//!   row of [`super::rebuild`] asks an input that is present at `v` or restored after
//!   `v`, and here before the recomputation that reads it, so before `p`). So `T_p >=
//!   c(anc p) + R_{v,p}`.
//! - The copies out of the tensors absent at `v` and swapped back after it end before `T_v`
//!   ([`super`], "The copies out"), and after `T_v` the compute stream runs `v`, the strict
//!   ancestors of `p` that descend from `v`, and `R_{v,p}`: `T_p >= s_out + c(v) + c(anc p
//!   & desc v) + R_{v,p}`.
//! - At `p`'s first computation the device holds its inputs, its output, the static bytes
//!   and the tensors of `L(p)` that are present, within the budget, so the absent ones of
//!   `L(p)` hold at least `d(p)`; the unpinned ones at most `U(p)`, their bytes, so pinned
//!   tensors of at least `F(p) = d(p) - U(p)` bytes are absent at `p` and are read after
//!   it. A pinned tensor cannot be recomputed: each is swapped in, issued after `p`'s
//!   compute step (one issued before it would be on the device at `p`), on the one
//!   host-to-device stream, and read before the step ends: `total >= T_p + F(p) / B`.
//!
//! With `theta` in [0, 1] mixing the two bounds on `T_p`:
//!
//! ```text
//! overhead >= R_{v,p} + (1 - theta) s_out + F(p) / B
//!             - (base - theta c(anc p) - (1 - theta) (c(v) + c(anc p & desc v)))
//! ```
//!
//! `R_{v,p} + (1 - theta) s_out` is bounded below by the rebuild LP of [`super::rebuild`] at
//! `v` alone with a recomputation charged its whole compute and a swap `(1 - theta)` its
//! copy out (the sides of [`super::LinkTerm::OutThenRebuild`]), except that a tensor of
//! `L(v)` with no reader in `desc(v) & (anc(p) + p)` is charged nothing and asks nothing
//! (its restoration may come after `p`, outside `R_{v,p}`): its rows would count what this
//! argument does not see. `F(p)` is a constant of the point. The best over `v` (each
//! `theta`'s best single point of that term), the latest points `p` and multiples of `v`'s
//! price is taken.
//!
//! Where it gives little: at or above the recompute floor (`F(p) <= 0` everywhere); where
//! the compute after `p` can hide the forced copies (8 layers at today's floor + 5%: 646
//! units of copies, 812 of compute not before `bwd:l0.softmax`; the plan still waits 272 at
//! the step's end, because memory stays full after the point, which the term does not
//! model); and in free order where many nodes are unrelated to `p` (weight gradients as
//! nodes off the backward's chain could run after it; the generator's transformers compute
//! them in the backward op that also gives the input gradient, so free and node order get
//! the same bound there). In node order every earlier node is an ancestor.

use std::time::Instant;

use crate::ir::Graph;

use super::rebuild::{self, Sides};
use super::{Cover, Link, LinkTerm, Start, best_multiple, sum_bits};

/// Points `p` evaluated per start, the largest constant first: the rebuild LP costs a
/// fraction of a millisecond at one point on 1,000 nodes, twenty-one times per `p`.
const POINTS_PER_START: usize = 6;

/// The best value of the module docs (in the graph's time unit) over the starts of
/// [`LinkTerm::OutThenRebuild`] and the points under the recompute floor after each, until
/// `deadline` (at least one point when there is one); `None` when no point has forced
/// copies back.
pub(super) fn best(cover: &Cover, link: &Link, starts: &[Start], deadline: Instant) -> Option<f64> {
    let graph = link.graph;
    let forced = forced_bytes(cover, graph);
    if forced.iter().all(|&f| f <= 0.0) {
        return None;
    }
    let compute = |w: usize| graph.node(w).compute_time;
    let mut best: Option<f64> = None;
    let mut evaluated = 0usize;
    for start in starts {
        let Start { theta, term, y } = start;
        if *term != LinkTerm::OutThenRebuild || y.len() != cover.points.len() {
            continue;
        }
        let Some(vq) = start.single_point() else {
            continue;
        };
        let v = cover.points[vq];
        let desc_v = link.ancestry.row(&link.ancestry.desc, v);
        // The constant of each point after `v` with forced copies back, largest first.
        let mut late: Vec<(f64, usize)> = (0..cover.points.len())
            .filter(|&q| forced[q] > 0.0 && link.ancestry.descends(v, cover.points[q]))
            .map(|q| {
                let p = cover.points[q];
                let anc_p = link.ancestry.row(&link.ancestry.anc, p);
                let between: Vec<u64> = anc_p.iter().zip(desc_v).map(|(a, d)| a & d).collect();
                let hidden = theta * cover.before[q]
                    + (1.0 - theta) * (cover.own[vq] + sum_bits(&between, compute));
                (forced[q] * link.units_per_byte - (link.base - hidden), q)
            })
            .collect();
        late.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(constant, q) in late.iter().take(POINTS_PER_START) {
            if evaluated > 0 && Instant::now() >= deadline {
                return best;
            }
            evaluated += 1;
            let sides = sides_before(cover, link, *theta, vq, cover.points[q]);
            let in_q = rebuild::q_set(graph, &sides);
            let mut scaled = y.clone();
            let at = |scale: f64| {
                for (s, y) in scaled.iter_mut().zip(y) {
                    *s = y * scale;
                }
                rebuild::value(cover, graph, &sides, &in_q, &scaled) + constant
            };
            let (value, stopped) = best_multiple(at, false, deadline);
            best = Some(best.map_or(value, |b: f64| b.max(value)));
            if stopped {
                return best;
            }
        }
    }
    best
}

/// `F(p)` per cover point: its deficit less the bytes of the unpinned tensors of `L(p)`
/// (the pinned tensors' bytes that must be absent there), in bytes; at most 0 where the
/// unpinned ones could cover it.
fn forced_bytes(cover: &Cover, graph: &Graph) -> Vec<f64> {
    (0..cover.points.len())
        .map(|q| {
            let unpinned: f64 = cover
                .items_of(q)
                .iter()
                .filter(|&&t| !graph.is_pinned(t as usize))
                .map(|&t| cover.item_bytes[t as usize])
                .sum();
            cover.demand[q] - unpinned
        })
        .collect()
}

/// The sides of [`LinkTerm::OutThenRebuild`] at `theta`, with the tensors of `L(v)` (`v`
/// the cover's point `vq`) that have no reader in `desc(v) & (anc(p) + p)` charged nothing
/// and given no rows (see the module docs).
fn sides_before(cover: &Cover, link: &Link, theta: f64, vq: usize, p: usize) -> Sides {
    let graph = link.graph;
    let v = cover.points[vq];
    let mut sides = LinkTerm::OutThenRebuild.sides(graph, theta, link.units_per_byte, true);
    for &t in cover.items_of(vq) {
        let t = t as usize;
        let read_before_p = graph
            .users(t)
            .iter()
            .any(|&u| link.ancestry.descends(v, u) && (u == p || link.ancestry.descends(u, p)));
        if !read_before_p {
            sides.free_of_rows(t);
        }
    }
    sides
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::super::{Ancestry, Cover, Link, LinkTerm, Start};
    use crate::problem::Problem;
    use crate::solve::Anytime;
    use crate::strategy::Strategy;
    use crate::synth::{TransformerParams, transformer};

    /// The generator's 12-layer transformer step in node order at today's floor + 5%,
    /// under the recompute floor: the gradient buffers held across the late softmax
    /// backwards cannot all stay, and their copies back come after the rebuilds the
    /// backward's first point forces. The term adds them up: above the rebuilds' term
    /// alone at the same point and `theta`, and still under the default search's plan.
    #[test]
    fn the_late_copies_back_add_to_the_rebuilds_before_them() {
        let graph = transformer(&TransformerParams::gpt(12))
            .expect("a transformer")
            .with_fixed_order();
        let floor = graph.memory_floor();
        let recompute = crate::floor::recompute_floor(&graph).bytes;
        assert!(recompute > floor, "{recompute} <= {floor}");
        let budget = floor + floor / 20;
        assert!(budget < recompute, "{budget} >= {recompute}");
        let problem = Problem {
            graph: &graph,
            budget_bytes: budget,
            bandwidth: 32e9,
        };
        let ancestry = Ancestry::of(&graph);
        let cover = Cover::build(&problem, &ancestry);
        let link = Link {
            graph: &graph,
            ancestry: &ancestry,
            base: graph.base_time(),
            units_per_byte: 1.0 / (problem.bandwidth * graph.time_unit_s()),
            recompute_only: false,
        };
        let planned = Anytime {
            time_limit: Some(Duration::from_secs(2)),
        }
        .plan(&problem)
        .expect("a plan");
        let overhead = planned.report.total_time - planned.report.base_time;
        let far = Instant::now() + Duration::from_secs(60);
        let mut gained = false;
        for theta in [0.85, 0.9, 0.93, 0.95] {
            let term = LinkTerm::OutThenRebuild;
            let weights = term
                .sides(&graph, theta, link.units_per_byte, false)
                .weights;
            let (_, y) = cover.best_single_point(&weights, theta, link.base, term);
            let starts = [Start { theta, term, y }];
            let rebuilds = cover.with_rebuilds(&link, &starts, true, far);
            let Some(late) = super::best(&cover, &link, &starts, far) else {
                panic!(
                    "no forced copies back at {budget} B (floor {floor}, recompute {recompute})"
                );
            };
            gained |= late > rebuilds + 1e-6 * link.base;
            assert!(
                late <= overhead + 1e-6,
                "theta {theta}: {late} above the plan's {overhead}"
            );
        }
        assert!(gained, "the late copies back never added to the rebuilds");
    }
}
