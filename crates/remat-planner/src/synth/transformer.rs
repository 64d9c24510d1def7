//! The training step of a decoder-only transformer (Llama-style: RMSNorm, rotary position
//! embedding, causal attention, SwiGLU MLP), op by op as an autograd trace lists it.
//!
//! **Forward.** `tokens` (the batch's int64 ids, also the loss's targets); the embedding;
//! per layer: RMSNorm (square, mean, rsqrt, normalize, scale), the q/k/v projections, head
//! reshapes and transposes, RoPE on q and k (cos product, rotate-half by two slices, a
//! negation and a concatenation, sin product, sum), attention scores `q k^T`, the
//! 1/sqrt(head dim) scale, the causal mask, softmax, the weighted sum with v, the heads put
//! back together (a transpose and a copy), the output projection and the residual add; then
//! RMSNorm, the gate and up projections, SiLU, their product (SwiGLU), the down projection
//! and the second residual add. Last: a final RMSNorm, the LM head, log-softmax and the
//! negative log-likelihood.
//!
//! **Backward.** Each op's backward, in reverse, reading what the real one reads: a matmul's
//! reads its input activation (for the weight gradient), a product of two activations reads
//! both, softmax and rsqrt read their own output, SiLU and the square read their input; a
//! residual add, the mask, a copy and a concatenation pass the gradient through as a view.
//! A tensor read by several ops (the residual stream read by the norm and the add, the
//! normalized input read by three projections) gets its gradient summed by a `grad-acc`
//! node. A backward op's tensor is the bundle of gradients of its activation inputs.
//!
//! **Parameters.** Weights and the optimizer's two fp32 moments are static memory. Each
//! weight's gradient is a `grad:` buffer node, as the engine lays a step out: zero cost,
//! placed right before the backward op that writes it (which reads it), pinned (a written
//! gradient cannot be recomputed), and read by `end:step` so it lives to the step's end.
//!
//! **Views** (reshapes, transposes, slices) cost nothing and own no bytes: a view node has
//! zero time and zero output bytes, and every op reading a view also reads the tensor that
//! owns its storage, so that tensor stays on the device while the view is in use and is on
//! the device whenever the view is recomputed.
//!
//! **Times** are a roofline in microseconds: an op takes the larger of its FLOPs over the
//! device's matmul throughput and its bytes moved (inputs read, output written) over the
//! memory bandwidth, so matmuls are FLOP-proportional and elementwise ops cost their
//! traffic. A matmul's backward does twice its forward's FLOPs (input and weight gradients).
//!
//! Why one file of ~670 lines: one trace of a transformer step, op by op, forward then
//! backward, as an autograd trace lists it; it reads top to bottom like the trace it mirrors.

use super::SynthError;
use crate::ir::{Graph, Node, NodeId, Phase};

/// The model's shape and the device's speed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TransformerParams {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub seq: usize,
    pub batch: usize,
    /// Hidden width of the SwiGLU MLP.
    pub ffn: usize,
    pub vocab: usize,
    /// Bytes per activation and weight element (2 for bf16).
    pub dtype_bytes: u64,
    /// Matmul throughput, FLOP/s.
    pub flops_per_s: f64,
    /// Memory bandwidth, bytes/s.
    pub bytes_per_s: f64,
}

impl TransformerParams {
    /// A small GPT of `layers` layers: d_model 512, 8 heads, sequence 1,024, batch 8, MLP
    /// 1,408 (about 8/3 of d_model, as Llama sizes SwiGLU), vocabulary 8,192, bf16, on a
    /// device of 200 TFLOP/s and 1.5 TB/s. Activations dominate, as in training at length:
    /// the floor is 0.23 of the store-all peak at 8 layers and 0.13 at 32, so budgets down
    /// to 0.3 of the peak are plannable.
    pub fn gpt(layers: usize) -> TransformerParams {
        TransformerParams {
            layers,
            d_model: 512,
            heads: 8,
            seq: 1024,
            batch: 8,
            ffn: 1408,
            vocab: 8192,
            dtype_bytes: 2,
            flops_per_s: 200e12,
            bytes_per_s: 1.5e12,
        }
    }

