//! The search: the fastest plan under a budget, over every strategy that can finish in the
//! time given, then the anytime solver improving on the best, then a lower bound on what any
//! schedule could do. Its one entry point, `search` (crate-private), is what
//! [`crate::request::plan`] runs when no strategy is named: the front ends come in there.
//!
//! Its rules are public so that a front end that runs strategies one by one (`remat plan
//! --compare`) skips what the search would skip, for the same reason: [`calibrate`] measures
//! one linear pass on the graph, [`estimated_seconds`] scales a strategy's
//! [`crate::strategy::SearchCost`] by it, and [`skipped_in_search`] says why a
//! strategy does not fit the time left.

use std::time::{Duration, Instant};

use crate::error::PlanError;
use crate::exact;
use crate::problem::{Planned, Problem, check_floor};
use crate::solve;
use crate::solve::bound::{Bound, cover_bound};
use crate::strategy::{SearchCost, Strategy, baselines};

/// Where a search stands, for progress bars.
#[derive(Clone, Debug)]
pub struct SearchProgress {
    pub elapsed: Duration,
    pub limit: Duration,
    /// What runs now (a strategy's name, or a stage of the anytime solver).
    pub stage: String,
    /// Overhead of the best plan so far.
    pub best_overhead: Option<f64>,
}

/// What a search found: the fastest plan (or why there is none), a note for every strategy
/// that did not take part (skipped for time, not applicable) or failed outright (an invalid
/// schedule is a strategy's bug, reported rather than hidden), and a lower bound on the
/// overhead of any schedule. [`crate::request::Outcome`] is how callers see it.
#[derive(Debug)]
pub(crate) struct BestPlan {
    pub result: Result<Planned, PlanError>,
    /// `(strategy, why)` for strategies skipped or not applicable.
    pub skipped: Vec<(String, String)>,
    /// Strategies that failed with an error other than over budget / not applicable.
    pub failed: Vec<(String, PlanError)>,
    /// A lower bound on the time overhead of every schedule at this budget (none when the
    /// budget is refused outright).
    pub bound: Option<Bound>,
    /// The least peak of the plans that did not fit, when any did not.
    pub smallest_peak: Option<u64>,
}

/// Seconds `strategy` is expected to take on a graph of `nodes` nodes, given the seconds
/// one linear pass takes per node (`seconds_per_node`, see [`calibrate`]).
pub fn estimated_seconds(strategy: &dyn Strategy, nodes: usize, seconds_per_node: f64) -> f64 {
    let cost = strategy.search_cost();
    let n = nodes as f64;
    seconds_per_node * n * cost.passes * (n / 1000.0).powi(cost.exponent - 1)
}

/// Seconds per node of one linear pass on this problem: store-all lowered and simulated.
pub fn calibrate(problem: &Problem) -> f64 {
    let started = Instant::now();
    let _ = baselines::StoreAll.plan(problem);
    started.elapsed().as_secs_f64() / problem.graph.len().max(1) as f64
}

/// The seconds per node of a linear pass after a strategy estimated at `estimate` seconds
/// took `took`: raised by the ratio when it ran slower, never lowered. Store-all's pass
/// ([`calibrate`]) can be far cheaper than a plan's on graphs where every recomputation
/// pulls a chain of ancestors (random layered n=5,000: `every:2` ran 40x its estimate and
/// `threshold`'s first candidate took 4.7 s of a 3 s share); the strategies after it are
/// then judged by what this graph costs.
fn recalibrated(rate: f64, estimate: f64, took: f64) -> f64 {
    if estimate > 0.0 && took > estimate {
        rate * (took / estimate)
    } else {
        rate
    }
}

/// Why a search with `seconds_left` skips `strategy` on `problem`'s graph, if it does
/// (see [`Strategy::search_cost`]; `seconds_per_node` from [`calibrate`]).
pub fn skipped_in_search(
    strategy: &dyn Strategy,
    problem: &Problem,
    seconds_left: f64,
    seconds_per_node: f64,
) -> Option<String> {
    let estimate = estimated_seconds(strategy, problem.graph.len(), seconds_per_node);
    (estimate > seconds_left).then(|| {
        format!(
            "skipped: expected to take about {estimate:.1} s on {} nodes ({}), more than the {:.1} s left of the time limit; raise --time-limit or ask for it with --strategy {}",
            problem.graph.len(),
            strategy.search_cost().why,
            seconds_left.max(0.0),
            strategy.name()
        )
    })
}

