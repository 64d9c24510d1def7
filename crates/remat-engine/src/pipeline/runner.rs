//! Runs a pipeline: one thread per stage, each walking its schedule's steps, keeping or
//! dropping each micro-batch's forward state through its own [`CheckpointManager`], and
//! exchanging activations and gradients with its neighbours through a [`Transport`].
//!
//! What a stage computes is behind [`StageWork`]; [`super::graph_stage::GraphStage`]
//! implements it for any [`super::graph_stage::StagedModel`] (the engine's GPT in
//! [`super::staged_gpt`], the MLP chain in [`super::staged_mlp`]), the tests with a toy model.

use std::time::{Duration, Instant};

use super::activation::Activation;
use super::auto::Transients;
use super::manager::{CheckpointError, CheckpointManager, ManagerStats, StagePressure, Strategy};
use super::schedule::{self, Schedule, ScheduleError, Step};
use super::transport::{ChannelTransport, Transport, TransportError};

/// What forward leaves behind for one micro-batch.
pub struct Forwarded<S, M> {
    /// Everything backward needs (for the engine: the recorded graph with its activations).
    pub state: S,
    /// The activation for the next stage; `None` on the last stage.
    pub output: Option<M>,
    /// A fingerprint of the stage's output bits, so a recomputation can be checked against it.
    pub digest: u64,
}

/// One stage's share of the model, as the runner drives it.
pub trait StageWork: Send {
    /// What the stage keeps per micro-batch to recompute from.
    type Input: Activation;
    /// What a forward pass leaves for backward.
    type State: Activation;
    /// What crosses a stage boundary (an activation forward, its gradient backward).
    type Message: Send;
    type Error: std::error::Error + Send + Sync + 'static;

    /// Micro-batch `micro_batch`'s input: from the batch on the first stage (`received` is
    /// `None`), else from the previous stage's message.
    fn load_input(
        &mut self,
        micro_batch: usize,
        received: Option<Self::Message>,
    ) -> Result<Self::Input, Self::Error>;

    /// Runs the stage's forward pass. Must be deterministic: a recompute gives the same bits.
    fn forward(
        &mut self,
        micro_batch: usize,
        input: &Self::Input,
    ) -> Result<Forwarded<Self::State, Self::Message>, Self::Error>;

    /// Backpropagates through `state` given the gradient of the stage's output (`None` on the
    /// last stage, which holds the loss), accumulates the parameters' gradients, and returns
    /// the gradient of the stage's input for the previous stage (`None` on the first stage).
    fn backward(
        &mut self,
        micro_batch: usize,
        state: Self::State,
        grad: Option<Self::Message>,
    ) -> Result<Option<Self::Message>, Self::Error>;

    /// The stage's memory now (`None`: no budget), read by the `auto` stage policy.
    fn memory(&self) -> Option<MemoryReading> {
        None
    }

    /// Restarts the peak that [`StageWork::memory`] reports at the live bytes, so that the
    /// next pass's own peak can be read (the stage keeps the step's peak itself).
    fn restart_peak(&mut self) {}

    /// Where the stage keeps the transients the `auto` policy measured, so that they carry
    /// over from step to step (`None`: measured afresh each step).
    fn transients(&mut self) -> Option<&mut Transients> {
        None
    }
}

/// A stage's memory pool as the `auto` stage policy reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryReading {
    pub live: usize,
    /// The highest live bytes since the step began.
    pub peak: usize,
    pub budget: usize,
}

/// How a pipeline run is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineConfig {
    pub schedule: Schedule,
    pub micro_batches: usize,
    pub strategy: Strategy,
}

/// Why a stage stopped.
#[derive(Debug, thiserror::Error)]
pub enum StageError<E: std::error::Error + 'static> {
    #[error("stage {stage}, micro-batch {micro_batch}: {error}")]
    Work {
        stage: usize,
        micro_batch: usize,
        error: E,
    },
    #[error("stage {stage}, preparing the step: {error}")]
    Prepare { stage: usize, error: E },
    #[error("stage {stage}: {error}")]
    Checkpoint {
        stage: usize,
        error: CheckpointError,
    },
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(
        "stage {stage}, micro-batch {micro_batch}: the recomputed forward pass differs from the \
         original (the stage's forward is not deterministic), so its gradients would be wrong"
    )]
    RecomputeMismatch { stage: usize, micro_batch: usize },
    #[error("stage {stage}: {message}")]
    Thread { stage: usize, message: String },
}

