//! Choosing the mix: the least predicted step time whose predicted peak fits the budget.
//!
//! The predicted peak of a mix (every term measured by [`super::profile()`]; `S<l` is the
//! bytes layers `0..l` keep on the device, `Q_l` layer `l`'s backward peak under its
//! rebuilt subset):
//!
//! ```text
//! max( S<l + forward_l,  S<l + backward_base_l + Q_l   for every layer l,
//!      S<L + head,  tail )
//! ```
//!
//! Every term grows with the earlier layers' kept bytes and depends otherwise on its own
//! layer's choice only, so a dynamic program over the layers in forward order whose state
//! is `S<l` is exact: of two partial mixes, the one keeping no more bytes in no more time
//! is as good for every later layer. The states kept are the Pareto front of (kept bytes,
//! time); each layer's options are the Pareto front of (kept bytes, backward peak, time)
//! over its rebuilt subsets and, per subset, every offload set (itself a front of
//! (offloaded bytes, time) built one candidate at a time). Nothing is rounded.
//!
//! The floor (the least peak any allowed mix reaches) is found by bisection on the budget:
//! at a fixed budget, taking at each layer the fitting option that keeps the fewest bytes
//! is optimal, since every later constraint only grows with the kept bytes.

use std::collections::BTreeMap;

use crate::spec::compile::LayerChoice;

use super::error::MixError;
use super::profile::{MixModel, Profile};

/// One way to run a layer of a class.
#[derive(Debug, Clone, PartialEq)]
struct Option_ {
    kept: u64,
    peak: u64,
    seconds: f64,
    mask: usize,
    offload: Vec<usize>,
}

/// The chosen mix: a choice per layer with its predicted figures.
#[derive(Debug, Clone)]
pub struct Mix {
    pub layers: Vec<LayerMix>,
    /// Predicted pool peak of the step, above what the pool held when it began.
    pub peak: u64,
    /// Predicted step time.
    pub seconds: f64,
}

/// One layer of a [`Mix`].
#[derive(Debug, Clone)]
pub struct LayerMix {
    pub choice: LayerChoice,
    /// Names of the rebuilt units' recipes and of the offloaded candidates.
    pub recomputed: Vec<String>,
    pub offloaded: Vec<String>,
    /// Device bytes kept from forward to backward, and offloaded.
    pub kept: u64,
    pub offloaded_bytes: u64,
    /// Predicted seconds this layer's recomputes and transfers add to the step.
    pub seconds: f64,
}

/// Offload sets of `available` candidates: for each total offloaded, the fastest set.
fn offload_front(
    available: &[usize],
    bytes: &[u64],
    seconds: &[f64],
) -> Vec<(u64, f64, Vec<usize>)> {
    let mut front: Vec<(u64, f64, Vec<usize>)> = vec![(0, 0.0, Vec::new())];
    for &c in available {
        let mut next: BTreeMap<u64, (f64, Vec<usize>)> = BTreeMap::new();
        let with = front.iter().map(|(b, t, set)| {
            let mut set = set.clone();
            set.push(c);
            (b + bytes[c], t + seconds[c], set)
        });
        for (b, t, set) in front.iter().cloned().chain(with) {
            match next.get(&b) {
                Some((best, _)) if *best <= t => {}
                _ => {
                    next.insert(b, (t, set));
                }
            }
        }
        // More offloaded must cost more time to be worth keeping.
        front.clear();
        let mut best = f64::INFINITY;
        for (b, (t, set)) in next.into_iter().rev() {
            if t < best {
                best = t;
                front.push((b, t, set));
            }
        }
        front.reverse();
    }
    front
}