    /// Nodes of the graph [`transformer`] builds: 123 per layer and 26 around them.
    pub fn node_count(&self) -> usize {
        123 * self.layers + 26
    }

    fn check(&self) -> Result<(), SynthError> {
        let positive = [
            ("layers", self.layers),
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("seq", self.seq),
            ("batch", self.batch),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
            ("dtype_bytes", self.dtype_bytes as usize),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(SynthError::Param {
                    field,
                    value: "0".into(),
                    what: "must be positive",
                });
            }
        }
        if !self.d_model.is_multiple_of(2 * self.heads) {
            return Err(SynthError::Param {
                field: "d_model",
                value: self.d_model.to_string(),
                what: "must split into heads of an even size (RoPE rotates pairs)",
            });
        }
        for (field, value) in [
            ("flops_per_s", self.flops_per_s),
            ("bytes_per_s", self.bytes_per_s),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(SynthError::Param {
                    field,
                    value: value.to_string(),
                    what: "must be a positive number",
                });
            }
        }
        Ok(())
    }
}

/// How an op's backward works.
#[derive(Clone, Debug)]
enum Back {
    /// No gradient flows (the tokens).
    Nothing,
    /// The gradient passes through unchanged (a view of the incoming one).
    Pass,
    /// A kernel reading the incoming gradient, the listed forward tensors (and the op's own
    /// output when `output`), doing `flops`.
    Kernel {
        reads: Vec<usize>,
        output: bool,
        flops: f64,
    },
}

/// One forward op of the trace.
#[derive(Clone, Debug)]
struct Op {
    name: String,
    inputs: Vec<usize>,
    /// Weights whose gradient the backward writes.
    weights: Vec<usize>,
    /// Logical bytes of the output (a view's are its shape's, though it owns none).
    bytes: u64,
    view: bool,
    flops: f64,
    back: Back,
}

/// The forward trace under construction.
struct Tape<'p> {
    p: &'p TransformerParams,
    ops: Vec<Op>,
    /// Bytes of each weight.
    weights: Vec<(String, u64)>,
}

