//! Baseline strategies: store-all, recompute-all, every-N, by-depth, memory-threshold and
//! Chen et al.'s sqrt(n) and greedy ("Training Deep Nets with Sublinear Memory Cost", 2016).
//!
//! All of them choose a set of checkpoints among the activations (tensors with an idle
//! interval, see [`crate::attrs`]), keep those and recompute the others; they differ only in
//! which they keep. Fixed rules (every-N, by-depth, sqrt) ignore the budget and report
//! [`PlanError::OverBudget`] when their plan does not fit; the greedy and the threshold search
//! their parameter for the fastest plan that fits.
//!
//! Segment strategies (every-N, by-depth, sqrt) replay a segment once and keep its
//! activations for the segment's backward, as checkpointing does ([`Helpers::KeepNeeded`]);
//! recompute-all and the threshold recompute each activation from the last kept one and
//! free the helpers ([`Helpers::Free`]): more time, the least memory. The greedy tries both.

use std::time::Instant;

use super::Strategy;
use crate::attrs::tensor_attrs;
use crate::error::PlanError;
use crate::ir::{Graph, NodeId, Phase};
use crate::lower::Helpers;
use crate::plan::Decision;
use crate::problem::{Planned, Problem, plan_from_decisions_with};

/// The tensors a baseline may drop: forward activations with an idle interval, in order,
/// with their (drop_after, use_at) window. Pinned tensors, and tensors whose rebuild could
/// need a pinned tensor already dead ([`Graph::may_drop`]), are always kept.
fn activations(graph: &Graph) -> Vec<(NodeId, (NodeId, NodeId))> {
    tensor_attrs(graph, 1.0)
        .iter()
        .enumerate()
        .filter(|(id, _)| graph.node(*id).phase == Phase::Forward && graph.may_drop(*id))
        .filter_map(|(id, a)| a.idle.map(|w| (id, w)))
        .collect()
}

/// Keeps the activations for which `keep(k, id)` holds (k: rank among activations) and
/// recomputes the others.
fn decisions_keeping(
    graph: &Graph,
    acts: &[(NodeId, (NodeId, NodeId))],
    keep: impl Fn(usize, NodeId) -> bool,
) -> Vec<Decision> {
    let mut decisions = vec![Decision::Keep; graph.len()];
    for (k, &(id, (drop_after, use_at))) in acts.iter().enumerate() {
        if !keep(k, id) {
            decisions[id] = Decision::Recompute {
                from: Vec::new(),
                drop_after,
                use_at,
            };
        }
    }
    decisions
}

/// Among candidate decision sets, the fastest plan under the budget, else OverBudget with
/// the smallest peak seen.
fn best_of(
    problem: &Problem,
    name: &str,
    candidates: impl IntoIterator<Item = (Vec<Decision>, Helpers)>,
    deadline: Option<Instant>,
) -> Result<Planned, PlanError> {
    let mut best: Option<Planned> = None;
    let mut smallest_peak = u64::MAX;
    for (tried, (decisions, helpers)) in candidates.into_iter().enumerate() {
        // Anytime: at the deadline, the best candidate so far is the answer.
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return best.ok_or_else(|| out_of_time(name, tried));
        }
        match plan_from_decisions_with(problem, name, decisions, helpers) {
            Ok(planned) => {
                if best
                    .as_ref()
                    .is_none_or(|b| planned.report.total_time < b.report.total_time)
                {
                    best = Some(planned);
                }
            }
            Err(PlanError::OverBudget { best_peak, .. }) => {
                smallest_peak = smallest_peak.min(best_peak)
            }
            Err(other) => return Err(other),
        }
    }
    best.ok_or(PlanError::OverBudget {
        strategy: name.to_string(),
        budget: problem.budget_bytes,
        best_peak: smallest_peak,
    })
}

/// A candidate search stopped at its deadline before any candidate fitted.
fn out_of_time(name: &str, tried: usize) -> PlanError {
    PlanError::NotApplicable {
        strategy: name.to_string(),
        why: format!("out of time after {tried} candidate plans, none of which fitted"),
    }
}

/// Keeps every activation.
pub struct StoreAll;

