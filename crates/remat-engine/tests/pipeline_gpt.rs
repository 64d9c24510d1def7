//! Pipelined GPT training against the single-stage reference ([`Gpt::record`] on one graph,
//! the same micro-batches accumulated in order): gradients and losses bit for bit under
//! every schedule and stage policy, with dropout; 1F1B's peak below GPipe's for M > P.

use std::sync::Arc;

use remat_engine::core::kernels::philox_hash;
use remat_engine::models::gpt::{Batch, Gpt, GptConfig};
use remat_engine::pipeline::driver::{Pipeline, StageResources, reference_step};
use remat_engine::pipeline::staged_gpt::{StagedGpt, split_batch};
use remat_engine::pipeline::{PipelineConfig, Schedule, Strategy};
use remat_engine::{Category, ExecContext, MemoryPool};

const VOCAB: usize = 17;
const SEQ: usize = 8;
const ROWS_PER_MICRO_BATCH: usize = 2;

fn model(layers: usize) -> Gpt {
    let config = GptConfig {
        vocab: VOCAB,
        d_model: 32,
        n_layers: layers,
        n_heads: 4,
        n_kv_heads: 2,
        ffn_hidden: 48,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        dropout: 0.1,
        init_seed: 3,
    };
    Gpt::new(&MemoryPool::unbounded(), config).unwrap()
}

fn micro_batches(micro_batches: usize) -> Arc<[Batch]> {
    let rows = ROWS_PER_MICRO_BATCH * micro_batches;
    let ids = |stream: u64| -> Arc<[u32]> {
        (0..(rows * SEQ) as u64)
            .map(|i| (philox_hash(stream, i) % VOCAB as u64) as u32)
            .collect()
    };
    let batch = Batch {
        tokens: ids(1),
        targets: ids(2),
        batch: rows,
        seq: SEQ,
    };
    split_batch(&batch, micro_batches).unwrap().into()
}

const ONE_THREAD: StageResources = StageResources {
    threads: 1,
    budget: None,
};

#[test]
fn gradients_equal_single_stage_under_every_schedule_and_strategy() {
    let gpt = model(4);
    let staged = StagedGpt(&gpt);
    let m = 4;
    let data = micro_batches(m);
    let ctx = ExecContext::single_threaded().unwrap();
    let reference = reference_step(&staged, &ctx, &data, 77).unwrap();
    let strategies = [
        Strategy::StoreAll,
        Strategy::RecomputeAll,
        Strategy::Selective { interval: 2 },
        Strategy::MemoryBased {
            threshold_bytes: 60_000,
        },
        Strategy::Auto,
    ];
    for stages in [2, 4] {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for strategy in strategies {
                let label = format!("P={stages} {schedule} {strategy}");
                let mut pipeline = Pipeline::new(&staged, stages, ONE_THREAD).unwrap();
                let config = PipelineConfig {
                    schedule,
                    micro_batches: m,
                    strategy,
                };
                let report = pipeline.step(Arc::clone(&data), 77, config).unwrap();
                let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&report.losses), bits(&reference.losses), "{label}");
                let grads = pipeline.grads();
                assert_eq!(grads.len(), reference.grads.len(), "{label}");
                for ((name, got), (ref_name, want)) in grads.iter().zip(&reference.grads) {
                    assert_eq!(name, ref_name, "{label}");
                    assert!(got.bit_eq(want), "{label}: gradient of {name} differs");
                }
                if let Strategy::MemoryBased { .. } = strategy {
                    // The threshold holds about one stage state: the rule really drops some.
                    let dropped: usize = report
                        .run
                        .stages
                        .iter()
                        .map(|s| s.checkpoint.evictions + s.checkpoint.declines)
                        .sum();
                    assert!(dropped > 0, "{label}");
                }
                if strategy == Strategy::RecomputeAll {
                    let recomputes: usize = report
                        .run
                        .stages
                        .iter()
                        .map(|s| s.checkpoint.recomputes)
                        .sum();
                    assert_eq!(recomputes, stages * m, "{label}");
                }
            }
        }
    }
}

