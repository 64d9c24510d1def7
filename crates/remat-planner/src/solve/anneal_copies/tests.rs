use super::*;
use crate::synth::layered::{LayeredParams, random_layered};
use std::time::Duration;

/// The excess of a sequence, by full replay.
fn full_excess(graph: &Graph, budget: u64, seq: &[NodeId]) -> u64 {
    State::new(graph, budget, seq.to_vec()).excess
}

/// The stretch evaluation of inserts and deletes equals the full replay, on random
/// moves over random layered graphs, with copies accumulating as the moves apply.
#[test]
fn incremental_excess_equals_full_replay_on_random_moves() {
    let mut checked = 0;
    for seed in 0..4 {
        let g = random_layered(&LayeredParams::moccasin(120), seed).expect("valid");
        let budget = g.store_all_peak() * 85 / 100;
        let mut state = State::new(&g, budget, (0..g.len()).collect());
        let mut rng = Rng::new(seed);
        let mut replay = Replay::new(&g);
        for step in 0..400 {
            let Some(mv) = propose(&state, &mut rng, true) else {
                continue;
            };
            let (_, delta) = evaluate(&state, &mv, &mut replay);
            let mut trial = State::new(&g, budget, state.seq.clone());
            apply(&mut trial, &mv);
            let full = full_excess(&g, budget, &trial.seq);
            assert_eq!(full, trial.excess);
            assert_eq!(
                delta,
                full as i128 - state.excess as i128,
                "seed {seed} step {step}"
            );
            checked += 1;
            // Keep about two moves in three so the sequence grows copies.
            if rng.below(3) > 0 {
                apply(&mut state, &mv);
            }
        }
    }
    assert!(checked > 800, "{checked} moves checked");
}

/// Annealing from the plain order of a random layered graph at 0.9 of its peak ends
/// with a sequence whose schedule replays within the budget, at the time it claims.
#[test]
fn annealed_sequences_replay_within_the_budget() {
    let g = random_layered(&LayeredParams::moccasin(150), 3).expect("valid");
    let budget = g.store_all_peak() * 9 / 10;
    let deadline = Instant::now() + Duration::from_millis(300);
    let (seq, time) =
        anneal(&g, budget, (0..g.len()).collect(), deadline, 7, true).expect("a fitting sequence");
    let steps = steps_of(&g, &Sequence { nodes: seq });
    let report = crate::sim::simulate_steps(&g, &steps, 1.0).expect("a valid schedule");
    assert!(
        report.peak_bytes <= budget,
        "{} > {budget}",
        report.peak_bytes
    );
    assert!((report.recompute_time - time).abs() < 1e-9 * time.max(1.0));
}