impl Strategy for StoreAll {
    fn name(&self) -> String {
        "store-all".into()
    }
    fn summary(&self) -> &'static str {
        "keep every activation until its last use"
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        let decisions = vec![Decision::Keep; problem.graph.len()];
        plan_from_decisions_with(problem, &self.name(), decisions, Helpers::Free)
    }
}

/// Running times in linear passes at 1,000 nodes, growing as n^2 (see
/// [`super::SearchCost`]): the largest measured on random layered DAGs and transformer
/// graphs of 500 to 1,000 nodes (`tests/solve_scale.rs`, `measure_search_costs`), rounded
/// up. The candidate searches stop at their deadline instead.
const PASSES_RECOMPUTE_ALL: f64 = 600.0;
const PASSES_THRESHOLD: f64 = 600.0;

/// Recomputes every activation from the graph's inputs when the backward pass needs it.
pub struct RecomputeAll;

impl Strategy for RecomputeAll {
    fn name(&self) -> String {
        "recompute-all".into()
    }
    fn summary(&self) -> &'static str {
        "drop every activation after its forward use, recompute it for the backward pass"
    }
    fn search_cost(&self) -> super::SearchCost {
        super::SearchCost {
            passes: PASSES_RECOMPUTE_ALL,
            exponent: 2,
            why: "its plan rebuilds every backward input from the graph inputs: O(n^2) steps",
        }
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        let acts = activations(problem.graph);
        let decisions = decisions_keeping(problem.graph, &acts, |_, _| false);
        plan_from_decisions_with(problem, &self.name(), decisions, Helpers::Free)
    }
}

/// Keeps every N-th activation in execution order.
pub struct EveryN(pub usize);

impl Strategy for EveryN {
    fn name(&self) -> String {
        format!("every:{}", self.0)
    }
    fn summary(&self) -> &'static str {
        "keep every N-th activation, recompute the ones between"
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        let n = self.0.max(1);
        let acts = activations(problem.graph);
        let decisions = decisions_keeping(problem.graph, &acts, |k, _| (k + 1).is_multiple_of(n));
        plan_from_decisions_with(problem, &self.name(), decisions, Helpers::KeepNeeded)
    }
}

/// Keeps the activations whose depth (longest path from a graph input) is a multiple of D,
/// so no recomputation replays more than D - 1 levels, whatever the graph's branching.
pub struct ByDepth(pub usize);

impl Strategy for ByDepth {
    fn name(&self) -> String {
        format!("by-depth:{}", self.0)
    }
    fn summary(&self) -> &'static str {
        "keep activations at every D-th level of graph depth"
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        let d = self.0.max(1);
        let graph = problem.graph;
        let mut depth = vec![0usize; graph.len()];
        for (id, node) in graph.nodes().iter().enumerate() {
            depth[id] = node.inputs.iter().map(|&i| depth[i] + 1).max().unwrap_or(0);
        }
        let acts = activations(graph);
        let decisions = decisions_keeping(graph, &acts, |_, id| (depth[id] + 1).is_multiple_of(d));
        plan_from_decisions_with(problem, &self.name(), decisions, Helpers::KeepNeeded)
    }
}

/// Keeps the oldest activations until their bytes reach a threshold, recomputes the rest.
/// `None`: searches the largest threshold whose plan fits the budget.
pub struct MemoryThreshold(pub Option<f64>);

impl MemoryThreshold {
    fn decisions(
        &self,
        graph: &Graph,
        acts: &[(NodeId, (NodeId, NodeId))],
        limit: u64,
    ) -> Vec<Decision> {
        let mut kept = 0u64;
        let mut keep = vec![false; graph.len()];
        for &(id, _) in acts {
            let bytes = graph.node(id).output_bytes;
            if kept + bytes <= limit {
                kept += bytes;
                keep[id] = true;
            } else {
                break;
            }
        }
        decisions_keeping(graph, acts, |_, id| keep[id])
    }
}

