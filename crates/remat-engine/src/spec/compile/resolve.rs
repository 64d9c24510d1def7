//! The layer-independent half of compilation: names and aliases, references, recipes
//! (groups merged into one op each), op and LoRA-target checks. Everything here is checked
//! once, before any layer is planned.

use std::collections::{BTreeMap, HashMap};

use super::super::error::{Result, SpecError};
use super::super::expr::Condition;
use super::super::ops::{self, LORA_TARGETS, REPLAY};
use super::super::types::{BlockSpec, RecomputePolicy, SlotSpec, Value};

/// What a `recompute_from` entry points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefKind {
    Slot(usize),
    Input(usize),
    Param(usize),
    Global(usize),
}

/// A `recompute_from` entry: `a|b` takes the first alternative present in the layer; a
/// trailing `?` allows none to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ref {
    pub alternatives: Vec<RefKind>,
    pub optional: bool,
}

/// One recompute op call: a lone slot's recipe, or a group's merged recipe.
#[derive(Debug, Clone)]
pub struct Recipe {
    /// The group name, or the slot name for an ungrouped slot.
    pub key: String,
    /// Registered op name, or [`REPLAY`].
    pub op: String,
    pub attrs: BTreeMap<String, Value>,
    pub from: Vec<Ref>,
    /// Op output position -> slot index.
    pub outputs: Vec<usize>,
    pub lora_targets: Vec<String>,
    pub policy: RecomputePolicy,
    pub group: Option<String>,
}

/// A spec whose structure has been checked; plan it per layer with [`Resolved::plan_layer`].
#[derive(Debug, Clone)]
pub struct Resolved {
    pub spec: BlockSpec,
    pub slot_when: Vec<Option<Condition>>,
    pub param_when: Vec<Option<Condition>>,
    pub recipes: Vec<Recipe>,
    /// Slot index -> recipe index, for slots some recipe outputs.
    pub producer: Vec<Option<usize>>,
    /// Slot index -> buffer root (union of `shares_with`).
    pub share_root: Vec<usize>,
    pub outputs: Vec<usize>,
}

struct Names<'a> {
    block: &'a str,
    slots: HashMap<&'a str, usize>,
    inputs: HashMap<&'a str, usize>,
    params: HashMap<&'a str, usize>,
    globals: HashMap<&'a str, usize>,
}

impl<'a> Names<'a> {
    fn build(spec: &'a BlockSpec) -> Result<Self> {
        let block = spec.name.as_str();
        let mut slots: HashMap<&str, usize> = HashMap::new();
        let mut owner_of_alias: HashMap<&str, &str> = HashMap::new();
        for (i, slot) in spec.slots.iter().enumerate() {
            if slots.insert(slot.name.as_str(), i).is_some() {
                if let Some(owner) = owner_of_alias.get(slot.name.as_str()) {
                    return Err(clash(
                        block,
                        &slot.name,
                        format!("an alias of `{owner}`"),
                        "a slot",
                    ));
                }
                return Err(SpecError::DuplicateSlot {
                    block: block.into(),
                    slot: slot.name.clone(),
                });
            }
            for alias in &slot.aliases {
                if let Some(&other) = slots.get(alias.as_str()) {
                    let first = match owner_of_alias.get(alias.as_str()) {
                        Some(owner) => format!("an alias of `{owner}`"),
                        None => format!("slot `{}`", spec.slots[other].name),
                    };
                    return Err(clash(
                        block,
                        alias,
                        first,
                        &format!("an alias of `{}`", slot.name),
                    ));
                }
                slots.insert(alias.as_str(), i);
                owner_of_alias.insert(alias.as_str(), slot.name.as_str());
            }
        }
        let index = |names: Vec<&'a str>, what: &str| -> Result<HashMap<&'a str, usize>> {
            let mut map = HashMap::new();
            for (i, name) in names.into_iter().enumerate() {
                if map.insert(name, i).is_some() {
                    return Err(clash(block, name, what.to_string(), what));
                }
            }
            Ok(map)
        };
        Ok(Self {
            block,
            slots,
            inputs: index(
                spec.inputs.iter().map(|x| x.name.as_str()).collect(),
                "an input",
            )?,
            params: index(
                spec.params.iter().map(|x| x.name.as_str()).collect(),
                "a parameter",
            )?,
            globals: index(
                spec.globals.iter().map(|x| x.name.as_str()).collect(),
                "a global",
            )?,
        })
    }

