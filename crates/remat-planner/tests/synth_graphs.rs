//! The generated transformer graphs as planning problems: plans for them replay in the
//! simulator within the budget, and a deeper model costs no more overhead at the same
//! budget fraction (the requirement for 32 layers against 8).

use remat_planner::exact::evict::Evict;
use remat_planner::synth::{LayeredParams, TransformerParams, random_layered, transformer};
use remat_planner::{Graph, Problem, Strategy, simulate};

const BANDWIDTH: f64 = 32e9;

/// Evict's overhead at `fraction` of the store-all peak, checked in the simulator.
fn overhead(graph: &Graph, fraction: f64) -> f64 {
    let budget = (graph.store_all_peak() as f64 * fraction) as u64;
    let planned = Evict
        .plan(&Problem {
            graph,
            budget_bytes: budget,
            bandwidth: BANDWIDTH,
        })
        .unwrap_or_else(|e| panic!("{} at {fraction}: {e}", graph.name()));
    let replayed = simulate(graph, &planned.plan).expect("the plan replays");
    assert!(
        replayed.peak_bytes <= budget,
        "{} at {fraction}",
        graph.name()
    );
    assert_eq!(replayed.total_time, planned.report.total_time);
    replayed.overhead()
}

#[test]
fn deeper_transformers_cost_no_more_overhead_at_the_same_fraction() {
    let shallow = transformer(&TransformerParams::gpt(8)).unwrap();
    let deep = transformer(&TransformerParams::gpt(32)).unwrap();
    for fraction in [0.9, 0.5, 0.3] {
        let (o8, o32) = (overhead(&shallow, fraction), overhead(&deep, fraction));
        eprintln!("at {fraction}: 8 layers {o8:.4}, 32 layers {o32:.4}");
        assert!(o32 <= o8 + 1e-9, "at {fraction}: {o32} > {o8}");
    }
}

#[test]
fn random_layered_graphs_plan_with_swapping() {
    // At 32 GB/s the kilobyte tensors swap almost for free: a plan fits at 0.8.
    let graph = random_layered(&LayeredParams::moccasin(250), 1).unwrap();
    let planned = remat_planner::lookup("mutwo")
        .unwrap()
        .plan(&Problem {
            graph: &graph,
            budget_bytes: graph.store_all_peak() * 8 / 10,
            bandwidth: BANDWIDTH,
        })
        .unwrap();
    let replayed = simulate(&graph, &planned.plan).unwrap();
    assert!(replayed.peak_bytes <= graph.store_all_peak() * 8 / 10);
}