impl Tape<'_> {
    fn elems(&self, dims: &[usize]) -> u64 {
        dims.iter().map(|&d| d as u64).product::<u64>() * self.p.dtype_bytes
    }
    fn push(&mut self, op: Op) -> usize {
        self.ops.push(op);
        self.ops.len() - 1
    }
    fn weight(&mut self, name: String, elems: usize) -> usize {
        self.weights.push((name, elems as u64 * self.p.dtype_bytes));
        self.weights.len() - 1
    }
    fn view(&mut self, name: String, base: usize) -> usize {
        let bytes = self.ops[base].bytes;
        self.push(Op {
            name,
            inputs: vec![base],
            weights: vec![],
            bytes,
            view: true,
            flops: 0.0,
            back: Back::Pass,
        })
    }
    /// A slice: a view forward, a kernel backward (it scatters into a zeroed full tensor).
    fn slice(&mut self, name: String, base: usize) -> usize {
        let bytes = self.ops[base].bytes / 2;
        self.push(Op {
            name,
            inputs: vec![base],
            weights: vec![],
            bytes,
            view: true,
            flops: 0.0,
            back: Back::Kernel {
                reads: vec![],
                output: false,
                flops: 0.0,
            },
        })
    }
    /// An elementwise op (or reduction) whose backward reads `reads` (and its output).
    fn pointwise(&mut self, name: String, inputs: Vec<usize>, bytes: u64, back: Back) -> usize {
        self.push(Op {
            name,
            inputs,
            weights: vec![],
            bytes,
            view: false,
            flops: 0.0,
            back,
        })
    }
    fn kernel(reads: Vec<usize>, output: bool) -> Back {
        Back::Kernel {
            reads,
            output,
            flops: 0.0,
        }
    }
    /// `x @ W` for a weight of `fan_in x fan_out` over `rows` rows.
    fn linear(
        &mut self,
        name: String,
        x: usize,
        rows: usize,
        fan_in: usize,
        fan_out: usize,
    ) -> usize {
        let w = self.weight(format!("{name}.weight"), fan_in * fan_out);
        let flops = 2.0 * rows as f64 * fan_in as f64 * fan_out as f64;
        let bytes = self.elems(&[rows, fan_out]);
        self.push(Op {
            name,
            inputs: vec![x],
            weights: vec![w],
            bytes,
            view: false,
            flops,
            back: Back::Kernel {
                reads: vec![x],
                output: false,
                flops: 2.0 * flops,
            },
        })
    }
    /// A batched product of two activations, `out_bytes` out, `flops` forward.
    fn bmm(&mut self, name: String, a: usize, b: usize, out_bytes: u64, flops: f64) -> usize {
        self.push(Op {
            name,
            inputs: vec![a, b],
            weights: vec![],
            bytes: out_bytes,
            view: false,
            flops,
            back: Back::Kernel {
                reads: vec![a, b],
                output: false,
                flops: 2.0 * flops,
            },
        })
    }
    /// RMSNorm: square, mean, rsqrt, normalize, scale by a weight.
    fn rms_norm(&mut self, name: &str, x: usize) -> usize {
        let p = *self.p;
        let bytes = self.ops[x].bytes;
        let stats = (p.batch * p.seq) as u64 * 4;
        let sq = self.pointwise(
            format!("{name}.pow"),
            vec![x],
            bytes,
            Self::kernel(vec![x], false),
        );
        let ms = self.pointwise(
            format!("{name}.mean"),
            vec![sq],
            stats,
            Self::kernel(vec![], false),
        );
        let rstd = self.pointwise(
            format!("{name}.rsqrt"),
            vec![ms],
            stats,
            Self::kernel(vec![], true),
        );
        let xn = self.pointwise(
            format!("{name}.mul"),
            vec![x, rstd],
            bytes,
            Self::kernel(vec![x, rstd], false),
        );
        let w = self.weight(format!("{name}.weight"), p.d_model);
        self.push(Op {
            name: format!("{name}.scale"),
            inputs: vec![xn],
            weights: vec![w],
            bytes,
            view: false,
            flops: 0.0,
            back: Self::kernel(vec![xn], false),
        })
    }
    /// Rotary embedding by rotate-half: `x cos + cat(-x2, x1) sin`.
    fn rope(&mut self, name: &str, x: usize) -> usize {
        let bytes = self.ops[x].bytes;
        let cos = self.pointwise(
            format!("{name}.mul_cos"),
            vec![x],
            bytes,
            Self::kernel(vec![], false),
        );
        let x1 = self.slice(format!("{name}.slice1"), x);
        let x2 = self.slice(format!("{name}.slice2"), x);
        let neg = self.pointwise(
            format!("{name}.neg"),
            vec![x2],
            bytes / 2,
            Self::kernel(vec![], false),
        );
        let cat = self.pointwise(format!("{name}.cat"), vec![neg, x1], bytes, Back::Pass);
        let sin = self.pointwise(
            format!("{name}.mul_sin"),
            vec![cat],
            bytes,
            Self::kernel(vec![], false),
        );
        self.pointwise(format!("{name}.add"), vec![cos, sin], bytes, Back::Pass)
    }
    fn attention(&mut self, l: usize, x: usize) -> usize {
        let p = *self.p;
        let (b, s, d, h) = (p.batch, p.seq, p.d_model, p.heads);
        let rows = b * s;
        let y = self.rms_norm(&format!("l{l}.attn_norm"), x);
        let yf = self.view(format!("l{l}.attn_norm.flatten"), y);
        let mut heads = Vec::new();
        for which in ["q", "k", "v"] {
            let proj = self.linear(format!("l{l}.{which}_proj"), yf, rows, d, d);
            let split = self.view(format!("l{l}.{which}.split_heads"), proj);
            heads.push(self.view(format!("l{l}.{which}.transpose"), split));
        }
        let q = self.rope(&format!("l{l}.q.rope"), heads[0]);
        let k = self.rope(&format!("l{l}.k.rope"), heads[1]);
        let kt = self.view(format!("l{l}.k.transpose_t"), k);
        let hd = d / h;
        let score_flops = 2.0 * (b * h * s * s) as f64 * hd as f64;
        let scores_bytes = self.elems(&[b, h, s, s]);
        let scores = self.bmm(format!("l{l}.scores"), q, kt, scores_bytes, score_flops);
        let scaled = self.pointwise(
            format!("l{l}.scale"),
            vec![scores],
            scores_bytes,
            Self::kernel(vec![], false),
        );
        let masked = self.pointwise(
            format!("l{l}.causal_mask"),
            vec![scaled],
            scores_bytes,
            Back::Pass,
        );
        let probs = self.pointwise(
            format!("l{l}.softmax"),
            vec![masked],
            scores_bytes,
            Self::kernel(vec![], true),
        );
        let out_bytes = self.elems(&[b, h, s, hd]);
        let mixed = self.bmm(
            format!("l{l}.attn_v"),
            probs,
            heads[2],
            out_bytes,
            score_flops,
        );
        let back = self.view(format!("l{l}.attn.transpose_back"), mixed);
        let merged = self.pointwise(
            format!("l{l}.attn.contiguous"),
            vec![back],
            out_bytes,
            Back::Pass,
        );
        let flat = self.view(format!("l{l}.attn.merge_heads"), merged);
        let o = self.linear(format!("l{l}.o_proj"), flat, rows, d, d);
        let ov = self.view(format!("l{l}.o_proj.unflatten"), o);
        let bytes = self.ops[x].bytes;
        self.pointwise(
            format!("l{l}.attn_residual"),
            vec![x, ov],
            bytes,
            Back::Pass,
        )
    }
    fn mlp(&mut self, l: usize, x: usize) -> usize {
        let p = *self.p;
        let rows = p.batch * p.seq;
        let y = self.rms_norm(&format!("l{l}.mlp_norm"), x);
        let yf = self.view(format!("l{l}.mlp_norm.flatten"), y);
        let gate = self.linear(format!("l{l}.gate_proj"), yf, rows, p.d_model, p.ffn);
        let up = self.linear(format!("l{l}.up_proj"), yf, rows, p.d_model, p.ffn);
        let hidden = self.ops[gate].bytes;
        let silu = self.pointwise(
            format!("l{l}.silu"),
            vec![gate],
            hidden,
            Self::kernel(vec![gate], false),
        );
        let swiglu = self.pointwise(
            format!("l{l}.swiglu"),
            vec![silu, up],
            hidden,
            Self::kernel(vec![silu, up], false),
        );
        let down = self.linear(format!("l{l}.down_proj"), swiglu, rows, p.ffn, p.d_model);
        let dv = self.view(format!("l{l}.down_proj.unflatten"), down);
        let bytes = self.ops[x].bytes;
        self.pointwise(format!("l{l}.mlp_residual"), vec![x, dv], bytes, Back::Pass)
    }
    /// The whole forward pass, ending in the loss.
    fn forward(&mut self) {
        let p = *self.p;
        let rows = p.batch * p.seq;
        let tokens = self.push(Op {
            name: "tokens".into(),
            inputs: vec![],
            weights: vec![],
            bytes: rows as u64 * 8,
            view: false,
            flops: 0.0,
            back: Back::Nothing,
        });
        let table = self.weight("embed.weight".into(), p.vocab * p.d_model);
        let bytes = self.elems(&[rows, p.d_model]);
        let mut x = self.push(Op {
            name: "embed".into(),
            inputs: vec![tokens],
            weights: vec![table],
            bytes,
            view: false,
            flops: 0.0,
            back: Self::kernel(vec![tokens], false),
        });
        for l in 0..p.layers {
            x = self.attention(l, x);
            x = self.mlp(l, x);
        }
        let y = self.rms_norm("final_norm", x);
        let yf = self.view("final_norm.flatten".into(), y);
        let logits = self.linear("lm_head".into(), yf, rows, p.d_model, p.vocab);
        let lbytes = self.ops[logits].bytes;
        let logp = self.pointwise(
            "log_softmax".into(),
            vec![logits],
            lbytes,
            Self::kernel(vec![], true),
        );
        self.pointwise(
            "nll_loss".into(),
            vec![logp, tokens],
            4,
            Self::kernel(vec![tokens], false),
        );
    }
}

