//! The floors of `../shared/graphs` (README): below a graph's floor every strategy reports
//! infeasible (the anytime solver and the combined planner refuse the budget up front,
//! naming the floor); just above the
//! store-all peak's middle ground MuTWO finds a valid plan. Skipped, saying so, when the
//! shared folder is absent.

mod common;

use common::graphs_dir;

use remat_planner::import::{ImportOptions, load};
use remat_planner::request::{self, RequestError};
use remat_planner::{PlanError, Problem, lookup, registry, simulate};
use remat_units::human_bytes;

const TRAINING: [&str; 4] = [
    "vgg16-b256-train.json",
    "vgg19-b256-train.json",
    "vgg-unet-b32-train.json",
    "mobilenet-b512-train.json",
];

#[test]
fn below_the_floor_every_strategy_is_infeasible() {
    let Some(dir) = graphs_dir() else { return };
    for file in TRAINING {
        let graph = load(&dir.join(file), ImportOptions::default()).expect(file);
        let floor = graph.memory_floor();
        let problem = Problem {
            graph: &graph,
            budget_bytes: floor - 1,
            bandwidth: 32e9,
        };
        for strategy in registry() {
            match strategy.plan(&problem) {
                Err(PlanError::OverBudget { best_peak, .. }) => {
                    assert!(best_peak >= floor, "{file} {}", strategy.name())
                }
                // An exact solver's proof (the MILP, feature `milp`) carries no peak.
                Err(PlanError::ProvedInfeasible { .. }) => {}
                Err(PlanError::BelowFloor { floor: named, .. }) => assert_eq!(named, floor),
                // Only strategies that cannot take this graph at all may decline; the MILP
                // must answer (see below).
                Err(PlanError::NotApplicable { .. }) if strategy.name() != "checkmate-milp" => {}
                other => panic!("{file} {}: {other:?}", strategy.name()),
            }
        }
        match request::plan(&problem, None, None, |_| {}).result {
            // Refused up front, naming the floor (in the front ends' words).
            Err(err @ RequestError::BelowFloor { .. }) => {
                assert_eq!(
                    err,
                    RequestError::BelowFloor {
                        budget: floor - 1,
                        floor
                    }
                );
                assert!(
                    err.to_string()
                        .contains(&format!("memory floor {}", human_bytes(floor))),
                    "{err}"
                );
            }
            other => panic!("{file}: {other:?}"),
        }
    }
}

#[test]
fn between_floor_and_peak_mutwo_plans_validate() {
    let Some(dir) = graphs_dir() else { return };
    for file in TRAINING {
        let graph = load(&dir.join(file), ImportOptions::default()).expect(file);
        let (floor, peak) = (graph.memory_floor(), graph.store_all_peak());
        let problem = Problem {
            graph: &graph,
            budget_bytes: floor + (peak - floor) / 2,
            bandwidth: 32e9,
        };
        let planned = lookup("mutwo").unwrap().plan(&problem).expect(file);
        let report = simulate(&graph, &planned.plan).expect(file);
        assert!(report.peak_bytes <= problem.budget_bytes, "{file}");
        println!("{file}: mutwo overhead {:.2}%", 100.0 * report.overhead());
    }
}

/// With the MILP built in, it must prove every shared training graph infeasible a byte
/// below its floor (the graphs are within its node limit).
#[cfg(feature = "milp")]
#[test]
fn below_the_floor_the_milp_proves_infeasibility() {
    let Some(dir) = graphs_dir() else { return };
    for file in TRAINING {
        let graph = load(&dir.join(file), ImportOptions::default()).expect(file);
        let problem = Problem {
            graph: &graph,
            budget_bytes: graph.memory_floor() - 1,
            bandwidth: 32e9,
        };
        match lookup("checkmate-milp").unwrap().plan(&problem) {
            Err(PlanError::ProvedInfeasible { budget, .. }) => {
                assert_eq!(budget, problem.budget_bytes, "{file}")
            }
            other => panic!("{file}: {other:?}"),
        }
    }
}
