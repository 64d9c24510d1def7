use super::*;
use crate::ir::Node;

/// f0 -> f1 -> f2 -> f3 -> loss -> b3 -> b2 -> b1 -> b0, where b_i reads f_{i-1} (the
/// input of layer i) and the gradient before it. Sizes and times per layer are given.
fn chain(sizes: [u64; 4], times: [f64; 4]) -> Graph {
    let mut nodes: Vec<Node> = (0..4)
        .map(|i| Node {
            name: format!("f{i}"),
            phase: Phase::Forward,
            compute_time: times[i],
            output_bytes: sizes[i],
            inputs: if i == 0 { vec![] } else { vec![i - 1] },
        })
        .collect();
    nodes.push(Node {
        name: "loss".into(),
        phase: Phase::Backward,
        compute_time: 1.0,
        output_bytes: 1,
        inputs: vec![3],
    });
    for k in 0..4 {
        let layer = 3 - k;
        let mut inputs = vec![4 + k];
        if layer > 0 {
            inputs.insert(0, layer - 1);
        }
        nodes.push(Node {
            name: format!("b{layer}"),
            phase: Phase::Backward,
            compute_time: 2.0 * times[layer],
            output_bytes: sizes[layer],
            inputs,
        });
    }
    Graph::new("chain4", nodes, 0, 1.0).unwrap()
}

#[test]
fn recompute_candidate_is_the_best_bytes_per_time() {
    // Activations (idle interval): f0 (f1 .. b1), f1 (f2 .. b2), f2 (f3 .. b3).
    // Bandwidth 1 byte/unit makes every swap cost its size (100s of units), far above any
    // recompute time, so recompute wins. Ratios: f0 100/1, f1 100/4, f2 100/2: f0 first.
    let g = chain([100, 100, 100, 100], [1.0, 4.0, 2.0, 1.0]);
    let problem = Problem {
        graph: &g,
        budget_bytes: 0,
        bandwidth: 1.0,
    };
    let mut s = Scheduler::new(&problem);
    s.measure().unwrap();
    s.step();
    assert_eq!(s.trace, vec![(0, Choice::Recompute)]);
    // Then f2 (ratio 50) before f1 (25).
    s.measure().unwrap();
    s.step();
    assert_eq!(s.trace[1], (2, Choice::Recompute));
}

#[test]
fn a_pinned_candidate_is_swapped_never_recomputed() {
    // As above, f0 has the best recompute ratio; pinned, it is passed over for f2 and
    // f1, and once it is the only candidate left it is swapped however dear the copy.
    let g = chain([100, 100, 100, 100], [1.0, 4.0, 2.0, 1.0])
        .with_pinned([0])
        .unwrap();
    let problem = Problem {
        graph: &g,
        budget_bytes: 0,
        bandwidth: 1.0,
    };
    let mut s = Scheduler::new(&problem);
    while !s.candidates.is_empty() {
        s.measure().unwrap();
        s.step();
    }
    assert_eq!(s.trace[0], (2, Choice::Recompute));
    assert_eq!(s.trace[1], (1, Choice::Recompute));
    assert!(
        matches!(s.trace[2], (0, Choice::Swap { .. })),
        "{:?}",
        s.trace
    );
    // Both strategies' plans at a reachable budget keep f0 computed once.
    let budget = g.store_all_peak() - 1;
    for strategy in [&MuTwo as &dyn Strategy, &MuTwoRefined] {
        let planned = strategy
            .plan(&Problem {
                budget_bytes: budget,
                ..problem
            })
            .unwrap();
        assert_ne!(planned.report.fates[0], crate::sim::Fate::Recomputed);
    }
}

#[test]
fn swap_wins_when_the_copy_hides_behind_backward_compute() {
    // f0's idle interval runs from f1 (1) to b1 (7): loss, b3, b2 (nodes 4, 5, 6) run in
    // between, 1 + 2 + 8 = 11 units before b1 (b2 is 2 x f2's 4 units).
    // At 100 bytes/unit, swapping 100 bytes takes 1 unit: walking back from b1, b2 alone
    // hides it: prompt b2 (6), overhead 0. Recomputing anything costs > 0, so swap wins.
    let g = chain([100, 100, 100, 100], [1.0, 1.0, 4.0, 1.0]);
    let problem = Problem {
        graph: &g,
        budget_bytes: u64::MAX,
        bandwidth: 100.0,
    };
    let mut s = Scheduler::new(&problem);
    s.measure().unwrap();
    assert_eq!(s.swap_overhead(0), (0.0, 6));
    s.step();
    assert_eq!(s.trace, vec![(0, Choice::Swap { prompt: 6 })]);
}

fn problem(g: &Graph, budget_bytes: u64, bandwidth: f64) -> Problem<'_> {
    Problem {
        graph: g,
        budget_bytes,
        bandwidth,
    }
}

