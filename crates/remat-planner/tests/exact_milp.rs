//! Checkmate's MILP (feature `milp`): its schedules validate in the simulator, it is never
//! beaten by the other strategies, and it proves budgets below the floor infeasible.

#![cfg(feature = "milp")]

mod common;

use common::{Rng, graphs_dir, node};

use remat_planner::exact::chain_strategy::ChainDp;
use remat_planner::exact::evict::Evict;
use remat_planner::exact::milp::{CheckmateMilp, MilpError, MilpOptions, solve_milp};
use remat_planner::{Graph, Phase, Problem, Strategy, simulate_steps};

const BANDWIDTH: f64 = 16e9;

/// A small training graph: a forward pass where each layer reads the previous one and,
/// when `skips`, sometimes an older one (a U-Net-like skip); a loss; and a backward pass in
/// which each layer's gradient reads the incoming gradient and the layer's forward inputs
/// and output.
fn training_graph(rng: &mut Rng, layers: usize, skips: bool) -> Graph {
    let mut nodes = Vec::new();
    for k in 0..layers {
        let mut inputs = if k == 0 { vec![] } else { vec![k - 1] };
        if skips && k >= 3 && rng.below(3) == 0 {
            inputs.insert(0, rng.below(k as u64 - 2) as usize);
        }
        nodes.push(node(
            format!("f{k}"),
            Phase::Forward,
            1 + rng.below(20),
            1 + rng.below(100),
            inputs,
        ));
    }
    nodes.push(node("loss".into(), Phase::Backward, 2, 1, vec![layers - 1]));
    for k in (0..layers).rev() {
        let mut inputs = nodes[k].inputs.clone();
        inputs.push(k);
        inputs.push(nodes.len() - 1);
        inputs.sort_unstable();
        let bytes = nodes[k].output_bytes;
        nodes.push(node(
            format!("f{k}_backward"),
            Phase::Backward,
            1 + rng.below(30),
            bytes,
            inputs,
        ));
    }
    Graph::new("small", nodes, 10, 1e-3).unwrap()
}

fn budgets(graph: &Graph) -> impl Iterator<Item = u64> {
    let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
    (0..=4).map(move |i| floor + (peak - floor) * i / 4)
}

fn milp_time(graph: &Graph, budget: u64) -> Option<f64> {
    let options = MilpOptions {
        time_limit_s: 60.0,
        ..MilpOptions::default()
    };
    match solve_milp(graph, budget, &options) {
        Ok(solution) => {
            assert!(
                solution.optimal,
                "{}: not proven optimal at {budget}",
                graph.name()
            );
            let report =
                simulate_steps(graph, &solution.steps, BANDWIDTH).expect("milp schedule validates");
            assert!(
                report.peak_bytes <= budget,
                "peak {} > budget {budget}",
                report.peak_bytes
            );
            assert!((report.total_time - solution.objective).abs() <= 1e-6 * report.total_time);
            // Proved optimal: the bound meets the objective.
            assert!(solution.lower_bound <= solution.objective);
            assert!(solution.lower_bound >= solution.objective * (1.0 - 1e-5));
            Some(report.total_time)
        }
        Err(MilpError::Infeasible { .. }) => None,
        Err(e) => panic!("{e}"),
    }
}

fn strategy_time(strategy: &dyn Strategy, graph: &Graph, budget: u64) -> Option<f64> {
    let planned = strategy
        .plan(&Problem {
            graph,
            budget_bytes: budget,
            bandwidth: BANDWIDTH,
        })
        .ok()?;
    assert!(planned.report.peak_bytes <= budget);
    Some(planned.report.total_time)
}

#[test]
fn milp_is_never_beaten_by_chain_dp_or_evict_on_chains() {
    let mut rng = Rng(0xdead_beef_cafe);
    for case in 0..6 {
        let graph = training_graph(&mut rng, 4 + case % 3, false);
        for budget in budgets(&graph) {
            let Some(best) = milp_time(&graph, budget) else {
                continue;
            };
            for strategy in [&ChainDp as &dyn Strategy, &Evict] {
                if let Some(time) = strategy_time(strategy, &graph, budget) {
                    assert!(
                        best <= time + 1e-9,
                        "case {case}: milp {best} beaten by {} {time}",
                        strategy.name()
                    );
                }
            }
        }
    }
}