/// Why the rest of a search is skipped once a plan without overhead is found.
const NOTHING_TO_GAIN: &str = "not run: a plan with no time overhead was found already";

/// Share of the time limit for planning; the rest climbs the lower bound.
const PLANNING_SHARE: f64 = 0.9;
/// Share of the time limit the strategies other than the anytime solver may use; each
/// stops there or is skipped when it could not finish by then.
const OTHERS_SHARE: f64 = 0.3;

/// The search under a time limit. The strategies run cheapest first, each skipped (with a
/// note) when its estimated time ([`estimated_seconds`], calibrated on this graph) exceeds
/// the time left; then the anytime solver ([`solve::solve`]) improves on the best of them
/// until the planning deadline, so the result is never slower than any strategy that ran.
/// Last, the lower bound ([`cover_bound`]) climbs until the limit.
pub(crate) fn search(
    strategies: &[Box<dyn Strategy>],
    problem: &Problem,
    limit: Duration,
    mut progress: impl FnMut(&SearchProgress),
) -> BestPlan {
    let started = Instant::now();
    let mut found = Found::default();
    if let Err(e) = check_floor(problem) {
        return BestPlan {
            result: Err(e),
            skipped: found.skipped,
            failed: found.failed,
            bound: None,
            smallest_peak: None,
        };
    }
    let planning = started + limit.mul_f64(PLANNING_SHARE);
    // The strategies other than the anytime solver share this part of the time.
    let others = started + limit.mul_f64(OTHERS_SHARE);
    let mut rate = calibrate(problem);
    let anytime = strategies.iter().any(|s| s.name() == solve::NAME);
    let queue = search_queue(strategies, anytime, &mut found);
    for (k, strategy) in queue.iter().enumerate() {
        let name = strategy.name();
        if found.overhead() == Some(0.0) {
            found.skipped.push((name, NOTHING_TO_GAIN.into()));
            continue;
        }
        let now = Instant::now();
        let left = others.saturating_duration_since(now);
        if let Some(why) = skipped_in_search(*strategy, problem, left.as_secs_f64(), rate) {
            found.skipped.push((name, why));
            continue;
        }
        let estimate = estimated_seconds(*strategy, problem.graph.len(), rate);
        // A strategy that stops at its deadline gets an equal share of what is left, so
        // one slow sweep (threshold's, on a large graph) cannot starve the ones after it;
        // what it leaves unused passes on to them.
        let deadline = if is_until_deadline(*strategy) {
            now + left.div_f64((queue.len() - k) as f64)
        } else {
            others
        };
        progress(&SearchProgress {
            elapsed: started.elapsed(),
            limit,
            stage: name.clone(),
            best_overhead: found.overhead(),
        });
        found.record(name, strategy.plan_until(problem, deadline));
        if !is_until_deadline(*strategy) {
            rate = recalibrated(rate, estimate, now.elapsed().as_secs_f64());
        }
    }
    if anytime && found.overhead() == Some(0.0) {
        found
            .skipped
            .push((solve::NAME.into(), NOTHING_TO_GAIN.into()));
    } else if anytime {
        let incumbent = found.best.take();
        let result = solve::solve(problem, planning, incumbent, |stage, best| {
            progress(&SearchProgress {
                elapsed: started.elapsed(),
                limit,
                stage: format!("{}: {stage}", solve::NAME),
                best_overhead: best,
            })
        });
        found.record(solve::NAME.into(), result);
    }
    progress(&SearchProgress {
        elapsed: started.elapsed(),
        limit,
        stage: "lower bound".into(),
        best_overhead: found.overhead(),
    });
    let bound_deadline = (started + limit).max(Instant::now() + Duration::from_millis(20));
    let bound = cover_bound(problem, bound_deadline, found.overhead());
    let smallest_peak = found.smallest.as_ref().map(|(peak, _)| *peak);
    BestPlan {
        result: found
            .best
            .ok_or_else(|| infeasible(problem, found.smallest)),
        skipped: found.skipped,
        failed: found.failed,
        bound: Some(bound),
        smallest_peak,
    }
}