// The traces below use `chain` with times [1, 1, 4, 1]: nodes f0 f1 f2 f3 loss b3 b2 b1
// b0 are 0..=8 and take 1 1 4 1 1 2 8 2 2 units. Idle windows (last forward access,
// first backward use): f0 (1, 7), f1 (2, 6), f2 (3, 5). At 100 bytes/unit a tensor of
// S bytes copies in S/100 units.

#[test]
fn case_1a_inside_the_peak_a_swap_used_before_the_last_prompt_pays_its_copy() {
    let g = chain([100, 200, 300, 100], [1.0, 1.0, 4.0, 1.0]);
    let p = problem(&g, u64::MAX, 100.0);
    let mut s = Scheduler::new(&p);
    // f0 is swapped first, prefetched before b1 (7): last_prompt = 7.
    s.apply(0, Choice::Swap { prompt: 7 });
    assert_eq!((s.last_prompt, s.last_swap), (7, Some(0)));
    // Once the peak interval is reached, f1 (used at b2 = 6, before the last prompt 7)
    // cannot hide behind anything and does not meet f0's copy (which starts after its
    // use): case 1(a), overhead = its whole copy (200 bytes = 2 units), prefetched right
    // before its use.
    s.reached_peak = true;
    assert_eq!(s.swap_overhead(1), (2.0, 6));
}

#[test]
fn case_1b_inside_the_peak_a_swap_waits_for_the_copy_in_flight() {
    let g = chain([100, 1200, 300, 100], [1.0, 1.0, 4.0, 1.0]);
    let p = problem(&g, u64::MAX, 100.0);
    let mut s = Scheduler::new(&p);
    // f1 (12 units of copy, used at b2 = 6) is swapped with its prefetch before b3 (5).
    // The prompt update keeps it there: walking back from 5 stops at the current prompt.
    s.apply(1, Choice::Swap { prompt: 5 });
    assert_eq!((s.last_prompt, s.last_swap), (5, Some(1)));
    // In the peak interval, f0 is used at b1 = 7, not before the last prompt 5: case
    // 1(b). f0's copy (1 unit) queues behind f1's, which started at 5; by 7, b3 and b2
    // ran 2 + 8 = 10 units, so 12 - 10 = 2 units of f1's copy remain: 1 + 2 = 3.
    s.reached_peak = true;
    assert_eq!(s.swap_overhead(0), (3.0, 7));
}

#[test]
fn case_3_the_walk_stops_at_the_peak_interval() {
    let g = chain([1500, 100, 100, 100], [1.0, 1.0, 4.0, 1.0]);
    let p = problem(&g, 1000, 100.0);
    let mut s = Scheduler::new(&p);
    // The peak interval: b3 (5) starts above the 1000-byte budget.
    s.node_mem = vec![0; g.len()];
    s.node_mem[5] = 2000;
    // f0 copies in 15 units for its use at b1 (7). Its use is before last_prompt (8,
    // the initial one), so the walk starts at b2 (6): 8 units hide, 7 remain. The next
    // node b3 is in the peak interval: prefetching there would raise the peak, so the
    // walk stops with 7 units exposed and the prompt at b2 (case 3).
    assert_eq!(s.swap_overhead(0), (7.0, 6));
    assert!(s.reached_peak);
    // Every later candidate now takes case 1: f1 (1 unit, used at 6 < 8) pays it all.
    assert_eq!(s.swap_overhead(1), (1.0, 6));
}

#[test]
fn case_2_walk_starts_at_the_last_prompt_when_the_use_comes_after_it() {
    let g = chain([100, 100, 100, 100], [1.0, 1.0, 4.0, 1.0]);
    let p = problem(&g, u64::MAX, 100.0);
    let mut s = Scheduler::new(&p);
    // f1 swapped with its prefetch before b3 (5): b3's 2 units hide its 1-unit copy.
    s.apply(1, Choice::Swap { prompt: 5 });
    assert_eq!(s.last_prompt, 5);
    // f0 is used at b1 (7), after the last prompt: Algorithm C line 35 starts the walk
    // at the last prompt itself, b3 (5), whose 2 units hide f0's 1-unit copy: prompt 5,
    // no overhead (starting one node earlier would put the prompt at the loss, 4).
    assert_eq!(s.swap_overhead(0), (0.0, 5));
}

#[test]
fn a_recomputation_in_the_prefetch_window_moves_the_prompt_later() {
    let g = chain([900, 100, 100, 100], [1.0, 1.0, 4.0, 1.0]);
    let p = problem(&g, u64::MAX, 100.0);
    let mut s = Scheduler::new(&p);
    // f0's copy takes 9 units: b2 (6) hides 8, b3 (5) the last one: prompt 5.
    assert_eq!(s.swap_overhead(0), (0.0, 5));
    s.apply(0, Choice::Swap { prompt: 5 });
    assert_eq!(s.last_prompt, 5);
    // Recomputing f1 runs its producer (1 unit) just before b2: b2 plus that
    // recomputation now hide 8 + 1 = 9 units, so f0's prefetch can start at b2 (6),
    // holding its bytes one node less, and last_prompt follows it.
    s.recomps.push(1);
    s.decisions[1] = Decision::Recompute {
        from: vec![0],
        drop_after: 2,
        use_at: 6,
    };
    s.update_swap_prompts();
    assert!(matches!(
        s.decisions[0],
        Decision::Swap { prefetch_at: 6, .. }
    ));
    assert_eq!(s.last_prompt, 6);
}

