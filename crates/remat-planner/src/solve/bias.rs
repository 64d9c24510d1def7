//! A search over the eviction's choices in one order: annealing on per-tensor score
//! multipliers of [`crate::exact::evict`]'s greedy pass.
//!
//! Reasoning. The greedy pass is myopic: at each allocation it drops the resident tensor
//! that is cheapest to rebuild per byte *now*, and may then pay for it several times, or
//! drop a big tensor where two small ones would have left room for the next allocation too.
//! The exact answer in a fixed order is Checkmate's MILP (minutes on a 71-node U-Net). Its
//! schedules differ from the greedy's in a handful of choices, so the search keeps the
//! greedy as the decoder and searches what it decides from: a multiplier per tensor on its
//! eviction score (large: keep it longer; small: drop it first), plus the score's weighting.
//! Every candidate is one pass (tens of microseconds at a hundred nodes), so a second tries
//! thousands. Moves focus on the tensors the current schedule recomputes, since those are
//! where the time goes; the annealing accepts a slightly slower schedule early on to leave a
//! local optimum. While no pass fits the budget, the search lowers the memory the pass
//! lacks first (the same moves), which finds plans the fixed weightings get stuck on.
//!
//! The work is counted in passes ([`Work::passes`]) as well as bounded by a deadline, so
//! that tests can fix the amount of search and not depend on the machine's load.

use std::time::Instant;

use crate::error::PlanError;
use crate::exact::chain_graph::decisions_of;
use crate::exact::evict::{self, Pass, Weights};
use crate::ir::{Graph, NodeId};
use crate::plan::Step;
use crate::problem::{Planned, Problem, plan_from_steps};

use super::{NAME, in_order, map_step};

/// How much search: at most `passes` greedy passes, none begun after `deadline`. Without
/// a deadline the temperature falls once over the passes (tests fix the work this way);
/// with one, it falls over every `NOMINAL_PASSES` and the search stops early once
/// `STALE_CYCLES` of them bring nothing better.
#[derive(Clone, Copy, Debug)]
pub struct Work {
    pub passes: usize,
    pub deadline: Option<Instant>,
}

/// The search's judgment of one pass: nodes of the order left when it got stuck (0 when it
/// fits), the memory it lacked there, then compute time. A stuck pass lacks about one
/// tensor's bytes wherever it stops (the pinned rebuilds fill the memory), so how far it got
/// is the measure that guides the search toward a fitting schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Score {
    unfinished: usize,
    lacking: u64,
    time: f64,
}

impl Score {
    fn of(pass: &Pass, graph: &Graph, budget: u64) -> Score {
        match pass {
            Pass::Fits { steps, .. } => Score {
                unfinished: 0,
                lacking: 0,
                time: evict::compute_time(graph, steps),
            },
            Pass::Stuck { needed, at } => Score {
                unfinished: graph.len() - at,
                lacking: needed.saturating_sub(budget).max(1),
                time: f64::INFINITY,
            },
        }
    }

    fn better_than(&self, other: &Score) -> bool {
        (self.unfinished, self.lacking, self.time) < (other.unfinished, other.lacking, other.time)
    }
}

/// Plans `problem.graph` run in `order` by the search (see the module docs): the fastest
/// schedule found, mapped back to the graph's ids and judged by the simulator, or
/// `OverBudget` with the store-all peak (no stuck pass has a schedule).
pub fn plan_in_order(
    problem: &Problem,
    order: &[NodeId],
    work: Work,
) -> Result<Planned, PlanError> {
    let graph = in_order(problem.graph, order)?;
    let graph = graph.as_ref();
    let budget = problem.budget_bytes;
    let Some(steps) = search(graph, budget, work) else {
        // A stuck pass has no schedule, so no peak to report (what it lacked where it
        // stuck says how close it came, not what any schedule reaches): store-all's.
        return Err(PlanError::OverBudget {
            strategy: NAME.into(),
            budget,
            best_peak: graph.store_all_peak(),
        });
    };
    let steps: Vec<Step> = steps.into_iter().map(|s| map_step(s, order)).collect();
    let decisions = decisions_of(problem.graph, &steps);
    plan_from_steps(problem, NAME, steps, decisions)
}

