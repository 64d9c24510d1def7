//! `remat spec derive` for the Mamba block: records layer 0's forward and writes a spec
//! in which every op output is a slot rebuilt by replaying its op.

use std::collections::BTreeMap;

use crate::core::swap::HostStore;
use crate::spec::BlockSpec;
use crate::spec::compile::Plan;
use crate::spec::run::RunResult;
use crate::spec::run::exec::{Forward, Shared};
use crate::spec::run::meter::Meter;

use super::super::head::embed_tokens;
use super::Mamba;

impl Mamba {
    /// Records layer 0's forward under `plan` (any compiled spec of this block) and
    /// derives a spec with every op output a replayed slot.
    pub fn derive_spec(&self, plan: &Plan) -> RunResult<BlockSpec> {
        let d = &self.dims;
        let tokens: Vec<u32> = (0..d.rows()).map(|i| (i % d.vocab) as u32).collect();
        let meter = Meter::unbounded();
        let host = HostStore::in_memory();
        let shared = Shared {
            plan,
            config: &plan.config,
            rope: None,
            lora: None,
            meter: &meter,
            host: &host,
            step: 0,
        };
        let x = embed_tokens(&self.embed, [d.batch, d.seq], &tokens, &meter)?;
        let inputs = BTreeMap::from([("x".to_string(), x)]);
        let mut f = Forward::new(&shared, 0, self.weights(0, false), inputs)?;
        self.block_forward(&mut f)?;
        let inputs = BTreeMap::from([("x".to_string(), vec![d.batch, d.seq, d.hidden])]);
        let params: BTreeMap<String, Vec<usize>> = self.layers[0]
            .iter()
            .map(|(k, v)| (k.clone(), v.shape.clone()))
            .collect();
        let shapes = crate::spec::derive::DeriveShapes {
            inputs: &inputs,
            params: &params,
        };
        let name = format!("{}-derived", super::BLOCK);
        let mut spec = crate::spec::derive::derive_spec(&name, f.records(), &shapes, "out");
        // The recorded attributes name config keys; keep the defaults they may fall back on.
        spec.config_defaults = plan.spec().config_defaults.clone();
        Ok(spec)
    }
}
