//! The GPT as a [`StagedModel`]: the entry is the token embedding, each layer one
//! [`block_forward`] block, the exit the final RMSNorm, the LM head and the cross-entropy.
//! The reference is [`Gpt::record`] (store-all) on one graph.

use super::graph_stage::{Part, StagedModel};
use crate::core::error::EngineError;
use crate::core::graph::{Graph, NodeId};
use crate::core::policy::Policy;
use crate::core::tensor::Tensor;
use crate::models::gpt::{BLOCK_TENSORS, Batch, BlockNodes, Checkpointing, Gpt, block_forward};

/// A [`Gpt`] cut into stages; micro-batches are [`Batch`]es.
#[derive(Debug)]
pub struct StagedGpt<'a>(pub &'a Gpt);

fn expect_params(what: &str, params: &[NodeId], n: usize) -> Result<(), EngineError> {
    if params.len() != n {
        return Err(EngineError::Invalid(format!(
            "{what} takes {n} parameters, got {}",
            params.len()
        )));
    }
    Ok(())
}

impl StagedModel for StagedGpt<'_> {
    type MicroBatch = Batch;

    fn layers(&self) -> usize {
        self.0.config.n_layers
    }

    fn part_params(&self, part: Part) -> Vec<(String, Tensor)> {
        let all = self.0.params();
        let n = all.len();
        match part {
            Part::Entry => all.into_iter().take(1).collect(),
            Part::Layer(l) => all
                .into_iter()
                .skip(1 + BLOCK_TENSORS.len() * l)
                .take(BLOCK_TENSORS.len())
                .collect(),
            Part::Exit => all.into_iter().skip(n - 2).collect(),
        }
    }

    fn record_entry(
        &self,
        g: &mut Graph,
        batch: &Batch,
        params: &[NodeId],
    ) -> Result<NodeId, EngineError> {
        expect_params("the GPT embedding", params, 1)?;
        let x = g.embedding(params[0], batch.tokens.clone(), &[batch.batch, batch.seq])?;
        g.set_name(x, "embed")?;
        Ok(x)
    }

    fn record_layer(
        &self,
        g: &mut Graph,
        layer: usize,
        x: NodeId,
        params: &[NodeId],
    ) -> Result<NodeId, EngineError> {
        expect_params(&format!("GPT block {layer}"), params, BLOCK_TENSORS.len())?;
        let w = BlockNodes {
            attn_norm: params[0],
            q_proj: params[1],
            k_proj: params[2],
            v_proj: params[3],
            o_proj: params[4],
            mlp_norm: params[5],
            gate_proj: params[6],
            up_proj: params[7],
            down_proj: params[8],
        };
        block_forward(g, &self.0.config, layer, x, &w)
    }

    fn record_exit(
        &self,
        g: &mut Graph,
        x: NodeId,
        batch: &Batch,
        params: &[NodeId],
    ) -> Result<NodeId, EngineError> {
        expect_params("the GPT head", params, 2)?;
        let h = g.rmsnorm(x, params[0], self.0.config.norm_eps)?;
        g.set_name(h, "final_norm")?;
        let logits = g.matmul(h, params[1])?;
        g.set_name(logits, "lm_head")?;
        let loss = g.cross_entropy(logits, batch.targets.clone())?;
        g.set_name(loss, "loss")?;
        Ok(loss)
    }

    fn batch_bytes(&self, batch: &Batch) -> usize {
        (batch.tokens.len() + batch.targets.len()) * std::mem::size_of::<u32>()
    }

    fn record_reference(
        &self,
        g: &mut Graph,
        batch: &Batch,
    ) -> Result<(NodeId, Vec<NodeId>), EngineError> {
        let step = self
            .0
            .record(g, batch, Checkpointing::Graph(Policy::StoreAll))?;
        Ok((step.loss, step.params))
    }
}

/// Splits `batch` row-wise into `micro_batches` equal micro-batches, in order.
pub fn split_batch(batch: &Batch, micro_batches: usize) -> Result<Vec<Batch>, EngineError> {
    if micro_batches == 0 || !batch.batch.is_multiple_of(micro_batches) {
        return Err(EngineError::Invalid(format!(
            "a batch of {} sequences cannot be split into {micro_batches} equal micro-batches",
            batch.batch
        )));
    }
    let expected = batch.batch * batch.seq;
    if batch.tokens.len() != expected || batch.targets.len() != expected {
        return Err(EngineError::Invalid(format!(
            "batch of {} x {} holds {} tokens and {} targets ({expected} expected)",
            batch.batch,
            batch.seq,
            batch.tokens.len(),
            batch.targets.len()
        )));
    }
    let rows = batch.batch / micro_batches;
    let len = rows * batch.seq;
    Ok((0..micro_batches)
        .map(|m| Batch {
            tokens: batch.tokens[m * len..(m + 1) * len].into(),
            targets: batch.targets[m * len..(m + 1) * len].into(),
            batch: rows,
            seq: batch.seq,
        })
        .collect())
}