/// The annealing itself on a graph numbered in its run order: the best fitting schedule
/// found, if any.
fn search(graph: &Graph, budget: u64, work: Work) -> Option<Vec<Step>> {
    let n = graph.len();
    let none = vec![false; n];
    let out_of_time = || work.deadline.is_some_and(|d| Instant::now() >= d);
    let weightings: Vec<Weights> = evict::weightings().collect();
    let mut passes = 0usize;
    let run = |bias: &[f64], weights: Weights, passes: &mut usize| {
        *passes += 1;
        evict::evict_pass_biased(graph, budget, weights, &none, bias, work.deadline)
    };
    // Start from the best plain weighting.
    let ones = vec![1.0; n];
    let mut current: Option<(Weights, Score, Pass)> = None;
    for &w in &weightings {
        if passes >= work.passes || (passes > 0 && out_of_time()) {
            break;
        }
        let pass = run(&ones, w, &mut passes);
        let score = Score::of(&pass, graph, budget);
        if current.as_ref().is_none_or(|c| score.better_than(&c.1)) {
            current = Some((w, score, pass));
        }
    }
    let (mut weights, mut score, pass) = current?;
    let mut bias = ones;
    let mut best_score = score;
    let mut best_steps = fitting_steps(&pass);
    let mut focus = recomputed(n, &pass);
    let mut rng = SplitMix(0xB1A5_5EED);
    let first = passes;
    let mut last_gain = passes;
    while passes < work.passes && !out_of_time() {
        // Under a deadline, a search that has not improved its best for STALE_CYCLES
        // cycles of the temperature has converged: the time is left to the caller.
        if work.deadline.is_some() && passes - last_gain > STALE_CYCLES * NOMINAL_PASSES {
            break;
        }
        // The temperature falls linearly to zero over the passes allowed, or, under a
        // deadline, over every NOMINAL_PASSES passes in turn (reheating after each).
        let span = if work.deadline.is_some() {
            NOMINAL_PASSES
        } else {
            (work.passes - first).max(1)
        };
        let progress = ((passes - first) % span) as f64 / span as f64;
        let temperature = START_TEMPERATURE * (1.0 - progress);
        let mut next_bias = bias.clone();
        let mut next_weights = weights;
        mutate(
            &mut next_bias,
            &mut next_weights,
            &weightings,
            &focus,
            &mut rng,
        );
        let pass = run(&next_bias, next_weights, &mut passes);
        let next = Score::of(&pass, graph, budget);
        if accept(&next, &score, temperature, &mut rng) {
            (bias, weights, score) = (next_bias, next_weights, next);
            focus = recomputed(n, &pass);
            if focus.is_empty() {
                focus = (0..n).collect();
            }
            if next.better_than(&best_score) {
                best_score = next;
                last_gain = passes;
                if let Some(steps) = fitting_steps(&pass) {
                    best_steps = Some(steps);
                }
                if next.lacking == 0 && next.time <= graph.base_time() {
                    break;
                }
            }
        }
    }
    best_steps
}

/// Passes over which the temperature falls from its start to zero when only a deadline
/// bounds the search (it then starts again: a reheat).
const NOMINAL_PASSES: usize = 20_000;

/// Temperature cycles without a better schedule after which a deadline-bound search stops.
const STALE_CYCLES: usize = 1;

/// Start temperature, as a fraction of the schedule's time that a worse move may add and
/// still be taken with probability 1/e.
const START_TEMPERATURE: f64 = 0.002;

fn fitting_steps(pass: &Pass) -> Option<Vec<Step>> {
    match pass {
        Pass::Fits { steps, .. } => Some(steps.clone()),
        Pass::Stuck { .. } => None,
    }
}