#[test]
fn milp_is_never_beaten_on_graphs_with_skips() {
    let mut rng = Rng(0x1234_5678);
    let mut compared = 0;
    for case in 0..6 {
        let graph = training_graph(&mut rng, 5 + case % 2, true);
        for budget in budgets(&graph) {
            let Some(best) = milp_time(&graph, budget) else {
                continue;
            };
            if let Some(time) = strategy_time(&Evict, &graph, budget) {
                assert!(
                    best <= time + 1e-9,
                    "case {case}: milp {best} beaten by evict {time}"
                );
                eprintln!(
                    "case {case} budget {budget}: evict / milp = {:.4}",
                    time / best
                );
                compared += 1;
            }
        }
    }
    assert!(compared > 10, "only {compared} comparisons");
}

#[test]
fn milp_proves_budgets_below_the_floor_infeasible() {
    let mut rng = Rng(77);
    let graph = training_graph(&mut rng, 5, true);
    let err = solve_milp(&graph, graph.memory_floor() - 1, &MilpOptions::default()).unwrap_err();
    assert!(matches!(err, MilpError::Infeasible { .. }), "{err}");
    assert!(milp_time(&graph, graph.store_all_peak()).is_some());
}

#[test]
fn highs_itself_proves_a_budget_below_the_floor_infeasible() {
    // Without the floor shortcut the model goes to HiGHS, which must find no schedule.
    let mut rng = Rng(91);
    let graph = training_graph(&mut rng, 3, false);
    let options = MilpOptions {
        floor_shortcut: false,
        ..MilpOptions::default()
    };
    let err = solve_milp(&graph, graph.memory_floor() - 1, &options).unwrap_err();
    assert!(matches!(err, MilpError::Infeasible { .. }), "{err}");
    // At the floor itself HiGHS finds a schedule.
    assert!(solve_milp(&graph, graph.memory_floor(), &options).is_ok());
    // The strategy reports the proof as infeasibility, not as "does not apply".
    let planned = remat_planner::lookup("checkmate-milp")
        .unwrap()
        .plan(&Problem {
            graph: &graph,
            budget_bytes: graph.memory_floor() - 1,
            bandwidth: BANDWIDTH,
        });
    assert!(
        matches!(
            planned,
            Err(remat_planner::PlanError::ProvedInfeasible { .. })
        ),
        "{planned:?}"
    );
}

#[test]
fn milp_proves_a_budget_above_the_floor_infeasible() {
    // x and y both read a, d reads x and y. The floor is x + y + d = 21, but y runs while a
    // and x are on the device (x waits for d, a is y's input; recomputing x later needs a
    // again), so every schedule peaks at a + x + y = 30: HiGHS must prove 25 infeasible
    // and find the schedule at 30.
    let nodes = vec![
        node("a".into(), Phase::Forward, 1, 10, vec![]),
        node("x".into(), Phase::Forward, 1, 10, vec![0]),
        node("y".into(), Phase::Forward, 1, 10, vec![0]),
        node("d".into(), Phase::Forward, 1, 1, vec![1, 2]),
    ];
    let graph = Graph::new("fork", nodes, 0, 1.0).unwrap();
    assert_eq!(graph.memory_floor(), 21);
    let err = solve_milp(&graph, 25, &MilpOptions::default()).unwrap_err();
    assert!(matches!(err, MilpError::Infeasible { .. }), "{err}");
    assert_eq!(milp_time(&graph, 30), Some(4.0));
}

