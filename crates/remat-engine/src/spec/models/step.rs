//! The training step every spec-driven model runs (Qwen3, Mamba, hybrid): embedding, each
//! layer's forward under its block's plan, the LM head, each layer's backward (rebuilding
//! through its plan), the embedding gradient. The models differ only in what runs a
//! layer's block (`BlockRunner`) and in the plans' shared state per block type. What a
//! step runs with ([`StepEnv`]) and what it measured ([`StepStats`]) are the same for all.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::core::kernels;
use crate::core::kernels::RopeTable;
use crate::core::swap::HostStore;
use crate::spec::compile::{Disposition, LayerPlan, Mode, Plan};
use crate::spec::run::Act;
use crate::spec::run::RunError;
use crate::spec::run::RunResult;
use crate::spec::run::check;
use crate::spec::run::exec::{
    Backward, Forward, LayerState, LayerWeights, Scratch, Shared, SharedBuffers,
};
use crate::spec::run::lora::{LayerAdapters, LoraConfig};
use crate::spec::run::meter::{Meter, MeterStats, Phase, Use};

use super::grads::{GradHolds, LayerGrads, SpecGrads};
use super::head::{LmHead, embed_tokens, kernel_err, lm_loss};

/// What one step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    pub loss: f32,
    /// The pool over the step: its peak (activations, scratch, gradients, and whatever the
    /// caller registered, such as parameters), and the saved / shared breakdown.
    pub activations: MeterStats,
    pub host_peak: u64,
    pub recomputed_ops: usize,
}

/// What a step runs with besides the model, the plan and the batch.
#[derive(Clone, Copy)]
pub struct StepEnv<'a> {
    /// Where offloaded slots live between forward and backward.
    pub host: &'a HostStore,
    /// The pool (with its budget) every buffer of the step is charged to.
    pub meter: &'a Arc<Meter>,
    /// The training step: LoRA dropout draws a fresh mask each step, shared by the step's
    /// forward, recompute and backward.
    pub step: u64,
}

/// What runs the block of a layer, forward and backward.
pub(crate) trait BlockRunner {
    fn forward(&self, layer: usize, f: &mut Forward) -> RunResult<()>;
    fn backward(
        &self,
        layer: usize,
        b: &mut Backward,
        dout: Scratch,
        g: &mut LayerGrads,
    ) -> RunResult<Scratch>;
}

/// The model around the blocks, borrowed for one step.
pub(crate) struct StepModel<'a> {
    pub embed: &'a Act,
    pub head: LmHead<'a>,
    pub batch: usize,
    pub seq: usize,
    /// Per layer, parameters under the spec's `@param:` names.
    pub layers: &'a [BTreeMap<String, Act>],
    /// Per layer, LoRA adapters (read only in LoRA mode).
    pub adapters: Option<&'a [LayerAdapters]>,
    /// Per layer, the index of its block type's entry in `shared`.
    pub layer_block: &'a [usize],
}

impl StepModel<'_> {
    fn weights(&self, layer: usize, mode: Mode) -> LayerWeights<'_> {
        LayerWeights {
            params: &self.layers[layer],
            adapters: match mode {
                Mode::Lora => self.adapters.map(|a| &a[layer]),
                Mode::Full => None,
            },
        }
    }
}

/// A model whose every layer runs the same block (Qwen3, Mamba), borrowed for one step.
pub(crate) struct UniformModel<'a> {
    pub embed: &'a Act,
    pub head: LmHead<'a>,
    pub batch: usize,
    pub seq: usize,
    pub layers: &'a [BTreeMap<String, Act>],
    pub lora: Option<&'a (LoraConfig, Vec<LayerAdapters>)>,
    /// Models without attention (Mamba) have none.
    pub rope: Option<&'a RopeTable<f32>>,
}

/// The LoRA configuration a step in `mode` runs with: none in full mode; in LoRA mode the
/// model's, which must have been added ([`LoraConfig`] through `with_lora`).
pub(crate) fn mode_lora(
    mode: Mode,
    lora: Option<&(LoraConfig, Vec<LayerAdapters>)>,
) -> RunResult<Option<&LoraConfig>> {
    match mode {
        Mode::Lora => lora
            .map(|(cfg, _)| Some(cfg))
            .ok_or_else(|| RunError::Model("LoRA mode needs adapters (with_lora)".into())),
        Mode::Full => Ok(None),
    }
}