/// The strategies a search runs before the anytime solver, in order: those of one pass
/// first, then those that stop at a deadline (MuTWO's first: quick, and the one with swaps).
/// `evict` is left out with a note when the anytime solver runs it inside.
fn search_queue<'s>(
    strategies: &'s [Box<dyn Strategy>],
    anytime: bool,
    found: &mut Found,
) -> Vec<&'s dyn Strategy> {
    let mut queue = Vec::new();
    for strategy in strategies {
        let name = strategy.name();
        if name == solve::NAME {
            continue;
        }
        if anytime && name == exact::evict::NAME {
            // The anytime solver runs evict's passes and local search on the given order
            // among its candidates, under the deadline; run alone, evict's search for a
            // smaller budget when nothing fits can take minutes.
            let why = format!(
                "run inside {}, on the given order and on the reordered ones",
                solve::NAME
            );
            found.skipped.push((name, why));
            continue;
        }
        queue.push(strategy.as_ref());
    }
    // One pass first, then those that stop at their deadline (MuTWO's first), then those
    // whose first solve cannot stop.
    queue.sort_by_key(|s| {
        let class = match s.search_cost() {
            c if c == SearchCost::TABLE => 2,
            c if c == SearchCost::UNTIL_DEADLINE => 1,
            _ => 0,
        };
        (class, !s.name().starts_with("mutwo"))
    });
    queue
}

fn is_until_deadline(strategy: &dyn Strategy) -> bool {
    strategy.search_cost() == SearchCost::UNTIL_DEADLINE
}

/// What the strategies of a search returned so far.
#[derive(Default)]
struct Found {
    best: Option<Planned>,
    smallest: Option<(u64, String)>,
    skipped: Vec<(String, String)>,
    failed: Vec<(String, PlanError)>,
}

impl Found {
    fn overhead(&self) -> Option<f64> {
        self.best.as_ref().map(|b| b.report.overhead())
    }

    fn record(&mut self, name: String, result: Result<Planned, PlanError>) {
        match result {
            Ok(planned) => {
                let faster = self
                    .best
                    .as_ref()
                    .is_none_or(|b| planned.report.total_time < b.report.total_time);
                if faster {
                    self.best = Some(planned);
                }
            }
            Err(PlanError::OverBudget {
                best_peak,
                strategy,
                ..
            }) => {
                if self.smallest.as_ref().is_none_or(|(p, _)| best_peak < *p) {
                    self.smallest = Some((best_peak, strategy));
                }
            }
            Err(PlanError::NotApplicable { why, .. }) => self.skipped.push((name, why)),
            // A solver's proof that nothing fits is an answer, not a failure.
            Err(PlanError::ProvedInfeasible { .. }) => {}
            Err(other) => self.failed.push((name, other)),
        }
    }
}