/// One step as it ran, in time since the run started.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepSpan {
    pub step: Step,
    pub start: Duration,
    pub end: Duration,
    /// A backward whose forward state had to be recomputed first.
    pub recomputed: bool,
}

/// What one stage did.
#[derive(Clone, Debug, PartialEq)]
pub struct StageReport {
    pub stage: usize,
    /// Time spent computing (waiting for a neighbour is not busy).
    pub busy: Duration,
    /// Of which spent recomputing forward passes.
    pub recompute: Duration,
    pub spans: Vec<StepSpan>,
    pub checkpoint: ManagerStats,
    /// The most micro-batches forwarded but not yet backwarded at once.
    pub max_in_flight: usize,
}

/// What a whole run did.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineReport {
    pub config: PipelineConfig,
    /// From the start of the run to the end of the last stage's last step.
    pub wall: Duration,
    pub stages: Vec<StageReport>,
}

impl PipelineReport {
    /// The measured idle share of all stages' time: 1 - sum(busy) / (P * wall).
    pub fn bubble_fraction(&self) -> f64 {
        let capacity = self.wall.as_secs_f64() * self.stages.len() as f64;
        if capacity == 0.0 {
            return 0.0;
        }
        let busy: f64 = self.stages.iter().map(|s| s.busy.as_secs_f64()).sum();
        (1.0 - busy / capacity).max(0.0)
    }

    /// The bubble of an ideal pipeline of the same shape: (P - 1) / (M + P - 1).
    pub fn ideal_bubble_fraction(&self) -> f64 {
        schedule::ideal_bubble_fraction(self.stages.len(), self.config.micro_batches)
    }
}

