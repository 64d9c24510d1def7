use super::*;
use crate::pipeline::activation::HostTensor;

type Manager = CheckpointManager<HostTensor, HostTensor>;

/// An f32 activation of `len` elements (4 * len bytes) whose values identify `tag`.
fn act(len: usize, tag: f32) -> HostTensor {
    let data = (0..len).map(|i| tag + i as f32 * 0.5).collect();
    HostTensor::f32(vec![len], data).unwrap()
}

/// Offers every micro-batch an activation of `len` elements, in order; returns what is stored.
fn run_all(manager: &mut Manager, len: usize) -> Vec<usize> {
    for i in 0..manager.micro_batches() {
        manager.store(i, &act(len, i as f32)).unwrap();
    }
    manager.entries().map(|m| m.micro_batch).collect()
}

fn stored_with(strategy: Strategy, micro_batches: usize) -> Vec<usize> {
    run_all(&mut Manager::new(strategy, micro_batches), 4)
}

#[test]
fn store_all_and_recompute_all() {
    assert_eq!(stored_with(Strategy::StoreAll, 5), vec![0, 1, 2, 3, 4]);
    let mut m = Manager::new(Strategy::RecomputeAll, 5);
    assert_eq!(run_all(&mut m, 4), Vec::<usize>::new());
    assert_eq!(m.stats().declines, 5);
    assert_eq!(m.memory_estimate(), 0);
}

#[test]
fn selective_stores_multiples_of_the_interval_and_first_and_last() {
    let sel = |interval| Strategy::Selective { interval };
    assert_eq!(stored_with(sel(3), 10), vec![0, 3, 6, 9]);
    assert_eq!(stored_with(sel(3), 8), vec![0, 3, 6, 7]);
    assert_eq!(stored_with(sel(1), 4), vec![0, 1, 2, 3]);
    assert_eq!(stored_with(sel(100), 6), vec![0, 5]);
    assert_eq!(stored_with(sel(4), 1), vec![0]);
}

#[test]
fn selective_interval_zero_stores_all() {
    assert_eq!(
        stored_with(Strategy::Selective { interval: 0 }, 6),
        vec![0, 1, 2, 3, 4, 5]
    );
}

#[test]
fn memory_based_with_a_huge_threshold_stores_all() {
    let strategy = Strategy::MemoryBased {
        threshold_bytes: usize::MAX / 2,
    };
    let mut m = Manager::new(strategy, 7);
    assert_eq!(run_all(&mut m, 16), (0..7).collect::<Vec<_>>());
    assert_eq!(m.stats().evictions, 0);
    assert_eq!(m.stored_bytes(), 7 * 64);
}

#[test]
fn memory_based_with_a_tiny_threshold_keeps_only_first_and_last() {
    for threshold_bytes in [0, 1, 63] {
        let mut m = Manager::new(Strategy::MemoryBased { threshold_bytes }, 6);
        assert_eq!(
            run_all(&mut m, 16),
            vec![0, 5],
            "threshold {threshold_bytes}"
        );
        assert_eq!(m.stats().evictions, 0);
        assert_eq!(m.stats().declines, 4);
    }
}

#[test]
fn memory_based_evicts_the_oldest_but_never_first_or_last() {
    // Each activation is 64 bytes; room for three.
    let mut m = Manager::new(
        Strategy::MemoryBased {
            threshold_bytes: 192,
        },
        6,
    );
    let mut evictions = Vec::new();
    for i in 0..6 {
        match m.store(i, &act(16, i as f32)).unwrap() {
            StoreOutcome::Stored { evicted } => evictions.push(evicted),
            StoreOutcome::Declined => panic!("micro-batch {i} declined"),
        }
    }
    // 0 is pinned, so 3 evicts 1, 4 evicts 2, and the last (pinned) evicts 3.
    assert_eq!(
        evictions,
        vec![vec![], vec![], vec![], vec![1], vec![2], vec![3]]
    );
    assert_eq!(
        m.entries().map(|e| e.micro_batch).collect::<Vec<_>>(),
        vec![0, 4, 5]
    );
    assert_eq!(m.stored_bytes(), 192);
    assert_eq!(m.stats().peak_stored_bytes, 192);
}

