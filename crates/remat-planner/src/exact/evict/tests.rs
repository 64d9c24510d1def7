use super::*;
use crate::error::PlanError;
use crate::ir::{Node, Phase};
use crate::plan::Step;
use crate::sim::Fate;

fn node(name: &str, time: f64, inputs: Vec<NodeId>) -> Node {
    Node {
        name: name.into(),
        phase: Phase::Forward,
        compute_time: time,
        output_bytes: if name == "end" { 0 } else { 10 },
        inputs,
    }
}

fn problem(graph: &Graph, budget_bytes: u64) -> Problem<'_> {
    Problem {
        graph,
        budget_bytes,
        bandwidth: 1e9,
    }
}

fn computes_of(steps: &[Step], id: NodeId) -> usize {
    steps
        .iter()
        .filter(|s| matches!(s, Step::Compute { node } if *node == id))
        .count()
}

/// g: a zero-cost buffer read only at the end (as the engine's gradient buffers are);
/// a -> b -> c a chain whose head is also read at the end. Computing c with g, a, b
/// resident needs 40 bytes; at 30 one of g and a must go, and g (free to rebuild) is
/// the greedy's first choice.
fn buffer_graph() -> Graph {
    let nodes = vec![
        node("g", 0.0, vec![]),
        node("a", 1.0, vec![]),
        node("b", 1.0, vec![1]),
        node("c", 1.0, vec![2]),
        node("end", 1.0, vec![0, 1, 3]),
    ];
    Graph::new("buffer", nodes, 0, 1.0).unwrap()
}

#[test]
fn a_pass_and_its_refinement_stop_at_the_deadline() {
    let g = crate::strategy::baselines::tests::training_chain(200);
    let budget = g.store_all_peak() / 3;
    let weights = weightings().next().expect("a weighting");
    let none = vec![false; g.len()];
    let Pass::Fits { steps, time } = evict_pass_until(&g, budget, weights, &none, None) else {
        panic!("a third of the chain's peak fits");
    };
    let past = std::time::Instant::now();
    // A deadline already past: the pass gives up at once, reported as stuck at the
    // store-all peak, and refinement keeps the schedule it was given.
    assert!(matches!(
        evict_pass_until(&g, budget, weights, &none, Some(past)),
        Pass::Stuck { needed, .. } if needed == g.store_all_peak()
    ));
    let kept = refine(&g, budget, weights, (steps.clone(), time), Some(past));
    assert_eq!(kept, steps);
}

#[test]
fn the_strategy_under_a_deadline_stops_there_and_says_so() {
    let g = crate::strategy::baselines::tests::training_chain(200);
    let p = problem(&g, g.store_all_peak() / 3);
    let unlimited = Evict.plan(&p).expect("a third of the chain's peak fits");
    // A deadline far ahead changes nothing: the same passes, the same plan.
    let far = std::time::Instant::now() + std::time::Duration::from_secs(3600);
    let limited = Evict.plan_until(&p, far).expect("fits before an hour");
    assert_eq!(limited.plan.steps, unlimited.plan.steps);
    // One already past: no pass runs, and the error says the time ran out rather than
    // calling a budget that fits infeasible.
    match Evict.plan_until(&p, std::time::Instant::now()) {
        Err(PlanError::NotApplicable { strategy, why }) => {
            assert_eq!(strategy, NAME);
            assert!(why.contains("out of time"), "{why}");
        }
        other => panic!("expected out of time, got {other:?}"),
    }
}

#[test]
fn a_pinned_buffer_is_never_the_victim_another_tensor_is() {
    let free = buffer_graph();
    let planned = Evict.plan(&problem(&free, 30)).unwrap();
    assert_eq!(
        computes_of(&planned.plan.steps, 0),
        2,
        "unpinned g is rebuilt"
    );
    assert_eq!(planned.report.fates[0], Fate::Recomputed);

    let pinned = buffer_graph().with_pinned([0]).unwrap();
    // The unpinned plan is exactly what the simulator must now refuse.
    let err = crate::sim::simulate(&pinned, &planned.plan).unwrap_err();
    assert!(
        matches!(err, crate::error::SimError::PinnedRecomputed { .. }),
        "{err}"
    );

    let planned = Evict.plan(&problem(&pinned, 30)).unwrap();
    assert_eq!(computes_of(&planned.plan.steps, 0), 1);
    assert_eq!(
        computes_of(&planned.plan.steps, 1),
        2,
        "a is dropped instead"
    );
    assert!(planned.report.peak_bytes <= 30);
    let report = crate::sim::simulate(&pinned, &planned.plan).unwrap();
    assert_eq!(report.fates[0], Fate::Kept);
}

