//! K models planned together (`remat_planner::multi`) on synthetic transformer graphs: every
//! plan replays in the simulator within its budget, every order is a valid order of the
//! combined graph, MuTWO's Algorithm C hides swaps behind the other model's compute where
//! one model fits whole and two do not, the general solver plans the combined graph, and bad
//! input is refused. All quantities are the simulator's, deterministic.

use std::time::Duration;

use remat_planner::multi::{
    MultiError, MultiPlanned, MultiRequest, Multiplexed, Order, plan, plan_each_alone,
};
use remat_planner::plan::Step;
use remat_planner::synth::{TransformerParams, transformer};
use remat_planner::{Graph, NodeId, simulate};

fn gpt(layers: usize) -> Graph {
    transformer(&TransformerParams::gpt(layers)).expect("a valid synthetic graph")
}

/// The plan replays on the given graph within the budget, as reported, and the report's
/// parts add up.
fn check(m: &Multiplexed, planned: &MultiPlanned, budget: u64) {
    let replay = simulate(m.graph(), &planned.plan).expect("the plan replays");
    assert!(
        replay.peak_bytes <= budget,
        "{} > {budget}",
        replay.peak_bytes
    );
    assert_eq!(replay.peak_bytes, planned.report.peak_bytes);
    assert_eq!(replay.total_time, planned.report.total_time);
    assert_eq!(planned.plan.node_count, m.graph().len());
    let stalls: f64 = planned.models.iter().map(|s| s.stall_time).sum();
    assert!((stalls - replay.stall_time).abs() <= 1e-6 * replay.total_time);
    let swaps: usize = planned.models.iter().map(|s| s.swaps).sum();
    assert_eq!(swaps, planned.swaps.len());
    for s in &planned.swaps {
        assert_eq!(s.model, m.label(s.tensor));
        assert!(s.exposed >= 0.0 && s.copy_out.1 >= s.copy_out.0);
    }
}

/// Whether `order` lists every node once, inputs before readers.
fn is_topological(g: &Graph, order: &[NodeId]) -> bool {
    let mut pos = vec![usize::MAX; g.len()];
    for (p, &v) in order.iter().enumerate() {
        if v >= g.len() || pos[v] != usize::MAX {
            return false;
        }
        pos[v] = p;
    }
    order.len() == g.len()
        && (0..g.len()).all(|v| g.node(v).inputs.iter().all(|&i| pos[i] < pos[v]))
}

/// The nodes in the order the steps first compute them.
fn first_computations(steps: &[Step], n: usize) -> Vec<NodeId> {
    let mut seen = vec![false; n];
    let mut order = Vec::new();
    for step in steps {
        if let Step::Compute { node } = *step
            && !std::mem::replace(&mut seen[node], true)
        {
            order.push(node);
        }
    }
    order
}

#[test]
fn every_multiplexed_plan_replays_within_the_budget() {
    let mixed = Multiplexed::union(&[gpt(1), gpt(2), gpt(1)]).expect("three models");
    let pair = Multiplexed::union(&[gpt(2), gpt(2)]).expect("two models");
    let mut planned = 0;
    for m in [&pair, &mixed] {
        let peak = m
            .interleave(Order::Interleaved)
            .unwrap()
            .graph()
            .store_all_peak();
        for fraction in [0.95, 0.8] {
            let budget = (peak as f64 * fraction) as u64;
            for strategy in [Some("mutwo"), Some("mutwo-refined"), None] {
                for order in [
                    Order::Interleaved,
                    Order::OneAfterAnother,
                    Order::ForwardsThenBackwards,
                ] {
                    let request = MultiRequest {
                        order,
                        strategy: strategy.map(str::to_string),
                        time_limit: Some(Duration::from_millis(200)),
                        ..MultiRequest::new(budget, 64e9)
                    };
                    match plan(m, &request) {
                        Ok(p) => {
                            check(m, &p, budget);
                            planned += 1;
                        }
                        // MuTWO alone may stop above the budget (it says its peak); the
                        // search never does at these budgets.
                        Err(MultiError::Plan { .. }) if strategy.is_some() => {}
                        Err(e) => panic!("{order:?} {strategy:?} at {fraction}: {e}"),
                    }
                }
            }
        }
    }
    assert!(planned >= 26, "only {planned} of 36 requests planned");
}