#[test]
fn one_f_one_b_peaks_below_gpipe_when_micro_batches_outnumber_stages() {
    let gpt = model(4);
    let staged = StagedGpt(&gpt);
    let (stages, m) = (4, 8);
    let data = micro_batches(m);
    let peaks = |schedule| {
        let mut pipeline = Pipeline::new(&staged, stages, ONE_THREAD).unwrap();
        let config = PipelineConfig {
            schedule,
            micro_batches: m,
            strategy: Strategy::StoreAll,
        };
        let report = pipeline.step(Arc::clone(&data), 5, config).unwrap();
        let in_flight: Vec<usize> = report.run.stages.iter().map(|s| s.max_in_flight).collect();
        let act: Vec<u64> = report
            .memory
            .iter()
            .map(|s| s.category(Category::Activations).peak)
            .collect();
        let total: Vec<u64> = report.memory.iter().map(|s| s.peak).collect();
        (in_flight, act, total)
    };
    let (gpipe_flight, gpipe_act, gpipe_total) = peaks(Schedule::GPipe);
    let (ofob_flight, ofob_act, ofob_total) = peaks(Schedule::OneFOneB);
    for s in 0..stages {
        assert_eq!(gpipe_flight[s], m);
        assert_eq!(ofob_flight[s], stages - s);
        assert!(
            ofob_act[s] < gpipe_act[s],
            "stage {s}: {} vs {}",
            ofob_act[s],
            gpipe_act[s]
        );
        assert!(
            ofob_total[s] < gpipe_total[s],
            "stage {s}: {} vs {}",
            ofob_total[s],
            gpipe_total[s]
        );
    }
}

/// The highest pool peak over the stages of one step, and the step's recomputes.
fn peak_and_recomputes(
    staged: &StagedGpt<'_>,
    data: &Arc<[Batch]>,
    schedule: Schedule,
    strategy: Strategy,
    budget: Option<u64>,
) -> Option<(u64, usize)> {
    let resources = StageResources { threads: 1, budget };
    let mut pipeline = Pipeline::new(staged, 2, resources).unwrap();
    let config = PipelineConfig {
        schedule,
        micro_batches: data.len(),
        strategy,
    };
    // Two steps: `auto` learns its stage's transients in the first.
    let mut report = pipeline.step(Arc::clone(data), 9, config).ok()?;
    if strategy == Strategy::Auto {
        report = pipeline.step(Arc::clone(data), 9, config).ok()?;
    }
    let peak = report.memory.iter().map(|m| m.peak).max().unwrap_or(0);
    let recomputes = report
        .run
        .stages
        .iter()
        .map(|s| s.checkpoint.recomputes)
        .sum();
    Some((peak, recomputes))
}

/// Under budgets between recompute-all's peak and store-all's, `auto` (in its second step,
/// having measured its passes in the first) fits and recomputes no more than any fixed
/// policy that fits; its gradients are the reference's.
#[test]
fn auto_fits_the_budget_and_recomputes_no_more_than_the_fixed_policies_that_fit() {
    let gpt = model(4);
    let staged = StagedGpt(&gpt);
    let data = micro_batches(8);
    let ctx = ExecContext::single_threaded().unwrap();
    let reference = reference_step(&staged, &ctx, &data, 9).unwrap();
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let unbounded = |s| peak_and_recomputes(&staged, &data, schedule, s, None).unwrap();
        let (low, _) = unbounded(Strategy::RecomputeAll);
        let (high, _) = unbounded(Strategy::StoreAll);
        assert!(low < high, "{schedule}: {low} vs {high}");
        for eighths in 1..8 {
            let budget = low + (high - low) * eighths / 8;
            let fixed = [
                Strategy::StoreAll,
                Strategy::RecomputeAll,
                Strategy::Selective { interval: 2 },
                Strategy::Selective { interval: 3 },
            ];
            let best = fixed
                .iter()
                .filter_map(|&s| peak_and_recomputes(&staged, &data, schedule, s, Some(budget)))
                .map(|(_, r)| r)
                .min()
                .expect("recompute-all fits");
            let (peak, recomputes) =
                peak_and_recomputes(&staged, &data, schedule, Strategy::Auto, Some(budget))
                    .unwrap_or_else(|| {
                        panic!("{schedule}: auto ran out of a budget recompute-all fits")
                    });
            assert!(peak <= budget, "{schedule}");
            assert!(
                recomputes <= best,
                "{schedule}: auto {recomputes} vs best fixed {best}"
            );
            if schedule == Schedule::GPipe && eighths == 7 {
                // Where the budget is loose, keeping as many as fit beats every fixed pattern.
                assert!(recomputes < best, "auto {recomputes} vs best fixed {best}");
            }
            // Exact whatever it chose.
            let resources = StageResources {
                threads: 1,
                budget: Some(budget),
            };
            let mut pipeline = Pipeline::new(&staged, 2, resources).unwrap();
            let config = PipelineConfig {
                schedule,
                micro_batches: data.len(),
                strategy: Strategy::Auto,
            };
            pipeline.step(Arc::clone(&data), 9, config).unwrap();
            for ((name, got), (_, want)) in pipeline.grads().iter().zip(&reference.grads) {
                assert!(got.bit_eq(want), "{schedule}: gradient of {name} differs");
            }
        }
    }
}