#[test]
fn memory_based_threshold_is_inclusive() {
    let mut exact = Manager::new(
        Strategy::MemoryBased {
            threshold_bytes: 128,
        },
        4,
    );
    exact.store(0, &act(16, 0.0)).unwrap();
    exact.store(1, &act(16, 1.0)).unwrap();
    assert_eq!(exact.stats().evictions, 0);
    let mut short = Manager::new(
        Strategy::MemoryBased {
            threshold_bytes: 127,
        },
        4,
    );
    short.store(0, &act(16, 0.0)).unwrap();
    assert_eq!(
        short.store(1, &act(16, 1.0)).unwrap(),
        StoreOutcome::Declined
    );
}

#[test]
fn memory_based_declines_without_evicting_when_it_could_never_fit() {
    let mut m = Manager::new(
        Strategy::MemoryBased {
            threshold_bytes: 200,
        },
        5,
    );
    m.store(0, &act(16, 0.0)).unwrap();
    m.store(1, &act(16, 1.0)).unwrap();
    assert!(!m.should_checkpoint(2, 160).unwrap());
    assert_eq!(m.store(2, &act(40, 2.0)).unwrap(), StoreOutcome::Declined);
    assert!(
        m.has(1),
        "nothing may be evicted for an activation that is declined anyway"
    );
    assert!(m.should_checkpoint(2, 136).unwrap());
}

#[test]
fn pinned_newcomer_is_stored_even_beyond_the_threshold() {
    let mut m = Manager::new(
        Strategy::MemoryBased {
            threshold_bytes: 100,
        },
        3,
    );
    m.store(0, &act(16, 0.0)).unwrap();
    m.store(1, &act(4, 1.0)).unwrap();
    let outcome = m.store(2, &act(16, 2.0)).unwrap();
    assert_eq!(outcome, StoreOutcome::Stored { evicted: vec![1] });
    assert_eq!(m.stored_bytes(), 128);
}

#[test]
fn storing_an_index_twice_replaces_entry_and_accounting() {
    let mut m = Manager::new(Strategy::StoreAll, 3);
    m.store(1, &act(16, 1.0)).unwrap();
    m.store(2, &act(8, 2.0)).unwrap();
    let first_time = m.metadata(1).unwrap().stored_at;
    let replacement = HostTensor::f32(vec![2, 3], vec![9.0; 6]).unwrap();
    m.store(1, &replacement).unwrap();
    assert_eq!(m.count(), 2);
    assert_eq!(m.stored_bytes(), 24 + 32);
    let meta = m.metadata(1).unwrap();
    assert_eq!((meta.bytes, meta.shape.clone()), (24, vec![2, 3]));
    assert!(meta.stored_at >= first_time);
    assert_eq!(m.get(1), Some(&replacement));
    assert_eq!(m.stats().replacements, 1);
}

#[test]
fn a_replaced_entry_becomes_the_newest_for_eviction() {
    let mut m = Manager::new(
        Strategy::MemoryBased {
            threshold_bytes: 192,
        },
        6,
    );
    m.store(0, &act(16, 0.0)).unwrap();
    m.store(1, &act(16, 1.0)).unwrap();
    m.store(2, &act(16, 2.0)).unwrap();
    m.store(1, &act(16, 1.5)).unwrap();
    let outcome = m.store(3, &act(16, 3.0)).unwrap();
    assert_eq!(outcome, StoreOutcome::Stored { evicted: vec![2] });
}

#[test]
fn a_declined_replacement_drops_the_stale_entry() {
    let mut m = Manager::new(
        Strategy::MemoryBased {
            threshold_bytes: 64,
        },
        4,
    );
    m.store(1, &act(16, 1.0)).unwrap();
    assert_eq!(m.store(1, &act(32, 1.0)).unwrap(), StoreOutcome::Declined);
    assert!(!m.has(1));
    assert_eq!((m.stored_bytes(), m.stats().replacements), (0, 1));
}

#[test]
fn store_keeps_a_copy_isolated_from_later_changes() {
    let mut m = Manager::new(Strategy::StoreAll, 2);
    let mut live = act(8, 3.0);
    let snapshot = live.clone();
    m.store(0, &live).unwrap();
    if let crate::pipeline::activation::HostData::F32(v) = &mut live.data {
        v.iter_mut().for_each(|x| *x = -1.0);
    }
    assert_eq!(m.get(0), Some(&snapshot));
}

#[test]
fn zero_micro_batches() {
    let mut m = Manager::new(Strategy::StoreAll, 0);
    assert!(matches!(
        m.should_checkpoint(0, 4),
        Err(CheckpointError::IndexOutOfRange {
            index: 0,
            micro_batches: 0
        })
    ));
    assert!(m.store(0, &act(1, 0.0)).is_err());
    assert!(m.keep_input(0, act(1, 0.0)).is_err());
    assert_eq!((m.count(), m.memory_estimate()), (0, 0));
    assert_eq!(run_all(&mut m, 4), Vec::<usize>::new());
    m.clear();
    assert_eq!(m.entries().count(), 0);
}