/// Tensors computed more than once in the pass's schedule (every tensor when it is stuck:
/// no schedule to learn from).
fn recomputed(n: usize, pass: &Pass) -> Vec<NodeId> {
    let Pass::Fits { steps, .. } = pass else {
        return (0..n).collect();
    };
    let mut count = vec![0u32; n];
    for s in steps {
        if let Step::Compute { node } = *s {
            count[node] += 1;
        }
    }
    (0..n).filter(|&v| count[v] > 1).collect()
}

/// One move: mostly a new multiplier on a recomputed tensor (keep it, or drop it earlier),
/// sometimes a reset of some tensor's multiplier or another weighting.
fn mutate(
    bias: &mut [f64],
    weights: &mut Weights,
    weightings: &[Weights],
    focus: &[NodeId],
    rng: &mut SplitMix,
) {
    let n = bias.len();
    let roll = rng.unit();
    if roll < 0.05 {
        *weights = weightings[rng.below(weightings.len())];
        return;
    }
    if roll < 0.15 {
        let t = rng.below(n);
        bias[t] = 1.0;
        return;
    }
    let t = if roll < 0.75 && !focus.is_empty() {
        focus[rng.below(focus.len())]
    } else {
        rng.below(n)
    };
    // A log-uniform factor in [1/64, 64], or a near-protection.
    bias[t] = if rng.unit() < 0.15 {
        1e6
    } else {
        let exponent = (rng.unit() * 2.0 - 1.0) * 6.0 * std::f64::consts::LN_2;
        (bias[t] * exponent.exp()).clamp(1e-6, 1e6)
    };
}

/// Annealing acceptance: better or equal always; worse with probability
/// `exp(-relative increase / temperature)`; a pass lacking more memory than the current
/// one only while the current one does not fit either, rarely.
fn accept(next: &Score, current: &Score, temperature: f64, rng: &mut SplitMix) -> bool {
    if !current.better_than(next) {
        return true;
    }
    if next.lacking > 0 || current.lacking > 0 {
        // Stuck passes: a worse one is taken rarely, to leave a plateau.
        return current.lacking > 0 && rng.unit() < 0.02;
    }
    if temperature <= 0.0 {
        return false;
    }
    let worse = (next.time - current.time) / current.time.max(f64::MIN_POSITIVE);
    rng.unit() < (-worse / temperature).exp()
}

