//! Inspecting the Qwen3 block through its spec: recording layer 0's forward (for `remat
//! spec derive`) and checking that every recompute rebuilds the forward's values bit for bit.

use std::collections::BTreeMap;

use crate::core::kernels::RopeTable;
use crate::core::swap::HostStore;
use crate::spec::compile::{Mode, Plan};
use crate::spec::run::RunResult;
use crate::spec::run::exec::{Backward, Forward, Record, Shared, SharedBuffers};
use crate::spec::run::meter::Meter;

use super::super::head::kernel_err;
use super::Qwen3;

/// The forward records of layer 0 for the given model (for `remat spec derive`).
pub fn record_block(model: &Qwen3, plan: &Plan, tokens: &[u32]) -> RunResult<Vec<Record>> {
    let d = &model.dims;
    let rope = RopeTable::<f32>::new(d.seq, d.head_dim, d.theta).map_err(kernel_err("rope"))?;
    let meter = Meter::unbounded();
    let host = HostStore::in_memory();
    let shared = Shared {
        plan,
        config: &plan.config,
        rope: Some(&rope),
        lora: None,
        meter: &meter,
        host: &host,
        step: 0,
    };
    let inputs = BTreeMap::from([("x".to_string(), model.embed_tokens(tokens, &meter)?)]);
    let mut f = Forward::new(&shared, 0, model.weights(0, false), inputs)?;
    model.block_forward(&mut f)?;
    Ok(f.records().to_vec())
}

impl Qwen3 {
    /// `remat spec derive`: records layer 0's forward (under `plan`, any compiled spec of
    /// this block) and writes a spec with every op output a slot rebuilt by replay.
    pub fn derive_spec(&self, plan: &Plan) -> RunResult<crate::spec::BlockSpec> {
        let d = &self.dims;
        let tokens: Vec<u32> = (0..d.rows()).map(|i| (i % d.vocab) as u32).collect();
        let records = record_block(self, plan, &tokens)?;
        let inputs = BTreeMap::from([("x".to_string(), vec![d.batch, d.seq, d.hidden])]);
        let params: BTreeMap<String, Vec<usize>> = self.layers[0]
            .iter()
            .map(|(k, v)| (k.clone(), v.shape.clone()))
            .collect();
        let shapes = crate::spec::derive::DeriveShapes {
            inputs: &inputs,
            params: &params,
        };
        let name = format!("{}-derived", self.kind.spec_name());
        let mut spec = crate::spec::derive::derive_spec(&name, &records, &shapes, "out");
        // The recorded attributes name config keys; keep the defaults they may fall back on.
        spec.config_defaults = plan.spec().config_defaults.clone();
        Ok(spec)
    }
}

/// One recomputed slot compared with the forward's value.
#[derive(Debug, Clone, PartialEq)]
pub struct RecomputeCheck {
    pub layer: usize,
    pub slot: String,
    pub bit_equal: bool,
}

impl Qwen3 {
    /// Runs the forward, then rebuilds every slot each layer's plan recomputes and compares
    /// it with the forward's value.
    pub fn verify_recompute(&self, plan: &Plan, tokens: &[u32]) -> RunResult<Vec<RecomputeCheck>> {
        let d = &self.dims;
        let rope = RopeTable::<f32>::new(d.seq, d.head_dim, d.theta).map_err(kernel_err("rope"))?;
        let (meter, host) = (Meter::unbounded(), HostStore::in_memory());
        let lora_cfg = match plan.mode {
            Mode::Lora => self.lora.as_ref().map(|(c, _)| c),
            Mode::Full => None,
        };
        let shared = Shared {
            plan,
            config: &plan.config,
            rope: Some(&rope),
            lora: lora_cfg,
            meter: &meter,
            host: &host,
            step: 0,
        };
        let mut x = self.embed_tokens(tokens, &meter)?;
        let mut checks = Vec::new();
        let mut buffers = SharedBuffers::new();
        for l in 0..d.layers {
            let mut f = Forward::new(
                &shared,
                l,
                self.weights(l, lora_cfg.is_some()),
                BTreeMap::from([("x".to_string(), x)]),
            )?;
            self.block_forward(&mut f)?;
            let forward_values = f.snapshot();
            let (out, state) = f.finish("out")?;
            let mut b = Backward::new(
                &shared,
                self.weights(l, lora_cfg.is_some()),
                state,
                &mut buffers,
            )?;
            for slot in b.recomputed_slots() {
                b.ensure(&[slot.as_str()])?;
                let rebuilt = b.get(&slot)?;
                let bit_equal = forward_values.get(&slot).is_some_and(|v| v.bit_eq(rebuilt));
                checks.push(RecomputeCheck {
                    layer: l,
                    slot,
                    bit_equal,
                });
            }
            x = out;
        }
        Ok(checks)
    }
}
