//! An N-layer MLP chain: `(matmul, bias, relu[, dropout])` per hidden layer, a final
//! `(matmul, bias)` and an MSE loss.

use std::sync::Arc;

use crate::core::error::{EngineError, Result};
use crate::core::graph::{Graph, NodeId};
use crate::core::pool::{Category, MemoryPool};
use crate::core::rng::RngState;
use crate::core::tensor::Tensor;

/// Shape of the chain.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpConfig {
    /// Widths from input to output: `dims.len() - 1` layers.
    pub dims: Vec<usize>,
    /// Dropout after each hidden activation (0 = none).
    pub dropout: f32,
    /// Seed of the weight initialisation.
    pub seed: u64,
}

/// The chain's parameters.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub config: MlpConfig,
    pub weights: Vec<Tensor>,
    pub biases: Vec<Tensor>,
}

/// Nodes of one recorded step.
#[derive(Clone, Debug)]
pub struct MlpNodes {
    pub loss: NodeId,
    pub output: NodeId,
    /// Parameter nodes in [`Mlp::params`] order.
    pub params: Vec<NodeId>,
    /// The output node of every layer.
    pub layer_outputs: Vec<NodeId>,
}

impl Mlp {
    /// Weights uniform in `±1/sqrt(fan_in)`, biases small, both deterministic in the seed.
    pub fn new(pool: &Arc<MemoryPool>, config: MlpConfig) -> Result<Self> {
        if config.dims.len() < 2 || config.dims.contains(&0) {
            return Err(EngineError::Invalid(format!(
                "MLP dims {:?}: need at least 2 non-zero widths",
                config.dims
            )));
        }
        let mut weights = Vec::new();
        let mut biases = Vec::new();
        for (l, w) in config.dims.windows(2).enumerate() {
            let (fan_in, fan_out) = (w[0], w[1]);
            let bound = 1.0 / (fan_in as f32).sqrt();
            let rng = RngState {
                seed: config.seed,
                offset: (l as u64) << 40,
            };
            let wdata: Vec<f32> = (0..fan_in * fan_out)
                .map(|i| (2.0 * rng.uniform(i as u64) - 1.0) * bound)
                .collect();
            let bdata: Vec<f32> = (0..fan_out)
                .map(|i| (2.0 * rng.uniform((1 << 39) + i as u64) - 1.0) * 0.1)
                .collect();
            weights.push(Tensor::from_vec(
                pool,
                &format!("layers.{l}.weight"),
                &[fan_in, fan_out],
                wdata,
                Category::Parameters,
            )?);
            biases.push(Tensor::from_vec(
                pool,
                &format!("layers.{l}.bias"),
                &[fan_out],
                bdata,
                Category::Parameters,
            )?);
        }
        Ok(Self {
            config,
            weights,
            biases,
        })
    }

    pub fn layers(&self) -> usize {
        self.weights.len()
    }

    /// `(name, tensor)` of every parameter: weight then bias, layer by layer.
    pub fn params(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (l, (w, b)) in self.weights.iter().zip(&self.biases).enumerate() {
            out.push((format!("layers.{l}.weight"), w.clone()));
            out.push((format!("layers.{l}.bias"), b.clone()));
        }
        out
    }

    /// Records one step: `x[batch, dims[0]]` to the loss against `target[batch, dims[-1]]`.
    pub fn build(&self, g: &mut Graph, x: NodeId, target: NodeId) -> Result<MlpNodes> {
        self.build_segmented(g, x, target, 0)
    }

    /// Like [`Mlp::build`], recording every `layers_per_segment` layers inside
    /// [`Graph::segment`] (0 = no segments).
    pub fn build_segmented(
        &self,
        g: &mut Graph,
        x: NodeId,
        target: NodeId,
        layers_per_segment: usize,
    ) -> Result<MlpNodes> {
        let mut params = Vec::new();
        for (name, t) in self.params() {
            params.push(g.param(&name, &t));
        }
        let mut h = x;
        let mut layer_outputs = Vec::new();
        let n = self.layers();
        let mut l = 0;
        while l < n {
            let end = if layers_per_segment == 0 {
                n
            } else {
                (l + layers_per_segment).min(n)
            };
            let range = l..end;
            let layer_range =
                |g: &mut Graph, mut h: NodeId, outs: &mut Vec<NodeId>| -> Result<NodeId> {
                    for i in range.clone() {
                        h = self.layer(g, h, params[2 * i], params[2 * i + 1], i + 1 == n)?;
                        outs.push(h);
                    }
                    Ok(h)
                };
            h = if layers_per_segment == 0 {
                layer_range(g, h, &mut layer_outputs)?
            } else {
                let mut outs = Vec::new();
                let out = g.segment(|g| layer_range(g, h, &mut outs))?;
                layer_outputs.extend(outs);
                out
            };
            l = end;
        }
        let loss = g.mse(h, target)?;
        g.set_name(loss, "loss")?;
        Ok(MlpNodes {
            loss,
            output: h,
            params,
            layer_outputs,
        })
    }

    fn layer(&self, g: &mut Graph, x: NodeId, w: NodeId, b: NodeId, last: bool) -> Result<NodeId> {
        let h = g.matmul(x, w)?;
        let z = g.bias(h, b)?;
        if last {
            return Ok(z);
        }
        let a = g.relu(z)?;
        if self.config.dropout > 0.0 {
            return g.dropout(a, self.config.dropout);
        }
        Ok(a)
    }
}
