//! K GPT models trained together in one step (issue 22), sharing the device pool and the
//! memory budget, each with its own parameters, AdamW state, data order (its seed) and
//! hyper-parameters. The K steps are recorded into one engine graph with K loss roots
//! ([`crate::models::multi`]), so an auto plan profiles, plans and executes the whole
//! K-model step. Model `k` sees exactly the batches, dropout masks and updates a run of it
//! alone would: its parameters after N steps are bit-identical to that run's (same thread
//! count).
//!
//! Models of one shape are fused ([`crate::models::fused`]): each op of theirs runs as one
//! call over all of them, bit-identical to running them one after another. Under a plan the
//! units are the multiplexed graph's "models".

use std::sync::Arc;

use super::error::{During, Result};
use super::task::Task;
use crate::core::graph::Graph;
use crate::models::fused::{ModelSet, SetStep, ShapeKey, record_set};
use crate::models::gpt::{Batch, Checkpointing, Gpt, GptConfig};
use crate::models::multi::{ModelStep, MultiStep, record_multi, step_optimizers, take_grads};
use crate::{AdamW, AdamWConfig, ExecContext, MemoryPool};

/// The K models' settings.
#[derive(Clone, Debug)]
pub struct Members {
    pub configs: Vec<GptConfig>,
    pub lrs: Vec<f64>,
    /// Seed of model k's initialization, data order and dropout.
    pub seeds: Vec<u64>,
}

impl Members {
    pub fn len(&self) -> usize {
        self.configs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.configs.is_empty()
    }

    /// How the models group into units for batches of `batch x seq`: same-shape models
    /// fused when `fuse`, every model a unit of its own otherwise.
    pub fn set(&self, batch: usize, seq: usize, fuse: bool) -> ModelSet {
        let keys: Vec<ShapeKey> = self
            .configs
            .iter()
            .map(|c| ShapeKey::new(c, batch, seq))
            .collect();
        ModelSet::group_keys(&keys, fuse)
    }

    /// Bytes every step holds whatever the plan: each model's parameters and its AdamW
    /// moments (two per parameter).
    pub fn resident_bytes(&self) -> Result<u64> {
        let mut total = 0u64;
        for c in &self.configs {
            total = total.saturating_add(c.param_bytes()?.saturating_mul(3));
        }
        Ok(total)
    }
}

/// The K models with their optimizers, on one pool.
pub struct Models {
    pub gpts: Vec<Gpt>,
    pub opts: Vec<AdamW>,
    pub seeds: Vec<u64>,
}

impl Models {
    pub fn new(pool: &Arc<MemoryPool>, members: &Members) -> Result<Models> {
        let mut gpts = Vec::with_capacity(members.len());
        let mut opts = Vec::with_capacity(members.len());
        for (k, config) in members.configs.iter().enumerate() {
            let gpt = Gpt::new(pool, config.clone()).during_with(|| format!("model {k}"))?;
            let opt_config = AdamWConfig {
                lr: members.lrs[k],
                weight_decay: 0.0,
                ..AdamWConfig::default()
            };
            opts.push(
                AdamW::new(pool, gpt.params(), opt_config)
                    .during_with(|| format!("model {k}'s optimizer"))?,
            );
            gpts.push(gpt);
        }
        Ok(Models {
            gpts,
            opts,
            seeds: members.seeds.clone(),
        })
    }

    /// Model k's batch of `step`: the one a run of model k alone (its seed) draws.
    pub fn batches(&self, task: &Task, step: u64, batch: usize) -> Vec<Batch> {
        self.seeds
            .iter()
            .map(|&s| task.batch(s, step, batch))
            .collect()
    }

    /// The K models' shares of step `step` on `batches`.
    fn steps<'a>(&'a self, batches: &'a [Batch], step: u64) -> Vec<ModelStep<'a>> {
        self.gpts
            .iter()
            .zip(batches)
            .zip(&self.seeds)
            .map(|((model, batch), &seed)| ModelStep {
                model,
                batch,
                seed: step_seed(seed, step),
            })
            .collect()
    }

    /// Records the K models' step `step` on `batches` into `g`, each model's ops on their
    /// own (the unfused path; see [`Models::record_set`]).
    pub fn record(
        &self,
        g: &mut Graph,
        batches: &[Batch],
        step: u64,
        ckpt: Checkpointing,
    ) -> Result<MultiStep> {
        Ok(record_multi(g, &self.steps(batches, step), ckpt)?)
    }

