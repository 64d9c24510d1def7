//! The gradients of a spec-driven model's step: what a step returns ([`SpecGrads`]), the
//! pool bytes they hold ([`GradHolds`]), and where one layer's backward writes its own
//! (`LayerGrads`, charged to the pool on first use).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::spec::run::RunResult;
use crate::spec::run::lora::AdapterGrad;
use crate::spec::run::meter::{Hold, Meter, Use};

/// Gradients of one step of a spec-driven model (the same shape for every one of them: the
/// embedding, the final norm and the head, then per layer its parameters by spec name and
/// its adapters): every weight under full fine-tuning, adapters only under LoRA. Each model
/// names it its own way ([`super::qwen3::Qwen3Grads`], [`super::mamba::MambaGrads`],
/// [`super::hybrid::HybridGrads`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecGrads {
    pub embed: Vec<f32>,
    pub final_norm: Vec<f32>,
    pub lm_head: Vec<f32>,
    pub layers: Vec<BTreeMap<String, Vec<f32>>>,
    pub adapters: Vec<BTreeMap<String, AdapterGrad>>,
    /// The pool bytes these gradients hold, released when the last copy is dropped.
    pub held: GradHolds,
}

/// Pool reservations of a step's gradient buffers. Accounting, not values: two gradient
/// sets compare equal whatever they hold.
#[derive(Debug, Clone, Default)]
pub struct GradHolds(pub(crate) Arc<Vec<Hold>>);

impl GradHolds {
    /// Pool bytes held by the gradient buffers.
    pub fn bytes(&self) -> u64 {
        self.0.iter().map(Hold::bytes).sum()
    }
}

impl PartialEq for GradHolds {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl SpecGrads {
    /// Every gradient buffer with a name, for comparisons and reports.
    pub fn named(&self) -> Vec<(String, &[f32])> {
        let mut out: Vec<(String, &[f32])> = vec![
            ("embed".into(), &self.embed),
            ("final_norm".into(), &self.final_norm),
            ("lm_head".into(), &self.lm_head),
        ];
        for (l, layer) in self.layers.iter().enumerate() {
            for (k, v) in layer {
                out.push((format!("layers.{l}.{k}"), v));
            }
        }
        for (l, layer) in self.adapters.iter().enumerate() {
            for (k, g) in layer {
                out.push((format!("layers.{l}.lora.{k}.A"), &g.a));
                out.push((format!("layers.{l}.lora.{k}.B"), &g.b));
            }
        }
        out
    }

    /// Names of the buffers whose bits differ from `other`'s.
    pub fn bit_diff(&self, other: &SpecGrads) -> Vec<String> {
        let theirs: BTreeMap<String, &[f32]> = other.named().into_iter().collect();
        let mut diff = Vec::new();
        for (name, ours) in self.named() {
            let same = theirs.get(&name).is_some_and(|t| {
                t.len() == ours.len() && t.iter().zip(ours).all(|(a, b)| a.to_bits() == b.to_bits())
            });
            if !same {
                diff.push(name);
            }
        }
        if theirs.len() != self.named().len() {
            diff.push("(different gradient sets)".into());
        }
        diff
    }
}

/// Where one layer's backward writes its gradients, and the pool bytes they hold.
pub(crate) struct LayerGrads<'g> {
    pub layer: usize,
    pub params: &'g mut BTreeMap<String, Vec<f32>>,
    pub adapters: &'g mut BTreeMap<String, AdapterGrad>,
    pub meter: &'g Arc<Meter>,
    pub holds: &'g mut Vec<Hold>,
}

impl LayerGrads<'_> {
    pub(crate) fn charge(&mut self, name: &str, len: usize) -> RunResult<()> {
        let layer = self.layer;
        let hold = self.meter.hold(len as u64 * 4, Use::Gradient, || {
            format!("layer {layer} gradient of `{name}`")
        })?;
        self.holds.push(hold);
        Ok(())
    }

    /// The gradient buffer of parameter `name`, created (and charged) on first use.
    pub(crate) fn param(&mut self, name: &str, len: usize) -> RunResult<&mut Vec<f32>> {
        if !self.params.contains_key(name) {
            self.charge(name, len)?;
        }
        Ok(self
            .params
            .entry(name.to_string())
            .or_insert_with(|| vec![0.0; len]))
    }

    /// The gradients of adapter `target`, created (and charged) on first use.
    pub(crate) fn adapter(
        &mut self,
        target: &str,
        a: usize,
        b: usize,
    ) -> RunResult<&mut AdapterGrad> {
        if !self.adapters.contains_key(target) {
            self.charge(&format!("lora.{target}"), a + b)?;
        }
        Ok(self
            .adapters
            .entry(target.to_string())
            .or_insert_with(|| AdapterGrad {
                a: vec![0.0; a],
                b: vec![0.0; b],
            }))
    }
}
