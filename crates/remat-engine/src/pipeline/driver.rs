//! A pipeline over a [`StagedModel`]: builds the stages (each on its own pool), runs training
//! steps through the runner, and the single-stage reference the tests compare against.

use std::sync::Arc;

use super::graph_stage::{
    Boundary, GraphStage, GraphStageError, StagedModel, accumulate, micro_batch_seed,
};
use super::partition::{PartitionError, balanced_ranges};
use super::runner::{
    PipelineConfig, PipelineReport, StageError, StageReport, run_pipeline, run_stage,
};
use super::schedule::Step;
use super::transport::Transport;
use crate::core::context::ExecContext;
use crate::core::error::EngineError;
use crate::core::graph::Graph;
use crate::core::optim::{AdamW, AdamWConfig};
use crate::core::pool::{Category, MemoryPool, PoolStats};
use crate::core::tensor::Tensor;

/// How the stages are provisioned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageResources {
    /// Kernel threads of each stage.
    pub threads: usize,
    /// Each stage's memory budget in bytes (`None`: unbounded, accounting only).
    pub budget: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineBuildError {
    #[error(transparent)]
    Partition(#[from] PartitionError),
    #[error("stage {stage}: {error}")]
    Engine { stage: usize, error: EngineError },
}

/// What one pipelined training step did.
#[derive(Clone, Debug)]
pub struct StepReport {
    pub run: PipelineReport,
    /// Each stage's pool statistics (peaks over the step).
    pub memory: Vec<PoolStats>,
    /// Loss of each micro-batch.
    pub losses: Vec<f64>,
}

impl StepReport {
    /// Mean loss over the micro-batches (0 for none).
    pub fn mean_loss(&self) -> f64 {
        match self.losses.len() {
            0 => 0.0,
            n => self.losses.iter().sum::<f64>() / n as f64,
        }
    }
}

/// The stages of one model, stage 0 first.
pub struct Pipeline<'m, M: StagedModel> {
    stages: Vec<GraphStage<'m, M>>,
    optimizers: Vec<Option<AdamW>>,
}

