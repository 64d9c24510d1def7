//! The anytime solver on the Checkmate graphs of ../shared/graphs (skipped, saying so,
//! when the directory is absent), at budgets from 0.95 to 0.4 of the store-all peak:
//! it never says infeasible where any strategy (or, with feature `milp`, the MILP) has a
//! plan, its plans replay within the budget, its overhead is compared with the exact
//! references that apply (chain-dp where exact; not the MILP, see [`exact_overheads`]) and
//! must be within 1% (relative) of them, and the lower bound never exceeds them.
//!
//! A slow host link makes swaps useless, so every strategy competes on recomputation (the
//! exact references are recompute-only).

mod common;

use std::time::Duration;

use common::graphs_dir;
use remat_planner::import::{ImportOptions, load};
use remat_planner::request::{self, RequestError};
use remat_planner::solve::Anytime;
use remat_planner::{Graph, PlanError, simulate};
use remat_planner::{Problem, Strategy, registry};

const BANDWIDTH: f64 = 1e3;
const FILES: [&str; 5] = [
    "vgg16-b256-train.json",
    "vgg19-b256-train.json",
    "vgg-unet-b32-train.json",
    "mobilenet-b512-train.json",
    "random-layered-n100.json",
];

/// The exact references that apply to this problem: (name, optimal overhead).
fn exact_overheads(problem: &Problem) -> Vec<(String, f64)> {
    let mut refs = Vec::new();
    for strategy in registry() {
        // The MILP (feature `milp`) is left out: with its 120 s limit per solve, 12 budgets
        // of five graphs (MobileNet has 185 nodes) would take CI hours, and it often returns
        // an unproved incumbent here. The 1%-of-MILP comparison is measured by `remat bench
        // plan`, not asserted here.
        if !strategy.is_exact_for(problem) || strategy.name() == "checkmate-milp" {
            continue;
        }
        if let Ok(p) = strategy.plan(problem) {
            refs.push((strategy.name(), p.report.overhead()));
        }
    }
    refs
}

fn solve_graph(graph: &Graph, file: &str) {
    let peak = graph.store_all_peak();
    for tenths in (8..=19).rev() {
        let fraction = tenths as f64 / 20.0;
        let budget = (peak as f64 * fraction) as u64;
        if budget < graph.memory_floor() {
            continue;
        }
        let problem = Problem {
            graph,
            budget_bytes: budget,
            bandwidth: BANDWIDTH,
        };
        let solver = Anytime {
            time_limit: Some(Duration::from_secs(1)),
        };
        let solved = solver.plan(&problem);
        let best = request::plan(&problem, None, Some(Duration::from_secs(1)), |_| {});
        let bound = best.bound.clone().expect("a bound").overhead;
        let any_plan = registry()
            .iter()
            .filter(|s| s.name() != "anytime")
            .find_map(|s| s.plan(&problem).ok().map(|_| s.name()));
        let exact = exact_overheads(&problem);
        match (&solved, &best.result) {
            (Ok(p), Ok(b)) => {
                let report = simulate(graph, &p.plan).unwrap();
                assert!(report.peak_bytes <= budget, "{file} at {fraction}");
                let o = b.report.overhead();
                assert!(
                    o + 1e-9 >= bound,
                    "{file} at {fraction}: bound {bound} above {o}"
                );
                for (name, opt) in &exact {
                    assert!(
                        bound <= opt + 1e-9,
                        "{file} at {fraction}: bound {bound} above {name} {opt}"
                    );
                    assert!(
                        (1.0 + o) <= (1.0 + opt) * 1.01 + 1e-12,
                        "{file} at {fraction}: default {o} more than 1% above {name} {opt}"
                    );
                }
                println!(
                    "{file} {fraction:.2}: anytime {:.3}%, default {:.3}% ({}), bound {:.3}%, exact {exact:?}",
                    100.0 * p.report.overhead(),
                    100.0 * o,
                    b.plan.strategy,
                    100.0 * bound
                );
            }
            _ => {
                assert!(
                    any_plan.is_none() && exact.is_empty(),
                    "{file} at {fraction}: no plan from the solver ({solved:?}) or the default, but {any_plan:?} / {exact:?} found one"
                );
                assert!(matches!(
                    best.result,
                    Err(RequestError::Infeasible { .. }
                        | RequestError::Plan(PlanError::OverBudget { .. }))
                ));
                println!("{file} {fraction:.2}: no strategy fits");
            }
        }
    }
}

#[test]
fn anytime_on_the_checkmate_graphs_against_the_exact_references() {
    let Some(dir) = graphs_dir() else { return };
    for file in FILES {
        let path = dir.join(file);
        if !path.exists() {
            eprintln!("skipping {file}: not in {}", dir.display());
            continue;
        }
        let graph = load(&path, ImportOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        solve_graph(&graph, file);
    }
}
