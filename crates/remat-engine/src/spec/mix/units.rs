//! What a mixed plan may choose in one layer: the recompute units (recipes whose policy
//! allows a rebuild in the mode and that rebuild a slot backward reads) and the offload
//! candidates (saved slots and block inputs).

use crate::spec::compile::{Disposition, LayerChoice, LayerPlan, Mode, Resolved, policy_applies};
use crate::spec::{ModelConfig, Result};

/// Something that can live on the host store between a layer's forward and backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Slot(usize),
    Input(usize),
}

/// An offload candidate of a layer with its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub target: Target,
    pub name: String,
    pub bytes: u64,
}

/// The choices of one class of layers (same block, same `when` outcomes).
#[derive(Debug, Clone)]
pub struct ClassUnits {
    pub block: usize,
    /// A representative layer of the class.
    pub layer: usize,
    /// Recipe indices that may be rebuilt; a subset is a bit mask over this list.
    pub units: Vec<usize>,
    /// Block inputs and the slots saved when nothing is rebuilt.
    pub candidates: Vec<Candidate>,
}

impl ClassUnits {
    /// The units and candidates of `layer` of `resolved` (config with its defaults).
    pub fn of(
        resolved: &Resolved,
        config: &ModelConfig,
        mode: Mode,
        block: usize,
        layer: usize,
    ) -> Result<Self> {
        let keep = LayerChoice::keep_all(resolved);
        let plan = resolved.plan_layer_with(config, mode, layer, Some(&keep))?;
        let units = (0..resolved.recipes.len())
            .filter(|&r| is_unit(resolved, &plan, mode, r))
            .collect();
        let inputs = plan.inputs.iter().enumerate().map(|(i, x)| Candidate {
            target: Target::Input(i),
            name: format!("@input:{}", x.name),
            bytes: x.bytes,
        });
        let slots = plan
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.disposition == Disposition::Saved)
            .map(|(i, s)| Candidate {
                target: Target::Slot(i),
                name: s.name.clone(),
                bytes: s.bytes,
            });
        Ok(Self {
            block,
            layer,
            units,
            candidates: inputs.chain(slots).collect(),
        })
    }

    pub fn subsets(&self) -> usize {
        1usize << self.units.len()
    }

    /// The layer choice rebuilding the units in `mask` and offloading the candidates in
    /// `offload` (candidate indices).
    pub fn choice(&self, resolved: &Resolved, mask: usize, offload: &[usize]) -> LayerChoice {
        let mut choice = LayerChoice::keep_all(resolved);
        for (bit, &r) in self.units.iter().enumerate() {
            choice.recompute[r] = mask & (1 << bit) != 0;
        }
        for &c in offload {
            match self.candidates[c].target {
                Target::Slot(s) => choice.offload[s] = true,
                Target::Input(i) => choice.offload_inputs[i] = true,
            }
        }
        choice
    }

    /// Candidates still saved (so offloadable) when the units in `mask` are rebuilt.
    pub fn offloadable(&self, plan: &LayerPlan) -> Vec<usize> {
        self.candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| match c.target {
                Target::Input(_) => true,
                Target::Slot(s) => plan.slots[s].disposition == Disposition::Saved,
            })
            .map(|(i, _)| i)
            .collect()
    }
}

/// A recipe is a unit when its policy lets it rebuild in `mode` and one of its outputs is
/// a present slot that backward reads (intermediates follow the slots that need them).
fn is_unit(resolved: &Resolved, plan: &LayerPlan, mode: Mode, recipe: usize) -> bool {
    let r = &resolved.recipes[recipe];
    policy_applies(r.policy, mode)
        && r.outputs.iter().any(|&s| {
            resolved.spec.slots[s].save && plan.slots[s].disposition != Disposition::Absent
        })
}