#[test]
fn out_of_range_error_names_the_index_and_count() {
    let m = Manager::new(Strategy::Selective { interval: 2 }, 4);
    let err = m.should_checkpoint(4, 16).unwrap_err();
    assert_eq!(
        err.to_string(),
        "micro-batch 4 is out of range: this stage's checkpoint manager was built for 4 micro-batches"
    );
}

/// A deterministic stand-in for a stage's forward pass.
fn forward(input: &HostTensor) -> Result<HostTensor, CheckpointError> {
    let x = input.as_f32().unwrap();
    let y = x.iter().map(|v| (v * 1.7 + 0.3).tanh() * v).collect();
    Ok(HostTensor::f32(input.shape.clone(), y).unwrap())
}

#[test]
fn recompute_from_the_kept_input_equals_the_stored_activation_bit_for_bit() {
    let mut m = Manager::new(Strategy::Selective { interval: 2 }, 3);
    for i in 0..3 {
        let input = act(32, i as f32 * 0.37);
        let out = forward(&input).unwrap();
        m.keep_input(i, input).unwrap();
        m.store(i, &out).unwrap();
    }
    assert!(!m.has(1));
    for i in [0, 2] {
        let stored = m.get(i).unwrap().clone();
        let again = m.recompute(i, forward).unwrap();
        let bits = |t: &HostTensor| {
            t.as_f32()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&stored), bits(&again));
    }
    let fetched = m.get_or_compute(1, forward).unwrap();
    assert!(fetched.was_recomputed());
    assert_eq!(*fetched, forward(&act(32, 0.37)).unwrap());
    assert!(!m.get_or_compute(0, forward).unwrap().was_recomputed());
    assert_eq!(m.stats().recomputes, 3);
    assert!(!m.has(1), "a recomputed activation is not stored");
}

#[test]
fn recompute_without_a_kept_input_is_an_error() {
    let mut m = Manager::new(Strategy::RecomputeAll, 2);
    let err = m.recompute(1, forward).unwrap_err();
    assert!(matches!(err, CheckpointError::MissingInput { index: 1 }));
    assert_eq!(
        err.to_string(),
        "micro-batch 1: no input was kept, so its activation cannot be recomputed"
    );
}

#[test]
fn take_or_compute_releases_the_stored_bytes() {
    let mut m = Manager::new(Strategy::Selective { interval: 5 }, 3);
    for i in 0..3 {
        m.keep_input(i, act(8, i as f32)).unwrap();
        m.store(i, &act(16, i as f32)).unwrap();
    }
    assert_eq!(m.memory_estimate(), 3 * 32 + 2 * 64);
    let (_, recomputed) = m.take_or_compute(0, forward).unwrap();
    assert!(!recomputed);
    let (_, recomputed) = m.take_or_compute(1, forward).unwrap();
    assert!(recomputed);
    assert_eq!(m.stored_bytes(), 64);
    m.release_input(0).unwrap();
    assert_eq!(m.memory_estimate(), 2 * 32 + 64);
    m.clear();
    assert_eq!((m.memory_estimate(), m.count()), (0, 0));
}

#[test]
fn metadata_records_index_bytes_shape_and_time() {
    let mut m = Manager::new(Strategy::StoreAll, 3);
    let before = Instant::now();
    m.store(0, &HostTensor::f32(vec![2, 4], vec![0.5; 8]).unwrap())
        .unwrap();
    m.store(2, &HostTensor::i64(vec![3], vec![1, 2, 3]).unwrap())
        .unwrap();
    let metas: Vec<_> = m.entries().cloned().collect();
    assert_eq!(metas.len(), 2);
    assert_eq!((metas[0].micro_batch, metas[0].bytes), (0, 32));
    assert_eq!(metas[0].shape, vec![2, 4]);
    assert_eq!((metas[1].micro_batch, metas[1].bytes), (2, 24));
    assert!(metas[0].stored_at >= before && metas[1].stored_at >= metas[0].stored_at);
}

#[derive(Debug)]
struct PoolFull;

impl std::fmt::Display for PoolFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pool full")
    }
}

impl std::error::Error for PoolFull {}

struct Uncopyable;

impl Activation for Uncopyable {
    fn byte_size(&self) -> usize {
        4
    }
    fn shape(&self) -> Vec<usize> {
        vec![1]
    }
}