/// The nodes under construction, with each tensor's storage owner.
struct Emitter<'p> {
    p: &'p TransformerParams,
    nodes: Vec<Node>,
    /// `owner[v]`: the node whose bytes hold `v`'s value (itself unless a view).
    owner: Vec<NodeId>,
    pinned: Vec<NodeId>,
}

impl Emitter<'_> {
    fn time(&self, flops: f64, bytes: f64) -> f64 {
        (flops / self.p.flops_per_s).max(bytes / self.p.bytes_per_s) * 1e6
    }
    /// `v` and the owner of its storage.
    fn reading(&self, v: NodeId) -> [NodeId; 2] {
        [v, self.owner[v]]
    }
    fn emit(
        &mut self,
        name: String,
        phase: Phase,
        reads: &[NodeId],
        bytes: u64,
        time: f64,
        view_of: Option<NodeId>,
    ) -> NodeId {
        let mut inputs: Vec<NodeId> = reads.iter().flat_map(|&v| self.reading(v)).collect();
        inputs.sort_unstable();
        inputs.dedup();
        let id = self.nodes.len();
        self.nodes.push(Node {
            name,
            phase,
            compute_time: time,
            output_bytes: bytes,
            inputs,
        });
        self.owner.push(view_of.map_or(id, |v| self.owner[v]));
        id
    }
}

