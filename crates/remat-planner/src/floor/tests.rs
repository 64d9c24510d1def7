use proptest::prelude::*;

use super::*;
use crate::ir::{Node, Phase};
use crate::sim::simulate_steps;
use crate::synth::transformer::{TransformerParams, transformer};

fn node(name: &str, output_bytes: u64, inputs: Vec<NodeId>) -> Node {
    Node {
        name: name.into(),
        phase: Phase::Forward,
        compute_time: 1.0,
        output_bytes,
        inputs,
    }
}

/// `a` (pinned) -> `b` -> `c` -> `d`, and `d` reads `a` too: `a` must stay on the device
/// while `c` is computed from `b`, which the op floor does not see.
fn pinned_across() -> Graph {
    let nodes = vec![
        node("a", 10, vec![]),
        node("b", 20, vec![0]),
        node("c", 20, vec![1]),
        node("d", 1, vec![2, 0]),
    ];
    Graph::new("pinned-across", nodes, 0, 1.0)
        .and_then(|g| g.with_pinned([0]))
        .expect("valid graph")
}

/// Two gradient buffers as a training step lays them out: `ga` written above `big`, `gb`
/// below it, both read by the step's end, which reads nothing else. By data alone the end
/// could run before `big`; but a pinned tensor's readers run in node order (`wb` writes
/// `gb` before the end reads it), so the end comes after `big` and `ga` is held across it.
fn two_gradient_buffers() -> Graph {
    let nodes = vec![
        node("ga", 100, vec![]),
        node("gb", 100, vec![]),
        node("x", 10, vec![]),
        node("wa", 10, vec![0, 2]),
        node("big", 1000, vec![3]),
        node("y", 10, vec![4]),
        node("wb", 10, vec![1, 5]),
        node("end", 1, vec![0, 1]),
    ];
    Graph::new("two-gradient-buffers", nodes, 0, 1.0)
        .and_then(|g| g.with_pinned([0, 1]))
        .expect("valid graph")
}

#[test]
fn a_buffer_read_by_the_step_end_is_held_across_what_runs_before_the_end_in_free_order() {
    let g = two_gradient_buffers();
    assert!(!g.order_is_fixed());
    assert_eq!(
        g.memory_floor(),
        1010,
        "big with its input wa, or y with big"
    );
    assert_eq!(certified_recompute_floor(&g), 1110, "ga is held across big");
    assert_eq!(least_recompute_peak(&g, EXACT_STATE_LIMIT), Some(1110));
    let fixed = g.clone().with_fixed_order();
    // In node order `gb` is made before `big` too, and held across it.
    assert_eq!(certified_recompute_floor(&fixed), 1210);
    // The order the data alone allows (the end before `wb` writes `gb`) is refused.
    let steps = [0, 1, 2, 3, 7, 4, 5, 6].map(|node| Step::Compute { node });
    let err = simulate_steps(&g, &steps, 1.0).expect_err("the end read gb before wb wrote it");
    assert_eq!(
        err,
        crate::error::SimError::PinnedReadOutOfOrder {
            step: 4,
            node: "end".into(),
            tensor: "gb".into(),
            earlier: "wb".into(),
        }
    );
}

#[test]
fn a_pinned_tensor_held_across_an_operation_raises_the_floor() {
    let g = pinned_across();
    assert_eq!(g.memory_floor(), 40, "c with its input b");
    assert_eq!(certified_recompute_floor(&g), 50, "a is held across c");
    assert_eq!(least_recompute_peak(&g, EXACT_STATE_LIMIT), Some(50));
    assert_eq!(
        recompute_floor(&g),
        RecomputeFloor {
            bytes: 50,
            exact: true
        }
    );
    // Unpinned, `a` is dropped and recomputed for `d`: the op floor is the least peak.
    let free = Graph::new("unpinned", g.nodes().to_vec(), 0, 1.0).expect("valid graph");
    assert_eq!(certified_recompute_floor(&free), 40);
    assert_eq!(least_recompute_peak(&free, EXACT_STATE_LIMIT), Some(40));
}

#[test]
fn a_fixed_order_holds_a_pinned_tensor_until_its_reader_in_node_order() {
    // `a` (pinned) is read by `d` only; `b`, `c` do not descend from `a`. In free order `a`
    // may wait until `c` is done; in node order it is made before `b` and `c`.
    let nodes = vec![
        node("a", 10, vec![]),
        node("b", 20, vec![]),
        node("c", 20, vec![1]),
        node("d", 1, vec![2, 0]),
    ];
    let free = Graph::new("g", nodes, 0, 1.0)
        .and_then(|g| g.with_pinned([0]))
        .expect("valid graph");
    let fixed = free.clone().with_fixed_order();
    assert_eq!(certified_recompute_floor(&free), 40);
    assert_eq!(least_recompute_peak(&free, EXACT_STATE_LIMIT), Some(40));
    assert_eq!(certified_recompute_floor(&fixed), 50);
    assert_eq!(least_recompute_peak(&fixed, EXACT_STATE_LIMIT), Some(50));
}