impl DeepCopy for Uncopyable {
    type CopyError = PoolFull;
    fn deep_copy(&self) -> Result<Self, PoolFull> {
        Err(PoolFull)
    }
}

#[test]
fn a_failed_copy_is_a_typed_error_and_stores_nothing() {
    let mut m: CheckpointManager<Uncopyable, HostTensor> =
        CheckpointManager::new(Strategy::StoreAll, 2);
    let err = m.store(1, &Uncopyable).unwrap_err();
    assert_eq!(
        err.to_string(),
        "micro-batch 1: copying the activation to store it failed: pool full"
    );
    assert_eq!(m.count(), 0);
    assert!(matches!(
        m.store_owned(1, Uncopyable),
        Ok(StoreOutcome::Stored { .. })
    ));
}

#[test]
fn strategies_parse_and_print() {
    for text in ["store-all", "recompute-all", "selective:4", "memory:4096"] {
        let s: Strategy = text.parse().unwrap();
        assert_eq!(s.to_string(), text);
    }
    assert_eq!(
        "memory:256MiB".parse::<Strategy>().unwrap(),
        Strategy::MemoryBased {
            threshold_bytes: 256 << 20
        }
    );
    assert_eq!(
        "memory:3KB".parse::<Strategy>().unwrap(),
        Strategy::MemoryBased {
            threshold_bytes: 3000
        }
    );
    assert_eq!(
        "selective:x".parse::<Strategy>().unwrap_err().to_string(),
        "stage policy `selective:x`: `x` is not a positive interval (keep every N-th, N >= 1)"
    );
    // Found by an audit: `selective:0` was accepted; N must be positive.
    assert!("selective:0".parse::<Strategy>().is_err());
    for (text, bytes) in [("memory:1TiB", 1usize << 40), ("memory:12kib", 12 << 10)] {
        assert_eq!(
            text.parse::<Strategy>().unwrap(),
            Strategy::MemoryBased {
                threshold_bytes: bytes
            },
            "{text}"
        );
    }
    assert!(matches!(
        "keep".parse::<Strategy>(),
        Err(StrategyParseError::Unknown(_))
    ));
    assert_eq!(
        "memory:-1".parse::<Strategy>().unwrap_err().to_string(),
        "stage policy `memory:-1`: the value is negative; give a number of bytes"
    );
    assert!(
        "memory:18446744073709551615GiB"
            .parse::<Strategy>()
            .unwrap_err()
            .to_string()
            .contains("out of range")
    );
    // One meaning of units: GB is 10^9, decimals round to whole bytes, any case.
    assert_eq!(
        "memory:1.5gb".parse::<Strategy>().unwrap(),
        Strategy::MemoryBased {
            threshold_bytes: 1_500_000_000
        }
    );
}

#[test]
fn auto_keeps_what_the_remaining_steps_leave_room_for() {
    // No budget: everything is kept.
    assert_eq!(stored_with(Strategy::Auto, 4), vec![0, 1, 2, 3]);
    // GPipe over 4 micro-batches with 16-byte states and no inputs; each pass needs 20
    // bytes above the live ones, a recomputing backward 30.
    let steps: Vec<Step> = (0..4)
        .map(Step::Forward)
        .chain((0..4).map(Step::Backward))
        .collect();
    let transients = Transients {
        forward: 20,
        backward: 20,
        backward_recomputed: 30,
    };
    let run = |budget: usize| {
        let mut m = Manager::new(Strategy::Auto, 4);
        for i in 0..4 {
            let live = 16 * (m.count() + 1);
            m.set_pressure(Some(StagePressure {
                remaining: steps[i + 1..].to_vec(),
                live,
                budget,
                transients,
            }));
            m.store_owned(i, act(4, i as f32)).unwrap();
        }
        m.entries().map(|e| e.micro_batch).collect::<Vec<_>>()
    };
    // 84 = 4 states + a backward: all kept; less keeps fewer (a third state needs the 68 of
    // its last forward, a second 52, the first 36: one state and a forward pass).
    assert_eq!(run(84), vec![0, 1, 2, 3]);
    assert_eq!(run(83), vec![0, 1, 2]);
    assert_eq!(run(67), vec![0, 1]);
    assert_eq!(run(51), vec![0]);
    assert_eq!(run(35), Vec::<usize>::new());
    assert_eq!("auto".parse::<Strategy>().unwrap(), Strategy::Auto);
    assert_eq!(Strategy::Auto.to_string(), "auto");
}
