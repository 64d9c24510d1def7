//! `remat spec derive`: a spec written from a block's recorded forward. Every forward op
//! becomes a slot (a group for several outputs) rebuilt by replaying that op, so the spec is
//! correct by construction and recomputes the whole block from its inputs: the starting
//! point for a new architecture, to be refined by hand (custom recompute ops, policies,
//! offload).

use std::collections::{BTreeMap, BTreeSet};

use super::run::exec::Record;
use super::types::{BlockSpec, GlobalSpec, InputSpec, ParamSpec, SlotSpec};

/// Shapes of what the records reference, by name.
pub struct DeriveShapes<'a> {
    pub inputs: &'a BTreeMap<String, Vec<usize>>,
    pub params: &'a BTreeMap<String, Vec<usize>>,
}

fn numeric(shape: &[usize]) -> Vec<String> {
    shape.iter().map(|d| d.to_string()).collect()
}

/// Builds the spec; `output` is the slot that leaves the block.
pub fn derive_spec(
    name: &str,
    records: &[Record],
    shapes: &DeriveShapes,
    output: &str,
) -> BlockSpec {
    let mut spec = BlockSpec::new(name).description(format!(
        "derived from a recorded forward of {} ops: every op output is a slot rebuilt by replay",
        records.len()
    ));
    let mut inputs = BTreeSet::new();
    let mut params = BTreeSet::new();
    let mut globals = BTreeSet::new();
    for record in records {
        for operand in &record.declared {
            let plain = operand.trim_end_matches('?');
            if let Some(n) = plain.strip_prefix("@input:") {
                inputs.insert(n.to_string());
            } else if let Some(n) = plain.strip_prefix("@param:") {
                params.insert((n.to_string(), operand.ends_with('?')));
            } else if let Some(n) = plain.strip_prefix("@global:") {
                globals.insert(n.to_string());
            }
        }
    }
    for n in inputs {
        let shape = shapes.inputs.get(&n).map_or_else(Vec::new, |s| numeric(s));
        spec.inputs.push(InputSpec {
            name: n,
            shape,
            dtype: Default::default(),
            offload: false,
            description: String::new(),
        });
    }
    for (n, optional) in params {
        let shape = shapes.params.get(&n);
        spec.params.push(ParamSpec {
            shape: shape.map_or_else(|| vec!["1".into()], |s| numeric(s)),
            // An optional parameter the recorded model lacked: declared, never present.
            when: (optional && shape.is_none()).then(|| "false".to_string()),
            name: n,
            dtype: Default::default(),
            description: String::new(),
        });
    }
    for n in globals {
        spec.globals.push(GlobalSpec {
            name: n,
            shape: Vec::new(),
            description: String::new(),
        });
    }
    for record in records {
        let group = record.outputs.len() > 1;
        for (i, out) in record.outputs.iter().enumerate() {
            let mut slot = SlotSpec::new(out.clone(), &[]);
            slot.shape = numeric(&record.output_shapes[i]);
            slot.description = format!("output {i} of forward op `{}`", record.op);
            if out == output {
                slot.save = false;
                spec.slots.push(slot);
                continue;
            }
            slot.recompute = true;
            if i == 0 {
                slot.recompute_from = record.declared.clone();
                if record.lora_declared.iter().any(Option::is_some) {
                    slot.lora_targets = record
                        .lora_declared
                        .iter()
                        .map(|t| t.clone().unwrap_or_default())
                        .collect();
                    // Only trailing positions may be left out; empty names mean "none".
                    while slot.lora_targets.last().is_some_and(String::is_empty) {
                        slot.lora_targets.pop();
                    }
                }
            }
            if group {
                slot.recompute_group = Some(record.outputs[0].clone());
                if i == 0 {
                    slot.recompute_outputs = record.outputs.clone();
                }
            }
            spec.slots.push(slot);
        }
    }
    spec.outputs.push(output.to_string());
    spec
}
