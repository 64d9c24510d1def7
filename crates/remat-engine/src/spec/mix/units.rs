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

/// Most recompute units of a class: the profile measures every subset of them, so
/// 2^12 = 4096 subsets at most.
pub const MAX_UNITS: usize = 12;

/// The choices of one class of layers (same block, same `when` outcomes).
#[derive(Debug, Clone)]
pub struct ClassUnits {
    pub block: usize,
    /// A representative layer of the class.
    pub layer: usize,
    /// Units, each a list of recipe indices rebuilt together; a subset is a bit mask over
    /// this list. A unit is one recipe, unless the block has more than [`MAX_UNITS`]
    /// rebuildable recipes: then neighbours in forward order join (see [`merge_units`]).
    pub units: Vec<Vec<usize>>,
    /// Block inputs and the slots saved when nothing is rebuilt.
    pub candidates: Vec<Candidate>,
}

impl ClassUnits {
    /// The units (at most `max_units`) and candidates of layer `layer` of `resolved`, block
    /// type `block` (config with its defaults).
    pub fn of(
        resolved: &Resolved,
        config: &ModelConfig,
        mode: Mode,
        (block, layer): (usize, usize),
        max_units: usize,
    ) -> Result<Self> {
        let keep = LayerChoice::keep_all(resolved);
        let plan = resolved.plan_layer_with(config, mode, layer, Some(&keep))?;
        let recipes: Vec<usize> = (0..resolved.recipes.len())
            .filter(|&r| is_unit(resolved, &plan, mode, r))
            .collect();
        let units = merge_units(&recipes, max_units);
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
        for (bit, unit) in self.units.iter().enumerate() {
            for &r in unit {
                choice.recompute[r] = mask & (1 << bit) != 0;
            }
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

/// `recipes` (in forward order) as at most `max` units of neighbours, as even in size as
/// can be: each recipe its own unit when they are few. Joining neighbours keeps the choices
/// that matter most, rebuilding a stretch of the block from what precedes it; the profile's
/// cost grows as 2^units, so a block with many rebuildable slots (a derived spec replays
/// every op) is mixed at a coarser grain rather than refused.
pub fn merge_units(recipes: &[usize], max: usize) -> Vec<Vec<usize>> {
    let n = recipes.len();
    let units = n.min(max.max(1));
    let mut out = Vec::with_capacity(units);
    let mut start = 0;
    for u in 0..units {
        let end = start + n / units + usize::from(u < n % units);
        out.push(recipes[start..end].to_vec());
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::merge_units;

    #[test]
    fn few_recipes_stay_single_and_many_join_neighbours_evenly() {
        assert_eq!(merge_units(&[4, 7], 12), vec![vec![4], vec![7]]);
        assert!(merge_units(&[], 12).is_empty());
        let many: Vec<usize> = (0..30).collect();
        let units = merge_units(&many, 12);
        assert_eq!(units.len(), 12);
        assert_eq!(units.concat(), many, "every recipe once, in order");
        let sizes: Vec<usize> = units.iter().map(Vec::len).collect();
        assert!(sizes.iter().all(|&s| s == 2 || s == 3), "{sizes:?}");
        assert_eq!(merge_units(&many, 30).len(), 30);
    }
}