/// Runs one training step over `works` (stage 0 first), each stage on its own thread.
///
/// On failure the root cause is returned: the first stage error that is not a neighbour
/// hanging up (which is how a failure propagates along the pipeline).
pub fn run_pipeline<W: StageWork>(
    works: &mut [W],
    config: PipelineConfig,
) -> Result<PipelineReport, StageError<W::Error>> {
    let stages = works.len();
    let steps = schedule::all_stage_steps(config.schedule, stages, config.micro_batches)?;
    let transports = ChannelTransport::<W::Message>::pipeline(stages);
    let epoch = Instant::now();
    let results: Vec<Result<StageReport, StageError<W::Error>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = works
            .iter_mut()
            .zip(transports)
            .zip(steps)
            .map(|((work, transport), steps)| {
                let stage = transport.stage();
                let runner = StageRunner::new(stage, stages, config, epoch);
                std::thread::Builder::new()
                    .name(format!("remat-stage-{stage}"))
                    .spawn_scoped(scope, move || runner.run(work, &transport, &steps))
                    .map_err(|e| StageError::Thread {
                        stage,
                        message: format!("cannot start its thread: {e}"),
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(stage, handle)| {
                handle?.join().unwrap_or_else(|_| {
                    Err(StageError::Thread {
                        stage,
                        message: "its thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    let wall = epoch.elapsed();
    let mut reports = Vec::with_capacity(stages);
    let mut first_error = None;
    for result in results {
        match result {
            Ok(report) => reports.push(report),
            Err(e) => first_error = Some(pick_root_cause(first_error, e)),
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let wall = reports
        .iter()
        .filter_map(|r| r.spans.last().map(|s| s.end))
        .max()
        .unwrap_or(wall);
    Ok(PipelineReport {
        config,
        wall,
        stages: reports,
    })
}

/// Runs stage `transport.stage()` of `stages` through one training step: what one process
/// of a multi-process pipeline runs (the threaded [`run_pipeline`] runs every stage so).
/// `watch` hears each step just before it starts, so that a process can say which
/// micro-batch it was on if it dies.
pub fn run_stage<W: StageWork>(
    work: &mut W,
    transport: &impl Transport<W::Message>,
    stages: usize,
    config: PipelineConfig,
    watch: &dyn Fn(Step),
) -> Result<StageReport, StageError<W::Error>> {
    let stage = transport.stage();
    let steps = schedule::stage_steps(config.schedule, stages, config.micro_batches, stage)?;
    let runner = StageRunner::new(stage, stages, config, Instant::now());
    runner.run_watched(work, transport, &steps, watch)
}

fn pick_root_cause<E: std::error::Error>(
    earlier: Option<StageError<E>>,
    new: StageError<E>,
) -> StageError<E> {
    let is_echo = |e: &StageError<E>| {
        matches!(
            e,
            StageError::Transport(TransportError::Disconnected { .. })
        )
    };
    match earlier {
        Some(earlier) if !is_echo(&earlier) || is_echo(&new) => earlier,
        _ => new,
    }
}

/// The recompute path's error: the manager's or the work's.
enum RecomputeError<E> {
    Checkpoint(CheckpointError),
    Work(E),
}

impl<E> From<CheckpointError> for RecomputeError<E> {
    fn from(e: CheckpointError) -> Self {
        RecomputeError::Checkpoint(e)
    }
}

/// One stage's execution of its step list.
struct StageRunner {
    stage: usize,
    stages: usize,
    config: PipelineConfig,
    epoch: Instant,
}

/// Per-run bookkeeping of a stage.
struct Progress {
    digests: Vec<Option<u64>>,
    spans: Vec<StepSpan>,
    busy: Duration,
    recompute: Duration,
    in_flight: usize,
    max_in_flight: usize,
    transients: Transients,
}

/// The bytes a pass needed above where it started (the peak was restarted before it).
fn transient(before: Option<MemoryReading>, after: Option<MemoryReading>) -> usize {
    match (before, after) {
        (Some(b), Some(a)) => a.peak.saturating_sub(b.live),
        _ => 0,
    }
}

/// Reads the stage's memory at the start of a pass; under `auto`, restarting the peak first.
fn pass_start<W: StageWork>(work: &mut W, strategy: Strategy) -> Option<MemoryReading> {
    if strategy != Strategy::Auto {
        return None;
    }
    work.restart_peak();
    work.memory()
}

impl StageRunner {
    fn new(stage: usize, stages: usize, config: PipelineConfig, epoch: Instant) -> Self {
        Self {
            stage,
            stages,
            config,
            epoch,
        }
    }

    fn run<W: StageWork>(
        &self,
        work: &mut W,
        transport: &impl Transport<W::Message>,
        steps: &[Step],
    ) -> Result<StageReport, StageError<W::Error>> {
        self.run_watched(work, transport, steps, &|_| {})
    }

    fn run_watched<W: StageWork>(
        &self,
        work: &mut W,
        transport: &impl Transport<W::Message>,
        steps: &[Step],
        watch: &dyn Fn(Step),
    ) -> Result<StageReport, StageError<W::Error>> {
        let mut manager = CheckpointManager::new(self.config.strategy, self.config.micro_batches);
        let mut progress = Progress {
            digests: vec![None; self.config.micro_batches],
            spans: Vec::with_capacity(steps.len()),
            busy: Duration::ZERO,
            recompute: Duration::ZERO,
            in_flight: 0,
            max_in_flight: 0,
            transients: work.transients().copied().unwrap_or_default(),
        };
        for (i, &step) in steps.iter().enumerate() {
            watch(step);
            match step {
                Step::Forward(m) => {
                    let rest = &steps[i + 1..];
                    self.forward(work, transport, &mut manager, &mut progress, m, rest)?
                }
                Step::Backward(m) => {
                    self.backward(work, transport, &mut manager, &mut progress, m)?
                }
            }
        }
        if let Some(kept) = work.transients() {
            kept.absorb(&progress.transients);
        }
        Ok(StageReport {
            stage: self.stage,
            busy: progress.busy,
            recompute: progress.recompute,
            spans: progress.spans,
            checkpoint: manager.stats(),
            max_in_flight: progress.max_in_flight,
        })
    }

    fn is_first(&self) -> bool {
        self.stage == 0
    }

    fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    fn forward<W: StageWork>(
        &self,
        work: &mut W,
        transport: &impl Transport<W::Message>,
        manager: &mut CheckpointManager<W::State, W::Input>,
        progress: &mut Progress,
        m: usize,
        remaining: &[Step],
    ) -> Result<(), StageError<W::Error>> {
        let received = match self.is_first() {
            true => None,
            false => Some(transport.recv_activation(m)?),
        };
        let start = Instant::now();
        let before = pass_start(work, self.config.strategy);
        let input = work.load_input(m, received).map_err(|e| self.work(m, e))?;
        let forwarded = work.forward(m, &input).map_err(|e| self.work(m, e))?;
        manager
            .keep_input(m, input)
            .map_err(|e| self.checkpoint(e))?;
        progress.digests[m] = Some(forwarded.digest);
        if let Some(output) = forwarded.output {
            transport.send_activation(m, output)?;
        }
        let after = work.memory();
        progress.transients.forward = progress.transients.forward.max(transient(before, after));
        if manager.strategy() == Strategy::Auto {
            manager.set_pressure(after.map(|a| StagePressure {
                remaining: remaining.to_vec(),
                live: a.live,
                budget: a.budget,
                transients: progress.transients,
            }));
        }
        manager
            .store_owned(m, forwarded.state)
            .map_err(|e| self.checkpoint(e))?;
        progress.in_flight += 1;
        progress.max_in_flight = progress.max_in_flight.max(progress.in_flight);
        self.record(progress, Step::Forward(m), start, false);
        Ok(())
    }

    fn backward<W: StageWork>(
        &self,
        work: &mut W,
        transport: &impl Transport<W::Message>,
        manager: &mut CheckpointManager<W::State, W::Input>,
        progress: &mut Progress,
        m: usize,
    ) -> Result<(), StageError<W::Error>> {
        let grad = match self.is_last() {
            true => None,
            false => Some(transport.recv_gradient(m)?),
        };
        let start = Instant::now();
        let before = pass_start(work, self.config.strategy);
        let (state, recomputed) = match manager.take(m) {
            Some(state) => (state, false),
            None => (self.recompute(work, manager, progress, m)?, true),
        };
        let grad_in = work.backward(m, state, grad).map_err(|e| self.work(m, e))?;
        let measured = transient(before, work.memory());
        let slot = match recomputed {
            true => &mut progress.transients.backward_recomputed,
            false => &mut progress.transients.backward,
        };
        *slot = (*slot).max(measured);
        manager.release_input(m);
        if let Some(grad_in) = grad_in {
            transport.send_gradient(m, grad_in)?;
        }
        progress.in_flight -= 1;
        self.record(progress, Step::Backward(m), start, recomputed);
        Ok(())
    }

    /// Reruns micro-batch `m`'s forward from its kept input and checks it against the original.
    fn recompute<W: StageWork>(
        &self,
        work: &mut W,
        manager: &mut CheckpointManager<W::State, W::Input>,
        progress: &mut Progress,
        m: usize,
    ) -> Result<W::State, StageError<W::Error>> {
        let start = Instant::now();
        let mut digest = None;
        let state = manager
            .recompute(m, |input| {
                let forwarded = work.forward(m, input).map_err(RecomputeError::Work)?;
                digest = Some(forwarded.digest);
                Ok(forwarded.state)
            })
            .map_err(|e| match e {
                RecomputeError::Checkpoint(e) => self.checkpoint(e),
                RecomputeError::Work(e) => self.work(m, e),
            })?;
        progress.recompute += start.elapsed();
        if digest.is_none() || progress.digests[m] != digest {
            return Err(StageError::RecomputeMismatch {
                stage: self.stage,
                micro_batch: m,
            });
        }
        Ok(state)
    }

    fn record(&self, progress: &mut Progress, step: Step, start: Instant, recomputed: bool) {
        let end = Instant::now();
        progress.busy += end - start;
        progress.spans.push(StepSpan {
            step,
            start: start - self.epoch,
            end: end - self.epoch,
            recomputed,
        });
    }

    fn work<E: std::error::Error>(&self, micro_batch: usize, source: E) -> StageError<E> {
        StageError::Work {
            stage: self.stage,
            micro_batch,
            error: source,
        }
    }

    fn checkpoint<E: std::error::Error>(&self, source: CheckpointError) -> StageError<E> {
        StageError::Checkpoint {
            stage: self.stage,
            error: source,
        }
    }
}

/// A fingerprint of f32 values' bits (FNV-1a over the bit patterns): cheap next to the
/// forward pass that produced them, and any differing bit changes it.
pub fn digest_f32(values: &[f32]) -> u64 {
    values.iter().fold(0xcbf2_9ce4_8422_2325, |hash, v| {
        (hash ^ u64::from(v.to_bits())).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests;