/// Every option of class `c`, less those another beats on kept bytes, peak and time.
fn class_options(profile: &Profile, c: usize) -> Vec<Option_> {
    let class = &profile.classes[c];
    let bytes: Vec<u64> = class.candidates.iter().map(|x| x.bytes).collect();
    let seconds = &profile.transfer_seconds[c];
    let mut all = Vec::new();
    for (mask, subset) in profile.subsets[c].iter().enumerate() {
        let Some(subset) = subset else { continue };
        for (off, t, set) in offload_front(&subset.offloadable, &bytes, seconds) {
            all.push(Option_ {
                kept: subset.saved - off,
                peak: subset.peak,
                seconds: subset.seconds + t,
                mask,
                offload: set,
            });
        }
    }
    all.sort_by(|a, b| {
        (a.peak, a.kept)
            .cmp(&(b.peak, b.kept))
            .then(a.seconds.total_cmp(&b.seconds))
    });
    // A staircase of the options seen so far (no higher peak): kept -> least time.
    let mut stairs: BTreeMap<u64, f64> = BTreeMap::new();
    let mut kept = Vec::new();
    for o in all {
        let beaten = stairs
            .range(..=o.kept)
            .next_back()
            .is_some_and(|(_, &t)| t <= o.seconds);
        if beaten {
            continue;
        }
        stairs.insert(o.kept, o.seconds);
        let dominated: Vec<u64> = stairs
            .range(o.kept + 1..)
            .take_while(|(_, t)| **t >= o.seconds)
            .map(|(k, _)| *k)
            .collect();
        dominated.iter().for_each(|k| {
            stairs.remove(k);
        });
        kept.push(o);
    }
    kept
}

/// A state of the program: bytes kept by the layers so far, time, and how it was reached.
#[derive(Debug, Clone, Copy)]
struct State {
    kept: u64,
    seconds: f64,
    parent: usize,
    option: usize,
}

/// The mix of least predicted time whose predicted peak is at most `budget` (bytes above
/// what the pool holds when the step begins); below the floor, [`MixError::BelowFloor`].
pub fn solve(model: &MixModel, profile: &Profile, budget: u64) -> Result<Mix, MixError> {
    let chosen = pick(profile, budget)?;
    let refs: Vec<&Option_> = chosen.iter().collect();
    Ok(describe(model, profile, &refs))
}

/// The option of each layer in the least-time mix that fits `budget`.
fn pick(profile: &Profile, budget: u64) -> Result<Vec<Option_>, MixError> {
    let options: Vec<Vec<Option_>> = (0..profile.classes.len())
        .map(|c| class_options(profile, c))
        .collect();
    let layers = profile.layer_class.len();
    let mut fronts: Vec<Vec<State>> = Vec::with_capacity(layers + 1);
    fronts.push(vec![State {
        kept: 0,
        seconds: 0.0,
        parent: 0,
        option: 0,
    }]);
    let fits = |a: u64, b: u64| a.checked_add(b).is_some_and(|x| x <= budget);
    for l in 0..layers {
        let opts = &options[profile.layer_class[l]];
        let mut next: BTreeMap<u64, State> = BTreeMap::new();
        for (s, state) in fronts[l].iter().enumerate() {
            if !fits(state.kept, profile.forward[l]) {
                continue;
            }
            let base = state.kept + profile.backward_base[l];
            for (o, opt) in opts.iter().enumerate() {
                if !fits(base, opt.peak) {
                    continue;
                }
                let cand = State {
                    kept: state.kept + opt.kept,
                    seconds: state.seconds + opt.seconds,
                    parent: s,
                    option: o,
                };
                match next.get(&cand.kept) {
                    Some(old) if old.seconds <= cand.seconds => {}
                    _ => {
                        next.insert(cand.kept, cand);
                    }
                }
            }
        }
        let mut front = Vec::with_capacity(next.len());
        let mut best = f64::INFINITY;
        for state in next.into_values() {
            if state.seconds < best {
                best = state.seconds;
                front.push(state);
            }
        }
        fronts.push(front);
    }
    let end = fronts[layers]
        .iter()
        .enumerate()
        .filter(|(_, s)| fits(s.kept, profile.head) && profile.tail <= budget)
        .min_by(|a, b| a.1.seconds.total_cmp(&b.1.seconds))
        .map(|(i, _)| i);
    let Some(mut at) = end else {
        return Err(MixError::BelowFloor {
            budget,
            floor: floor(profile),
        });
    };
    let mut picked = vec![0usize; layers];
    for l in (0..layers).rev() {
        let state = fronts[l + 1][at];
        picked[l] = state.option;
        at = state.parent;
    }
    Ok((0..layers)
        .map(|l| options[profile.layer_class[l]][picked[l]].clone())
        .collect())
}

/// Predicted peak of the options chosen per layer (the formula in the module docs).
fn predicted_peak(profile: &Profile, chosen: &[&Option_]) -> u64 {
    let mut kept = 0u64;
    let mut peak = profile.tail;
    for (l, o) in chosen.iter().enumerate() {
        peak = peak
            .max(kept + profile.forward[l])
            .max(kept + profile.backward_base[l] + o.peak);
        kept += o.kept;
    }
    peak.max(kept + profile.head)
}