#[test]
fn large_graphs_get_the_certified_bound_between_the_op_floor_and_store_all() {
    for layers in [1, 2] {
        let g = transformer(&TransformerParams::gpt(layers)).expect("generator");
        for graph in [g.clone(), g.with_fixed_order()] {
            let floor = recompute_floor(&graph);
            assert!(!floor.exact);
            assert!(graph.memory_floor() <= floor.bytes);
            assert!(floor.bytes <= graph.store_all_peak());
        }
    }
    // In node order the gradient buffers, read at the step's end, are all held across the
    // first layer's backward: the floor rises well above the largest operation.
    let fixed = transformer(&TransformerParams::gpt(8))
        .expect("generator")
        .with_fixed_order();
    assert!(certified_recompute_floor(&fixed) > fixed.memory_floor() * 105 / 100);
}

/// A random graph of up to `max` nodes: inputs among earlier nodes, some nodes pinned, the
/// order fixed or not.
fn small_graph(max: usize) -> impl Strategy<Value = Graph> {
    (1..=max)
        .prop_flat_map(|n| {
            (
                prop::collection::vec((0u64..=20, any::<u64>(), any::<bool>()), n),
                0u64..=10,
                any::<bool>(),
            )
        })
        .prop_map(|(specs, static_bytes, fixed)| {
            let nodes = specs
                .iter()
                .enumerate()
                .map(|(id, &(bytes, mask, _))| {
                    let inputs = (0..id).filter(|&i| mask >> i & 1 == 1).collect();
                    node(&format!("n{id}"), bytes, inputs)
                })
                .collect();
            let pinned = specs
                .iter()
                .enumerate()
                .filter_map(|(id, &(_, _, pin))| pin.then_some(id));
            let g = Graph::new("random", nodes, static_bytes, 1.0)
                .and_then(|g| g.with_pinned(pinned))
                .expect("valid graph");
            if fixed { g.with_fixed_order() } else { g }
        })
}

/// A random recompute-only schedule: random computes of nodes whose inputs are on the
/// device, random frees, until every node is computed; `None` at a dead end (a pinned
/// tensor freed before all its readers ran).
fn random_schedule(g: &Graph, mut seed: u64) -> Option<Vec<Step>> {
    let n = g.len();
    // First computations wait for their precedence: a pinned tensor's earlier readers, and
    // in a fixed order every earlier node.
    let prec = crate::solve::order::Precedence::of(g);
    let mut computed = vec![false; n];
    let mut resident = vec![false; n];
    let mut steps = Vec::new();
    for _ in 0..10 * n + 10 {
        if computed.iter().all(|&c| c) {
            return Some(steps);
        }
        let mut moves = Vec::new();
        for v in 0..n {
            if resident[v] {
                moves.push(Step::Free { tensor: v });
            } else if g.node(v).inputs.iter().all(|&i| resident[i])
                && !(computed[v] && g.is_pinned(v))
                && (computed[v] || prec.preds[v].iter().all(|&p| computed[p]))
            {
                moves.push(Step::Compute { node: v });
            }
        }
        if moves.is_empty() {
            return None;
        }
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let step = moves[(seed >> 33) as usize % moves.len()];
        match step {
            Step::Compute { node } => {
                computed[node] = true;
                resident[node] = true;
            }
            Step::Free { tensor } => resident[tensor] = false,
            Step::SwapOut { .. } | Step::SwapIn { .. } => {}
        }
        steps.push(step);
    }
    computed.iter().all(|&c| c).then_some(steps)
}