impl Strategy for MemoryThreshold {
    fn name(&self) -> String {
        match self.0 {
            Some(f) => format!("threshold:{f}"),
            None => "threshold".into(),
        }
    }
    fn summary(&self) -> &'static str {
        "keep the oldest activations up to a byte threshold, recompute the rest"
    }
    fn search_cost(&self) -> super::SearchCost {
        match self.0 {
            Some(_) => super::SearchCost {
                passes: PASSES_THRESHOLD,
                exponent: 2,
                why: "each activation is rebuilt from the last kept one: up to O(n^2) steps",
            },
            None => super::SearchCost::UNTIL_DEADLINE,
        }
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        self.plan_by(problem, None)
    }
    fn plan_until(&self, problem: &Problem, deadline: Instant) -> Result<Planned, PlanError> {
        self.plan_by(problem, Some(deadline))
    }
}

impl MemoryThreshold {
    fn plan_by(&self, problem: &Problem, deadline: Option<Instant>) -> Result<Planned, PlanError> {
        let graph = problem.graph;
        let acts = activations(graph);
        let total: u64 = acts
            .iter()
            .map(|&(id, _)| graph.node(id).output_bytes)
            .sum();
        if let Some(fraction) = self.0 {
            let limit = (total as f64 * fraction.clamp(0.0, 1.0)) as u64;
            let decisions = self.decisions(graph, &acts, limit);
            return plan_from_decisions_with(problem, &self.name(), decisions, Helpers::Free);
        }
        // Each prefix of the activations is a candidate threshold. A prefix's peak is not
        // monotone in its length, so no bisection: try up to THRESHOLDS prefixes spread
        // evenly (all of them on graphs with fewer activations).
        const THRESHOLDS: usize = 64;
        let mut prefix = 0u64;
        let mut limits = vec![0u64];
        for &(id, _) in &acts {
            prefix += graph.node(id).output_bytes;
            limits.push(prefix);
        }
        let stride = limits.len().div_ceil(THRESHOLDS).max(1);
        let last = limits.len() - 1;
        let picked = (0..limits.len())
            .filter(move |i| i % stride == 0 || *i == last)
            .map(|i| limits[i])
            .collect::<Vec<_>>();
        let candidates = picked
            .into_iter()
            .map(|l| (self.decisions(graph, &acts, l), Helpers::Free));
        best_of(problem, &self.name(), candidates, deadline)
    }
}

/// Chen et al.'s sqrt(n): keep every ceil(sqrt(n))-th of the n activations.
pub struct SqrtN;

impl Strategy for SqrtN {
    fn name(&self) -> String {
        "sqrt".into()
    }
    fn summary(&self) -> &'static str {
        "Chen et al.: segments of sqrt(n) activations, keep one per segment"
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        let acts = activations(problem.graph);
        let segment = (acts.len() as f64).sqrt().ceil().max(1.0) as usize;
        let decisions =
            decisions_keeping(problem.graph, &acts, |k, _| (k + 1).is_multiple_of(segment));
        plan_from_decisions_with(problem, &self.name(), decisions, Helpers::KeepNeeded)
    }
}

/// Chen et al.'s greedy: walk the activations accumulating bytes; when the running sum
/// exceeds B, keep the activation and restart the sum. B is searched over a geometric grid
/// (and Chen's sqrt(x * y) refinement) for the fastest plan under the budget.
pub struct ChenGreedy;

impl ChenGreedy {
    fn with_b(graph: &Graph, acts: &[(NodeId, (NodeId, NodeId))], b: f64) -> (Vec<Decision>, f64) {
        let mut temp = 0.0;
        let (mut x, mut y) = (0.0f64, 0.0f64);
        let mut keep = vec![false; graph.len()];
        for &(id, _) in acts {
            let bytes = graph.node(id).output_bytes as f64;
            temp += bytes;
            if temp > b {
                keep[id] = true;
                x += bytes;
                y = y.max(temp);
                temp = 0.0;
            }
        }
        (
            (decisions_keeping(graph, acts, |_, id| keep[id])),
            (x * y).sqrt(),
        )
    }
}

impl Strategy for ChenGreedy {
    fn name(&self) -> String {
        "chen-greedy".into()
    }
    fn summary(&self) -> &'static str {
        "Chen et al.: greedy segments under a byte bound B, B searched for the budget"
    }
    fn search_cost(&self) -> super::SearchCost {
        super::SearchCost::UNTIL_DEADLINE
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        self.plan_by(problem, None)
    }
    fn plan_until(&self, problem: &Problem, deadline: Instant) -> Result<Planned, PlanError> {
        self.plan_by(problem, Some(deadline))
    }
}

