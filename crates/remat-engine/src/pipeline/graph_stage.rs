//! Pipeline stages over engine graphs. A stage owns a contiguous range of a model's layers
//! (the first stage also the entry, e.g. the token embedding; the last the exit: final norm,
//! head and loss), copies of their parameters in its own memory pool, and gradient
//! accumulators; per micro-batch it records its layers on a fresh graph, runs it forward and,
//! in backward, from the upstream gradient back to its input.
//!
//! What the checkpoint manager keeps per micro-batch is the recorded graph with its
//! activations ([`StageGraph`]); dropping it frees them, and recomputing it means recording
//! and running the stage's forward again from the kept input.

use std::ops::Range;
use std::sync::Arc;

use super::activation::{Activation, DeepCopy, HostTensor};
use super::auto::Transients;
use super::runner::{Forwarded, MemoryReading, StageWork, digest_f32};
use crate::core::context::ExecContext;
use crate::core::error::EngineError;
use crate::core::graph::{Graph, NodeId};
use crate::core::pool::{Category, MemoryPool, PoolStats};
use crate::core::rng::mix64;
use crate::core::tensor::Tensor;

/// A piece of a staged model that owns parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Before the first layer (the first stage's).
    Entry,
    Layer(usize),
    /// After the last layer, ending in the loss (the last stage's).
    Exit,
}

/// A model cut into a chain of layers, as pipeline stages record it.
///
/// The parts must record, in order entry, layers, exit, exactly the nodes the model's own
/// single-graph builder ([`StagedModel::record_reference`]) records, so that a pipeline's
/// gradients can equal a single-stage run bit for bit.
pub trait StagedModel: Sync {
    /// One micro-batch's data (inputs and targets).
    type MicroBatch: Send + Sync;

    fn layers(&self) -> usize;

    /// `(name, tensor)` of the parameters of `part`, in the order the record methods take
    /// their parameter nodes.
    fn part_params(&self, part: Part) -> Vec<(String, Tensor)>;

    /// Records the entry on the first stage; returns the hidden state fed to layer 0.
    fn record_entry(
        &self,
        g: &mut Graph,
        batch: &Self::MicroBatch,
        params: &[NodeId],
    ) -> Result<NodeId, EngineError>;

    /// Records layer `layer` on hidden state `x`.
    fn record_layer(
        &self,
        g: &mut Graph,
        layer: usize,
        x: NodeId,
        params: &[NodeId],
    ) -> Result<NodeId, EngineError>;

    /// Records the exit on the last stage; returns the scalar loss.
    fn record_exit(
        &self,
        g: &mut Graph,
        x: NodeId,
        batch: &Self::MicroBatch,
        params: &[NodeId],
    ) -> Result<NodeId, EngineError>;

    /// Bytes of a micro-batch's entry data (what the first stage keeps to recompute from).
    fn batch_bytes(&self, batch: &Self::MicroBatch) -> usize;

    /// The model's own whole-model builder (the single-stage reference): returns the loss and
    /// the parameter nodes in part order (entry, layers, exit).
    fn record_reference(
        &self,
        g: &mut Graph,
        batch: &Self::MicroBatch,
    ) -> Result<(NodeId, Vec<NodeId>), EngineError>;

    /// Every part in order: entry, layers, exit.
    fn parts(&self) -> Vec<Part> {
        let mut parts = vec![Part::Entry];
        parts.extend((0..self.layers()).map(Part::Layer));
        parts.push(Part::Exit);
        parts
    }
}

/// The seed of micro-batch `micro_batch`'s random ops in training step `step_seed`; the
/// pipeline and the single-stage reference use the same one.
pub fn micro_batch_seed(step_seed: u64, micro_batch: usize) -> u64 {
    mix64(step_seed, micro_batch as u64)
}

/// What crosses a stage boundary: an activation (forward) or its gradient (backward).
#[derive(Clone, Debug, PartialEq)]
pub struct Boundary {
    pub tensor: HostTensor,
    /// Forward only: where the sender's random stream stopped, so the receiver's random ops
    /// continue it exactly as in a single graph of the whole model.
    pub rng_offset: u64,
}

/// What a stage keeps per micro-batch to recompute its forward pass from.
#[derive(Clone, Debug)]
pub enum StageInput {
    /// First stage: micro-batch data owned by the caller (`bytes` of it).
    Batch { bytes: usize },
    /// Other stages: the received activation, in the stage's pool.
    Hidden { tensor: Tensor, rng_offset: u64 },
}

impl Activation for StageInput {
    fn byte_size(&self) -> usize {
        match self {
            StageInput::Batch { bytes } => *bytes,
            StageInput::Hidden { tensor, .. } => tensor.bytes() as usize,
        }
    }

