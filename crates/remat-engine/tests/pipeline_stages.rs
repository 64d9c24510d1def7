//! Engine-backed pipeline stages: recomputation is bit-exact, memory-based eviction frees
//! real pool memory, a stage running out of memory is reported (not a hang), zero
//! micro-batches is a no-op step.

use std::sync::Arc;

use remat_engine::models::mlp::{Mlp, MlpConfig};
use remat_engine::pipeline::driver::{Pipeline, StageResources};
use remat_engine::pipeline::graph_stage::{GraphStage, GraphStageError};
use remat_engine::pipeline::runner::StageError;
use remat_engine::pipeline::staged_mlp::{MlpBatch, StagedMlp};
use remat_engine::pipeline::{PipelineConfig, Schedule, StageWork, Strategy};
use remat_engine::{Category, EngineError, MemoryPool, Tensor};

const DIMS: [usize; 5] = [6, 32, 32, 32, 3];
const ROWS: usize = 4;

fn model() -> Mlp {
    let config = MlpConfig {
        dims: DIMS.to_vec(),
        dropout: 0.25,
        seed: 5,
    };
    Mlp::new(&MemoryPool::unbounded(), config).unwrap()
}

fn batches(micro_batches: usize) -> Arc<[MlpBatch]> {
    let pool = MemoryPool::unbounded();
    let tensor = |m: usize, cols: usize| {
        let data = (0..ROWS * cols)
            .map(|i| ((m * 37 + i) as f32 * 0.29).cos())
            .collect();
        Tensor::from_vec(&pool, "data", &[ROWS, cols], data, Category::Activations).unwrap()
    };
    (0..micro_batches)
        .map(|m| MlpBatch {
            x: tensor(m, DIMS[0]),
            target: tensor(m, DIMS[4]),
        })
        .collect()
}

fn config(schedule: Schedule, micro_batches: usize, strategy: Strategy) -> PipelineConfig {
    PipelineConfig {
        schedule,
        micro_batches,
        strategy,
    }
}

const ONE_THREAD: StageResources = StageResources {
    threads: 1,
    budget: None,
};

#[test]
fn a_recomputed_stage_forward_equals_the_stored_one_bit_for_bit() {
    let mlp = model();
    let staged = StagedMlp(&mlp);
    // The middle stage of three, fed a received activation, with dropout drawing from the
    // carried random stream.
    let mut stage = GraphStage::new(&staged, 1, 3, 1..2, MemoryPool::unbounded(), 1).unwrap();
    stage.begin_step(batches(2), 9).unwrap();
    let data: Vec<f32> = (0..ROWS * 32).map(|i| (i as f32 * 0.11).sin()).collect();
    let received = remat_engine::pipeline::graph_stage::Boundary {
        tensor: remat_engine::pipeline::HostTensor::f32(vec![ROWS, 32], data).unwrap(),
        rng_offset: 1234,
    };
    let input = stage.load_input(1, Some(received)).unwrap();
    let first = stage.forward(1, &input).unwrap();
    let again = stage.forward(1, &input).unwrap();
    let out = |f: &remat_engine::pipeline::runner::Forwarded<
        _,
        remat_engine::pipeline::graph_stage::Boundary,
    >| { f.output.clone().unwrap() };
    let bits = |b: &remat_engine::pipeline::graph_stage::Boundary| {
        b.tensor
            .as_f32()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&out(&first)), bits(&out(&again)));
    assert_eq!(first.digest, again.digest);
    assert_eq!(out(&first).rng_offset, out(&again).rng_offset);
    assert!(
        out(&first).rng_offset > 1234,
        "the dropout drew from the carried stream"
    );
    // Dropout zeroed some activations: the stream really was used.
    assert!(out(&first).tensor.as_f32().unwrap().contains(&0.0));
}

#[test]
fn recompute_all_holds_less_than_store_all_and_memory_based_sits_between() {
    let mlp = model();
    let staged = StagedMlp(&mlp);
    let micro_batches = 6;
    let data = batches(micro_batches);
    let peak_of = |strategy| {
        let mut pipeline = Pipeline::new(&staged, 2, ONE_THREAD).unwrap();
        let report = pipeline
            .step(
                Arc::clone(&data),
                3,
                config(Schedule::GPipe, micro_batches, strategy),
            )
            .unwrap();
        let act = report.memory[0].category(Category::Activations).peak;
        (act, report.run.stages[0].checkpoint)
    };
    let (store_all, stats) = peak_of(Strategy::StoreAll);
    let state = stats.peak_stored_bytes / micro_batches;
    let (recompute_all, _) = peak_of(Strategy::RecomputeAll);
    let (memory, mstats) = peak_of(Strategy::MemoryBased {
        threshold_bytes: 3 * state,
    });
    assert!(
        recompute_all < memory && memory < store_all,
        "{recompute_all} {memory} {store_all}"
    );
    assert!(mstats.evictions > 0);
    assert!(mstats.peak_stored_bytes <= 3 * state);
}

#[test]
fn a_stage_out_of_memory_is_reported_with_its_stage_and_node() {
    let mlp = model();
    let staged = StagedMlp(&mlp);
    let tight = StageResources {
        threads: 1,
        budget: Some(20_000),
    };
    let mut pipeline = Pipeline::new(&staged, 2, tight).unwrap();
    let err = pipeline
        .step(
            batches(16),
            1,
            config(Schedule::GPipe, 16, Strategy::StoreAll),
        )
        .unwrap_err();
    match &err {
        StageError::Work {
            error: GraphStageError::Engine(EngineError::OutOfMemory { .. }),
            ..
        } => {}
        other => panic!("expected an out-of-memory stage error, got {other}"),
    }
    let message = err.to_string();
    assert!(message.starts_with("stage "), "{message}");
    assert!(
        message.contains("out of memory while running node"),
        "{message}"
    );
}

#[test]
fn zero_micro_batches_is_an_empty_step() {
    let mlp = model();
    let staged = StagedMlp(&mlp);
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let mut pipeline = Pipeline::new(&staged, 4, ONE_THREAD).unwrap();
        let report = pipeline
            .step(batches(0), 0, config(schedule, 0, Strategy::StoreAll))
            .unwrap();
        assert!(report.losses.is_empty());
        assert_eq!(report.mean_loss(), 0.0);
        assert!(report.run.stages.iter().all(|s| s.spans.is_empty()));
        for (_, g) in pipeline.grads() {
            assert!(g.to_f64_vec().iter().all(|v| *v == 0.0));
        }
    }
}

#[test]
fn training_steps_lower_the_loss() {
    let mlp = model();
    let staged = StagedMlp(&mlp);
    let data = batches(4);
    let mut pipeline = Pipeline::new(&staged, 2, ONE_THREAD).unwrap();
    let cfg = config(Schedule::OneFOneB, 4, Strategy::Selective { interval: 2 });
    let adam = remat_engine::AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    };
    let first = pipeline
        .step(Arc::clone(&data), 0, cfg)
        .unwrap()
        .mean_loss();
    let mut last = first;
    for step in 1..30 {
        pipeline.optimizer_step(adam).unwrap();
        last = pipeline
            .step(Arc::clone(&data), step, cfg)
            .unwrap()
            .mean_loss();
    }
    assert!(last < 0.7 * first, "loss {first} -> {last}");
}