    /// Records the K models' step `step` on `batches` into `g` as the units of `set`: one
    /// loss root per unit ([`SetStep::roots`], for `backward_many`, the profiler and the
    /// plan executor), each model's loss read with [`SetStep::losses`] (after forward) or
    /// [`SetStep::losses_from`] (a plan's `StepReport::loss_values`), each model's
    /// gradients with `take_grads(g, &step.params)`.
    pub fn record_set(
        &self,
        g: &mut Graph,
        batches: &[Batch],
        step: u64,
        ckpt: Checkpointing,
        set: &ModelSet,
    ) -> Result<SetStep> {
        Ok(record_set(g, &self.steps(batches, step), set, ckpt)?)
    }

    /// One training step of the K models under a fixed policy, fused as `set` says:
    /// record, forward, backward from every unit's loss root, one AdamW step per model.
    /// Returns each model's loss.
    pub fn train_step(
        &mut self,
        ctx: &ExecContext,
        batches: &[Batch],
        step: u64,
        ckpt: Checkpointing,
        set: &ModelSet,
    ) -> Result<Vec<f64>> {
        let mut g = Graph::new(ctx);
        let recorded = self.record_set(&mut g, batches, step, ckpt, set)?;
        g.forward()
            .during_with(|| format!("training step {step} (forward)"))?;
        let losses = recorded.losses(&g)?;
        g.backward_many(&recorded.roots)
            .during_with(|| format!("training step {step} (backward)"))?;
        let grads = take_grads(&mut g, &recorded.params)?;
        drop(g);
        ctx.install(|| step_optimizers(&mut self.opts, &grads))?;
        Ok(losses)
    }
}

/// `set` with every unit of more than `width` models split, in model order, into units of
/// at most `width` (as even as possible: 5 models at width 2 give 2 + 2 + 1). MuTWO fuses
/// the models into a few groups and multiplexes the groups, so that one group's swaps hide
/// behind another's compute; one unit of all K leaves nothing to hide behind.
pub fn limit_fuse_width(set: &ModelSet, width: usize) -> ModelSet {
    let width = width.max(1);
    let mut units = Vec::with_capacity(set.units.len());
    for unit in &set.units {
        let parts = unit.len().div_ceil(width).max(1);
        let (base, extra) = (unit.len() / parts, unit.len() % parts);
        let mut start = 0;
        for p in 0..parts {
            let len = base + usize::from(p < extra);
            units.push(unit[start..start + len].to_vec());
            start += len;
        }
    }
    ModelSet { units }
}

/// `set`, then narrower groupings of it: the widest unit halved (rounding up) each time,
/// down to every model alone. What `--policy auto` tries, in order, when fusion is left to
/// it and the fused units need more than the budget.
pub fn narrower_fusions(set: &ModelSet) -> Vec<ModelSet> {
    let mut out = vec![set.clone()];
    let mut width = set.units.iter().map(Vec::len).max().unwrap_or(1);
    while width > 1 {
        width = width.div_ceil(2).min(width - 1);
        out.push(limit_fuse_width(set, width));
    }
    out
}

/// The dropout seed of a step, as a single-model run uses it.
pub fn step_seed(seed: u64, step: u64) -> u64 {
    seed ^ (step << 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuse_width_splits_units_evenly_in_model_order() {
        // Models 0, 1, 3, 4, 5 share a shape; model 2 has its own.
        let set = ModelSet {
            units: vec![vec![0, 1, 3, 4, 5], vec![2]],
        };
        let split = limit_fuse_width(&set, 2);
        assert_eq!(split.units, vec![vec![0, 1], vec![3, 4], vec![5], vec![2]]);
        assert_eq!(
            limit_fuse_width(&set, 3).units,
            vec![vec![0, 1, 3], vec![4, 5], vec![2]]
        );
        assert_eq!(limit_fuse_width(&set, 5).units, set.units);
        assert_eq!(limit_fuse_width(&set, 1).units.len(), 6);
        let tries: Vec<Vec<Vec<usize>>> = narrower_fusions(&set)
            .into_iter()
            .map(|s| s.units)
            .collect();
        assert_eq!(
            tries,
            vec![
                set.units.clone(),
                vec![vec![0, 1, 3], vec![4, 5], vec![2]],
                vec![vec![0, 1], vec![3, 4], vec![5], vec![2]],
                vec![vec![0], vec![1], vec![3], vec![4], vec![5], vec![2]],
            ]
        );
        // Width 0 is treated as 1 (the CLI refuses it before).
        assert_eq!(limit_fuse_width(&set, 0).units.len(), 6);
    }
}