#[test]
fn a_budget_reachable_only_by_dropping_a_pinned_node_is_infeasible() {
    // g, a -> b, end reads g and b. Computing b with g and a resident needs 30 bytes;
    // 20 (the floor) is reachable only by dropping g, which is pinned.
    let nodes = vec![
        node("g", 0.0, vec![]),
        node("a", 1.0, vec![]),
        node("b", 1.0, vec![1]),
        node("end", 1.0, vec![0, 2]),
    ];
    let free = Graph::new("tight", nodes, 0, 1.0).unwrap();
    assert_eq!(free.memory_floor(), 20);
    let planned = Evict.plan(&problem(&free, 20)).unwrap();
    assert_eq!(computes_of(&planned.plan.steps, 0), 2);

    let pinned = free.with_pinned([0]).unwrap();
    let err = Evict.plan(&problem(&pinned, 20)).unwrap_err();
    assert_eq!(
        err,
        PlanError::OverBudget {
            strategy: NAME.into(),
            budget: 20,
            best_peak: 30,
        }
    );
    let planned = Evict.plan(&problem(&pinned, 30)).unwrap();
    assert_eq!(computes_of(&planned.plan.steps, 0), 1);
}

#[test]
fn no_rebuild_needs_a_pinned_tensor_after_it_died() {
    // p (pinned, 1 byte) is last read by a; a, q and s are read at the end. Computing s
    // with a, q, r resident needs 40 bytes; at 31, a (cheap to rebuild) or q must go.
    // Rebuilding a at the end would recompute p, dead by then, so q goes instead.
    let mut nodes = vec![
        node("p", 1.0, vec![]),
        node("a", 0.0, vec![0]),
        node("q", 5.0, vec![]),
        node("r", 1.0, vec![2]),
        node("s", 1.0, vec![3]),
        node("end", 1.0, vec![1, 2, 4]),
    ];
    nodes[0].output_bytes = 1;
    let free = Graph::new("dead-pin", nodes, 0, 1.0).unwrap();
    let planned = Evict.plan(&problem(&free, 31)).unwrap();
    assert_eq!(
        computes_of(&planned.plan.steps, 0),
        2,
        "unpinned: p and a rebuilt"
    );
    assert_eq!(computes_of(&planned.plan.steps, 1), 2);

    let pinned = free.with_pinned([0]).unwrap();
    assert!(!pinned.may_drop(1));
    let planned = Evict.plan(&problem(&pinned, 31)).unwrap();
    assert!(planned.report.peak_bytes <= 31);
    let counts: Vec<usize> = (0..6)
        .map(|v| computes_of(&planned.plan.steps, v))
        .collect();
    assert_eq!(counts, vec![1, 1, 2, 1, 1, 1]);
}

/// In the eager order a swap pass evicts only what the form lets leave: no tensor leaves
/// (freed with a reader still ahead) before the node that holds it has run, so the plan
/// made of the pass is an eager plan once its copies out move to their producers. At the
/// eager floor + 5% over 32 GB/s the passes swap (before, the eager order had no swap
/// passes at all).
#[test]
fn in_the_eager_order_a_swap_pass_lets_only_released_values_leave() {
    use crate::synth::{TransformerParams, transformer};
    let graph = transformer(&TransformerParams::gpt(2))
        .unwrap()
        .with_eager_order()
        .unwrap();
    let floor = crate::eager::floor(&graph);
    let budget = floor + floor / 20;
    let problem = Problem {
        graph: &graph,
        budget_bytes: budget,
        bandwidth: 32e9,
    };
    let none = vec![false; graph.len()];
    let (mut fitted, mut swapping, mut planned) = (0, 0, 0);
    for weights in weightings() {
        let Pass::Fits { steps, .. } =
            evict_pass_with_swaps(&graph, budget, weights, &none, 32e9, None)
        else {
            continue;
        };
        fitted += 1;
        let mut now = 0;
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Step::Compute { node } => now = now.max(node),
                Step::Free { tensor } => {
                    let read_later = steps[i..].iter().any(|s| {
                        matches!(s, Step::Compute { node } if graph.node(*node).inputs.contains(&tensor))
                    });
                    assert!(
                        !read_later || graph.eager_may_leave(tensor, now),
                        "step {i}: `{}` leaves before its holder has run",
                        graph.node(tensor).name
                    );
                }
                Step::SwapOut { .. } | Step::SwapIn { .. } => {}
            }
        }
        if steps.iter().any(|s| matches!(s, Step::SwapOut { .. })) {
            swapping += 1;
            let decisions = crate::exact::chain_graph::decisions_of(&graph, &steps);
            if crate::problem::plan_from_steps(&problem, "evict", steps, decisions).is_ok() {
                planned += 1;
            }
        }
    }
    assert!(
        fitted > 0 && swapping > 0,
        "{fitted} passes fit, {swapping} swap"
    );
    assert!(
        planned > 0,
        "no swap pass became an eager plan ({swapping} swap)"
    );
}
