//! K GPT models trained together (issue 22): one graph, one device pool, one budget, each
//! model with its own parameters, data, dropout stream and loss.
//!
//! The K models' steps are recorded one after another into a single [`Graph`]: model `k`'s
//! nodes are owned by `k` ([`Graph::set_owner`]), draw their random states from stream `k`
//! ([`Graph::set_rng_stream`]) seeded as `k`'s own step would be, and are named `m{k}.NAME`
//! so the profiled planner graph tells them apart. Each model keeps its own loss root: the
//! losses are never summed (a sum would force every forward before any backward), and
//! [`Graph::backward_many`], the profiler ([`crate::plan_exec::profile::profile_step_multi`]) and the
//! plan executor ([`crate::plan_exec::Layout::build_multi`]) all take the K roots. Because
//! the models share no node, each one's gradients are accumulated exactly as when it is
//! recorded alone: parameters after N steps equal training that model by itself, bit for bit.
//!
//! This is the unfused path (`--no-fuse`): each model's ops run on their own.
//! [`crate::models::fused`] fuses the ops of same-shape models into one call each.

use crate::core::context::ExecContext;
use crate::core::error::{EngineError, Result};
use crate::core::graph::{Graph, NodeId};
use crate::core::optim::AdamW;
use crate::core::policy::Policy;
use crate::core::tensor::Tensor;
use crate::models::gpt::{Batch, Checkpointing, Gpt, GptStep};

/// One model's share of a multi-model step: its data and its dropout seed.
#[derive(Clone, Debug)]
pub struct ModelStep<'a> {
    pub model: &'a Gpt,
    pub batch: &'a Batch,
    /// The seed its graph would get alone ([`Graph::set_seed`]).
    pub seed: u64,
}

/// The nodes of a recorded multi-model step.
#[derive(Clone, Debug)]
pub struct MultiStep {
    /// Model `k`'s loss root.
    pub losses: Vec<NodeId>,
    /// Model `k`'s parameter nodes, in [`Gpt::params`] order.
    pub params: Vec<Vec<NodeId>>,
}

/// What one multi-model forward + backward produced.
#[derive(Debug)]
pub struct MultiStepOutput {
    pub losses: Vec<f64>,
    /// Model `k`'s gradients, in [`Gpt::params`] order.
    pub grads: Vec<Vec<Option<Tensor>>>,
}

/// Records the K models' steps into `g`. A whole-graph policy ([`Checkpointing::Graph`])
/// is applied once to the combined graph; segment-based checkpointing applies per model.
pub fn record_multi(
    g: &mut Graph,
    steps: &[ModelStep<'_>],
    ckpt: Checkpointing,
) -> Result<MultiStep> {
    if steps.is_empty() {
        return Err(EngineError::Invalid(
            "a multi-model step needs at least one model".into(),
        ));
    }
    let per_model = match ckpt {
        Checkpointing::Graph(_) => Checkpointing::Graph(Policy::StoreAll),
        other => other,
    };
    let mut out = MultiStep {
        losses: Vec::with_capacity(steps.len()),
        params: Vec::with_capacity(steps.len()),
    };
    for (k, step) in steps.iter().enumerate() {
        g.set_owner(Some(k));
        let recorded = record_model(g, k, step, per_model);
        g.set_owner(None);
        let recorded = recorded?;
        out.losses.push(recorded.loss);
        out.params.push(recorded.params);
    }
    if let Checkpointing::Graph(policy) = ckpt {
        policy.apply(g)?;
    }
    Ok(out)
}

/// Records model `k`'s step as it is recorded alone (with checkpointing `ckpt`), under
/// whatever owner the caller set: its nodes draw from random stream `k`, seeded with the
/// step's seed, and are named `m{k}.NAME`. The graph's stream is 0 again afterwards.
pub(crate) fn record_model(
    g: &mut Graph,
    k: usize,
    step: &ModelStep<'_>,
    ckpt: Checkpointing,
) -> Result<GptStep> {
    let first = g.len();
    g.set_rng_stream(k);
    g.set_stream_seed(k, step.seed);
    let recorded = step.model.record(g, step.batch, ckpt);
    g.set_rng_stream(0);
    let recorded = recorded?;
    for index in first..g.len() {
        let id = NodeId(index);
        let name = format!("m{k}.{}", g.name(id)?);
        g.set_name(id, name)?;
    }
    Ok(recorded)
}

/// Records the K models' step, runs forward and one backward from the K loss roots, and
/// returns each model's loss and gradients.
pub fn forward_backward_multi(
    ctx: &ExecContext,
    steps: &[ModelStep<'_>],
    ckpt: Checkpointing,
) -> Result<MultiStepOutput> {
    let mut g = Graph::new(ctx);
    let step = record_multi(&mut g, steps, ckpt)?;
    g.forward()?;
    let losses = step
        .losses
        .iter()
        .map(|&l| g.scalar(l))
        .collect::<Result<Vec<_>>>()?;
    g.backward_many(&step.losses)?;
    let grads = take_grads(&mut g, &step.params)?;
    Ok(MultiStepOutput { losses, grads })
}

/// Takes each model's gradients out of a graph whose backward ran.
pub fn take_grads(g: &mut Graph, params: &[Vec<NodeId>]) -> Result<Vec<Vec<Option<Tensor>>>> {
    params
        .iter()
        .map(|ps| ps.iter().map(|&p| g.take_grad(p)).collect())
        .collect()
}

/// One optimizer step per model, each on its own gradients.
pub fn step_optimizers(opts: &mut [AdamW], grads: &[Vec<Option<Tensor>>]) -> Result<()> {
    if opts.len() != grads.len() {
        return Err(EngineError::Invalid(format!(
            "{} optimizers for the gradients of {} models",
            opts.len(),
            grads.len()
        )));
    }
    opts.iter_mut()
        .zip(grads)
        .try_for_each(|(opt, g)| opt.step(g))
}

#[cfg(test)]
mod tests;
