//! Measuring a spec model for mixed plans: peaks per phase from the pool, recompute and
//! transfer times from the runtime's trace (see [`crate::spec::run::meter::Trace`]).
//!
//! Runs, all of the real model's step: one with everything kept (phase peaks of the
//! forwards, the head and the tail; the bytes the other layers' gradients hold at each
//! backward); then runs giving each layer's backward peak under a subset of its recompute
//! units, every layer of a class at another subset (a layer's backward peak depends on its
//! own subset only), until every subset of every class is measured; `rounds` timed runs
//! of everything kept, and of every candidate offloaded, for the base step time and the
//! transfer times. Times are medians over runs and over the layers of a class.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::spec::compile::{LayerChoice, Mode, Plan, Resolved};
use crate::spec::run::meter::{Meter, Phase, Trace};
use crate::spec::{BlockSpec, ModelConfig};

use super::error::MixError;
use super::units::{ClassUnits, MAX_UNITS};

/// One block type of a model, with the config its spec compiles against.
#[derive(Debug, Clone)]
pub struct BlockOf {
    pub resolved: Resolved,
    /// With the spec's defaults applied.
    pub config: ModelConfig,
}

/// What a mixed plan is chosen for: the model's block types and which one each layer is.
#[derive(Debug, Clone)]
pub struct MixModel {
    pub blocks: Vec<BlockOf>,
    pub layer_block: Vec<usize>,
    pub mode: Mode,
    /// Most recompute units per class ([`MAX_UNITS`] unless set by
    /// [`MixModel::with_max_units`]): more rebuildable recipes join into this many.
    pub max_units: usize,
}

impl MixModel {
    /// `blocks`: (spec, config) per block type; every config lists all of the model's layers.
    pub fn new(
        blocks: &[(BlockSpec, ModelConfig)],
        layer_block: Vec<usize>,
        mode: Mode,
    ) -> Result<Self, MixError> {
        let blocks = blocks
            .iter()
            .map(|(spec, config)| {
                Ok(BlockOf {
                    resolved: Resolved::new(spec.clone())?,
                    config: config.clone().with_defaults(&spec.config_defaults),
                })
            })
            .collect::<Result<Vec<_>, MixError>>()?;
        if let Some(&b) = layer_block.iter().find(|&&b| b >= blocks.len()) {
            return Err(MixError::Profile(format!(
                "a layer names block {b} of {}",
                blocks.len()
            )));
        }
        Ok(Self {
            blocks,
            layer_block,
            mode,
            max_units: MAX_UNITS,
        })
    }

    /// At most `max` (1..=[`MAX_UNITS`]) recompute units per class: a coarser mix that is
    /// profiled in fewer runs (2^max subsets per class).
    pub fn with_max_units(mut self, max: usize) -> Result<Self, MixError> {
        if !(1..=MAX_UNITS).contains(&max) {
            return Err(MixError::Profile(format!(
                "recompute units per layer must be 1 to {MAX_UNITS}, not {max}"
            )));
        }
        self.max_units = max;
        Ok(self)
    }

    /// One plan per block type, layer `l` under `choices[l]` in its block's plan (the other
    /// blocks' plans keep everything in that layer: they never run it).
    pub fn plans(&self, choices: &[LayerChoice]) -> Result<Vec<Plan>, MixError> {
        self.blocks
            .iter()
            .enumerate()
            .map(|(b, block)| {
                let per_layer: Vec<LayerChoice> = self
                    .layer_block
                    .iter()
                    .zip(choices)
                    .map(|(&lb, c)| {
                        if lb == b {
                            c.clone()
                        } else {
                            LayerChoice::keep_all(&block.resolved)
                        }
                    })
                    .collect();
                Ok(block
                    .resolved
                    .plan_with(&block.config, self.mode, &per_layer)?)
            })
            .collect()
    }

    /// Layer classes: layers of one block whose `when` conditions all agree share one.
    pub fn classes(&self) -> Result<(Vec<ClassUnits>, Vec<usize>), MixError> {
        let mut keys: HashMap<(usize, Vec<bool>), usize> = HashMap::new();
        let mut classes = Vec::new();
        let mut layer_class = Vec::with_capacity(self.layer_block.len());
        for (l, &b) in self.layer_block.iter().enumerate() {
            let block = &self.blocks[b];
            let key = (b, block.resolved.condition_key(&block.config, l)?);
            let next = classes.len();
            let c = *keys.entry(key).or_insert(next);
            if c == next {
                let units = ClassUnits::of(
                    &block.resolved,
                    &block.config,
                    self.mode,
                    (b, l),
                    self.max_units,
                )?;
                classes.push(units);
            }
            layer_class.push(c);
        }
        Ok((classes, layer_class))
    }
}

