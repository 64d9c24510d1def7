//! Horizontal fusion of K GPT models (issue 22, item 2): models of one shape train as one
//! fused unit whose every op runs once for all of them ([`crate::core::ops::fused`]: one grouped
//! gemm over the K weight matrices, one attention over the K batches, one norm, one loss
//! giving a `[K]` vector of losses), forward and backward.
//!
//! A [`ModelSet`] groups the models of a step into units: models whose shapes agree (every
//! [`GptConfig`] field but dropout and the init seed, and the batch shape) form one fused
//! unit; a model of its own shape, or every model when fusion is off, is a unit of one,
//! recorded exactly as [`crate::models::multi::record_multi`] records it. Each unit's nodes
//! are owned by the unit's index ([`Graph::set_owner`]), so a multiplexed plan schedules
//! units as its "models"; model `k`'s random numbers always come from stream `k` seeded as
//! alone, and every model keeps its own parameter nodes (the fused ops take the K weights
//! as separate inputs, nothing is stacked), so its gradients, AdamW state and checkpoints
//! are its own. Each fused op computes slice `k` with the kernel call the unfused op makes
//! on model `k`: losses, gradients and parameters after any number of steps are
//! bit-identical to training each model alone, fused or not, under every plan.

use crate::core::context::ExecContext;
use crate::core::error::{EngineError, Result};
use crate::core::graph::{Graph, NodeId};
use crate::core::policy::Policy;
use crate::models::gpt::{BlockNodes, Checkpointing, GptConfig};
use crate::models::multi::{ModelStep, MultiStepOutput, record_model, take_grads};

/// What models must share to be fused: every size and constant of the computation (the
/// config without its dropout probability and init seed) and the batch shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeKey {
    config: GptConfig,
    batch: usize,
    seq: usize,
}

impl ShapeKey {
    pub fn new(config: &GptConfig, batch: usize, seq: usize) -> Self {
        ShapeKey {
            config: GptConfig {
                dropout: 0.0,
                init_seed: 0,
                ..config.clone()
            },
            batch,
            seq,
        }
    }

    fn of(step: &ModelStep<'_>) -> Self {
        Self::new(&step.model.config, step.batch.batch, step.batch.seq)
    }
}

/// Whether two models can share a fused unit (equal [`ShapeKey`]s).
pub fn same_shape(a: &ModelStep<'_>, b: &ModelStep<'_>) -> bool {
    ShapeKey::of(a) == ShapeKey::of(b)
}

/// How the models of a step are grouped: `units[u]` lists unit `u`'s models, ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSet {
    pub units: Vec<Vec<usize>>,
}

impl ModelSet {
    /// With `fuse`, models of one shape form one unit (in order of their first model);
    /// without, each model is a unit of its own (the `--no-fuse` path).
    pub fn group(steps: &[ModelStep<'_>], fuse: bool) -> ModelSet {
        let keys: Vec<ShapeKey> = steps.iter().map(ShapeKey::of).collect();
        Self::group_keys(&keys, fuse)
    }

    /// [`ModelSet::group`] from the models' shapes alone (before any model is built).
    pub fn group_keys(keys: &[ShapeKey], fuse: bool) -> ModelSet {
        let mut units: Vec<Vec<usize>> = Vec::new();
        for k in 0..keys.len() {
            match units.iter_mut().find(|u| fuse && keys[u[0]] == keys[k]) {
                Some(u) => u.push(k),
                None => units.push(vec![k]),
            }
        }
        ModelSet { units }
    }

    /// Unit `u`'s label in node names and reports: `m0+2` for models 0 and 2.
    pub fn label(&self, unit: usize) -> String {
        let models = self.units.get(unit).map_or(&[][..], Vec::as_slice);
        let names: Vec<String> = models.iter().map(|k| k.to_string()).collect();
        format!("m{}", names.join("+"))
    }

    /// The units of more than one model (the fused ones).
    pub fn fused_units(&self) -> impl Iterator<Item = &Vec<usize>> {
        self.units.iter().filter(|u| u.len() > 1)
    }

    /// Model count over all units.
    pub fn models(&self) -> usize {
        self.units.iter().map(Vec::len).sum()
    }

    /// The unit of each model.
    pub fn unit_of(&self) -> Vec<usize> {
        let mut of = vec![0; self.models()];
        for (u, models) in self.units.iter().enumerate() {
            for &k in models {
                if let Some(slot) = of.get_mut(k) {
                    *slot = u;
                }
            }
        }
        of
    }
}

/// The nodes of a recorded step of a model set.
#[derive(Clone, Debug)]
pub struct SetStep {
    pub set: ModelSet,
    /// Unit `u`'s loss root: a `[K]` vector for a fused unit, a scalar for a unit of one;
    /// ascending node ids (units are recorded in order). [`Graph::backward_many`] seeds
    /// each with ones, the seed each model's scalar loss gets alone.
    pub roots: Vec<NodeId>,
    /// Model `k`'s parameter nodes, in [`crate::models::gpt::Gpt::params`] order.
    pub params: Vec<Vec<NodeId>>,
    /// Model `k`'s loss: element `.1` of root `.0`.
    loss_at: Vec<(usize, usize)>,
}

impl SetStep {
    /// Each model's loss, read from the roots' values after forward.
    pub fn losses(&self, g: &Graph) -> Result<Vec<f64>> {
        let values = self
            .roots
            .iter()
            .map(|&r| Ok(g.value(r)?.to_f64_vec()))
            .collect::<Result<Vec<_>>>()?;
        self.losses_from(&values)
    }