#[test]
fn the_interleaving_is_a_valid_order_that_costs_no_more_memory_than_one_after_another() {
    let one = gpt(2);
    for k in [2usize, 4] {
        let m = Multiplexed::union(&vec![one.clone(); k]).unwrap();
        let mut peaks = Vec::new();
        for order in Order::ALL {
            let i = m.interleave(order).unwrap();
            assert!(is_topological(m.graph(), i.nodes()), "K={k} {order:?}");
            for model in 0..k {
                let own: Vec<NodeId> = i
                    .nodes()
                    .iter()
                    .copied()
                    .filter(|&v| m.label(v) == Some(model))
                    .collect();
                assert!(own.windows(2).all(|w| w[0] < w[1]), "K={k} {order:?}");
            }
            peaks.push(i.store_all_report(32e9).unwrap().peak_bytes);
        }
        let [interleaved, together, apart, given] = peaks[..] else {
            unreachable!()
        };
        eprintln!(
            "K={k}: store-all peak interleaved {interleaved}, forwards then backwards {together}, one after another {apart} (one model {})",
            one.store_all_peak()
        );
        assert!(interleaved <= apart, "K={k}");
        assert!(interleaved < together, "K={k}");
        assert_eq!(given, apart);
        // It is interleaved: some forward node of model 1 runs before model 0's last node.
        let i = m.interleave(Order::Interleaved).unwrap();
        let last_of_0 = (0..one.len()).map(|v| i.position(v)).max().unwrap();
        let first_of_1 = (one.len()..2 * one.len())
            .map(|v| i.position(v))
            .min()
            .unwrap();
        assert!(first_of_1 < last_of_0, "K={k}: model 1 waits for model 0");
    }
}

#[test]
fn algorithm_c_hides_swaps_behind_the_other_model_where_one_model_fits_whole() {
    // Budget 1.1 x one model's store-all peak: one model fits whole (its plan alone has no
    // stall), two copies together do not (twice the static memory on top of one model's
    // activations). MuTWO over the interleaved order swaps, and the copies back overlap the
    // other model's compute; its exposed stall stays under 5% of the step (the issue's
    // goal) and, at 128 GB/s, below MuTWO's over the same two models one after another,
    // where each model's prefetches can hide behind its own backward only.
    let one = gpt(2);
    let m = Multiplexed::union(&[one.clone(), one.clone()]).unwrap();
    let budget = (one.store_all_peak() as f64 * 1.1) as u64;
    for bandwidth in [32e9, 128e9] {
        let request = MultiRequest::mutwo(budget, bandwidth);
        let multiplexed = plan(&m, &request).expect("a plan at 1.1 x one model");
        check(&m, &multiplexed, budget);
        let apart = plan(
            &m,
            &MultiRequest {
                order: Order::OneAfterAnother,
                ..request.clone()
            },
        )
        .expect("a plan one after another");
        check(&m, &apart, budget);
        let alone = plan_each_alone(std::slice::from_ref(&one), &request).unwrap();
        let r = &multiplexed.report;
        let hidden: f64 = multiplexed.swaps.iter().map(|s| s.hidden_by_others()).sum();
        eprintln!(
            "{:.0} GB/s: interleaved stall {:.1} of {:.1} ({:.2}%), {} swaps, {hidden:.1} hidden by the other model; one after another stall {:.1} of {:.1}; one model alone stall {:.1}",
            bandwidth / 1e9,
            r.stall_time,
            r.total_time,
            100.0 * r.stall_time / r.total_time,
            multiplexed.swaps.len(),
            apart.report.stall_time,
            apart.report.total_time,
            alone[0].report.stall_time
        );
        assert!(!multiplexed.swaps.is_empty());
        assert!(hidden > 0.0, "no copy back overlapped the other model");
        assert!(r.stall_time < 0.05 * r.total_time);
        assert_eq!(alone[0].report.stall_time, 0.0);
        if bandwidth >= 128e9 {
            assert!(r.stall_time <= apart.report.stall_time);
            assert!(r.total_time <= apart.report.total_time);
        }
    }
}

