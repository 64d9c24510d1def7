//! The training step every spec-driven model runs (Qwen3, Mamba, hybrid): embedding, each
//! layer's forward under its block's plan, the LM head, each layer's backward (rebuilding
//! through its plan), the embedding gradient. The models differ only in what runs a
//! layer's block ([`BlockRunner`]) and in the plans' shared state per block type.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::kernels;
use crate::spec::compile::Mode;
use crate::spec::run::RunError;
use crate::spec::run::RunResult;
use crate::spec::run::exec::{
    Backward, Forward, LayerState, LayerWeights, Scratch, Shared, SharedBuffers,
};
use crate::spec::run::lora::LayerAdapters;
use crate::spec::run::meter::{Phase, Use};
use crate::spec::run::ops::Act;

use super::qwen3::{
    GradHolds, LayerGrads, LmHead, Qwen3Grads, StepEnv, StepStats, embed_tokens, kernel_err,
    lm_loss,
};

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
) -> RunResult<(Qwen3Grads, StepStats)> {
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
