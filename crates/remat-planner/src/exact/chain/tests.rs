use super::*;
use crate::exact::revolve::min_forward_steps;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

#[test]
fn dp_reaches_the_binomial_optimum() {
    // Griewank's model for every chain length up to 64 and 1..=8 snapshots.
    for steps in 1..=64usize {
        for snapshots in 0..=8usize {
            let got = solve_chain(&RevolveChain { steps }, snapshots);
            let want = min_forward_steps(steps as u64, snapshots as u64);
            match (got, want) {
                (Ok(sol), Some(t)) => {
                    assert_eq!(sol.time, t as f64, "l={steps} c={snapshots}");
                    assert_revolve_schedule(steps, snapshots, &sol);
                }
                (Err(ChainError::Infeasible { .. }), None) => {}
                (got, want) => {
                    panic!("l={steps} c={snapshots}: dp {got:?} vs closed form {want:?}")
                }
            }
        }
    }
}

/// Replays a Revolve schedule: the adjoint of step t needs x_{t-1} (x_0 always there),
/// snapshots other than the working state never exceed c, every forward counted once.
fn assert_revolve_schedule(steps: usize, snapshots: usize, sol: &ChainSolution) {
    let mut resident = vec![false; steps + 1];
    resident[0] = true;
    let mut forwards = 0usize;
    let mut next = steps;
    for step in &sol.steps {
        match *step {
            ChainStep::Forward(k) => {
                assert!(resident[k - 1], "F{k} without x{}", k - 1);
                resident[k] = true;
                forwards += 1;
            }
            ChainStep::Free(k) => {
                assert!(resident[k], "free of absent x{k}");
                resident[k] = false;
            }
            ChainStep::Backward(t) => {
                assert_eq!(t, next, "groups out of order");
                assert!(resident[t - 1], "B{t} without x{}", t - 1);
                next -= 1;
            }
        }
        // Advancing is in place in Griewank's model (the step and its free are one move), so
        // count after frees and adjoints: the working state plus at most c snapshots.
        if !matches!(step, ChainStep::Forward(_)) {
            let held = resident.iter().filter(|r| **r).count();
            assert!(
                held <= snapshots + 1,
                "{held} states held with {snapshots} snapshots"
            );
        }
    }
    assert_eq!(next, 0, "not every group ran");
    assert_eq!(forwards as f64, sol.time);
}

/// A tiny deterministic generator (xorshift) so the test needs no dependency.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn random_chain(rng: &mut Rng, n: usize) -> ByteChain {
    let mut chain = ByteChain {
        state_bytes: vec![0],
        fwd_time: vec![0.0],
        bwd_time: vec![0.0],
        reads_output: vec![false],
        grad_live_before: vec![0],
        grad_peak_during: vec![0],
        unit_bytes: 1,
    };
    for t in 1..=n {
        chain.state_bytes.push(1 + rng.below(4));
        chain.fwd_time.push((1 + rng.below(5)) as f64);
        chain.bwd_time.push((1 + rng.below(5)) as f64);
        chain.reads_output.push(rng.below(4) != 0);
        chain
            .grad_live_before
            .push(if t == n { 0 } else { rng.below(3) });
        chain.grad_peak_during.push(1 + rng.below(3));
    }
    chain
}

/// Exhaustive search over every schedule (any order of forwards, frees and the fixed order
/// of backward groups), by Dijkstra on (resident set, next group).
fn brute_force(chain: &ByteChain, budget: u64) -> Option<u64> {
    let n = chain.stages();
    let bytes_of = |mask: u32| -> u64 {
        chain.state_bytes[0]
            + (1..=n)
                .filter(|k| mask >> (k - 1) & 1 == 1)
                .map(|k| chain.state_bytes[k])
                .sum::<u64>()
    };
    let has = |mask: u32, k: usize| k == 0 || mask >> (k - 1) & 1 == 1;
    let mut best = vec![u64::MAX; (1usize << n) * (n + 1)];
    let mut heap = BinaryHeap::new();
    heap.push(Reverse((0u64, 0u32, n)));
    while let Some(Reverse((cost, mask, next))) = heap.pop() {
        if next == 0 {
            return Some(cost);
        }
        let slot = mask as usize * (n + 1) + next;
        if best[slot] <= cost && best[slot] != u64::MAX {
            continue;
        }
        best[slot] = cost;
        let resident = bytes_of(mask);
        let mut push = |c: u64, m: u32, nx: usize| heap.push(Reverse((c, m, nx)));
        for k in 1..=n {
            if has(mask, k) {
                push(cost, mask & !(1 << (k - 1)), next);
            } else if has(mask, k - 1)
                && resident + chain.state_bytes[k] + chain.grad_live_before[next] <= budget
            {
                push(cost + chain.fwd_time[k] as u64, mask | 1 << (k - 1), next);
            }
        }
        let t = next;
        let inputs = has(mask, t - 1) && (!chain.reads_output[t] || has(mask, t));
        if inputs && resident + chain.grad_peak_during[t] <= budget {
            push(cost + chain.bwd_time[t] as u64, mask, t - 1);
        }
    }
    None
}