#[test]
fn a_swap_still_copying_out_in_the_peak_interval_is_not_taken() {
    // f0 (1500 bytes, 15 units of copy) is swapped out after f1 (1) ends at time 2, so
    // its copy runs until 17: nodes 2 .. 6 (starting at 2, 6, 7, 8, 10) still hold it.
    let g = chain([1500, 100, 100, 100], [1.0, 1.0, 4.0, 1.0]);
    let p = problem(&g, 1000, 100.0);
    let mut s = Scheduler::new(&p);
    s.node_mem = vec![0; g.len()];
    assert!(s.copy_out_clears_peak(0));
    // Over budget at f3 (3, starting at 6): swapping f0 frees nothing there.
    s.node_mem[3] = 2000;
    assert!(!s.copy_out_clears_peak(0));
    // Over budget at b1 (7, starting at 18): the copy is done by then.
    s.node_mem[3] = 0;
    s.node_mem[7] = 2000;
    assert!(s.copy_out_clears_peak(0));
}

#[test]
fn recomputing_a_source_updates_later_candidates() {
    // Recompute f1 first (ratio 100/1, the best). Algorithm F: f2's source f1 is gone, so
    // f2 is rebuilt from f0 and its recompute time grows by f1's: 1 + 1 = 2.
    let g = chain([10, 100, 10, 10], [1.0, 1.0, 1.0, 1.0]);
    let problem = Problem {
        graph: &g,
        budget_bytes: 0,
        bandwidth: 1e-3,
    };
    let mut s = Scheduler::new(&problem);
    s.measure().unwrap();
    s.step();
    assert_eq!(s.trace, vec![(1, Choice::Recompute)]);
    assert_eq!(s.attrs[2].recomp_srcs, vec![0]);
    assert_eq!(s.attrs[2].recomp_time, 2.0);
    // Algorithm E: recomputing f0 next would make f1's recomputation start from f0's
    // sources (none: f0 is the input) and cost f0's time too.
    s.recomps.push(0);
    let cnt = s.update_recomps(0);
    assert_eq!(cnt, 2);
    assert_eq!(s.attrs[1].recomp_time, 2.0);
}

#[test]
fn refinement_never_loses_to_mutwo() {
    let g = chain([100, 300, 50, 200], [1.0, 4.0, 2.0, 3.0]);
    let mut compared = 0;
    for budget in [
        g.store_all_peak() - 1,
        g.memory_floor() + 100,
        g.memory_floor() + 300,
    ] {
        for bandwidth in [1.0, 100.0] {
            let problem = Problem {
                graph: &g,
                budget_bytes: budget,
                bandwidth,
            };
            let (Ok(plain), Ok(refined)) = (MuTwo.plan(&problem), MuTwoRefined.plan(&problem))
            else {
                continue;
            };
            assert!(refined.report.total_time <= plain.report.total_time);
            assert!(refined.report.peak_bytes <= budget);
            compared += 1;
        }
    }
    assert!(compared >= 4, "only {compared} budgets planned");
}

#[test]
fn stops_as_soon_as_the_peak_fits_and_reports_the_smallest_peak() {
    let g = chain([100, 100, 100, 100], [1.0, 4.0, 2.0, 1.0]);
    let store_all = g.store_all_peak();
    let problem = Problem {
        graph: &g,
        budget_bytes: store_all - 1,
        bandwidth: 1.0,
    };
    let planned = MuTwo.plan(&problem).unwrap();
    // Store-all peaks at 401 bytes while the loss runs (f0..f3 and the loss) and again
    // while b3 runs (f0..f2, the loss, b3). Recomputing f0, the first choice (ratio
    // 100/1), leaves 301 there and no higher peak (b1: the rebuilt f0, b2, b1 = 300):
    // one step fits the 400-byte budget, so it is the only tensor dropped.
    assert_eq!(store_all, 401);
    assert_eq!(planned.report.peak_bytes, 301);
    assert_eq!(planned.report.recompute_time, 1.0);
    let dropped: Vec<NodeId> = (0..g.len())
        .filter(|&t| planned.plan.decisions[t] != Decision::Keep)
        .collect();
    assert_eq!(dropped, vec![0]);
    let impossible = Problem {
        budget_bytes: 1,
        ..problem
    };
    match MuTwo.plan(&impossible) {
        Err(PlanError::OverBudget { best_peak, .. }) => {
            assert!(best_peak >= g.memory_floor() && best_peak < store_all)
        }
        other => panic!("{other:?}"),
    }
}