/// The training graph of the transformer `params` describes.
pub fn transformer(params: &TransformerParams) -> Result<Graph, SynthError> {
    params.check()?;
    let mut tape = Tape {
        p: params,
        ops: Vec::new(),
        weights: Vec::new(),
    };
    tape.forward();
    let mut out = Emitter {
        p: params,
        nodes: Vec::new(),
        owner: Vec::new(),
        pinned: Vec::new(),
    };
    let node_of = emit_forward(&tape, &mut out);
    emit_backward(&tape, &node_of, &mut out);
    let weight_bytes: u64 = tape.weights.iter().map(|(_, b)| b).sum();
    // Weights plus Adam's two fp32 moments per element.
    let static_bytes = weight_bytes + weight_bytes / params.dtype_bytes * 8;
    let name = format!(
        "transformer-l{}-d{}-h{}-s{}-b{}-f{}",
        params.layers, params.d_model, params.heads, params.seq, params.batch, params.ffn
    );
    let pinned = std::mem::take(&mut out.pinned);
    Graph::new(name, out.nodes, static_bytes, 1e-6)
        .and_then(|g| g.with_pinned(pinned))
        .map_err(|error| SynthError::Graph { error })
}

/// The forward nodes, one per op; returns each op's node. The tokens are pinned: they are
/// the batch, loaded once.
fn emit_forward(tape: &Tape, out: &mut Emitter) -> Vec<NodeId> {
    let mut node_of = Vec::with_capacity(tape.ops.len());
    for op in &tape.ops {
        let reads: Vec<NodeId> = op.inputs.iter().map(|&i| node_of[i]).collect();
        let moved = op.bytes + op.inputs.iter().map(|&i| tape.ops[i].bytes).sum::<u64>();
        let (bytes, time, view_of) = if op.view {
            (0, 0.0, Some(reads[0]))
        } else {
            (op.bytes, out.time(op.flops, moved as f64), None)
        };
        let phase = if op.name == "nll_loss" {
            Phase::Backward
        } else {
            Phase::Forward
        };
        let id = out.emit(op.name.clone(), phase, &reads, bytes, time, view_of);
        if op.name == "tokens" {
            out.pinned.push(id);
        }
        node_of.push(id);
    }
    node_of
}