fn infeasible(problem: &Problem, smallest: Option<(u64, String)>) -> PlanError {
    let (best_peak, strategy) =
        smallest.unwrap_or_else(|| (problem.graph.store_all_peak(), "store-all".to_string()));
    PlanError::Infeasible {
        budget: problem.budget_bytes,
        best_peak,
        strategy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SimError;
    use crate::ir::Graph;
    use crate::solve::default_time_limit;
    use crate::strategy::mutwo;

    /// A training chain: `n` forward layers, the loss, `n` backward layers.
    fn chain(n: usize) -> Graph {
        baselines::tests::training_chain(n)
    }

    /// A strategy with a bug: its schedule is invalid.
    struct Broken;
    impl Strategy for Broken {
        fn name(&self) -> String {
            "broken".into()
        }
        fn summary(&self) -> &'static str {
            "always invalid"
        }
        fn plan(&self, _: &Problem) -> Result<Planned, PlanError> {
            Err(PlanError::InvalidSchedule {
                strategy: self.name(),
                error: SimError::NeverComputed { node: "x".into() },
            })
        }
    }

    #[test]
    fn a_strategy_with_an_invalid_schedule_is_reported_not_dropped() {
        let g = chain(8);
        let problem = Problem {
            graph: &g,
            budget_bytes: u64::MAX,
            bandwidth: 1.0,
        };
        let strategies: Vec<Box<dyn Strategy>> =
            vec![Box::new(Broken), Box::new(baselines::StoreAll)];
        let limit = default_time_limit(g.len());
        let best = search(&strategies, &problem, limit, |_| {});
        assert!(best.result.is_ok());
        assert_eq!(best.failed.len(), 1);
        assert_eq!(best.failed[0].0, "broken");
        assert!(best.failed[0].1.to_string().contains("invalid schedule"));
    }

    /// A strategy that says it needs about a million linear passes.
    struct Slow;
    impl Strategy for Slow {
        fn name(&self) -> String {
            "slow".into()
        }
        fn summary(&self) -> &'static str {
            "would take very long"
        }
        fn search_cost(&self) -> SearchCost {
            SearchCost {
                passes: 1e6,
                exponent: 2,
                why: "a million passes",
            }
        }
        fn plan(&self, _: &Problem) -> Result<Planned, PlanError> {
            panic!("a search must not run it");
        }
    }

    #[test]
    fn searches_skip_what_cannot_finish_in_time_and_say_why() {
        let g = chain(600);
        let problem = Problem {
            graph: &g,
            budget_bytes: g.store_all_peak() / 2,
            bandwidth: 1.0,
        };
        let strategies: Vec<Box<dyn Strategy>> = vec![
            Box::new(baselines::StoreAll),
            Box::new(Slow),
            Box::new(baselines::SqrtN),
            Box::new(solve::Anytime::default()),
        ];
        let started = Instant::now();
        let best = search(&strategies, &problem, Duration::from_millis(500), |_| {});
        let planned = best.result.expect("a plan fits");
        assert!(planned.report.peak_bytes <= problem.budget_bytes);
        let (name, why) = &best.skipped[0];
        assert_eq!(name, "slow");
        assert!(
            why.contains("a million passes") && why.contains("--strategy slow"),
            "{why}"
        );
        assert!(best.failed.is_empty(), "{:?}", best.failed);
        let bound = best.bound.expect("a bound");
        assert!(bound.overhead <= planned.report.overhead() + 1e-12);
        // The limit holds up to one strategy's last step and the bound's last climb.
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
    }

    /// A strategy that says it takes one linear pass and takes far longer.
    struct Sluggish;
    impl Strategy for Sluggish {
        fn name(&self) -> String {
            "sluggish".into()
        }
        fn summary(&self) -> &'static str {
            "one pass, it says"
        }
        fn plan(&self, _: &Problem) -> Result<Planned, PlanError> {
            std::thread::sleep(Duration::from_millis(150));
            Err(PlanError::NotApplicable {
                strategy: self.name(),
                why: "nothing".into(),
            })
        }
    }

    /// A strategy of one linear pass that a search must not start.
    struct MustBeSkipped;
    impl Strategy for MustBeSkipped {
        fn name(&self) -> String {
            "must-be-skipped".into()
        }
        fn summary(&self) -> &'static str {
            "one pass"
        }
        fn plan(&self, _: &Problem) -> Result<Planned, PlanError> {
            panic!("a search that saw a pass take 150 ms must not start another with 60 ms left");
        }
    }

    #[test]
    fn a_strategy_slower_than_estimated_makes_the_search_expect_the_rest_slower() {
        let g = chain(8);
        let problem = Problem {
            graph: &g,
            budget_bytes: g.store_all_peak(),
            bandwidth: 1.0,
        };
        // Others' share: 0.3 of 700 ms = 210 ms; the sluggish one takes 150 ms of it, so a
        // pass costs 150 ms on this graph and the next cannot finish in the 60 ms left
        // (store-all's calibrating pass on 17 nodes takes microseconds).
        let strategies: Vec<Box<dyn Strategy>> = vec![Box::new(Sluggish), Box::new(MustBeSkipped)];
        let best = search(&strategies, &problem, Duration::from_millis(700), |_| {});
        let skipped: Vec<&str> = best.skipped.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            skipped,
            ["sluggish", "must-be-skipped"],
            "{:?}",
            best.skipped
        );
        assert!(
            best.skipped[1].1.contains("expected to take"),
            "{:?}",
            best.skipped
        );
    }

    #[test]
    fn recalibration_only_raises_the_rate() {
        assert_eq!(recalibrated(1e-6, 0.01, 0.5), 1e-6 * 50.0);
        assert_eq!(recalibrated(1e-6, 0.01, 0.001), 1e-6);
        assert_eq!(recalibrated(1e-6, 0.0, 0.5), 1e-6);
    }

    /// A strategy that stops at its deadline, having used all of it, with nothing found.
    struct Sweeper;
    impl Strategy for Sweeper {
        fn name(&self) -> String {
            "sweeper".into()
        }
        fn summary(&self) -> &'static str {
            "uses its whole share"
        }
        fn search_cost(&self) -> SearchCost {
            SearchCost::UNTIL_DEADLINE
        }
        fn plan(&self, _: &Problem) -> Result<Planned, PlanError> {
            panic!("a search gives it a deadline");
        }
        fn plan_until(&self, _: &Problem, deadline: Instant) -> Result<Planned, PlanError> {
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
            Err(PlanError::NotApplicable {
                strategy: self.name(),
                why: "out of time".into(),
            })
        }
    }

    #[test]
    fn a_strategy_that_stops_at_its_deadline_leaves_time_to_the_next() {
        // Registry order puts the sweeper first; before the fix it took the whole share
        // and every strategy after it was skipped for time (Moccasin n=1000: threshold).
        let g = chain(40);
        let problem = Problem {
            graph: &g,
            budget_bytes: g.store_all_peak() * 3 / 4,
            bandwidth: 1e3,
        };
        let strategies: Vec<Box<dyn Strategy>> = vec![Box::new(Sweeper), Box::new(mutwo::MuTwo)];
        let best = search(&strategies, &problem, Duration::from_millis(400), |_| {});
        assert!(
            !best.skipped.iter().any(|(name, _)| name == "mutwo"),
            "{:?}",
            best.skipped
        );
        let alone = mutwo::MuTwo.plan(&problem).expect("mutwo fits");
        let planned = best.result.expect("mutwo's plan");
        assert_eq!(planned.plan.strategy, alone.plan.strategy);
    }

    #[test]
    fn a_plan_without_overhead_ends_the_search() {
        let g = chain(40);
        let problem = Problem {
            graph: &g,
            budget_bytes: g.store_all_peak(),
            bandwidth: 1e3,
        };
        let strategies: Vec<Box<dyn Strategy>> = vec![
            Box::new(baselines::StoreAll),
            Box::new(Sweeper),
            Box::new(solve::Anytime::default()),
        ];
        let started = Instant::now();
        let best = search(&strategies, &problem, Duration::from_secs(30), |_| {});
        assert_eq!(best.result.expect("store-all fits").report.overhead(), 0.0);
        for name in ["sweeper", solve::NAME] {
            assert!(
                best.skipped
                    .iter()
                    .any(|(n, why)| n == name && why == NOTHING_TO_GAIN),
                "{name}: {:?}",
                best.skipped
            );
        }
        assert_eq!(best.bound.expect("a bound").overhead, 0.0);
        assert!(started.elapsed() < Duration::from_secs(20));
    }

    #[test]
    fn the_default_time_limit_grows_with_the_graph() {
        assert_eq!(default_time_limit(10), Duration::from_secs(1));
        assert_eq!(default_time_limit(1000), Duration::from_secs(1));
        assert_eq!(default_time_limit(5000), Duration::from_secs(5));
    }
}