fn first_computations_in_order(steps: &[Step], n: usize) -> bool {
    let mut seen = vec![false; n];
    let mut next = 0;
    for step in steps {
        let Step::Compute { node } = *step else {
            continue;
        };
        if !seen[node] {
            if node != next {
                return false;
            }
            seen[node] = true;
            next += 1;
        }
    }
    true
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The exact search's schedule is valid, recompute-only and reaches its peak; the
    /// certified bound is between the op floor and it; `recompute_floor` says it exactly.
    #[test]
    fn the_bound_is_sound_and_the_search_exact(g in small_graph(8)) {
        let (least, steps) = least_recompute_schedule(&g, EXACT_STATE_LIMIT).expect("small");
        let report = simulate_steps(&g, &steps, 1.0).expect("valid schedule");
        prop_assert_eq!(report.peak_bytes, least);
        prop_assert_eq!(report.swapped_out_bytes, 0);
        prop_assert!(!g.order_is_fixed() || first_computations_in_order(&steps, g.len()));
        let bound = certified_recompute_floor(&g);
        prop_assert!(g.memory_floor() <= bound, "op floor {} > bound {bound}", g.memory_floor());
        prop_assert!(bound <= least, "bound {bound} > least peak {least}");
        prop_assert!(least <= g.store_all_peak());
        prop_assert_eq!(recompute_floor(&g), RecomputeFloor { bytes: least, exact: true });
    }

    /// No recompute-only schedule, drawn at random and judged by the simulator, peaks below
    /// the exact least peak (nor, then, below the bound).
    #[test]
    fn no_random_schedule_beats_the_least_peak(g in small_graph(6), seeds in prop::collection::vec(any::<u64>(), 20)) {
        let least = least_recompute_peak(&g, EXACT_STATE_LIMIT).expect("small");
        for seed in seeds {
            let Some(steps) = random_schedule(&g, seed) else { continue };
            let report = simulate_steps(&g, &steps, 1.0).expect("valid schedule");
            prop_assert!(least <= report.peak_bytes, "schedule peaks at {} < {least}", report.peak_bytes);
        }
    }

    /// Under the exact least peak, the eviction and the anytime search find nothing
    /// without swaps, and the smallest peak they report is one a whole schedule reached:
    /// never under the least peak (a stuck pass's need at the step it stuck on was
    /// reported once, as low as the budget plus a byte).
    #[test]
    fn the_smallest_peak_reported_is_a_schedules(g in small_graph(8), cut in 0.0f64..1.0) {
        use crate::problem::{Problem, RECOMPUTE_ONLY_BANDWIDTH};
        use crate::strategy::Strategy;
        let least = least_recompute_peak(&g, EXACT_STATE_LIMIT).expect("small");
        let floor = g.memory_floor();
        if least <= floor {
            return Ok(());
        }
        let budget = floor + ((least - 1 - floor) as f64 * cut) as u64;
        let problem = Problem { graph: &g, budget_bytes: budget, bandwidth: RECOMPUTE_ONLY_BANDWIDTH };
        let evicted = crate::exact::evict::Evict.plan(&problem);
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(50);
        let searched = crate::solve::solve(&problem, deadline, None, |_, _| {});
        for result in [evicted, searched] {
            match result {
                Err(crate::PlanError::OverBudget { best_peak, .. }) => prop_assert!(
                    best_peak >= least,
                    "reported {best_peak} under the least peak {least} (budget {budget})"
                ),
                Ok(planned) => prop_assert!(planned.report.swapped_out_bytes > 0),
                Err(_) => {}
            }
        }
    }
}

#[test]
fn a_recompute_only_request_under_the_recompute_floor_is_refused_naming_it() {
    use crate::problem::Problem;
    use crate::request::{RequestError, plan, plan_recompute_only};
    let g = pinned_across();
    let below = Problem {
        graph: &g,
        budget_bytes: 49,
        bandwidth: 32e9,
    };
    let refused = plan_recompute_only(&below, None, None, |_| {});
    let Err(err) = refused.result else {
        panic!("planned under the recompute floor")
    };
    assert_eq!(
        err,
        RequestError::BelowRecomputeFloor {
            budget: 49,
            floor: 50,
            exact: true
        }
    );
    assert!(
        err.to_string().contains(
            "below the graph's recompute floor 50 B (the least peak of any schedule without swaps)"
        ),
        "{err}"
    );
    // With swaps the floor is the op floor: `a` waits on the host across `c`. So a request
    // that may swap is not refused up front.
    use Step::{Compute, Free, SwapIn, SwapOut};
    let swapping = [
        Compute { node: 0 },
        SwapOut { tensor: 0 },
        Compute { node: 1 },
        Free { tensor: 0 },
        Compute { node: 2 },
        Free { tensor: 1 },
        SwapIn { tensor: 0 },
        Compute { node: 3 },
    ];
    let report = simulate_steps(&g, &swapping, 32e9).expect("valid schedule");
    assert_eq!(report.peak_bytes, g.memory_floor());
    assert!(!matches!(
        plan(&below, None, None, |_| {}).result,
        Err(RequestError::BelowRecomputeFloor { .. } | RequestError::BelowFloor { .. })
    ));
    // At the recompute floor a recompute-only plan is found, at the floor's peak.
    let at = Problem {
        budget_bytes: 50,
        ..below
    };
    let planned = plan_recompute_only(&at, None, None, |_| {})
        .result
        .expect("a recompute-only plan at the floor");
    assert_eq!(planned.report.swapped_out_bytes, 0);
    assert_eq!(planned.report.peak_bytes, 50);
}

/// `v` reads `p` and `q`, each made from a 10-byte source of its own. Whichever of them is
/// made last, the other is held while it is: 1 + 1 + 10 = 12 bytes, above the largest
/// operation (`p` with `x`: 11), and the exact least peak.
#[test]
fn the_last_made_input_of_an_operation_is_made_beside_the_others() {
    let g = Graph::new(
        "look back",
        vec![
            node("x", 10, vec![]),
            node("y", 10, vec![]),
            node("p", 1, vec![0]),
            node("q", 1, vec![1]),
            node("v", 1, vec![2, 3]),
        ],
        0,
        1.0,
    )
    .expect("valid graph");
    assert_eq!(g.memory_floor(), 11);
    assert_eq!(certified_recompute_floor(&g), 12);
    assert_eq!(least_recompute_peak(&g, EXACT_STATE_LIMIT), Some(12));
}