#[test]
fn the_general_solver_plans_the_multiplexed_graph_and_keeps_a_fixed_order() {
    let one = gpt(2);
    let free = Multiplexed::union(&[one.clone(), one.clone()]).unwrap();
    // The engine's way in: one combined graph, order-fixed, and a label per node.
    let fixed = Multiplexed::from_labels(
        free.graph().clone().with_fixed_order(),
        free.labels().to_vec(),
    )
    .unwrap();
    let peak = free
        .interleave(Order::Interleaved)
        .unwrap()
        .graph()
        .store_all_peak();
    let budget = peak * 8 / 10;
    for m in [&free, &fixed] {
        let request = MultiRequest {
            time_limit: Some(Duration::from_millis(500)),
            ..MultiRequest::new(budget, 32e9)
        };
        let planned = plan(m, &request).expect("the search plans the combined graph");
        check(m, &planned, budget);
        if m.graph().order_is_fixed() {
            let interleaved = m.interleave(Order::Interleaved).unwrap();
            let computed = first_computations(&planned.plan.steps, m.graph().len());
            assert_eq!(
                computed,
                interleaved.nodes(),
                "the solver left the interleaved order"
            );
            assert!(planned.plan.reorders());
        }
    }
}

#[test]
fn bad_input_is_refused_naming_what_is_wrong() {
    let one = gpt(1);
    let m = Multiplexed::union(&[one.clone(), one.clone()]).unwrap();
    let floor = m.floor();
    assert!(
        floor > one.memory_floor(),
        "the floor counts both models' static memory"
    );
    match plan(&m, &MultiRequest::new(floor - 1, 32e9)) {
        Err(MultiError::BelowFloor {
            budget,
            floor: f,
            models: 2,
        }) => assert_eq!((budget, f), (floor - 1, floor)),
        other => panic!("{other:?}"),
    }
    let text = plan(&m, &MultiRequest::new(floor - 1, 32e9))
        .unwrap_err()
        .to_string();
    assert!(
        text.contains(&floor.to_string()) && text.contains("floor"),
        "{text}"
    );
    let err = Multiplexed::from_labels(one.clone(), vec![Some(0); 3]).unwrap_err();
    assert!(err.to_string().contains(&one.len().to_string()), "{err}");
    let mut labels = vec![Some(0); one.len()];
    labels[0] = Some(2);
    let err = Multiplexed::from_labels(one.clone(), labels).unwrap_err();
    assert_eq!(err, MultiError::EmptyModel { model: 1, last: 2 });
    assert_eq!(Multiplexed::union(&[]).unwrap_err(), MultiError::NoGraphs);
    let bad_strategy = MultiRequest {
        strategy: Some("every:0".into()),
        ..MultiRequest::new(floor * 2, 32e9)
    };
    assert!(matches!(
        plan(&m, &bad_strategy),
        Err(MultiError::Plan { models: 2, .. })
    ));
}

#[test]
fn shared_nodes_of_a_fixed_order_graph_stay_barriers_in_every_plan() {
    // The engine's case: one order-fixed graph with some nodes shared by both models (here
    // each model's `end:step`, the node reading every gradient buffer, marked shared).
    let one = gpt(1);
    let union = Multiplexed::union(&[one.clone(), one.clone()]).unwrap();
    let mut labels = union.labels().to_vec();
    let shared: Vec<NodeId> = (0..union.graph().len())
        .filter(|&v| union.graph().node(v).name.ends_with("end:step"))
        .collect();
    assert_eq!(shared.len(), 2);
    for &v in &shared {
        labels[v] = None;
    }
    let m = Multiplexed::from_labels(union.graph().clone().with_fixed_order(), labels).unwrap();
    let peak = m
        .interleave(Order::Interleaved)
        .unwrap()
        .graph()
        .store_all_peak();
    let budget = peak * 9 / 10;
    for strategy in [Some("mutwo"), None] {
        let request = MultiRequest {
            strategy: strategy.map(str::to_string),
            time_limit: Some(Duration::from_millis(300)),
            ..MultiRequest::new(budget, 64e9)
        };
        let planned = match plan(&m, &request) {
            Ok(p) => p,
            Err(MultiError::Plan { .. }) if strategy.is_some() => continue,
            Err(e) => panic!("{strategy:?}: {e}"),
        };
        check(&m, &planned, budget);
        assert_eq!(planned.models.len(), 3, "two models and the shared row");
        let computed = first_computations(&planned.plan.steps, m.graph().len());
        let pos = |v: NodeId| computed.iter().position(|&c| c == v).unwrap();
        for &s in &shared {
            for v in 0..m.graph().len() {
                // Everything given before a shared node runs before it, everything after it
                // after it.
                assert_eq!(v < s, pos(v) < pos(s), "{strategy:?}: node {v} around {s}");
            }
        }
    }
}