/// SplitMix64: the search's own deterministic random numbers.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solve::order::reordered;
    use crate::strategy::baselines::tests::training_chain;
    use crate::synth::layered::{LayeredParams, random_layered};

    fn problem(graph: &Graph, budget_bytes: u64) -> Problem<'_> {
        Problem {
            graph,
            budget_bytes,
            bandwidth: 1e3,
        }
    }

    fn passes(n: usize) -> Work {
        Work {
            passes: n,
            deadline: None,
        }
    }

    /// The least compute time of the plain passes (every weighting, no bias) that fit.
    fn best_plain(graph: &Graph, budget: u64) -> Option<f64> {
        evict::weightings()
            .filter_map(|w| match evict::evict_pass(graph, budget, w) {
                Pass::Fits { steps, .. } => Some(evict::compute_time(graph, &steps)),
                Pass::Stuck { .. } => None,
            })
            .min_by(f64::total_cmp)
    }

    fn layered(nodes: usize) -> Graph {
        random_layered(&LayeredParams::moccasin(nodes), 7).expect("a layered graph")
    }

    #[test]
    fn equal_biases_give_the_plain_pass() {
        // The lazy pinning and the sorted rebuild order must reduce to the plain pass when
        // every multiplier is the same, or the search would not start from the greedy.
        let g = layered(120);
        let none = vec![false; g.len()];
        let ones = vec![1.0; g.len()];
        for fraction in [0.9, 0.7] {
            let budget = (g.store_all_peak() as f64 * fraction) as u64;
            for w in evict::weightings() {
                let plain = evict::evict_pass(&g, budget, w);
                let biased = evict::evict_pass_biased(&g, budget, w, &none, &ones, None);
                match (plain, biased) {
                    (Pass::Fits { steps: a, .. }, Pass::Fits { steps: b, .. }) => {
                        assert_eq!(a, b)
                    }
                    (Pass::Stuck { needed: a, at: x }, Pass::Stuck { needed: b, at: y }) => {
                        assert_eq!((a, x), (b, y))
                    }
                    (a, b) => panic!("plain {a:?}, biased {b:?}"),
                }
            }
        }
    }

    #[test]
    fn the_search_fits_and_beats_or_matches_every_plain_pass() {
        for (g, fraction) in [(training_chain(60), 0.35), (layered(100), 0.85)] {
            let budget = (g.store_all_peak() as f64 * fraction) as u64;
            let order: Vec<NodeId> = (0..g.len()).collect();
            let planned = plan_in_order(&problem(&g, budget), &order, passes(3000))
                .expect("the plain passes fit, so the search does");
            let report = crate::sim::simulate(&g, &planned.plan).expect("a valid plan");
            assert!(report.peak_bytes <= budget);
            let plain = best_plain(&g, budget).expect("a plain pass fits");
            let searched = evict::compute_time(&g, &planned.plan.steps);
            assert!(searched <= plain + 1e-9, "{searched} > {plain}");
        }
    }

    #[test]
    fn the_search_is_deterministic_for_a_pass_count() {
        let g = layered(80);
        let budget = (g.store_all_peak() as f64 * 0.8) as u64;
        let order: Vec<NodeId> = (0..g.len()).collect();
        let a = plan_in_order(&problem(&g, budget), &order, passes(500)).map(|p| p.plan.steps);
        let b = plan_in_order(&problem(&g, budget), &order, passes(500)).map(|p| p.plan.steps);
        assert_eq!(a, b);
    }

    /// Two independent chains of four 10-byte tensors, each head also read by the last
    /// node (a skip connection; it outputs nothing): the chains can run in either order.
    fn two_chains() -> Graph {
        let node = |name: &str, inputs: Vec<NodeId>| crate::ir::Node {
            name: name.into(),
            phase: crate::ir::Phase::Forward,
            compute_time: 1.0,
            output_bytes: if name == "end" { 0 } else { 10 },
            inputs,
        };
        let nodes = vec![
            node("a0", vec![]),
            node("a1", vec![0]),
            node("a2", vec![1]),
            node("a3", vec![2]),
            node("b0", vec![]),
            node("b1", vec![4]),
            node("b2", vec![5]),
            node("b3", vec![6]),
            node("end", vec![0, 3, 4, 7]),
        ];
        Graph::new("two-chains", nodes, 0, 1.0).expect("a valid graph")
    }

    #[test]
    fn a_search_in_another_order_maps_its_plan_back() {
        let g = two_chains();
        // The b chain first.
        let order: Vec<NodeId> = vec![4, 5, 6, 7, 0, 1, 2, 3, 8];
        // Store-all computing a2 holds b0, b3, a0, a1 and a2: 50 bytes; 40 (the floor: the
        // last node's inputs) needs a recomputation.
        let budget = 40;
        assert!(reordered(&g, &order).unwrap().store_all_peak() > budget);
        let planned = plan_in_order(&problem(&g, budget), &order, passes(300)).unwrap();
        let report = crate::sim::simulate(&g, &planned.plan).unwrap();
        assert!(report.peak_bytes <= budget);
        // The plan runs the operations in the new order: their first computations follow it.
        assert_eq!(super::super::run_order(&planned.plan.steps, g.len()), order);
    }

    #[test]
    fn a_budget_no_pass_reaches_is_over_budget_with_a_larger_peak() {
        let g = training_chain(40);
        let budget = g.memory_floor() - 1;
        let order: Vec<NodeId> = (0..g.len()).collect();
        match plan_in_order(&problem(&g, budget), &order, passes(300)) {
            Err(PlanError::OverBudget { best_peak, .. }) => assert!(best_peak > budget),
            other => panic!("{other:?}"),
        }
    }
}