    fn shape(&self) -> Vec<usize> {
        match self {
            StageInput::Batch { bytes } => vec![*bytes],
            StageInput::Hidden { tensor, .. } => tensor.shape().to_vec(),
        }
    }
}

/// One micro-batch's forward state on a stage: the graph with every activation backward
/// will read.
pub struct StageGraph {
    graph: Graph,
    /// The received activation's node (not on the first stage).
    input: Option<NodeId>,
    /// The stage's output: the hidden state sent on, or the loss on the last stage.
    output: NodeId,
    /// Parameter nodes, in the order of the stage's parameter list.
    params: Vec<NodeId>,
    bytes: usize,
    shape: Vec<usize>,
}

impl Activation for StageGraph {
    fn byte_size(&self) -> usize {
        self.bytes
    }

    fn shape(&self) -> Vec<usize> {
        self.shape.clone()
    }
}

impl Activation for Tensor {
    fn byte_size(&self) -> usize {
        self.bytes() as usize
    }

    fn shape(&self) -> Vec<usize> {
        Tensor::shape(self).to_vec()
    }
}

impl DeepCopy for Tensor {
    type CopyError = EngineError;

    fn deep_copy(&self) -> Result<Self, EngineError> {
        Tensor::deep_copy(self, self.category()).map_err(|e| e.at("checkpoint copy"))
    }
}

/// Bytes of activations a graph holds: values and auxiliary tensors of its op nodes (the
/// inputs and parameters are counted elsewhere).
fn held_activation_bytes(g: &Graph) -> usize {
    g.nodes
        .iter()
        .filter(|n| !n.is_leaf())
        .map(|n| {
            let value = n.value.as_ref().map_or(0, Tensor::bytes);
            value + n.aux.iter().map(Tensor::bytes).sum::<u64>()
        })
        .sum::<u64>() as usize
}

/// Errors of a graph stage; the runner adds the stage and micro-batch.
#[derive(Debug, thiserror::Error)]
pub enum GraphStageError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("{0}")]
    Boundary(String),
}

/// One stage of a pipeline over a [`StagedModel`].
pub struct GraphStage<'m, M: StagedModel> {
    model: &'m M,
    stage: usize,
    stages: usize,
    layers: Range<usize>,
    ctx: ExecContext,
    /// The parts this stage owns with their parameters' copies in this stage's pool.
    parts: Vec<(Part, Vec<(String, Tensor)>)>,
    grads: Vec<Tensor>,
    batches: Arc<[M::MicroBatch]>,
    step_seed: u64,
    losses: Vec<Option<f64>>,
    /// The `auto` stage policy's measurements, kept from step to step.
    transients: Transients,
    /// The step's peaks before the pool's peak was last restarted (by `auto`'s per-pass
    /// measurements); [`GraphStage::pool_stats`] folds them in.
    step_peaks: PoolStats,
}

impl<'m, M: StagedModel> GraphStage<'m, M> {
    /// Stage `stage` of `stages`, owning `layers`, on its own pool `pool` with `threads`
    /// kernel threads; copies its parameters into that pool.
    pub fn new(
        model: &'m M,
        stage: usize,
        stages: usize,
        layers: Range<usize>,
        pool: Arc<MemoryPool>,
        threads: usize,
    ) -> Result<Self, EngineError> {
        let ctx = ExecContext::new(pool, threads)?;
        let mut owned = Vec::new();
        if stage == 0 {
            owned.push(Part::Entry);
        }
        owned.extend(layers.clone().map(Part::Layer));
        if stage + 1 == stages {
            owned.push(Part::Exit);
        }
        let mut parts = Vec::with_capacity(owned.len());
        let mut grads = Vec::new();
        for part in owned {
            let mut copies = Vec::new();
            for (name, t) in model.part_params(part) {
                let copy = copy_into(ctx.pool(), &name, &t, Category::Parameters)?;
                grads.push(
                    Tensor::zeros(ctx.pool(), t.shape(), t.dtype(), Category::Gradients, None)
                        .map_err(|e| e.at(format!("gradient of {name}")))?,
                );
                copies.push((name, copy));
            }
            parts.push((part, copies));
        }
        Ok(Self {
            model,
            stage,
            stages,
            layers,
            ctx,
            parts,
            grads,
            batches: Arc::from(Vec::new()),
            step_seed: 0,
            losses: Vec::new(),
            transients: Transients::default(),
            step_peaks: PoolStats::default(),
        })
    }

    /// Sets the micro-batches and seed of the next training step and zeroes the gradients.
    pub fn begin_step(
        &mut self,
        batches: Arc<[M::MicroBatch]>,
        step_seed: u64,
    ) -> Result<(), EngineError> {
        self.losses = vec![None; batches.len()];
        self.batches = batches;
        self.step_seed = step_seed;
        for g in &self.grads {
            g.write().as_mut_slice::<f32>()?.fill(0.0);
        }
        self.ctx.pool().reset_peak();
        self.step_peaks = PoolStats::default();
        Ok(())
    }

