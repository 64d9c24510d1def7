//! Pipelined training of the engine's MLP chain (with dropout) against the single-stage
//! reference: gradients bit for bit under every schedule and stage strategy.

use std::sync::Arc;

use remat_engine::models::mlp::{Mlp, MlpConfig};
use remat_engine::pipeline::driver::{Pipeline, StageResources, reference_step};
use remat_engine::pipeline::staged_mlp::{MlpBatch, StagedMlp};
use remat_engine::pipeline::{PipelineConfig, Schedule, Strategy};
use remat_engine::{Category, ExecContext, MemoryPool, Tensor};

const DIMS: [usize; 7] = [8, 24, 24, 24, 24, 24, 4];
const ROWS: usize = 3;

fn model() -> Mlp {
    let config = MlpConfig {
        dims: DIMS.to_vec(),
        dropout: 0.2,
        seed: 11,
    };
    Mlp::new(&MemoryPool::unbounded(), config).unwrap()
}

fn batches(micro_batches: usize) -> Arc<[MlpBatch]> {
    let pool = MemoryPool::unbounded();
    let tensor = |m: usize, cols: usize, salt: f32| {
        let data = (0..ROWS * cols)
            .map(|i| ((m * 131 + i) as f32 * 0.173 + salt).sin())
            .collect();
        Tensor::from_vec(&pool, "data", &[ROWS, cols], data, Category::Activations).unwrap()
    };
    (0..micro_batches)
        .map(|m| MlpBatch {
            x: tensor(m, DIMS[0], 0.0),
            target: tensor(m, DIMS[6], 1.0),
        })
        .collect()
}

fn resources() -> StageResources {
    StageResources {
        threads: 1,
        budget: None,
    }
}

#[test]
fn gradients_equal_single_stage_under_every_schedule_and_strategy() {
    let mlp = model();
    let staged = StagedMlp(&mlp);
    let micro_batches = 5;
    let data = batches(micro_batches);
    let ctx = ExecContext::single_threaded().unwrap();
    let reference = reference_step(&staged, &ctx, &data, 42).unwrap();
    assert!(
        reference
            .grads
            .iter()
            .any(|(_, g)| g.to_f64_vec().iter().any(|v| *v != 0.0))
    );
    // One stored MLP stage state is a few KiB; this threshold keeps about two.
    let strategies = [
        Strategy::StoreAll,
        Strategy::RecomputeAll,
        Strategy::Selective { interval: 2 },
        Strategy::MemoryBased {
            threshold_bytes: 2048,
        },
    ];
    for stages in [1, 2, 3, 6] {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for strategy in strategies {
                let label = format!("P={stages} {schedule} {strategy}");
                let mut pipeline = Pipeline::new(&staged, stages, resources()).unwrap();
                let config = PipelineConfig {
                    schedule,
                    micro_batches,
                    strategy,
                };
                let report = pipeline.step(Arc::clone(&data), 42, config).unwrap();
                let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&report.losses), bits(&reference.losses), "{label}");
                let grads = pipeline.grads();
                assert_eq!(grads.len(), reference.grads.len(), "{label}");
                for ((name, got), (ref_name, want)) in grads.iter().zip(&reference.grads) {
                    assert_eq!(name, ref_name, "{label}");
                    assert!(got.bit_eq(want), "{label}: gradient of {name} differs");
                }
            }
        }
    }
}

#[test]
fn one_f_one_b_peaks_below_gpipe_when_micro_batches_outnumber_stages() {
    let mlp = model();
    let staged = StagedMlp(&mlp);
    let (stages, micro_batches) = (3, 8);
    let data = batches(micro_batches);
    let peaks = |schedule| {
        let mut pipeline = Pipeline::new(&staged, stages, resources()).unwrap();
        let config = PipelineConfig {
            schedule,
            micro_batches,
            strategy: Strategy::StoreAll,
        };
        let report = pipeline.step(Arc::clone(&data), 7, config).unwrap();
        report
            .memory
            .iter()
            .map(|m| m.category(Category::Activations).peak)
            .collect::<Vec<_>>()
    };
    let gpipe = peaks(Schedule::GPipe);
    let ofob = peaks(Schedule::OneFOneB);
    for s in 0..stages {
        assert!(
            ofob[s] < gpipe[s],
            "stage {s}: 1F1B {} vs GPipe {}",
            ofob[s],
            gpipe[s]
        );
    }
}