/// Replays a DP schedule under the brute force's rules; returns (time, peak bytes).
fn replay(chain: &ByteChain, steps: &[ChainStep]) -> (f64, u64) {
    let n = chain.stages();
    let mut resident = vec![false; n + 1];
    resident[0] = true;
    let held = |r: &[bool]| -> u64 {
        (0..=n)
            .filter(|k| r[*k])
            .map(|k| chain.state_bytes[k])
            .sum()
    };
    let (mut time, mut peak, mut next) = (0.0, 0u64, n);
    for step in steps {
        match *step {
            ChainStep::Forward(k) => {
                assert!(resident[k - 1] && !resident[k], "F{k} invalid");
                peak =
                    peak.max(held(&resident) + chain.state_bytes[k] + chain.grad_live_before[next]);
                resident[k] = true;
                time += chain.fwd_time[k];
            }
            ChainStep::Free(k) => {
                assert!(resident[k], "free x{k} invalid");
                resident[k] = false;
            }
            ChainStep::Backward(t) => {
                assert_eq!(t, next);
                assert!(
                    resident[t - 1] && (!chain.reads_output[t] || resident[t]),
                    "B{t} inputs"
                );
                peak = peak.max(held(&resident) + chain.grad_peak_during[t]);
                time += chain.bwd_time[t];
                next -= 1;
            }
        }
    }
    assert_eq!(next, 0);
    (time, peak)
}

#[test]
fn dp_matches_exhaustive_search_on_small_heterogeneous_chains() {
    // The DP is optimal among persistent schedules (a kept state stays until its interval is
    // done, as in Rotor). The exhaustive search also finds non-persistent ones, which can win
    // when backward groups are memory-heavy: e.g. use x1 to recompute x2, drop x1 to make room
    // for G3, recompute x1 afterwards. So the DP is never better than the search, matches it
    // in the vast majority of cases, and its schedules always replay within the budget.
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut feasible, mut equal) = (0, 0);
    for case in 0..400 {
        let n = 1 + case % 6;
        let chain = random_chain(&mut rng, n);
        let total: u64 = chain.state_bytes.iter().sum::<u64>() + 6;
        let budget = rng.below(total + 1);
        let want = brute_force(&chain, budget);
        match solve_chain(&chain, chain.budget_units(budget)) {
            Ok(sol) => {
                let best = want.unwrap_or_else(|| {
                    panic!("case {case}: dp solved what exhaustive search cannot")
                });
                feasible += 1;
                assert!(
                    sol.time >= best as f64,
                    "case {case}: dp {} beats exhaustive {best}",
                    sol.time
                );
                equal += usize::from(sol.time == best as f64);
                let (time, peak) = replay(&chain, &sol.steps);
                assert_eq!(time, sol.time, "case {case}");
                assert!(peak <= budget, "case {case}: peak {peak} > {budget}");
            }
            Err(ChainError::Infeasible { .. }) => feasible += usize::from(want.is_some()),
            Err(e) => panic!("case {case}: {e}"),
        }
    }
    eprintln!("chain dp: optimal in {equal} of {feasible} feasible random chains");
    assert!(
        feasible > 100,
        "too few feasible cases ({feasible}) to mean anything"
    );
    assert!(
        equal * 100 >= feasible * 95,
        "dp optimal in only {equal} of {feasible} cases"
    );
}

#[test]
fn unlimited_memory_computes_each_state_once() {
    let mut rng = Rng(7);
    let chain = random_chain(&mut rng, 12);
    let sol = solve_chain(&chain, 1000).unwrap();
    let base: f64 = chain.fwd_time.iter().sum::<f64>() + chain.bwd_time.iter().sum::<f64>();
    assert_eq!(sol.time, base);
    assert_eq!(sol.recomputations, 0);
}

#[test]
fn oversized_tables_are_refused() {
    let err = solve_chain(&RevolveChain { steps: 4000 }, 4).unwrap_err();
    assert!(matches!(err, ChainError::TooLarge { .. }), "{err}");
}