/// The backward nodes, in reverse op order, then `end:step`.
fn emit_backward(tape: &Tape, node_of: &[NodeId], out: &mut Emitter) {
    // Gradient contributions to each op's output, as nodes.
    let mut contributions: Vec<Vec<NodeId>> = vec![Vec::new(); tape.ops.len()];
    let mut buffers = Vec::new();
    let needs_grad = needs_grad(tape);
    let loss = tape.ops.len() - 1;
    for (t, op) in tape.ops.iter().enumerate().rev() {
        if matches!(op.back, Back::Nothing) || (t != loss && contributions[t].is_empty()) {
            continue;
        }
        let incoming = incoming_gradient(op, &contributions[t], out);
        let grad_inputs: Vec<usize> = op
            .inputs
            .iter()
            .copied()
            .filter(|&i| needs_grad[i])
            .collect();
        let id = match &op.back {
            Back::Pass => {
                let from = incoming.unwrap_or(node_of[t]);
                out.emit(
                    format!("bwd:{}", op.name),
                    Phase::Backward,
                    &[from],
                    0,
                    0.0,
                    Some(from),
                )
            }
            Back::Kernel {
                reads,
                output,
                flops,
            } => {
                let mut read: Vec<NodeId> = incoming.into_iter().collect();
                read.extend(reads.iter().map(|&i| node_of[i]));
                if *output {
                    read.push(node_of[t]);
                }
                for &w in &op.weights {
                    let (name, bytes) = &tape.weights[w];
                    let buffer = out.emit(
                        format!("grad:{name}"),
                        Phase::Backward,
                        &[],
                        *bytes,
                        0.0,
                        None,
                    );
                    out.pinned.push(buffer);
                    buffers.push(buffer);
                    read.push(buffer);
                }
                let bytes: u64 = grad_inputs.iter().map(|&i| tape.ops[i].bytes).sum();
                let moved = bytes + read.iter().map(|&v| out.nodes[v].output_bytes).sum::<u64>();
                let time = out.time(*flops, moved as f64);
                out.emit(
                    format!("bwd:{}", op.name),
                    Phase::Backward,
                    &read,
                    bytes,
                    time,
                    None,
                )
            }
            Back::Nothing => continue,
        };
        for i in grad_inputs {
            contributions[i].push(id);
        }
    }
    out.emit("end:step".into(), Phase::Backward, &buffers, 0, 0.0, None);
}

/// The gradient of an op's output: none for the loss (the seed is implicit), the single
/// contribution, or a `grad-acc` node summing several.
fn incoming_gradient(op: &Op, contributions: &[NodeId], out: &mut Emitter) -> Option<NodeId> {
    match contributions {
        [] => None,
        [one] => Some(*one),
        many => {
            let moved = op.bytes * (many.len() as u64 + 1);
            let time = out.time(0.0, moved as f64);
            Some(out.emit(
                format!("grad-acc:{}", op.name),
                Phase::Backward,
                many,
                op.bytes,
                time,
                None,
            ))
        }
    }
}

/// Whether each op's output depends on a weight (so a gradient flows into it).
fn needs_grad(tape: &Tape) -> Vec<bool> {
    let mut needs = vec![false; tape.ops.len()];
    for (t, op) in tape.ops.iter().enumerate() {
        needs[t] = !op.weights.is_empty() || op.inputs.iter().any(|&i| needs[i]);
    }
    needs
}

#[cfg(test)]
mod tests;