/// What one subset of a class's recompute units does to one of its layers.
#[derive(Debug, Clone, PartialEq)]
pub struct SubsetProfile {
    /// Device bytes the layer keeps from forward to backward (nothing offloaded).
    pub saved: u64,
    /// Peak of the layer's backward above what the earlier layers keep plus the layer's
    /// backward base ([`Profile::backward_base`]).
    pub peak: u64,
    /// Predicted seconds of its recompute ops (sum over the plan's steps).
    pub seconds: f64,
    /// Candidates (indices into the class's) still saved, so offloadable.
    pub offloadable: Vec<usize>,
}

/// The measured profile of a model in one mode.
#[derive(Debug, Clone)]
pub struct Profile {
    pub classes: Vec<ClassUnits>,
    pub layer_class: Vec<usize>,
    /// Per class, per subset mask: `None` where that subset is not a valid plan.
    pub subsets: Vec<Vec<Option<SubsetProfile>>>,
    /// Per class, per candidate: seconds of its offload plus prefetch.
    pub transfer_seconds: Vec<Vec<f64>>,
    /// Per class, per recipe: seconds of one rebuild.
    pub recompute_seconds: Vec<Vec<f64>>,
    /// Per layer: the forward's peak above the bytes the earlier layers keep.
    pub forward: Vec<u64>,
    /// Per layer: at its backward, the bytes besides every layer's kept slots (gradients of
    /// later layers and the head, the incoming gradient, what the step started with).
    pub backward_base: Vec<u64>,
    /// The LM head's peak above the bytes all layers keep.
    pub head: u64,
    /// The peak after the last backward.
    pub tail: u64,
    /// Median step time with everything kept.
    pub base_seconds: f64,
    /// Pool bytes live when the profiled steps began (subtracted from every figure).
    pub start: u64,
}

/// Runs one step of the model under `plans` on a step whose buffers are charged to `meter`.
pub type Runner<'a> = dyn FnMut(&[Plan], &Arc<Meter>) -> Result<(), MixError> + 'a;

fn traced(
    model: &MixModel,
    choices: &[LayerChoice],
    meter: &Arc<Meter>,
    run: &mut Runner,
) -> Result<(Vec<Plan>, Trace), MixError> {
    let plans = model.plans(choices)?;
    meter.start_trace();
    let result = run(&plans, meter);
    let trace = meter
        .take_trace()
        .ok_or_else(|| MixError::Profile("the step left no trace".into()))?;
    result?;
    Ok((plans, trace))
}

/// Phase peaks and starts of a traced step, relative to the step's starting live bytes.
struct Phases {
    start: u64,
    forward: Vec<u64>,
    backward_start: Vec<u64>,
    backward_peak: Vec<u64>,
    head: u64,
    tail: u64,
}

fn phases(trace: &Trace, layers: usize) -> Result<Phases, MixError> {
    let missing = |what: String| MixError::Profile(format!("the traced step has no {what} phase"));
    let find = |p: Phase| trace.phases.iter().find(|r| r.phase == p);
    let start = find(Phase::Forward(0))
        .ok_or_else(|| missing("first forward".into()))?
        .start;
    let mut out = Phases {
        start,
        forward: Vec::with_capacity(layers),
        backward_start: Vec::with_capacity(layers),
        backward_peak: Vec::with_capacity(layers),
        head: find(Phase::Head)
            .ok_or_else(|| missing("head".into()))?
            .peak
            - start,
        tail: find(Phase::Tail)
            .ok_or_else(|| missing("tail".into()))?
            .peak
            - start,
    };
    for l in 0..layers {
        let f = find(Phase::Forward(l)).ok_or_else(|| missing(format!("layer {l} forward")))?;
        let b = find(Phase::Backward(l)).ok_or_else(|| missing(format!("layer {l} backward")))?;
        out.forward.push(f.peak - start);
        out.backward_start.push(b.start - start);
        out.backward_peak.push(b.peak - start);
    }
    Ok(out)
}