    pub fn stage(&self) -> usize {
        self.stage
    }

    pub fn layer_range(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// The pool's statistics, with peaks over the whole step.
    pub fn pool_stats(&self) -> PoolStats {
        let mut stats = self.ctx.pool().stats();
        stats.peak = stats.peak.max(self.step_peaks.peak);
        for (c, earlier) in stats.categories.iter_mut().zip(&self.step_peaks.categories) {
            c.peak = c.peak.max(earlier.peak);
        }
        stats
    }

    pub fn context(&self) -> &ExecContext {
        &self.ctx
    }

    /// `(name, parameter)` of this stage's parameters, in model order.
    pub fn params(&self) -> Vec<(String, Tensor)> {
        self.parts
            .iter()
            .flat_map(|(_, p)| p.iter().cloned())
            .collect()
    }

    /// Gradients accumulated over the step's micro-batches, in [`Self::params`] order.
    pub fn grads(&self) -> &[Tensor] {
        &self.grads
    }

    /// Losses of the step's micro-batches (last stage only; `None` elsewhere).
    pub fn losses(&self) -> &[Option<f64>] {
        &self.losses
    }

    fn is_first(&self) -> bool {
        self.stage == 0
    }

    fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    fn batch(&self, m: usize) -> Result<&M::MicroBatch, GraphStageError> {
        self.batches.get(m).ok_or_else(|| {
            GraphStageError::Boundary(format!(
                "micro-batch {m} does not exist: the step has {} micro-batches",
                self.batches.len()
            ))
        })
    }

    /// Records the stage's nodes for micro-batch `m` on `g`.
    fn record(
        &self,
        g: &mut Graph,
        m: usize,
        input: &StageInput,
    ) -> Result<Recorded, GraphStageError> {
        let mut part_nodes = Vec::with_capacity(self.parts.len());
        for (part, params) in &self.parts {
            let ids: Vec<NodeId> = params.iter().map(|(name, t)| g.param(name, t)).collect();
            part_nodes.push((*part, ids));
        }
        let nodes_of = |part: Part| {
            part_nodes
                .iter()
                .find(|(p, _)| *p == part)
                .map(|(_, ids)| ids.as_slice())
                .unwrap_or(&[])
        };
        let (mut x, input_node) = match input {
            StageInput::Batch { .. } => (
                self.model
                    .record_entry(g, self.batch(m)?, nodes_of(Part::Entry))?,
                None,
            ),
            StageInput::Hidden { tensor, .. } => {
                let id = g.input_with_grad(&format!("stage{}.input", self.stage), tensor.clone());
                (id, Some(id))
            }
        };
        for l in self.layers.clone() {
            x = self.model.record_layer(g, l, x, nodes_of(Part::Layer(l)))?;
        }
        if self.is_last() {
            x = self
                .model
                .record_exit(g, x, self.batch(m)?, nodes_of(Part::Exit))?;
        }
        let params = part_nodes.into_iter().flat_map(|(_, ids)| ids).collect();
        Ok(Recorded {
            input: input_node,
            output: x,
            params,
        })
    }
}

/// The nodes of a recorded stage graph the runner needs later.
struct Recorded {
    input: Option<NodeId>,
    output: NodeId,
    params: Vec<NodeId>,
}

/// Copies `t` into `pool` (another stage's device) under `category`.
fn copy_into(
    pool: &Arc<MemoryPool>,
    name: &str,
    t: &Tensor,
    category: Category,
) -> Result<Tensor, EngineError> {
    Tensor::from_vec(pool, name, t.shape(), t.to_vec::<f32>()?, category)
}

/// `acc += g`, element by element (the one accumulation both the pipeline and the reference use).
pub fn accumulate(acc: &Tensor, g: &Tensor) -> Result<(), EngineError> {
    if acc.shape() != g.shape() {
        return Err(EngineError::Invalid(format!(
            "gradient of shape {:?} added to an accumulator of shape {:?}",
            g.shape(),
            acc.shape()
        )));
    }
    let src = g.read();
    let src = src.as_slice::<f32>()?;
    let mut dst = acc.write();
    for (a, b) in dst.as_mut_slice::<f32>()?.iter_mut().zip(src) {
        *a += *b;
    }
    Ok(())
}

fn to_host(t: &Tensor) -> Result<HostTensor, GraphStageError> {
    HostTensor::f32(t.shape().to_vec(), t.to_vec::<f32>()?)
        .map_err(|e| GraphStageError::Boundary(e.to_string()))
}

impl<M: StagedModel> StageWork for GraphStage<'_, M> {
    type Input = StageInput;
    type State = StageGraph;
    type Message = Boundary;
    type Error = GraphStageError;