impl<'m, M: StagedModel> Pipeline<'m, M> {
    /// Splits `model`'s layers over `stages` stages (balanced, contiguous).
    pub fn new(
        model: &'m M,
        stages: usize,
        resources: StageResources,
    ) -> Result<Self, PipelineBuildError> {
        let ranges = balanced_ranges(model.layers(), stages)?;
        let stages = ranges
            .into_iter()
            .enumerate()
            .map(|(s, layers)| {
                let pool = stage_pool(resources);
                GraphStage::new(model, s, stages, layers, pool, resources.threads).map_err(
                    |source| PipelineBuildError::Engine {
                        stage: s,
                        error: source,
                    },
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let optimizers = stages.iter().map(|_| None).collect();
        Ok(Self { stages, optimizers })
    }

    pub fn stages(&self) -> &[GraphStage<'m, M>] {
        &self.stages
    }

    /// One forward and backward pass over `batches` (the micro-batches, in order), with
    /// gradients accumulated on every stage.
    pub fn step(
        &mut self,
        batches: Arc<[M::MicroBatch]>,
        step_seed: u64,
        config: PipelineConfig,
    ) -> Result<StepReport, StageError<GraphStageError>> {
        let config = PipelineConfig {
            micro_batches: batches.len(),
            ..config
        };
        for stage in &mut self.stages {
            let index = stage.stage();
            stage
                .begin_step(Arc::clone(&batches), step_seed)
                .map_err(|source| StageError::Prepare {
                    stage: index,
                    error: GraphStageError::Engine(source),
                })?;
        }
        let run = run_pipeline(&mut self.stages, config)?;
        let memory = self.stages.iter().map(GraphStage::pool_stats).collect();
        let losses = self
            .stages
            .last()
            .map(|s| s.losses().iter().map(|l| l.unwrap_or(f64::NAN)).collect())
            .unwrap_or_default();
        Ok(StepReport {
            run,
            memory,
            losses,
        })
    }

    /// `(name, accumulated gradient)` of every parameter, in model order.
    pub fn grads(&self) -> Vec<(String, Tensor)> {
        self.stages
            .iter()
            .flat_map(|s| {
                s.params()
                    .into_iter()
                    .map(|(n, _)| n)
                    .zip(s.grads().iter().cloned())
            })
            .collect()
    }

    /// Applies AdamW on every stage to the gradients of the last step (each stage updates its
    /// own parameters; the moments live in the stage's pool).
    pub fn optimizer_step(&mut self, config: AdamWConfig) -> Result<(), PipelineBuildError> {
        for (stage, opt) in self.stages.iter().zip(&mut self.optimizers) {
            stage_optimizer_step(stage, opt, config)?;
        }
        Ok(())
    }
}

/// AdamW on one stage's parameters (the moments are created on first use, in its pool).
fn stage_optimizer_step<M: StagedModel>(
    stage: &GraphStage<'_, M>,
    opt: &mut Option<AdamW>,
    config: AdamWConfig,
) -> Result<(), PipelineBuildError> {
    let engine = |source| PipelineBuildError::Engine {
        stage: stage.stage(),
        error: source,
    };
    if opt.is_none() {
        *opt = Some(AdamW::new(stage.context().pool(), stage.params(), config).map_err(engine)?);
    }
    let grads: Vec<Option<Tensor>> = stage.grads().iter().cloned().map(Some).collect();
    if let Some(opt) = opt {
        opt.step(&grads).map_err(engine)?;
    }
    Ok(())
}

fn stage_pool(resources: StageResources) -> Arc<MemoryPool> {
    match resources.budget {
        Some(b) => MemoryPool::with_budget(b),
        None => MemoryPool::unbounded(),
    }
}

/// What one stage did in one step of a pipeline whose other stages run elsewhere.
#[derive(Clone, Debug)]
pub struct OneStageReport {
    pub run: StageReport,
    /// The stage's pool statistics (peaks over the step).
    pub memory: PoolStats,
    /// Loss of each micro-batch (last stage only; `None` elsewhere).
    pub losses: Vec<Option<f64>>,
}

/// One stage of a pipeline whose other stages run in other processes (one MPI rank each):
/// its share of the model on its own pool and budget, and its optimizer. It splits the
/// model exactly as [`Pipeline`] does, so the two compute the same bits.
pub struct OneStage<'m, M: StagedModel> {
    stage: GraphStage<'m, M>,
    stages: usize,
    optimizer: Option<AdamW>,
}

impl<'m, M: StagedModel> OneStage<'m, M> {
    /// Stage `stage` of `model` split over `stages` stages (balanced, contiguous).
    pub fn new(
        model: &'m M,
        stage: usize,
        stages: usize,
        resources: StageResources,
    ) -> Result<Self, PipelineBuildError> {
        let mut ranges = balanced_ranges(model.layers(), stages)?;
        if stage >= stages {
            return Err(PipelineBuildError::Partition(
                PartitionError::StageOutOfRange { stage, stages },
            ));
        }
        let layers = ranges.swap_remove(stage);
        let pool = stage_pool(resources);
        let stage_work = GraphStage::new(model, stage, stages, layers, pool, resources.threads)
            .map_err(|error| PipelineBuildError::Engine { stage, error })?;
        Ok(Self {
            stage: stage_work,
            stages,
            optimizer: None,
        })
    }

    pub fn stage(&self) -> &GraphStage<'m, M> {
        &self.stage
    }

    /// This stage's share of one forward and backward pass over `batches` (every
    /// micro-batch of the step: the first stage reads inputs, the last targets), exchanging
    /// activations and gradients with its neighbours over `transport`.
    pub fn step(
        &mut self,
        batches: Arc<[M::MicroBatch]>,
        step_seed: u64,
        config: PipelineConfig,
        transport: &impl Transport<Boundary>,
        watch: &dyn Fn(Step),
    ) -> Result<OneStageReport, StageError<GraphStageError>> {
        let config = PipelineConfig {
            micro_batches: batches.len(),
            ..config
        };
        let index = self.stage.stage();
        self.stage
            .begin_step(batches, step_seed)
            .map_err(|source| StageError::Prepare {
                stage: index,
                error: GraphStageError::Engine(source),
            })?;
        let run = run_stage(&mut self.stage, transport, self.stages, config, watch)?;
        Ok(OneStageReport {
            run,
            memory: self.stage.pool_stats(),
            losses: self.stage.losses().to_vec(),
        })
    }

    /// `(name, accumulated gradient)` of this stage's parameters, in model order.
    pub fn grads(&self) -> Vec<(String, Tensor)> {
        self.stage
            .params()
            .into_iter()
            .map(|(n, _)| n)
            .zip(self.stage.grads().iter().cloned())
            .collect()
    }

    /// AdamW on this stage's parameters with its accumulated gradients.
    pub fn optimizer_step(&mut self, config: AdamWConfig) -> Result<(), PipelineBuildError> {
        stage_optimizer_step(&self.stage, &mut self.optimizer, config)
    }
}

/// The seed of data-parallel replica `replica`'s share of a step seeded `step_seed`: replica
/// 0 keeps the step's seed (one replica is the plain pipeline), the others draw their own,
/// so that their micro-batches' dropout masks differ as their data do.
pub fn replica_step_seed(step_seed: u64, replica: usize) -> u64 {
    match replica {
        0 => step_seed,
        r => crate::core::rng::mix64(step_seed, u64::MAX - r as u64),
    }
}

/// The single-stage reference of a pipelined step: the same micro-batches, each through the
/// model's own whole-model graph with the same seed, gradients accumulated in micro-batch
/// order with the same [`accumulate`].
#[derive(Debug)]
pub struct ReferenceStep {
    pub losses: Vec<f64>,
    /// `(name, gradient)` in model order.
    pub grads: Vec<(String, Tensor)>,
}

pub fn reference_step<M: StagedModel>(
    model: &M,
    ctx: &ExecContext,
    batches: &[M::MicroBatch],
    step_seed: u64,
) -> Result<ReferenceStep, EngineError> {
    let names: Vec<(String, Tensor)> = model
        .parts()
        .into_iter()
        .flat_map(|p| model.part_params(p))
        .collect();
    let grads = names
        .iter()
        .map(|(name, t)| {
            Tensor::zeros(ctx.pool(), t.shape(), t.dtype(), Category::Gradients, None)
                .map_err(|e| e.at(format!("gradient of {name}")))
                .map(|g| (name.clone(), g))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut losses = Vec::with_capacity(batches.len());
    for (m, batch) in batches.iter().enumerate() {
        let mut g = Graph::new(ctx);
        g.set_seed(micro_batch_seed(step_seed, m));
        let (loss, params) = model.record_reference(&mut g, batch)?;
        if params.len() != grads.len() {
            return Err(EngineError::Invalid(format!(
                "the reference graph has {} parameters, the staged model {}",
                params.len(),
                grads.len()
            )));
        }
        g.forward()?;
        losses.push(g.scalar(loss)?);
        g.backward(loss)?;
        for ((_, acc), id) in grads.iter().zip(params) {
            if let Some(grad) = g.take_grad(id)? {
                accumulate(acc, &grad)?;
            }
        }
    }
    Ok(ReferenceStep { losses, grads })
}