/// The upper median of `values` (0 without any).
fn median(values: Vec<f64>) -> f64 {
    remat_units::upper_median(&values).unwrap_or(0.0)
}

/// Measures `model` (see the module docs); `rounds` timed runs per timing.
pub fn profile(model: &MixModel, rounds: usize, run: &mut Runner) -> Result<Profile, MixError> {
    let (classes, layer_class) = model.classes()?;
    let layers = model.layer_block.len();
    let meter = Meter::unbounded();
    let keep: Vec<LayerChoice> = model
        .layer_block
        .iter()
        .map(|&b| LayerChoice::keep_all(&model.blocks[b].resolved))
        .collect();
    // Everything kept: the choice-independent terms.
    let (plans, trace) = traced(model, &keep, &meter, run)?;
    let base = phases(&trace, layers)?;
    let saved = |plans: &[Plan], l: usize| plans[model.layer_block[l]].layers[l].bytes.saved;
    let mut prefix = 0u64;
    let mut forward = Vec::with_capacity(layers);
    let mut backward_base = Vec::with_capacity(layers);
    for l in 0..layers {
        forward.push(base.forward[l] - prefix);
        prefix += saved(&plans, l);
        backward_base.push(base.backward_start[l] - prefix);
    }
    let head = base.head - prefix;
    // Every subset of every class: a layer's backward peak depends on its own subset
    // only, so each run measures as many subsets of a class as it has layers.
    let valid = valid_subsets(model, &classes)?;
    let members = class_members(&layer_class, classes.len());
    let runs = classes
        .iter()
        .zip(&members)
        .map(|(c, m)| c.subsets().div_ceil(m.len().max(1)))
        .max()
        .unwrap_or(1);
    let mut subsets: Vec<Vec<Option<SubsetProfile>>> =
        classes.iter().map(|c| vec![None; c.subsets()]).collect();
    let mut rebuilds: Vec<HashMap<usize, Vec<f64>>> = vec![HashMap::new(); classes.len()];
    for run_index in 0..runs {
        let masks: Vec<usize> = (0..layers)
            .map(|l| {
                let c = layer_class[l];
                let j = members[c].iter().position(|&m| m == l).unwrap_or(0);
                let mask = (run_index * members[c].len() + j) % classes[c].subsets();
                if valid[c][mask] { mask } else { 0 }
            })
            .collect();
        let choices: Vec<LayerChoice> = (0..layers)
            .map(|l| {
                let c = &classes[layer_class[l]];
                c.choice(&model.blocks[c.block].resolved, masks[l], &[])
            })
            .collect();
        let (plans, trace) = traced(model, &choices, &meter, run)?;
        let got = phases(&trace, layers)?;
        collect_rebuilds(&trace, &layer_class, &mut rebuilds);
        record_subsets(
            model,
            &classes,
            &layer_class,
            &masks,
            &plans,
            &got,
            &mut subsets,
        );
    }
    let recompute_seconds: Vec<Vec<f64>> = classes
        .iter()
        .enumerate()
        .map(|(c, class)| {
            let recipes = model.blocks[class.block].resolved.recipes.len();
            (0..recipes)
                .map(|r| median(rebuilds[c].get(&r).cloned().unwrap_or_default()))
                .collect()
        })
        .collect();
    for (c, class) in classes.iter().enumerate() {
        let block = &model.blocks[class.block];
        for (mask, entry) in subsets[c].iter_mut().enumerate() {
            let Some(entry) = entry else { continue };
            let choice = class.choice(&block.resolved, mask, &[]);
            let plan = block.resolved.plan_layer_with(
                &block.config,
                model.mode,
                class.layer,
                Some(&choice),
            )?;
            entry.seconds = plan
                .steps
                .iter()
                .map(|s| recompute_seconds[c][s.recipe])
                .sum();
        }
    }
    let transfer_seconds = time_transfers(model, &classes, &layer_class, rounds, &meter, run)?;
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds.max(1) {
        let plans = model.plans(&keep)?;
        let start = Instant::now();
        run(&plans, &meter)?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(Profile {
        classes,
        layer_class,
        subsets,
        transfer_seconds,
        recompute_seconds,
        forward,
        backward_base,
        head,
        tail: base.tail,
        base_seconds: median(times),
        start: base.start,
    })
}

/// Per class, per subset: whether the subset compiles (a rebuild needing a slot nothing
/// keeps is no allowed mix).
fn valid_subsets(model: &MixModel, classes: &[ClassUnits]) -> Result<Vec<Vec<bool>>, MixError> {
    classes
        .iter()
        .map(|c| {
            let block = &model.blocks[c.block];
            (0..c.subsets())
                .map(|mask| {
                    let choice = c.choice(&block.resolved, mask, &[]);
                    let plan = block.resolved.plan_layer_with(
                        &block.config,
                        model.mode,
                        c.layer,
                        Some(&choice),
                    );
                    Ok(plan.is_ok())
                })
                .collect()
        })
        .collect()
}

/// The layers of each class, in order.
fn class_members(layer_class: &[usize], classes: usize) -> Vec<Vec<usize>> {
    let mut members = vec![Vec::new(); classes];
    for (l, &c) in layer_class.iter().enumerate() {
        members[c].push(l);
    }
    members
}

/// Each layer's backward peak under its class's subset `mask`: above what the earlier
/// layers keep and the layer's backward base, so the layer's own kept bytes are in it.
fn record_subsets(
    model: &MixModel,
    classes: &[ClassUnits],
    layer_class: &[usize],
    masks: &[usize],
    plans: &[Plan],
    got: &Phases,
    subsets: &mut [Vec<Option<SubsetProfile>>],
) {
    let mut prefix = 0u64;
    for (l, &c) in layer_class.iter().enumerate() {
        let layer = &plans[model.layer_block[l]].layers[l];
        let kept = layer.bytes.saved;
        let m = masks[l];
        // backward_start = base + prefix + kept, so the base is what is left.
        let base = got.backward_start[l] - prefix - kept;
        let peak = got.backward_peak[l] - prefix - base;
        prefix += kept;
        let entry = subsets[c][m].get_or_insert_with(|| SubsetProfile {
            saved: kept,
            peak,
            seconds: 0.0,
            offloadable: classes[c].offloadable(layer),
        });
        // Layers of a class behave alike; should two differ, the larger peak is kept so
        // the prediction stays an upper bound (the tests hold it to equality).
        entry.peak = entry.peak.max(peak);
    }
}

fn collect_rebuilds(trace: &Trace, layer_class: &[usize], into: &mut [HashMap<usize, Vec<f64>>]) {
    // Summed per (layer, recipe): a recipe run twice in one backward counts both times.
    let mut per: HashMap<(usize, usize), f64> = HashMap::new();
    for &(layer, recipe, seconds) in &trace.recomputes {
        *per.entry((layer, recipe)).or_default() += seconds;
    }
    for ((layer, recipe), seconds) in per {
        if let Some(&c) = layer_class.get(layer) {
            into[c].entry(recipe).or_default().push(seconds);
        }
    }
}

/// Seconds per candidate (offload plus prefetch), from `rounds` runs offloading every one.
fn time_transfers(
    model: &MixModel,
    classes: &[ClassUnits],
    layer_class: &[usize],
    rounds: usize,
    meter: &Arc<Meter>,
    run: &mut Runner,
) -> Result<Vec<Vec<f64>>, MixError> {
    let choices: Vec<LayerChoice> = (0..layer_class.len())
        .map(|l| {
            let c = &classes[layer_class[l]];
            let all: Vec<usize> = (0..c.candidates.len()).collect();
            c.choice(&model.blocks[c.block].resolved, 0, &all)
        })
        .collect();
    let mut samples: Vec<Vec<Vec<f64>>> = classes
        .iter()
        .map(|c| vec![Vec::new(); c.candidates.len()])
        .collect();
    for _ in 0..rounds.max(1) {
        let (_, trace) = traced(model, &choices, meter, run)?;
        let mut per: HashMap<(usize, &str), f64> = HashMap::new();
        for (layer, name, seconds) in &trace.transfers {
            *per.entry((*layer, name.as_str())).or_default() += seconds;
        }
        for ((layer, name), seconds) in per {
            let c = layer_class[layer];
            if let Some(i) = classes[c].candidates.iter().position(|x| x.name == name) {
                samples[c][i].push(seconds);
            }
        }
    }
    Ok(samples
        .into_iter()
        .map(|class| class.into_iter().map(median).collect())
        .collect())
}