fn describe(model: &MixModel, profile: &Profile, chosen: &[&Option_]) -> Mix {
    let mut layers = Vec::with_capacity(chosen.len());
    let mut seconds = profile.base_seconds;
    for (l, o) in chosen.iter().enumerate() {
        let class = &profile.classes[profile.layer_class[l]];
        let resolved = &model.blocks[class.block].resolved;
        let recomputed = class
            .units
            .iter()
            .enumerate()
            .filter(|(bit, _)| o.mask & (1 << bit) != 0)
            .flat_map(|(_, unit)| unit.iter().map(|&r| resolved.recipes[r].key.clone()))
            .collect();
        let offloaded = o
            .offload
            .iter()
            .map(|&c| class.candidates[c].name.clone())
            .collect();
        let offloaded_bytes = o.offload.iter().map(|&c| class.candidates[c].bytes).sum();
        seconds += o.seconds;
        layers.push(LayerMix {
            choice: class.choice(resolved, o.mask, &o.offload),
            recomputed,
            offloaded,
            kept: o.kept,
            offloaded_bytes,
            seconds: o.seconds,
        });
    }
    Mix {
        peak: predicted_peak(profile, chosen),
        layers,
        seconds,
    }
}

/// Whether some allowed mix peaks at most `budget`: at each layer, the fitting option
/// that keeps the fewest bytes (see the module docs).
fn feasible(profile: &Profile, options: &[Vec<Option_>], budget: u64) -> bool {
    if profile.tail > budget {
        return false;
    }
    let mut kept = 0u64;
    for (l, &c) in profile.layer_class.iter().enumerate() {
        if kept + profile.forward[l] > budget {
            return false;
        }
        let base = kept + profile.backward_base[l];
        let Some(least) = options[c]
            .iter()
            .filter(|o| base + o.peak <= budget)
            .map(|o| o.kept)
            .min()
        else {
            return false;
        };
        kept += least;
    }
    kept + profile.head <= budget
}