#[cfg(test)]
mod queue_tests {
    use super::*;
    use crate::registry::registry;

    /// The search runs one-pass strategies first, then those that stop at their deadline
    /// (MuTWO's first), and last the chain DPs, whose first table fill cannot stop: run
    /// earlier, one fill on a long chain took the whole share of the others.
    #[test]
    fn table_strategies_run_after_those_that_stop_at_their_deadline() {
        let strategies = registry();
        let mut found = Found::default();
        let queue = search_queue(&strategies, true, &mut found);
        let class = |s: &dyn Strategy| match s.search_cost() {
            c if c == SearchCost::TABLE => 2,
            c if c == SearchCost::UNTIL_DEADLINE => 1,
            _ => 0,
        };
        let classes: Vec<i32> = queue.iter().map(|s| class(*s)).collect();
        assert!(classes.is_sorted(), "{classes:?}");
        let names: Vec<String> = queue.iter().map(|s| s.name()).collect();
        let position = |n: &str| names.iter().position(|x| x == n);
        for table in [exact::chain_strategy::NAME, exact::chain_offload::NAME] {
            let at = position(table).unwrap_or_else(|| panic!("{table} not in {names:?}"));
            let mutwo = position("mutwo").unwrap_or_else(|| panic!("no mutwo in {names:?}"));
            assert!(mutwo < at, "{names:?}");
        }
    }
}