impl ChenGreedy {
    fn plan_by(&self, problem: &Problem, deadline: Option<Instant>) -> Result<Planned, PlanError> {
        let graph = problem.graph;
        let acts = activations(graph);
        let sizes = acts
            .iter()
            .map(|&(id, _)| graph.node(id).output_bytes as f64);
        let total: f64 = sizes.clone().sum();
        let smallest = sizes.fold(f64::INFINITY, f64::min).max(1.0);
        const GRID: usize = 48;
        let mut candidates = Vec::with_capacity(4 * GRID + 4);
        for i in 0..=GRID {
            let b = smallest * (total.max(smallest) / smallest).powf(i as f64 / GRID as f64);
            let (decisions, refined) = Self::with_b(graph, &acts, b);
            let refined = Self::with_b(graph, &acts, refined).0;
            for helpers in [Helpers::KeepNeeded, Helpers::Free] {
                candidates.push((decisions.clone(), helpers));
                candidates.push((refined.clone(), helpers));
            }
        }
        best_of(problem, &self.name(), candidates, deadline)
    }
}

/// The default instances, for `--compare` and the benchmark.
pub fn all() -> Vec<Box<dyn Strategy>> {
    vec![
        Box::new(StoreAll),
        Box::new(RecomputeAll),
        Box::new(EveryN(2)),
        Box::new(EveryN(4)),
        Box::new(ByDepth(2)),
        Box::new(MemoryThreshold(None)),
        Box::new(SqrtN),
        Box::new(ChenGreedy),
    ]
}

/// The parameterized forms [`parse`] reads, for listings and error messages.
pub const PARAMETERIZED: &str = "every:N (N >= 1), by-depth:D (D >= 1), threshold:F (0 <= F <= 1, fraction of activation bytes)";