/// [`run_step`] for a [`UniformModel`] under `plan` (already checked against the model).
pub(crate) fn run_uniform_step(
    model: UniformModel,
    plan: &Plan,
    runner: &dyn BlockRunner,
    tokens: &[u32],
    targets: &[u32],
    env: StepEnv,
) -> RunResult<(SpecGrads, StepStats)> {
    let shared = [Shared {
        plan,
        config: &plan.config,
        rope: model.rope,
        lora: mode_lora(plan.mode, model.lora)?,
        meter: env.meter,
        host: env.host,
        step: env.step,
    }];
    let layer_block = vec![0; model.layers.len()];
    let step_model = StepModel {
        embed: model.embed,
        head: model.head,
        batch: model.batch,
        seq: model.seq,
        layers: model.layers,
        adapters: model.lora.map(|(_, a)| a.as_slice()),
        layer_block: &layer_block,
    };
    run_step(step_model, &shared, runner, plan.mode, tokens, targets, env)
}

/// One forward and backward, layer `l` run by `runner` under `shared[layer_block[l]]`.
/// Every buffer is charged to `env.meter`'s pool; the phases are marked for traced steps.
pub(crate) fn run_step(
    model: StepModel,
    shared: &[Shared],
    runner: &dyn BlockRunner,
    mode: Mode,
    tokens: &[u32],
    targets: &[u32],
    env: StepEnv,
) -> RunResult<(SpecGrads, StepStats)> {
    let meter = env.meter;
    let n = model.layers.len();
    meter.reset_peak();
    env.host.reset_peak();
    meter.mark(Phase::Forward(0));
    let mut x = Some(embed_tokens(
        model.embed,
        [model.batch, model.seq],
        tokens,
        meter,
    )?);
    let mut states: Vec<LayerState> = Vec::with_capacity(n);
    for l in 0..n {
        if l > 0 {
            meter.mark(Phase::Forward(l));
        }
        let input = x
            .take()
            .ok_or_else(|| RunError::Model("lost the residual stream".into()))?;
        let inputs = BTreeMap::from([("x".to_string(), input)]);
        let shared = &shared[model.layer_block[l]];
        let mut f = Forward::new(shared, l, model.weights(l, mode), inputs)?;
        runner.forward(l, &mut f)?;
        let (out, state) = f.finish("out")?;
        states.push(state);
        x = Some(out);
    }
    let (last, last_hold) = x.ok_or_else(|| RunError::Model("no block output".into()))?;
    meter.mark(Phase::Head);
    let mut holds = Vec::new();
    let (loss, mut dx, mut grads) = lm_loss(model.head, &last, targets, mode, meter, &mut holds)?;
    drop((last, last_hold));
    // One buffer set per block type: layers of one type have the same shapes.
    let mut buffers: Vec<SharedBuffers> = shared.iter().map(|_| SharedBuffers::new()).collect();
    let mut recomputed_ops = 0;
    grads.layers = vec![BTreeMap::new(); n];
    grads.adapters = vec![BTreeMap::new(); n];
    for l in (0..n).rev() {
        meter.mark(Phase::Backward(l));
        let block = model.layer_block[l];
        let state = states
            .pop()
            .ok_or_else(|| RunError::Model("lost a layer's state".into()))?;
        let mut b = Backward::new(
            &shared[block],
            model.weights(l, mode),
            state,
            &mut buffers[block],
        )?;
        let mut lg = LayerGrads {
            layer: l,
            params: &mut grads.layers[l],
            adapters: &mut grads.adapters[l],
            meter,
            holds: &mut holds,
        };
        dx = runner.backward(l, &mut b, dx, &mut lg)?;
        recomputed_ops += b.recomputed_ops;
    }
    drop(buffers);
    meter.mark(Phase::Tail);
    if mode == Mode::Full {
        holds.push(meter.hold(model.embed.bytes(), Use::Gradient, || {
            "gradient of `embed`".into()
        })?);
        grads.embed = vec![0.0; model.embed.data.len()];
        let (vocab, hidden) = (model.embed.shape[0], model.embed.shape[1]);
        kernels::embedding_backward(tokens, &dx, vocab, hidden, &mut grads.embed)
            .map_err(kernel_err("embedding"))?;
    } else {
        grads.layers.iter_mut().for_each(BTreeMap::clear);
    }
    drop(dx);
    grads.held = GradHolds(Arc::new(holds));
    Ok((
        grads,
        StepStats {
            loss,
            activations: meter.stats(),
            host_peak: env.host.stats().peak_bytes,
            recomputed_ops,
        },
    ))
}

