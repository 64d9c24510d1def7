use super::*;
use crate::ir::{Node, Phase};

fn node(bytes: u64, inputs: Vec<NodeId>) -> Node {
    Node {
        name: format!("n{}", inputs.len()),
        phase: Phase::Forward,
        compute_time: 1.0,
        output_bytes: bytes,
        inputs,
    }
}

/// Two branches a -> a2 and b -> b2 joined by j. Given order a, b, a2, b2, j holds both
/// 100-byte heads at once; finishing branch a first never does.
fn two_branches() -> Graph {
    let nodes = vec![
        node(100, vec![]),
        node(100, vec![]),
        node(1, vec![0]),
        node(1, vec![1]),
        node(1, vec![2, 3]),
    ];
    Graph::new("branches", nodes, 0, 1.0).unwrap()
}

#[test]
fn list_scheduling_finishes_a_branch_first_and_lowers_the_peak() {
    let g = two_branches();
    assert_eq!(g.store_all_peak(), 201);
    let prec = Precedence::of(&g);
    let mut eval = Evaluator::new(&g, 150);
    let order = list_schedule(&g, &prec, 150, TieBreak::GivenOrder);
    assert!(is_valid(&order, &prec));
    let profile = eval.profile(&order, &positions(&order));
    assert_eq!(
        profile,
        Profile {
            excess: 0,
            peak: 102
        }
    );
    let given: Vec<NodeId> = (0..5).collect();
    let profile = eval.profile(&given, &positions(&given));
    assert_eq!(profile.peak, 201);
    assert_eq!(profile.excess, 50 + 51);
    // The renumbered graph has the lower store-all peak itself.
    assert_eq!(reordered(&g, &order).unwrap().store_all_peak(), 102);
}

#[test]
fn local_moves_reach_the_low_peak_from_the_given_order() {
    let g = two_branches();
    let prec = Precedence::of(&g);
    let mut eval = Evaluator::new(&g, 150);
    let mut s = Searched::new((0..5).collect(), &mut eval);
    let mut rng = Rng::new(7);
    assert!(improve(&mut s, &prec, &mut eval, &mut rng, 500, || false));
    assert!(is_valid(&s.order, &prec));
    assert_eq!(s.profile.excess, 0);
    assert!(s.profile.peak <= 150);
}

#[test]
fn annealing_reaches_the_low_peak_and_ends_at_the_best_order_seen() {
    use crate::synth::layered::{LayeredParams, random_layered};
    let g = random_layered(&LayeredParams::moccasin(120), 3).expect("valid parameters");
    let prec = Precedence::of(&g);
    let budget = g.store_all_peak() * 9 / 10;
    let mut eval = Evaluator::new(&g, budget);
    let given: Vec<NodeId> = (0..g.len()).collect();
    let mut s = Searched::new(given, &mut eval);
    let start = s.profile;
    let mut rng = Rng::new(11);
    anneal(&mut s, &prec, &mut eval, &mut rng, 20_000, || false);
    assert!(is_valid(&s.order, &prec));
    // The profile it reports is the order it holds, and no worse than where it began.
    assert_eq!(eval.profile(&s.order, &positions(&s.order)), s.profile);
    assert!(s.profile <= start, "{:?} from {start:?}", s.profile);
    assert_eq!(s.pos, positions(&s.order));
}

/// The window evaluation of a move equals a replay of the whole order, and an undone
/// move leaves every array as it was, on random moves over random layered graphs.
#[test]
fn window_evaluation_equals_full_replay_and_undo_restores() {
    use crate::synth::layered::{LayeredParams, random_layered};
    let mut checked = 0;
    for seed in 0..3 {
        let g = random_layered(&LayeredParams::moccasin(150), seed).expect("valid");
        let prec = Precedence::of(&g);
        let budget = g.store_all_peak() * 85 / 100;
        let mut eval = Evaluator::new(&g, budget);
        let mut s = Searched::new((0..g.len()).collect(), &mut eval);
        let mut rng = Rng::new(seed);
        for _ in 0..2000 {
            let Some((from, to)) = random_move(&s, &prec, &mut rng, g.len()) else {
                continue;
            };
            let before = (s.order.clone(), s.live.clone(), s.after.clone());
            let before_readers = (s.last_reader.clone(), s.freed_by.clone());
            let profile = s.try_shift(from, to, &eval);
            assert!(is_valid(&s.order, &prec));
            assert_eq!(profile, eval.profile(&s.order, &positions(&s.order)));
            let fresh = Searched::new(s.order.clone(), &mut eval);
            assert_eq!((&fresh.live, &fresh.after), (&s.live, &s.after));
            if rng.below(2) == 0 {
                s.profile = profile;
            } else {
                let profile = s.profile;
                s.undo();
                assert_eq!((s.order.clone(), s.live.clone(), s.after.clone()), before);
                assert_eq!((s.last_reader.clone(), s.freed_by.clone()), before_readers);
                assert_eq!(s.pos, positions(&s.order));
                assert_eq!(s.profile, profile);
            }
            checked += 1;
        }
    }
    assert!(checked > 3000, "{checked} moves checked");
}

#[test]
fn fixed_orders_and_pinned_readers_keep_their_order() {
    let g = two_branches().with_fixed_order();
    let prec = Precedence::of(&g);
    for tie in TIE_BREAKS {
        assert_eq!(list_schedule(&g, &prec, 150, tie), vec![0, 1, 2, 3, 4]);
    }
    // p is pinned and read by x (node 2) then y (node 3), which are otherwise free to
    // swap: they stay in that order.
    let nodes = vec![
        node(1, vec![]),
        node(50, vec![]),
        node(1, vec![0]),
        node(1, vec![0, 1]),
    ];
    let g = Graph::new("pins", nodes, 0, 1.0)
        .unwrap()
        .with_pinned([0])
        .unwrap();
    let prec = Precedence::of(&g);
    assert_eq!(prec.preds[3], vec![0, 1, 2]);
    let mut eval = Evaluator::new(&g, 0);
    let mut s = Searched::new(vec![0, 1, 2, 3], &mut eval);
    improve(&mut s, &prec, &mut eval, &mut Rng::new(1), 200, || false);
    assert!(s.pos[2] < s.pos[3], "{:?}", s.order);
    let r = reordered(&g, &[1, 0, 2, 3]).unwrap();
    assert!(r.is_pinned(1) && !r.is_pinned(0));
}