/// Parses a parameterized baseline name: `every:N`, `by-depth:D`, `threshold:F`. `None`
/// when `name` is not of these forms; an error naming the parameter and its range when the
/// form is known but its parameter is not valid.
pub fn parse(name: &str) -> Option<Result<Box<dyn Strategy>, PlanError>> {
    let (kind, arg) = name.split_once(':')?;
    let bad = |why: &str| PlanError::BadParameter {
        name: name.to_string(),
        why: why.to_string(),
    };
    let count = |what: &str| match arg.parse::<usize>() {
        Ok(0) => Err(bad(&format!("{what} must be a positive integer, got 0"))),
        Ok(n) => Ok(n),
        Err(_) => Err(bad(&format!(
            "{what} must be a positive integer, got `{arg}`"
        ))),
    };
    Some(match kind {
        "every" => count("N").map(|n| Box::new(EveryN(n)) as Box<dyn Strategy>),
        "by-depth" => count("D").map(|d| Box::new(ByDepth(d)) as Box<dyn Strategy>),
        "threshold" => match arg.parse::<f64>() {
            Ok(f) if (0.0..=1.0).contains(&f) => Ok(Box::new(MemoryThreshold(Some(f))) as _),
            Ok(_) => Err(bad(&format!(
                "F is a fraction of the activation bytes and must be in [0, 1], got {arg}"
            ))),
            Err(_) => Err(bad(&format!(
                "F must be a number in [0, 1] (a fraction of the activation bytes), got `{arg}`"
            ))),
        },
        _ => return None,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ir::Node;

    /// A training chain of `n` forward layers (10 bytes, time 1) and their backward twins.
    pub(crate) fn training_chain(n: usize) -> Graph {
        let mut nodes = Vec::new();
        for i in 0..n {
            nodes.push(Node {
                name: format!("f{i}"),
                phase: Phase::Forward,
                compute_time: 1.0,
                output_bytes: 10,
                inputs: if i == 0 { vec![] } else { vec![i - 1] },
            });
        }
        nodes.push(Node {
            name: "loss".into(),
            phase: Phase::Backward,
            compute_time: 1.0,
            output_bytes: 1,
            inputs: vec![n - 1],
        });
        for k in 0..n {
            let fw = n - 1 - k;
            let mut inputs = vec![n + k];
            if fw > 0 {
                inputs.push(fw - 1);
            }
            inputs.sort_unstable();
            nodes.push(Node {
                name: format!("b{fw}"),
                phase: Phase::Backward,
                compute_time: 2.0,
                output_bytes: 10,
                inputs,
            });
        }
        Graph::new("chain", nodes, 0, 1.0).unwrap()
    }

    fn problem(graph: &Graph, budget: u64) -> Problem<'_> {
        Problem {
            graph,
            budget_bytes: budget,
            bandwidth: 1.0,
        }
    }

    #[test]
    fn every_two_recomputes_half_of_the_dropped_layers() {
        // Chain of 8: activations are f0..f6 (f7 is read by the loss right away). every:2
        // keeps f1, f3, f5 and recomputes f0, f2, f4, f6 once each: 4 units.
        let g = training_chain(8);
        let planned = EveryN(2).plan(&problem(&g, u64::MAX)).unwrap();
        assert_eq!(planned.report.recompute_time, 4.0);
        let store_all = StoreAll.plan(&problem(&g, u64::MAX)).unwrap();
        assert!(planned.report.peak_bytes < store_all.report.peak_bytes);
    }

    #[test]
    fn fixed_rules_report_their_peak_when_over_budget() {
        let g = training_chain(8);
        let err = SqrtN.plan(&problem(&g, 1)).unwrap_err();
        assert!(matches!(err, PlanError::OverBudget { best_peak, .. } if best_peak > 1));
    }

    #[test]
    fn searched_strategies_fit_a_middle_budget() {
        let g = training_chain(16);
        let full = g.store_all_peak();
        let floor = g.memory_floor();
        let budget = floor + (full - floor) / 2;
        for s in [&ChenGreedy as &dyn Strategy, &MemoryThreshold(None)] {
            let planned = s.plan(&problem(&g, budget)).unwrap();
            assert!(planned.report.peak_bytes <= budget, "{}", s.name());
            assert!(planned.report.recompute_time > 0.0, "{}", s.name());
        }
    }

    #[test]
    fn pinned_activations_are_always_kept() {
        // f0 and f3 pinned: recompute-all drops every other activation but those two, and
        // no baseline recomputes them at any budget it can meet.
        let g = training_chain(8).with_pinned([0, 3]).unwrap();
        let planned = RecomputeAll.plan(&problem(&g, u64::MAX)).unwrap();
        let fates = &planned.report.fates;
        assert_eq!(fates[0], crate::sim::Fate::Kept);
        assert_eq!(fates[3], crate::sim::Fate::Kept);
        assert_eq!(fates[1], crate::sim::Fate::Recomputed);
        let (full, floor) = (g.store_all_peak(), g.memory_floor());
        let mut planned_count = 0;
        for strategy in all() {
            for budget in [full, floor + (full - floor) / 2, floor] {
                match strategy.plan(&problem(&g, budget)) {
                    Ok(p) => {
                        assert_eq!(p.report.fates[0], crate::sim::Fate::Kept);
                        assert_eq!(p.report.fates[3], crate::sim::Fate::Kept);
                        planned_count += 1;
                    }
                    Err(e) => assert!(matches!(e, PlanError::OverBudget { .. }), "{e}"),
                }
            }
        }
        assert!(planned_count >= all().len(), "only {planned_count} plans");
    }

    #[test]
    fn parses_parameterized_names() {
        let name = |n: &str| parse(n).unwrap().unwrap().name();
        assert_eq!(name("every:3"), "every:3");
        assert_eq!(name("by-depth:2"), "by-depth:2");
        assert_eq!(name("threshold:0.5"), "threshold:0.5");
        assert!(parse("mutwo").is_none() && parse("nope:1").is_none());
    }

    #[test]
    fn bad_parameters_say_the_range() {
        for (name, what) in [
            ("every:0", "N must be a positive integer, got 0"),
            ("by-depth:0", "D must be a positive integer"),
            ("every:x", "got `x`"),
            ("threshold:1.5", "must be in [0, 1], got 1.5"),
        ] {
            let err = parse(name).unwrap().err().unwrap().to_string();
            assert!(err.contains(name) && err.contains(what), "{err}");
        }
    }
}