#[test]
fn milp_never_recomputes_a_pinned_node() {
    // g: a zero-cost buffer read at the end. a -> b, end reads g and b. The floor (20) is
    // reachable only by dropping g while b runs and recomputing it for free: the MILP does
    // so unpinned, proves 20 infeasible once g is pinned, and keeps g at 30.
    let nodes = vec![
        node("g".into(), Phase::Backward, 0, 10, vec![]),
        node("a".into(), Phase::Forward, 1, 10, vec![]),
        node("b".into(), Phase::Forward, 1, 10, vec![1]),
        node("end".into(), Phase::Backward, 1, 0, vec![0, 2]),
    ];
    let free = Graph::new("buffer", nodes, 0, 1.0).unwrap();
    let computes = |steps: &[remat_planner::Step]| {
        steps
            .iter()
            .filter(|s| matches!(s, remat_planner::Step::Compute { node: 0 }))
            .count()
    };
    let solution = solve_milp(&free, 20, &MilpOptions::default()).unwrap();
    assert_eq!(computes(&solution.steps), 2);
    let pinned = free.with_pinned([0]).unwrap();
    let err = solve_milp(&pinned, 20, &MilpOptions::default()).unwrap_err();
    assert!(matches!(err, MilpError::Infeasible { .. }), "{err}");
    let solution = solve_milp(&pinned, 30, &MilpOptions::default()).unwrap();
    assert_eq!(computes(&solution.steps), 1);
    simulate_steps(&pinned, &solution.steps, BANDWIDTH).unwrap();
}

#[test]
fn under_a_short_time_limit_the_outcome_is_an_incumbent_and_a_bound() {
    // Graphs large enough that HiGHS cannot always finish in 50 ms; whatever it returns,
    // the bound is at most the proved optimum (solved without a tight limit) and at least
    // the base time, and an incumbent fits the budget and is no faster than the bound.
    let mut rng = Rng(0xfeed);
    let mut incumbents = 0;
    for case in 0..4 {
        let graph = training_graph(&mut rng, 8 + 2 * case, true);
        let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
        let budget = floor + (peak - floor) / 4;
        let problem = Problem {
            graph: &graph,
            budget_bytes: budget,
            bandwidth: BANDWIDTH,
        };
        let Some(optimum) = milp_time(&graph, budget) else {
            continue;
        };
        let short = CheckmateMilp {
            options: MilpOptions {
                time_limit_s: 0.05,
                ..MilpOptions::default()
            },
        };
        let outcome = short.solve(&problem).unwrap();
        let bound = outcome.lower_bound_time;
        assert!(bound >= graph.base_time() - 1e-9, "case {case}: {bound}");
        assert!(
            bound <= optimum * (1.0 + 1e-6),
            "case {case}: {bound} > {optimum}"
        );
        if let Some(planned) = &outcome.planned {
            incumbents += 1;
            assert!(planned.report.peak_bytes <= budget, "case {case}");
            assert!(
                planned.report.total_time >= bound - 1e-9 * bound,
                "case {case}"
            );
            if outcome.proved_optimal {
                let time = planned.report.total_time;
                assert!((time - optimum).abs() <= 1e-6 * optimum, "case {case}");
            }
        } else {
            assert!(!outcome.proved_optimal);
        }
        let overhead = outcome.lower_bound_overhead(&graph);
        eprintln!(
            "case {case}: {} nodes, optimum {optimum}, 50 ms: bound {bound} (overhead >= {overhead:.4}), plan {:?}, proved {}",
            graph.len(),
            outcome.planned.as_ref().map(|p| p.report.total_time),
            outcome.proved_optimal
        );
    }
    eprintln!("{incumbents} incumbents under 50 ms");
}