    fn slot(&self, owner: &str, name: &str, field: &'static str) -> Result<usize> {
        self.slots
            .get(name)
            .copied()
            .ok_or_else(|| SpecError::UnknownSlot {
                block: self.block.into(),
                slot: owner.into(),
                unknown: name.into(),
                field,
            })
    }

    fn reference(&self, owner: &str, text: &str) -> Result<Ref> {
        let (body, optional) = match text.strip_suffix('?') {
            Some(body) => (body, true),
            None => (text, false),
        };
        let alternatives = body
            .split('|')
            .map(|alt| self.alternative(owner, text, alt.trim()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Ref {
            alternatives,
            optional,
        })
    }

    fn alternative(&self, owner: &str, text: &str, body: &str) -> Result<RefKind> {
        let bad = |reason: &str| SpecError::BadReference {
            block: self.block.into(),
            slot: owner.into(),
            reference: text.into(),
            reason: reason.into(),
        };
        let Some(rest) = body.strip_prefix('@') else {
            if body.is_empty() {
                return Err(bad("empty name"));
            }
            return Ok(RefKind::Slot(self.slot(owner, body, "recompute_from")?));
        };
        let (kind, name) = rest
            .split_once(':')
            .ok_or_else(|| bad("expected @input:NAME, @param:NAME or @global:NAME"))?;
        if name.is_empty() {
            return Err(bad("empty name"));
        }
        let (block, slot) = (self.block.to_string(), owner.to_string());
        let kind = match kind {
            "input" => RefKind::Input(*self.inputs.get(name).ok_or(SpecError::UnknownInput {
                block,
                slot,
                input: name.into(),
            })?),
            "param" => RefKind::Param(*self.params.get(name).ok_or(SpecError::UnknownParam {
                block,
                slot,
                param: name.into(),
            })?),
            "global" => {
                RefKind::Global(*self.globals.get(name).ok_or(SpecError::UnknownGlobal {
                    block,
                    slot,
                    global: name.into(),
                })?)
            }
            _ => return Err(bad("unknown kind (expected input, param or global)")),
        };
        Ok(kind)
    }
}

fn clash(block: &str, name: &str, first: String, second: &str) -> SpecError {
    SpecError::NameClash {
        block: block.into(),
        name: name.into(),
        first,
        second: second.into(),
    }
}

fn parse_when(block: &str, owner: String, when: &Option<String>) -> Result<Option<Condition>> {
    match when {
        None => Ok(None),
        Some(text) => Condition::parse(text)
            .map(Some)
            .map_err(|reason| SpecError::BadCondition {
                block: block.into(),
                owner,
                condition: text.clone(),
                reason,
            }),
    }
}

/// Merges one field over a group's members: unset members inherit, differing ones conflict.
struct Merge<'a> {
    block: &'a str,
    group: &'a str,
}

impl Merge<'_> {
    fn field<'s, T: PartialEq + std::fmt::Debug + Clone>(
        &self,
        merged: &mut Option<(T, &'s str)>,
        value: Option<T>,
        slot: &'s str,
        field: &'static str,
    ) -> Result<()> {
        let Some(value) = value else { return Ok(()) };
        match merged {
            None => *merged = Some((value, slot)),
            Some((ours, first)) if *ours != value => {
                return Err(SpecError::GroupConflict {
                    block: self.block.into(),
                    group: self.group.into(),
                    field,
                    first: format!("slot `{first}` says {ours:?}"),
                    second: format!("slot `{slot}` says {value:?}"),
                });
            }
            Some(_) => {}
        }
        Ok(())
    }
}

fn non_empty<T: Clone>(v: &[T]) -> Option<Vec<T>> {
    (!v.is_empty()).then(|| v.to_vec())
}

