//! The engine's MLP chain as a [`StagedModel`]: the entry feeds the input batch, each layer is
//! `(matmul, bias, relu[, dropout])` (the last layer `(matmul, bias)`), the exit is the MSE
//! loss. The reference is [`Mlp::build`] on one graph.

use super::graph_stage::{Part, StagedModel};
use crate::core::error::EngineError;
use crate::core::graph::{Graph, NodeId};
use crate::core::tensor::Tensor;
use crate::models::mlp::Mlp;

/// One micro-batch of the MLP chain: inputs `[rows, dims[0]]`, targets `[rows, dims[-1]]`.
#[derive(Clone, Debug)]
pub struct MlpBatch {
    pub x: Tensor,
    pub target: Tensor,
}

/// An [`Mlp`] cut into stages.
#[derive(Debug)]
pub struct StagedMlp<'a>(pub &'a Mlp);

impl StagedModel for StagedMlp<'_> {
    type MicroBatch = MlpBatch;

    fn layers(&self) -> usize {
        self.0.layers()
    }

    fn part_params(&self, part: Part) -> Vec<(String, Tensor)> {
        match part {
            Part::Layer(l) => self.0.params().into_iter().skip(2 * l).take(2).collect(),
            Part::Entry | Part::Exit => Vec::new(),
        }
    }

    fn record_entry(
        &self,
        g: &mut Graph,
        batch: &MlpBatch,
        _: &[NodeId],
    ) -> Result<NodeId, EngineError> {
        Ok(g.input("x", batch.x.clone()))
    }

    fn record_layer(
        &self,
        g: &mut Graph,
        layer: usize,
        x: NodeId,
        params: &[NodeId],
    ) -> Result<NodeId, EngineError> {
        let [w, b] = params else {
            return Err(EngineError::Invalid(format!(
                "MLP layer {layer} takes 2 parameters, got {}",
                params.len()
            )));
        };
        let h = g.matmul(x, *w)?;
        let z = g.bias(h, *b)?;
        if layer + 1 == self.layers() {
            return Ok(z);
        }
        let a = g.relu(z)?;
        match self.0.config.dropout {
            p if p > 0.0 => g.dropout(a, p),
            _ => Ok(a),
        }
    }

    fn record_exit(
        &self,
        g: &mut Graph,
        x: NodeId,
        batch: &MlpBatch,
        _: &[NodeId],
    ) -> Result<NodeId, EngineError> {
        let target = g.input("target", batch.target.clone());
        g.mse(x, target)
    }

    fn batch_bytes(&self, batch: &MlpBatch) -> usize {
        (batch.x.bytes() + batch.target.bytes()) as usize
    }

    fn record_reference(
        &self,
        g: &mut Graph,
        batch: &MlpBatch,
    ) -> Result<(NodeId, Vec<NodeId>), EngineError> {
        let x = g.input("x", batch.x.clone());
        let target = g.input("target", batch.target.clone());
        let nodes = self.0.build(g, x, target)?;
        Ok((nodes.loss, nodes.params))
    }
}
