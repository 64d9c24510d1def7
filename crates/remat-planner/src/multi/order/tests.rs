use super::super::graph::tests::tiny;
use super::*;
use crate::sim::simulate_steps;

/// Whether `order` is a permutation in which every input comes before its reader.
pub(crate) fn is_topological(g: &Graph, order: &[NodeId]) -> bool {
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

fn names(m: &Multiplexed, order: Order) -> Vec<String> {
    let i = m.interleave(order).unwrap();
    i.nodes()
        .iter()
        .map(|&v| m.graph().node(v).name.clone())
        .collect()
}

/// f0 -> f1 -> f2 -> loss -> b2 -> b1 -> b0: activations of `act` bytes, gradients (and
/// the loss) of 1 byte; b_i reads f_i and the gradient after it. Forward nodes take 1
/// unit, backward 2. The model's own backward frees its activations one by one.
pub(crate) fn layers3(name: &str, act: u64, static_bytes: u64) -> Graph {
    let node = |n: String, phase, bytes, inputs: Vec<NodeId>| Node {
        name: n,
        phase,
        compute_time: if phase == Phase::Forward { 1.0 } else { 2.0 },
        output_bytes: bytes,
        inputs,
    };
    let mut nodes: Vec<Node> = (0..3)
        .map(|i| {
            node(
                format!("f{i}"),
                Phase::Forward,
                act,
                (0..i).rev().take(1).collect(),
            )
        })
        .collect();
    nodes.push(node("loss".into(), Phase::Backward, 1, vec![2]));
    for i in (0..3).rev() {
        nodes.push(node(format!("b{i}"), Phase::Backward, 1, vec![i, 5 - i]));
    }
    Graph::new(name, nodes, static_bytes, 1.0).unwrap()
}

#[test]
fn the_orders_of_two_models_by_hand() {
    let m = Multiplexed::union(&[layers3("a", 10, 5), layers3("b", 10, 5)]).unwrap();
    let model = |k: usize, names: &[&str]| -> Vec<String> {
        names.iter().map(|n| format!("m{k}/{n}")).collect()
    };
    let (fw, bw) = (["f0", "f1", "f2"], ["loss", "b2", "b1", "b0"]);
    let apart = [model(0, &fw), model(0, &bw), model(1, &fw), model(1, &bw)].concat();
    assert_eq!(names(&m, Order::OneAfterAnother), apart);
    let together = [model(0, &fw), model(1, &fw), model(0, &bw), model(1, &bw)].concat();
    assert_eq!(names(&m, Order::ForwardsThenBackwards), together);
    // Model 0's own run holds 30 bytes at the end of its forward; before its b1 it holds
    // 21 (30% freed), before b0 11 (63% freed). Model 1's f0 brings it to 33% of its
    // forward, so it runs between model 0's b1 and b0, then its f1 (67%) after b0.
    let interleaved = [
        model(0, &fw),
        model(0, &["loss", "b2", "b1"]),
        model(1, &["f0"]),
        model(0, &["b0"]),
        model(1, &["f1", "f2"]),
        model(1, &bw),
    ]
    .concat();
    assert_eq!(names(&m, Order::Interleaved), interleaved);
}

#[test]
fn interleaving_costs_no_more_memory_than_one_after_another() {
    // One model's peak: f0 f1 f2, the loss and b2 = 32 bytes, plus both models' static
    // 10. Forwards then backwards: both forwards (60), then model 0's loss and b2 = 72.
    // Interleaved: model 1's f0 joins model 0's f0 and b1 (21 bytes), under the cap.
    let m = Multiplexed::union(&[layers3("a", 10, 5), layers3("b", 10, 5)]).unwrap();
    let peak = |o| {
        m.interleave(o)
            .unwrap()
            .store_all_report(1.0)
            .unwrap()
            .peak_bytes
    };
    assert_eq!(peak(Order::OneAfterAnother), 42);
    assert_eq!(peak(Order::ForwardsThenBackwards), 72);
    assert_eq!(peak(Order::Interleaved), 42);
    assert_eq!(peak(Order::AsGiven), 42);
}

#[test]
fn every_order_is_topological_and_replays_on_the_given_graph() {
    let m = Multiplexed::union(&[
        tiny("a", 10, 5),
        layers3("b", 30, 5),
        tiny("c", 20, 1),
        layers3("d", 10, 0),
    ])
    .unwrap();
    for order in Order::ALL {
        let i = m.interleave(order).unwrap();
        assert!(is_topological(m.graph(), i.nodes()), "{order:?}");
        let on_given = simulate_steps(m.graph(), &i.store_all_steps(), 1e3).unwrap();
        let on_renumbered = i.store_all_report(1e3).unwrap();
        assert_eq!(on_given.peak_bytes, on_renumbered.peak_bytes);
        assert_eq!(on_given.total_time, on_renumbered.total_time);
        assert_eq!(i.graph().store_all_peak(), on_given.peak_bytes);
        // Each model's nodes keep their order.
        for model in 0..4 {
            let own: Vec<usize> = i
                .nodes()
                .iter()
                .copied()
                .filter(|&v| m.label(v) == Some(model))
                .collect();
            assert!(own.windows(2).all(|w| w[0] < w[1]), "{order:?}");
        }
    }
    assert!(!m.interleave(Order::AsGiven).unwrap().reorders());
    assert!(
        m.interleave(Order::Interleaved).unwrap().reorders(),
        "{:?}",
        names(&m, Order::Interleaved)
    );
}

#[test]
fn shared_nodes_are_barriers_in_a_fixed_order_graph() {
    // Model 0: a0 -> a1 -> ab; model 1: b0 -> b1 -> bb; a shared node s reads a0 and b0
    // and is read by bb. Given order: a0 b0 a1 s b1 ab bb.
    let n = |name: &str, phase, inputs: Vec<NodeId>| Node {
        name: name.into(),
        phase,
        compute_time: 1.0,
        output_bytes: 1,
        inputs,
    };
    let nodes = vec![
        n("a0", Phase::Forward, vec![]),
        n("b0", Phase::Forward, vec![]),
        n("a1", Phase::Forward, vec![0]),
        n("s", Phase::Forward, vec![0, 1]),
        n("b1", Phase::Forward, vec![1]),
        n("ab", Phase::Backward, vec![2]),
        n("bb", Phase::Backward, vec![4, 3]),
    ];
    let labels = vec![Some(0), Some(1), Some(0), None, Some(1), Some(0), Some(1)];
    let g = Graph::new("g", nodes, 0, 1.0).unwrap();
    let free = Multiplexed::from_labels(g.clone(), labels.clone()).unwrap();
    let fixed = Multiplexed::from_labels(g.with_fixed_order(), labels).unwrap();
    for m in [&free, &fixed] {
        for order in Order::ALL {
            let i = m.interleave(order).unwrap();
            assert!(is_topological(m.graph(), i.nodes()));
            assert_eq!(i.graph().order_is_fixed(), m.graph().order_is_fixed());
        }
    }
    let order = |m: &Multiplexed| {
        m.interleave(Order::OneAfterAnother)
            .unwrap()
            .nodes()
            .to_vec()
    };
    // Unfixed, model 0's whole step (a0 a1 ab) runs first; s waits only for its inputs.
    assert_eq!(order(&free), [0, 2, 5, 1, 3, 4, 6]);
    // Fixed, ab (given after s) waits for s, which waits for b0 (given before it).
    assert_eq!(order(&fixed), [0, 2, 1, 3, 5, 4, 6]);
}