impl Resolved {
    pub fn new(spec: BlockSpec) -> Result<Self> {
        let names = Names::build(&spec)?;
        let block = spec.name.clone();
        check_slots(&spec, &names)?;
        let slot_when = spec
            .slots
            .iter()
            .map(|s| parse_when(&block, format!("slot `{}`", s.name), &s.when))
            .collect::<Result<Vec<_>>>()?;
        let param_when = spec
            .params
            .iter()
            .map(|p| parse_when(&block, format!("parameter `{}`", p.name), &p.when))
            .collect::<Result<Vec<_>>>()?;
        let recipes = build_recipes(&spec, &names)?;
        let mut producer = vec![None; spec.slots.len()];
        for (r, recipe) in recipes.iter().enumerate() {
            for &slot in &recipe.outputs {
                if let Some(previous) = producer[slot] {
                    let first: &Recipe = &recipes[previous];
                    return Err(SpecError::TwoProducers {
                        block,
                        slot: spec.slots[slot].name.clone(),
                        first: describe_recipe(first),
                        second: describe_recipe(recipe),
                    });
                }
                producer[slot] = Some(r);
            }
        }
        let share_root = share_roots(&spec, &names)?;
        let outputs = spec
            .outputs
            .iter()
            .map(|o| names.slot("block outputs", o, "outputs"))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            spec,
            slot_when,
            param_when,
            recipes,
            producer,
            share_root,
            outputs,
        })
    }
}

fn describe_recipe(recipe: &Recipe) -> String {
    match &recipe.group {
        Some(g) => format!("group `{g}` (op `{}`)", recipe.op),
        None => format!("slot `{}` (op `{}`)", recipe.key, recipe.op),
    }
}

fn check_slots(spec: &BlockSpec, names: &Names) -> Result<()> {
    let block = spec.name.as_str();
    for slot in &spec.slots {
        let bad = |reason: &str| SpecError::BadSlot {
            block: block.into(),
            slot: slot.name.clone(),
            reason: reason.into(),
        };
        if slot.offload && slot.recompute {
            return Err(bad("is marked both `offload` and `recompute`; choose one"));
        }
        if !slot.recompute
            && (slot.recompute_op.is_some()
                || !slot.recompute_from.is_empty()
                || slot.recompute_group.is_some())
        {
            return Err(bad(
                "has a recompute recipe (recompute_op, recompute_from or recompute_group) but `recompute` is false",
            ));
        }
        if slot.shape.is_empty() {
            return Err(bad("has an empty shape"));
        }
        for target in &slot.lora_targets {
            if !LORA_TARGETS.contains(&target.as_str()) {
                return Err(SpecError::UnknownLoraTarget {
                    block: block.into(),
                    slot: slot.name.clone(),
                    target: target.clone(),
                });
            }
        }
        if let Some(op) = &slot.recompute_op
            && op != REPLAY
            && ops::lookup(op).is_none()
        {
            return Err(SpecError::UnknownOp {
                block: block.into(),
                slot: slot.name.clone(),
                op: op.clone(),
                known: ops::known_names(),
            });
        }
        for reference in &slot.recompute_from {
            names.reference(&slot.name, reference)?;
        }
    }
    Ok(())
}