/// The least predicted peak any allowed mix reaches.
pub fn floor(profile: &Profile) -> u64 {
    let options: Vec<Vec<Option_>> = (0..profile.classes.len())
        .map(|c| class_options(profile, c))
        .collect();
    // Everything kept fits its own peak: an upper end that is feasible.
    let (mut lo, mut hi) = (0u64, u64::MAX / 4);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if feasible(profile, &options, mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::mix::profile::SubsetProfile;
    use crate::spec::mix::units::{Candidate, ClassUnits, Target};

    /// A deterministic pseudo-random stream for the synthetic profiles.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, below: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % below
        }
    }

    /// Two classes (2 and 1 units, 2 and 1 candidates) over `layers` layers, random terms.
    fn synthetic(seed: u64, layers: usize) -> Profile {
        let mut r = Lcg(seed);
        let mut classes = Vec::new();
        let mut subsets = Vec::new();
        let mut transfer = Vec::new();
        for (units, cands) in [(2usize, 2usize), (1, 1)] {
            let candidates: Vec<Candidate> = (0..cands)
                .map(|i| Candidate {
                    target: Target::Slot(i),
                    name: format!("s{i}"),
                    bytes: 10 + r.next(40),
                })
                .collect();
            let saved_all: u64 = 100 + candidates.iter().map(|c| c.bytes).sum::<u64>();
            subsets.push(
                (0..1usize << units)
                    .map(|mask| {
                        // Mask 3 of the first class is not a valid plan.
                        (!(units == 2 && mask == 3)).then(|| SubsetProfile {
                            saved: saved_all - 20 * mask.count_ones() as u64,
                            peak: 50 + r.next(60),
                            seconds: mask.count_ones() as f64 * (1.0 + r.next(5) as f64),
                            offloadable: (0..cands).filter(|&c| c != mask % 2).collect(),
                        })
                    })
                    .collect(),
            );
            transfer.push((0..cands).map(|_| 0.5 + r.next(4) as f64).collect());
            classes.push(ClassUnits {
                block: 0,
                layer: 0,
                units: (0..units).map(|u| vec![u]).collect(),
                candidates,
            });
        }
        Profile {
            classes,
            layer_class: (0..layers).map(|l| l % 2).collect(),
            subsets,
            transfer_seconds: transfer,
            recompute_seconds: vec![Vec::new(); 2],
            forward: (0..layers).map(|_| 80 + r.next(40)).collect(),
            backward_base: (0..layers).map(|_| 30 + r.next(40)).collect(),
            head: 90,
            tail: 60,
            base_seconds: 0.0,
            start: 0,
        }
    }

    /// Every (subset, offload set) of a class, unpruned.
    fn raw_options(profile: &Profile, c: usize) -> Vec<Option_> {
        let mut out = Vec::new();
        for (mask, subset) in profile.subsets[c].iter().enumerate() {
            let Some(subset) = subset else { continue };
            let n = subset.offloadable.len();
            for bits in 0..1usize << n {
                let set: Vec<usize> = (0..n)
                    .filter(|i| bits & (1 << i) != 0)
                    .map(|i| subset.offloadable[i])
                    .collect();
                let off: u64 = set
                    .iter()
                    .map(|&i| profile.classes[c].candidates[i].bytes)
                    .sum();
                let t: f64 = set.iter().map(|&i| profile.transfer_seconds[c][i]).sum();
                out.push(Option_ {
                    kept: subset.saved - off,
                    peak: subset.peak,
                    seconds: subset.seconds + t,
                    mask,
                    offload: set,
                });
            }
        }
        out
    }

    /// Least time and least peak over every combination (no pruning, no program).
    fn brute_force(profile: &Profile, budget: u64) -> (Option<f64>, u64) {
        let per_layer: Vec<Vec<Option_>> = profile
            .layer_class
            .iter()
            .map(|&c| raw_options(profile, c))
            .collect();
        let (mut best, mut least_peak) = (None::<f64>, u64::MAX);
        let mut index = vec![0usize; per_layer.len()];
        loop {
            let chosen: Vec<&Option_> = index.iter().zip(&per_layer).map(|(&i, o)| &o[i]).collect();
            let peak = predicted_peak(profile, &chosen);
            least_peak = least_peak.min(peak);
            let t: f64 = chosen.iter().map(|o| o.seconds).sum();
            if peak <= budget && best.is_none_or(|b| t < b) {
                best = Some(t);
            }
            let mut l = 0;
            while l < index.len() {
                index[l] += 1;
                if index[l] < per_layer[l].len() {
                    break;
                }
                index[l] = 0;
                l += 1;
            }
            if l == index.len() {
                return (best, least_peak);
            }
        }
    }

    /// The program and the floor agree with exhaustive search on random profiles.
    #[test]
    fn solve_and_floor_match_exhaustive_search() {
        for seed in 0..40 {
            let profile = synthetic(seed, 3);
            let floor = floor(&profile);
            let (_, least) = brute_force(&profile, u64::MAX);
            assert_eq!(floor, least, "seed {seed}");
            for budget in [floor, floor + 7, floor + 25, floor + 60, floor + 500] {
                let (best, _) = brute_force(&profile, budget);
                let picked = pick(&profile, budget).unwrap();
                let refs: Vec<&Option_> = picked.iter().collect();
                assert!(predicted_peak(&profile, &refs) <= budget, "seed {seed}");
                let t: f64 = picked.iter().map(|o| o.seconds).sum();
                let best = best.unwrap();
                assert!(
                    (t - best).abs() < 1e-9,
                    "seed {seed} budget {budget}: {t} vs {best}"
                );
            }
            assert!(matches!(
                pick(&profile, floor - 1),
                Err(MixError::BelowFloor { floor: f, .. }) if f == floor
            ));
        }
    }

    #[test]
    fn the_offload_front_keeps_the_fastest_set_per_total() {
        let front = offload_front(&[0, 1, 2], &[10, 10, 20], &[1.0, 3.0, 1.5]);
        let pairs: Vec<(u64, f64)> = front.iter().map(|(b, t, _)| (*b, *t)).collect();
        // 10: candidate 0 (1.0); 20: candidate 2 (1.5); 30: 0+2 (2.5); 40: all (5.5).
        assert_eq!(
            pairs,
            [(0, 0.0), (10, 1.0), (20, 1.5), (30, 2.5), (40, 5.5)]
        );
        assert_eq!(front[3].2, [0, 2]);
    }
}