#[test]
fn an_incumbent_not_proved_optimal_is_returned_with_its_bound() {
    // HiGHS stops at its first schedule: the strategy returns it (it used to decline), and
    // the bound is a true lower bound, below the optimum found without the limit.
    let mut rng = Rng(0xbead);
    let mut unproved = 0;
    for case in 0..4 {
        let graph = training_graph(&mut rng, 8 + case, true);
        let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
        let budget = floor + (peak - floor) / 4;
        let problem = Problem {
            graph: &graph,
            budget_bytes: budget,
            bandwidth: BANDWIDTH,
        };
        let first = CheckmateMilp {
            options: MilpOptions {
                max_improving_schedules: Some(1),
                ..MilpOptions::default()
            },
        };
        let outcome = match first.solve(&problem) {
            Ok(outcome) => outcome,
            Err(remat_planner::PlanError::ProvedInfeasible { .. }) => continue,
            Err(e) => panic!("case {case}: {e}"),
        };
        let Some(optimum) = milp_time(&graph, budget) else {
            panic!("case {case}: a schedule was found, yet the MILP proves none fits");
        };
        let planned = outcome.planned.as_ref().expect("HiGHS stops at a schedule");
        assert!(planned.report.peak_bytes <= budget);
        let time = planned.report.total_time;
        assert!(time >= optimum - 1e-9 && outcome.lower_bound_time <= optimum + 1e-9);
        assert_eq!(
            outcome.proved_optimal,
            time - outcome.lower_bound_time <= 1e-6 * time
        );
        if !outcome.proved_optimal {
            unproved += 1;
            let via_strategy = first.plan(&problem).expect("the incumbent is the plan");
            assert_eq!(via_strategy.report.total_time, time);
        }
        eprintln!(
            "case {case}: first schedule {time}, bound {}, optimum {optimum}",
            outcome.lower_bound_time
        );
    }
    assert!(
        unproved > 0,
        "every first schedule was proved optimal: no unproved case tested"
    );
}

#[test]
fn a_graph_too_large_for_the_model_is_refused_pointing_at_the_fast_solver() {
    let graph = remat_planner::synth::training_graph(150, 3);
    let problem = Problem {
        graph: &graph,
        budget_bytes: graph.store_all_peak(),
        bandwidth: BANDWIDTH,
    };
    let milp = CheckmateMilp {
        options: MilpOptions::default(),
    };
    let err = milp.solve(&problem).unwrap_err().to_string();
    assert!(
        err.contains("301 nodes") && err.contains("limit 200") && err.contains("fast strategy"),
        "{err}"
    );
    let err = solve_milp(&graph, graph.store_all_peak(), &MilpOptions::default()).unwrap_err();
    assert!(
        matches!(err, MilpError::TooLarge { nodes: 301, .. }),
        "{err}"
    );
}

#[test]
fn a_proof_of_infeasibility_stays_an_answer_of_solve() {
    let mut rng = Rng(5);
    let graph = training_graph(&mut rng, 4, false);
    let problem = Problem {
        graph: &graph,
        budget_bytes: graph.memory_floor() - 1,
        bandwidth: BANDWIDTH,
    };
    let milp = CheckmateMilp {
        options: MilpOptions::default(),
    };
    let err = milp.solve(&problem).unwrap_err();
    assert!(
        matches!(err, remat_planner::PlanError::ProvedInfeasible { .. }),
        "{err}"
    );
}

/// Minutes of HiGHS on the real graphs: run by hand with `--ignored` (the benchmark
/// `remat bench plan` with `--features milp` reports the same comparison).
#[test]
#[ignore]
fn evict_within_two_percent_of_the_milp_on_shared_graphs() {
    let Some(dir) = graphs_dir() else { return };
    let options = MilpOptions {
        time_limit_s: 600.0,
        ..MilpOptions::default()
    };
    for file in [
        "vgg16-b256-train.json",
        "vgg19-b256-train.json",
        "vgg-unet-b32-train.json",
    ] {
        let path = dir.join(file);
        let graph =
            remat_planner::import::load(&path, remat_planner::import::ImportOptions::default())
                .unwrap();
        let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
        for fraction in [0.1, 0.25, 0.5] {
            let budget = floor + ((peak - floor) as f64 * fraction) as u64;
            let start = std::time::Instant::now();
            let milp = solve_milp(&graph, budget, &options).unwrap_or_else(|e| panic!("{e}"));
            let solve = start.elapsed();
            let base = graph.base_time();
            let opt = (milp.objective - base) / base;
            let ev = strategy_time(&Evict, &graph, budget).unwrap();
            let ev = (ev - base) / base;
            eprintln!(
                "{file} {fraction}: milp overhead {opt:.4} (optimal {}, {solve:?}), evict {ev:.4}",
                milp.optimal
            );
            assert!(
                ev <= opt * 1.02 + 1e-4,
                "{file} at {fraction}: evict {ev} vs milp {opt}"
            );
        }
        let err = solve_milp(&graph, floor - 1, &options).unwrap_err();
        assert!(matches!(err, MilpError::Infeasible { .. }), "{file}: {err}");
    }
}