/// The sizes a stacked spec model runs at, which a plan's block input must match.
pub(crate) struct StackDims {
    pub layers: usize,
    pub batch: usize,
    pub seq: usize,
    pub hidden: usize,
}

/// The checks every model that stacks one block type makes of a plan, after its own check
/// of the block name: one block output `out`, a plan layer per model layer, dtypes the
/// runtime runs, the block input `x` at this run's sizes, and per layer the parameter
/// shapes and the slots `backward_reads` needs (see [`check_layer_plan`]).
pub(crate) fn check_stacked_plan(
    plan: &Plan,
    model: &str,
    d: &StackDims,
    layers: &[BTreeMap<String, Act>],
    backward_reads: &[&str],
) -> RunResult<()> {
    let bad = |what: String| Err(RunError::Model(what));
    if plan.spec().outputs != ["out"] {
        return bad(format!(
            "spec `{}` lists block outputs {:?}; the {model} model passes exactly one output, `out`, from each block to the next",
            plan.spec().name,
            plan.spec().outputs,
        ));
    }
    if plan.layers.len() != d.layers {
        return bad(format!(
            "plan has {} layers, the model {}",
            plan.layers.len(),
            d.layers
        ));
    }
    check::check_dtypes(plan)?;
    let expected = [d.batch, d.seq, d.hidden];
    if let Some(x) = plan
        .layers
        .first()
        .and_then(|l| l.inputs.iter().find(|x| x.name == "x"))
        && x.shape != expected
    {
        return bad(format!(
            "the spec's block input `x` has shape {:?}, but this run is [batch {}, seq {}, hidden {}]; a spec with fixed sizes (as `remat spec derive` writes) runs only at its own batch and sequence length: set the batch and sequence length to match it (remat train: --batch, and --digits N for sequence 2N or --data FILE --seq N), or write its dims as `batch` and `seq_len`",
            x.shape, d.batch, d.seq, d.hidden
        ));
    }
    for (l, (layer_plan, params)) in plan.layers.iter().zip(layers).enumerate() {
        check_layer_plan(
            &format!("layer {l}"),
            plan,
            layer_plan,
            params,
            backward_reads,
        )?;
    }
    Ok(())
}

/// Checks one layer's part of `plan` against the layer: every parameter the spec declares
/// has the layer's shape, and every slot the block's backward reads is declared (present,
/// whatever its disposition). `layer` names the layer in the error.
pub(crate) fn check_layer_plan(
    layer: &str,
    plan: &Plan,
    layer_plan: &LayerPlan,
    params: &BTreeMap<String, Act>,
    backward_reads: &[&str],
) -> RunResult<()> {
    let bad = |what: String| Err(RunError::Model(what));
    for (spec, shape) in plan.spec().params.iter().zip(&layer_plan.params) {
        let have = params.get(&spec.name).map(|p| &p.shape);
        if have != shape.as_ref() {
            return bad(format!(
                "{layer}: parameter `{}`: the spec declares {}, the model has {}",
                spec.name,
                shape
                    .as_ref()
                    .map_or("none (absent)".into(), |s| format!("{s:?}")),
                have.map_or("none".into(), |s| format!("{s:?}"))
            ));
        }
    }
    let declared = |slot: &str| {
        layer_plan
            .slots
            .iter()
            .any(|s| s.name == slot && s.disposition != Disposition::Absent)
    };
    if let Some(missing) = backward_reads.iter().find(|s| !declared(s)) {
        return bad(format!(
            "{layer}: the block's backward reads slot `{missing}`, which the spec `{}` does not declare",
            plan.spec().name
        ));
    }
    Ok(())
}