    /// Each model's loss from the roots' values (in [`Self::roots`] order, e.g. a plan
    /// executor's `StepReport::loss_values`).
    pub fn losses_from(&self, root_values: &[Vec<f64>]) -> Result<Vec<f64>> {
        self.loss_at
            .iter()
            .enumerate()
            .map(|(k, &(root, slot))| {
                root_values
                    .get(root)
                    .and_then(|v| v.get(slot))
                    .copied()
                    .ok_or_else(|| {
                        EngineError::Invalid(format!(
                            "no value for model {k}'s loss (element {slot} of root {root})"
                        ))
                    })
            })
            .collect()
    }
}

/// Records the step of every model of `steps` into `g`, grouped into units as `set` says.
/// A whole-graph policy ([`Checkpointing::Graph`]) is applied once to the combined graph;
/// segment checkpointing applies per unit.
pub fn record_set(
    g: &mut Graph,
    steps: &[ModelStep<'_>],
    set: &ModelSet,
    ckpt: Checkpointing,
) -> Result<SetStep> {
    check_set(steps, set)?;
    let per_unit = match ckpt {
        Checkpointing::Graph(_) => Checkpointing::Graph(Policy::StoreAll),
        other => other,
    };
    let mut out = SetStep {
        set: set.clone(),
        roots: Vec::with_capacity(set.units.len()),
        params: vec![Vec::new(); steps.len()],
        loss_at: vec![(0, 0); steps.len()],
    };
    for (u, models) in set.units.iter().enumerate() {
        for &k in models {
            g.set_stream_seed(k, steps[k].seed);
        }
        g.set_owner(Some(u));
        let recorded = match models.as_slice() {
            [k] => record_model(g, *k, &steps[*k], per_unit).map(|s| (s.loss, vec![s.params])),
            _ => {
                let unit: Vec<(usize, &ModelStep)> =
                    models.iter().map(|&k| (k, &steps[k])).collect();
                record_unit(g, &set.label(u), &unit, per_unit)
            }
        };
        g.set_owner(None);
        g.set_rng_stream(0);
        let (root, params) = recorded?;
        for (slot, (&k, p)) in models.iter().zip(params).enumerate() {
            out.params[k] = p;
            out.loss_at[k] = (u, slot);
        }
        out.roots.push(root);
    }
    if let Checkpointing::Graph(policy) = ckpt {
        policy.apply(g)?;
    }
    Ok(out)
}

/// Every model in exactly one unit, and every fused unit of one shape.
fn check_set(steps: &[ModelStep<'_>], set: &ModelSet) -> Result<()> {
    let mut seen = vec![false; steps.len()];
    for (u, models) in set.units.iter().enumerate() {
        let Some(&first) = models.first() else {
            return Err(EngineError::Invalid(format!("unit {u} has no model")));
        };
        for &k in models {
            if k >= steps.len() || std::mem::replace(&mut seen[k], true) {
                return Err(EngineError::Invalid(format!(
                    "unit {u} lists model {k}, which is not one of the {} models or is in \
                     another unit too",
                    steps.len()
                )));
            }
            if first < steps.len() && !same_shape(&steps[first], &steps[k]) {
                return Err(EngineError::Invalid(format!(
                    "unit {u} fuses models {first} and {k} of different shapes ({:?} batch {}x{} \
                     against {:?} batch {}x{})",
                    steps[first].model.config,
                    steps[first].batch.batch,
                    steps[first].batch.seq,
                    steps[k].model.config,
                    steps[k].batch.batch,
                    steps[k].batch.seq
                )));
            }
        }
    }
    if let Some(k) = seen.iter().position(|s| !s) {
        return Err(EngineError::Invalid(format!("model {k} is in no unit")));
    }
    if steps.is_empty() {
        return Err(EngineError::Invalid(
            "a multi-model step needs at least one model".into(),
        ));
    }
    Ok(())
}

/// Records one fused unit (models `unit[i].0`, all of one shape): returns its `[K]` loss
/// and each model's parameter nodes.
fn record_unit(
    g: &mut Graph,
    label: &str,
    unit: &[(usize, &ModelStep<'_>)],
    ckpt: Checkpointing,
) -> Result<(NodeId, Vec<Vec<NodeId>>)> {
    let c = &unit[0].1.model.config;
    let (batch, seq) = (unit[0].1.batch.batch, unit[0].1.batch.seq);
    let params: Vec<Vec<NodeId>> = unit
        .iter()
        .map(|&(k, step)| {
            g.set_rng_stream(k);
            let ps = step.model.params();
            ps.iter()
                .map(|(name, t)| g.param(&format!("m{k}.{name}"), t))
                .collect()
        })
        .collect();
    g.set_rng_stream(unit[0].0);
    let fused = FusedModels {
        config: c,
        label,
        dropout: unit.iter().map(|(_, s)| s.model.config.dropout).collect(),
        streams: unit.iter().map(|&(k, _)| k).collect(),
    };
    let at = |i: usize| -> Vec<NodeId> { params.iter().map(|p| p[i]).collect() };
    let ids = unit.iter().map(|(_, s)| s.batch.tokens.clone()).collect();
    let mut x = g.fused_embedding(&at(0), ids, &[batch, seq])?;
    fused.name(g, x, "embed")?;
    let blocks: Vec<Vec<BlockNodes>> = (0..c.n_layers)
        .map(|l| {
            params
                .iter()
                .map(|p| BlockNodes::from_slice(&p[1 + 9 * l..10 + 9 * l]))
                .collect()
        })
        .collect();
    x = fused.blocks(g, x, &blocks, ckpt)?;
    let n = params[0].len();
    let h = g.fused_rmsnorm(x, &at(n - 2), c.norm_eps)?;
    fused.name(g, h, "final_norm")?;
    let logits = g.grouped_matmul(h, &at(n - 1))?;
    fused.name(g, logits, "lm_head")?;
    let targets = unit.iter().map(|(_, s)| s.batch.targets.clone()).collect();
    let loss = g.fused_cross_entropy(logits, targets)?;
    fused.name(g, loss, "loss")?;
    Ok((loss, params))
}

/// What the fused blocks of one unit share.
struct FusedModels<'a> {
    config: &'a GptConfig,
    label: &'a str,
    /// Per model of the unit.
    dropout: Vec<f32>,
    streams: Vec<usize>,
}

impl FusedModels<'_> {
    fn name(&self, g: &mut Graph, id: NodeId, part: &str) -> Result<()> {
        g.set_name(id, format!("{}.{part}", self.label))
    }

    /// The blocks, segmented as [`crate::models::gpt::Gpt::record`] segments them (the
    /// last segment never checkpointed).
    fn blocks(
        &self,
        g: &mut Graph,
        mut x: NodeId,
        blocks: &[Vec<BlockNodes>],
        ckpt: Checkpointing,
    ) -> Result<NodeId> {
        let layers = blocks.len();
        let per_segment = ckpt.blocks_per_segment(layers);
        let mut i = 0;
        while i < layers {
            let end = per_segment.map_or(layers, |n| (i + n).min(layers));
            let run = |g: &mut Graph, mut h: NodeId| -> Result<NodeId> {
                for (l, ws) in blocks.iter().enumerate().take(end).skip(i) {
                    h = self.block(g, l, h, ws)?;
                }
                Ok(h)
            };
            x = match per_segment {
                Some(_) if end < layers => g.segment(|g| run(g, x))?,
                _ => run(g, x)?,
            };
            i = end;
        }
        Ok(x)
    }

    /// [`crate::models::gpt::block_forward`] for every model of the unit at once.
    fn block(&self, g: &mut Graph, layer: usize, x: NodeId, ws: &[BlockNodes]) -> Result<NodeId> {
        let c = self.config;
        let name = |g: &mut Graph, id: NodeId, part: &str| {
            self.name(g, id, &format!("layers.{layer}.{part}"))
        };
        let w = |f: fn(&BlockNodes) -> NodeId| -> Vec<NodeId> { ws.iter().map(f).collect() };
        let h = g.fused_rmsnorm(x, &w(|b| b.attn_norm), c.norm_eps)?;
        name(g, h, "input_layernorm")?;
        let q = g.grouped_matmul(h, &w(|b| b.q_proj))?;
        let k = g.grouped_matmul(h, &w(|b| b.k_proj))?;
        let v = g.grouped_matmul(h, &w(|b| b.v_proj))?;
        name(g, q, "q_proj")?;
        name(g, k, "k_proj")?;
        name(g, v, "v_proj")?;
        let a = g.attention(q, k, v, c.attention())?;
        name(g, a, "self_attn")?;
        let mut o = g.grouped_matmul(a, &w(|b| b.o_proj))?;
        name(g, o, "o_proj")?;
        o = self.dropout(g, o, layer, "attn_dropout")?;
        let x = g.add(x, o)?;
        name(g, x, "attn_residual")?;
        let h = g.fused_rmsnorm(x, &w(|b| b.mlp_norm), c.norm_eps)?;
        name(g, h, "post_attention_layernorm")?;
        let gate = g.grouped_matmul(h, &w(|b| b.gate_proj))?;
        let up = g.grouped_matmul(h, &w(|b| b.up_proj))?;
        name(g, gate, "gate_proj")?;
        name(g, up, "up_proj")?;
        let act = g.swiglu(gate, up)?;
        name(g, act, "swiglu")?;
        let mut d = g.grouped_matmul(act, &w(|b| b.down_proj))?;
        name(g, d, "down_proj")?;
        d = self.dropout(g, d, layer, "mlp_dropout")?;
        let out = g.add(x, d)?;
        name(g, out, "output")?;
        Ok(out)
    }

    /// A fused dropout when any model of the unit has dropout (models without it pass
    /// through unchanged and draw nothing), else no node, as a model alone records none.
    fn dropout(&self, g: &mut Graph, x: NodeId, layer: usize, part: &str) -> Result<NodeId> {
        if self.dropout.iter().all(|&p| p == 0.0) {
            return Ok(x);
        }
        let d = g.fused_dropout(x, &self.dropout, &self.streams)?;
        self.name(g, d, &format!("layers.{layer}.{part}"))?;
        Ok(d)
    }
}

/// Records the set's step, runs forward and one backward from every unit's loss root, and
/// returns each model's loss and gradients.
pub fn forward_backward_set(
    ctx: &ExecContext,
    steps: &[ModelStep<'_>],
    set: &ModelSet,
    ckpt: Checkpointing,
) -> Result<MultiStepOutput> {
    let mut g = Graph::new(ctx);
    let step = record_set(&mut g, steps, set, ckpt)?;
    g.forward()?;
    let losses = step.losses(&g)?;
    g.backward_many(&step.roots)?;
    let grads = take_grads(&mut g, &step.params)?;
    Ok(MultiStepOutput { losses, grads })
}

#[cfg(test)]
mod tests;