    fn load_input(
        &mut self,
        m: usize,
        received: Option<Boundary>,
    ) -> Result<StageInput, GraphStageError> {
        match received {
            None if self.is_first() => Ok(StageInput::Batch {
                bytes: self.model.batch_bytes(self.batch(m)?),
            }),
            Some(b) if !self.is_first() => {
                let data = b.tensor.as_f32().ok_or_else(|| {
                    GraphStageError::Boundary(format!(
                        "the activation of micro-batch {m} is not f32"
                    ))
                })?;
                let name = format!("stage{}.input", self.stage);
                let tensor = Tensor::from_vec(
                    self.ctx.pool(),
                    &name,
                    &b.tensor.shape,
                    data.to_vec(),
                    Category::Activations,
                )?;
                Ok(StageInput::Hidden {
                    tensor,
                    rng_offset: b.rng_offset,
                })
            }
            _ => Err(GraphStageError::Boundary(format!(
                "stage {} of {} got {} input for micro-batch {m}",
                self.stage,
                self.stages,
                if self.is_first() {
                    "a neighbour's"
                } else {
                    "no"
                }
            ))),
        }
    }

    fn forward(
        &mut self,
        m: usize,
        input: &StageInput,
    ) -> Result<Forwarded<StageGraph, Boundary>, GraphStageError> {
        let mut g = Graph::new(&self.ctx);
        g.set_seed(micro_batch_seed(self.step_seed, m));
        if let StageInput::Hidden { rng_offset, .. } = input {
            g.rng.stream(0).draw(*rng_offset);
        }
        let recorded = self.record(&mut g, m, input)?;
        g.forward()?;
        let value = g.value(recorded.output)?;
        let host = to_host(&value)?;
        let digest = host.as_f32().map_or(0, digest_f32);
        if self.is_last() {
            self.losses[m] = Some(g.scalar(recorded.output)?);
        }
        let output = (!self.is_last()).then(|| Boundary {
            tensor: host,
            rng_offset: g.rng.stream(0).state().offset,
        });
        let state = StageGraph {
            bytes: held_activation_bytes(&g),
            shape: value.shape().to_vec(),
            graph: g,
            input: recorded.input,
            output: recorded.output,
            params: recorded.params,
        };
        Ok(Forwarded {
            state,
            output,
            digest,
        })
    }

    fn backward(
        &mut self,
        m: usize,
        state: StageGraph,
        grad: Option<Boundary>,
    ) -> Result<Option<Boundary>, GraphStageError> {
        let StageGraph {
            mut graph,
            input,
            output,
            params,
            ..
        } = state;
        match grad {
            None if self.is_last() => graph.backward(output)?,
            Some(b) if !self.is_last() => {
                let data = b.tensor.as_f32().ok_or_else(|| {
                    GraphStageError::Boundary(format!("the gradient of micro-batch {m} is not f32"))
                })?;
                let name = format!("stage{}.output_grad", self.stage);
                let seed = Tensor::from_vec(
                    self.ctx.pool(),
                    &name,
                    &b.tensor.shape,
                    data.to_vec(),
                    Category::Temporaries,
                )?;
                graph.backward_with(output, seed)?;
            }
            _ => {
                return Err(GraphStageError::Boundary(format!(
                    "stage {} of {}: unexpected gradient message for micro-batch {m}",
                    self.stage, self.stages
                )));
            }
        }
        for (acc, &id) in self.grads.iter().zip(&params) {
            if let Some(g) = graph.take_grad(id)? {
                accumulate(acc, &g)?;
            }
        }
        let Some(input) = input else { return Ok(None) };
        let grad_in = graph.take_grad(input)?.ok_or_else(|| {
            GraphStageError::Boundary(format!(
                "stage {}: backward left no gradient for the stage input",
                self.stage
            ))
        })?;
        Ok(Some(Boundary {
            tensor: to_host(&grad_in)?,
            rng_offset: 0,
        }))
    }

    fn restart_peak(&mut self) {
        self.step_peaks = self.pool_stats();
        self.ctx.pool().reset_peak();
    }

    fn transients(&mut self) -> Option<&mut Transients> {
        Some(&mut self.transients)
    }

    fn memory(&self) -> Option<MemoryReading> {
        let stats = self.ctx.pool().stats();
        let size = |b: u64| usize::try_from(b).unwrap_or(usize::MAX);
        Some(MemoryReading {
            live: size(stats.live),
            peak: size(stats.peak),
            budget: size(stats.budget?),
        })
    }
}