fn build_recipes(spec: &BlockSpec, names: &Names) -> Result<Vec<Recipe>> {
    let block = spec.name.as_str();
    // Recipe key -> member slots, in declaration order of the first member.
    let mut order: Vec<String> = Vec::new();
    let mut members: HashMap<String, Vec<usize>> = HashMap::new();
    for (i, slot) in spec.slots.iter().enumerate().filter(|(_, s)| s.recompute) {
        let key = slot
            .recompute_group
            .clone()
            .unwrap_or_else(|| slot.name.clone());
        if !members.contains_key(&key) {
            order.push(key.clone());
        }
        members.entry(key).or_default().push(i);
    }
    let mut recipes = Vec::with_capacity(order.len());
    for key in order {
        let group_members = &members[&key];
        let first = &spec.slots[group_members[0]];
        let group = first.recompute_group.clone();
        let merge = Merge { block, group: &key };
        let mut op: Option<(String, &str)> = None;
        let mut from: Option<(Vec<String>, &str)> = None;
        let mut attrs: Option<(BTreeMap<String, Value>, &str)> = None;
        let mut outputs: Option<(Vec<String>, &str)> = None;
        let mut lora: Option<(Vec<String>, &str)> = None;
        let mut policy: Option<(RecomputePolicy, &str)> = None;
        for &m in group_members {
            let s: &SlotSpec = &spec.slots[m];
            let name = s.name.as_str();
            merge.field(&mut op, s.recompute_op.clone(), name, "recompute_op")?;
            merge.field(
                &mut from,
                non_empty(&s.recompute_from),
                name,
                "recompute_from",
            )?;
            let a = (!s.recompute_attrs.is_empty()).then(|| s.recompute_attrs.clone());
            merge.field(&mut attrs, a, name, "recompute_attrs")?;
            merge.field(
                &mut outputs,
                non_empty(&s.recompute_outputs),
                name,
                "recompute_outputs",
            )?;
            merge.field(&mut lora, non_empty(&s.lora_targets), name, "lora_targets")?;
            merge.field(
                &mut policy,
                Some(s.recompute_policy),
                name,
                "recompute_policy",
            )?;
        }
        let op = op.map(|(o, _)| o).unwrap_or_else(|| REPLAY.to_string());
        let from = from
            .map(|(f, _)| f)
            .unwrap_or_default()
            .iter()
            .map(|r| names.reference(&first.name, r))
            .collect::<Result<Vec<_>>>()?;
        let outputs = match outputs {
            Some((list, _)) => list
                .iter()
                .map(|o| names.slot(&first.name, o, "recompute_outputs"))
                .collect::<Result<Vec<_>>>()?,
            None => group_members.clone(),
        };
        for &m in group_members {
            if !outputs.contains(&m) {
                return Err(SpecError::BadSlot {
                    block: block.into(),
                    slot: spec.slots[m].name.clone(),
                    reason: format!(
                        "is in recompute group `{key}` but not in its recompute_outputs"
                    ),
                });
            }
        }
        let recipe = Recipe {
            key,
            op,
            attrs: attrs.map(|(a, _)| a).unwrap_or_default(),
            from,
            outputs,
            lora_targets: lora.map(|(l, _)| l).unwrap_or_default(),
            policy: policy.map(|(p, _)| p).unwrap_or_default(),
            group,
        };
        check_arity(block, &first.name, &recipe)?;
        recipes.push(recipe);
    }
    Ok(recipes)
}

fn check_arity(block: &str, slot: &str, recipe: &Recipe) -> Result<()> {
    let Some(schema) = ops::lookup(&recipe.op) else {
        return Ok(()); // replay: the forward record fixes the arity at run time
    };
    let bad = |reason: String| SpecError::BadOpUse {
        block: block.into(),
        slot: slot.into(),
        op: recipe.op.clone(),
        reason,
    };
    let n = recipe.from.len();
    if n < schema.min_inputs() || n > schema.inputs.len() {
        return Err(bad(format!(
            "takes operands ({}) but recompute_from has {n}",
            schema.inputs.join(", ")
        )));
    }
    if recipe.outputs.len() > schema.outputs.len() {
        return Err(bad(format!(
            "has outputs ({}) but {} are declared",
            schema.outputs.join(", "),
            recipe.outputs.len()
        )));
    }
    for attr in schema.required_attrs {
        if !recipe.attrs.contains_key(*attr) {
            return Err(bad(format!("needs attribute `{attr}` in recompute_attrs")));
        }
    }
    Ok(())
}

fn share_roots(spec: &BlockSpec, names: &Names) -> Result<Vec<usize>> {
    let mut parent: Vec<usize> = (0..spec.slots.len()).collect();
    let find = |parent: &mut Vec<usize>, mut i: usize| {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    };
    for (i, slot) in spec.slots.iter().enumerate() {
        let Some(other) = &slot.shares_with else {
            continue;
        };
        let j = names.slot(&slot.name, other, "shares_with")?;
        if j == i {
            return Err(SpecError::BadSlot {
                block: spec.name.clone(),
                slot: slot.name.clone(),
                reason: "shares_with names itself".into(),
            });
        }
        let (a, b) = (find(&mut parent, i), find(&mut parent, j));
        parent[a.max(b)] = a.min(b);
    }
    Ok((0..spec.slots.len())
        .map(|i| find(&mut parent, i))
        .collect())
}
