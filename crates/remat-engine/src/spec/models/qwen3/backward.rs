//! The Qwen3 block's hand-written backward. It reads slots through [`Backward`], which
//! returns saved ones, prefetched ones, or ones rebuilt by the layer's recompute plan; every
//! activation gradient and parameter gradient it allocates is charged to the step's memory
//! pool, so the budget and the measured peak cover backward too.

use crate::core::kernels::{self, RopeTable};
use crate::spec::compile::Mode;
use crate::spec::run::exec::{Backward, Scratch};
use crate::spec::run::lora;
use crate::spec::run::{Act, ops};
use crate::spec::run::{RunError, RunResult, linalg, moe};

use super::super::grads::LayerGrads;
use super::super::head::kernel_err;
use super::{BlockKind, Qwen3};

/// A layer parameter by name, or an error naming the layer and parameter.
fn param<'a>(b: &'a Backward, name: &str) -> RunResult<&'a Act> {
    b.weights()
        .params
        .get(name)
        .ok_or_else(|| RunError::Model(format!("layer {}: no parameter `{name}`", b.layer)))
}

/// `[rows, cols]` of a matrix parameter, or an error naming it.
fn matrix(b: &Backward, name: &str, w: &Act) -> RunResult<(usize, usize)> {
    match w.shape[..] {
        [n, k] => Ok((n, k)),
        _ => Err(RunError::Model(format!(
            "layer {}: parameter `{name}` has shape {:?}, expected a matrix",
            b.layer, w.shape
        ))),
    }
}

/// One linear use in the block: its input slot, weight, optional bias and LoRA target.
struct LinearUse<'s> {
    x: &'s str,
    w: &'s str,
    bias: Option<&'s str>,
    target: Option<&'s str>,
}

const fn linear<'s>(x: &'s str, w: &'s str, target: Option<&'s str>) -> LinearUse<'s> {
    LinearUse {
        x,
        w,
        bias: None,
        target,
    }
}

/// Slot, parameter and scratch names of one SwiGLU MLP (the dense one or the shared expert).
#[derive(Clone, Copy)]
struct SwigluNames {
    act: &'static str,
    gate: &'static str,
    up: &'static str,
    down_proj: &'static str,
    /// Scratch names of the activation, gate and up gradients.
    scratch: [&'static str; 3],
}

/// Slots the dense MLP backward reads.
const DENSE_MLP_READS: [&str; 6] = ["act", "gate", "up", "ln2", "h", "ln2_rstd"];
/// Slots the MoE backward reads (plus [`SHARED_EXPERT_READS`] with a shared expert).
const MOE_READS: [&str; 10] = [
    "ln2",
    "h",
    "ln2_rstd",
    "router_logits",
    "topk_weights",
    "topk_experts",
    "expert_gate",
    "expert_up",
    "expert_act",
    "expert_out",
];
const SHARED_EXPERT_READS: [&str; 3] = ["shared_gate", "shared_up", "shared_act"];
/// Slots the attention backward reads (plus the block input `x`, and
/// [`QK_NORM_READS`] with QK-norm).
const ATTENTION_READS: [&str; 7] = ["attn", "q", "k", "v", "attn_lse", "ln1", "ln1_rstd"];
const QK_NORM_READS: [&str; 4] = ["q_lin", "k_lin", "q_rstd", "k_rstd"];

impl Qwen3 {
    /// Every slot this model's backward reads: a spec must declare each of them (checked
    /// before a step, so a spec for another block fails before any work).
    pub(crate) fn backward_reads(&self) -> Vec<&'static str> {
        let d = &self.dims;
        let mut reads: Vec<&'static str> = match self.kind {
            BlockKind::Dense => DENSE_MLP_READS.to_vec(),
            BlockKind::Moe => MOE_READS.to_vec(),
        };
        if self.kind == BlockKind::Moe && d.shared_intermediate > 0 {
            reads.extend(SHARED_EXPERT_READS);
        }
        reads.extend(ATTENTION_READS);
        if d.qk_norm {
            reads.extend(QK_NORM_READS);
        }
        reads
    }

    /// Backward of one linear use: `dx (+)= dy W` (+ the adapter's input gradient); in full
    /// mode `dW += dy^T x` (and the bias); in LoRA mode the adapter's gradients.
    fn linear_backward(
        &self,
        b: &Backward,
        g: &mut LayerGrads,
        lin: LinearUse,
        dy: &[f32],
        dx: &mut [f32],
        accumulate: bool,
    ) -> RunResult<()> {
        let w = param(b, lin.w)?;
        let (n, k) = matrix(b, lin.w, w)?;
        let m = dy.len() / n.max(1);
        linalg::linear_dx(dy, &w.data, m, k, n, dx, accumulate, 1.0);
        match b.mode() {
            Mode::Full => {
                let x = b.get(lin.x)?;
                linalg::linear_dw(dy, &x.data, m, k, n, g.param(lin.w, w.data.len())?, 1.0);
                if let Some(bias) = lin
                    .bias
                    .filter(|name| b.weights().params.contains_key(*name))
                {
                    let db = g.param(bias, n)?;
                    for row in dy.chunks(n) {
                        for (o, v) in db.iter_mut().zip(row) {
                            *o += v;
                        }
                    }
                }
            }
            Mode::Lora => {
                let target = lin.target;
                let adapter = target.and_then(|t| b.weights().adapters.and_then(|a| a.get(t)));
                if let (Some(t), Some(adapter), Some(cfg)) = (target, adapter, b.lora_config()) {
                    let x = b.get(lin.x)?;
                    let grad = g.adapter(t, adapter.a.data.len(), adapter.b.data.len())?;
                    lora::backward(cfg, b.mask(), t, adapter, &x.data, dy, dx, grad);
                }
            }
        }
        Ok(())
    }

    /// RMSNorm backward: returns dx; accumulates the weight gradient in full mode.
    fn norm_backward(
        &self,
        b: &Backward,
        g: &mut LayerGrads,
        (x, w_name, rstd): (&str, &str, &str),
        dy: &[f32],
    ) -> RunResult<Scratch> {
        let w = param(b, w_name)?;
        let mut dx = b.scratch(dy.len(), &format!("d{x}"))?;
        let mut dw = b.scratch(w.data.len(), &format!("d{w_name} (partial)"))?;
        kernels::rmsnorm_backward(
            &b.get(x)?.data,
            &w.data,
            &b.get(rstd)?.data,
            dy,
            &mut dx,
            Some(&mut dw),
        )
        .map_err(kernel_err("rmsnorm"))?;
        if b.mode() == Mode::Full {
            for (o, v) in g.param(w_name, dw.len())?.iter_mut().zip(dw.iter()) {
                *o += v;
            }
        }
        Ok(dx)
    }

    /// One block's backward: takes the gradient of its output, returns its input's.
    pub(crate) fn block_backward(
        &self,
        b: &mut Backward,
        dout: Scratch,
        g: &mut LayerGrads,
    ) -> RunResult<Scratch> {
        let dln2 = match self.kind {
            BlockKind::Dense => self.dense_mlp_backward(b, g, &dout)?,
            BlockKind::Moe => self.moe_backward(b, g, &dout)?,
        };
        let dh_norm =
            self.norm_backward(b, g, ("h", "post_attention_layernorm", "ln2_rstd"), &dln2)?;
        drop(dln2);
        let mut dh = dout;
        for (a, c) in dh.iter_mut().zip(dh_norm.iter()) {
            *a += c;
        }
        drop(dh_norm);
        self.attention_backward(b, g, dh)
    }

    fn dense_mlp_backward(
        &self,
        b: &mut Backward,
        g: &mut LayerGrads,
        dout: &[f32],
    ) -> RunResult<Scratch> {
        let d = &self.dims;
        b.ensure(&DENSE_MLP_READS)?;
        let n = d.rows();
        let names = SwigluNames {
            act: "act",
            gate: "gate",
            up: "up",
            down_proj: "down_proj",
            scratch: ["dact", "dgate", "dup"],
        };
        let (dgate, dup) = self.swiglu_grads(b, g, names, dout, n * d.intermediate)?;
        let mut dln2 = b.scratch(n * d.hidden, "dln2")?;
        let gate = linear("ln2", "gate_proj", Some("gate"));
        self.linear_backward(b, g, gate, &dgate, &mut dln2, false)?;
        let up = linear("ln2", "up_proj", Some("up"));
        self.linear_backward(b, g, up, &dup, &mut dln2, true)?;
        Ok(dln2)
    }

    fn moe_backward(
        &self,
        b: &mut Backward,
        g: &mut LayerGrads,
        dout: &[f32],
    ) -> RunResult<Scratch> {
        let d = &self.dims;
        let shared = d.shared_intermediate > 0;
        let mut needed = MOE_READS.to_vec();
        if shared {
            needed.extend(SHARED_EXPERT_READS);
        }
        b.ensure(&needed)?;
        let full = b.mode() == Mode::Full;
        let (deo, dweights) =
            moe::combine_backward(b.get("expert_out")?, b.get("topk_weights")?, dout);
        let (deo, dweights) = (
            b.charge(deo, "dexpert_out")?,
            b.charge(dweights, "dweights")?,
        );
        let err = |e: String| RunError::Model(format!("layer {}: {e}", b.layer));
        let wd = param(b, "experts_down")?;
        let (wg, wu) = (param(b, "experts_gate")?, param(b, "experts_up")?);
        let mut dact = b.scratch(b.get("expert_act")?.data.len(), "dexpert_act")?;
        let grad_len = |w: &Act| if full { w.data.len() } else { 0 };
        for (name, w) in [
            ("experts_down", wd),
            ("experts_gate", wg),
            ("experts_up", wu),
        ] {
            if full {
                g.charge(name, w.data.len())?;
            }
        }
        let mut dwd = vec![0.0; grad_len(wd)];
        moe::down_backward(
            b.get("expert_act")?,
            b.get("topk_experts")?,
            wd,
            &deo,
            &mut dact,
            full.then_some(dwd.as_mut_slice()),
        )
        .map_err(err)?;
        drop(deo);
        let mut deg = b.scratch(dact.len(), "dexpert_gate")?;
        let mut deu = b.scratch(dact.len(), "dexpert_up")?;
        kernels::swiglu_backward(
            &b.get("expert_gate")?.data,
            &b.get("expert_up")?.data,
            &dact,
            &mut deg,
            &mut deu,
        )
        .map_err(kernel_err("swiglu"))?;
        drop(dact);
        let mut dln2 = b.scratch(d.rows() * d.hidden, "dln2")?;
        let (mut dwg, mut dwu) = (vec![0.0; grad_len(wg)], vec![0.0; grad_len(wu)]);
        let dws = full.then_some((dwg.as_mut_slice(), dwu.as_mut_slice()));
        moe::gate_up_backward(
            b.get("ln2")?,
            b.get("topk_experts")?,
            wg,
            wu,
            &deg,
            &deu,
            &mut dln2,
            dws,
        )
        .map_err(err)?;
        drop((deg, deu));
        let dlogits = moe::topk_softmax_backward(
            b.get("router_logits")?,
            b.get("topk_experts")?,
            &dweights,
            d.norm_topk,
        );
        let dlogits = b.charge(dlogits, "drouter_logits")?;
        let router = linear("ln2", "router", None);
        self.linear_backward(b, g, router, &dlogits, &mut dln2, true)?;
        if shared {
            self.shared_expert_backward(b, g, dout, &mut dln2)?;
        }
        if full {
            g.params.insert("experts_down".into(), dwd);
            g.params.insert("experts_gate".into(), dwg);
            g.params.insert("experts_up".into(), dwu);
        }
        Ok(dln2)
    }

    /// The SwiGLU half of an MLP's backward, shared by the dense MLP and the shared expert:
    /// the down projection's input gradient, then the gradients of the gate and up
    /// projections' outputs. The activation gradient is released before returning, so the
    /// caller's next buffer does not coexist with it (the pool's peak depends on that).
    fn swiglu_grads(
        &self,
        b: &Backward,
        g: &mut LayerGrads,
        names: SwigluNames,
        dout: &[f32],
        width: usize,
    ) -> RunResult<(Scratch, Scratch)> {
        let [dact_name, dgate_name, dup_name] = names.scratch;
        let mut dact = b.scratch(width, dact_name)?;
        let down = linear(names.act, names.down_proj, Some("down"));
        self.linear_backward(b, g, down, dout, &mut dact, false)?;
        let mut dgate = b.scratch(width, dgate_name)?;
        let mut dup = b.scratch(width, dup_name)?;
        kernels::swiglu_backward(
            &b.get(names.gate)?.data,
            &b.get(names.up)?.data,
            &dact,
            &mut dgate,
            &mut dup,
        )
        .map_err(kernel_err("swiglu"))?;
        Ok((dgate, dup))
    }

    fn shared_expert_backward(
        &self,
        b: &Backward,
        g: &mut LayerGrads,
        dout: &[f32],
        dln2: &mut [f32],
    ) -> RunResult<()> {
        let d = &self.dims;
        let names = SwigluNames {
            act: "shared_act",
            gate: "shared_gate",
            up: "shared_up",
            down_proj: "shared_down_proj",
            scratch: ["dshared_act", "dshared_gate", "dshared_up"],
        };
        let width = d.rows() * d.shared_intermediate;
        let (dsg, dsu) = self.swiglu_grads(b, g, names, dout, width)?;
        let gate = linear("ln2", "shared_gate_proj", Some("gate"));
        self.linear_backward(b, g, gate, &dsg, dln2, true)?;
        let up = linear("ln2", "shared_up_proj", Some("up"));
        self.linear_backward(b, g, up, &dsu, dln2, true)
    }

    fn attention_backward(
        &self,
        b: &mut Backward,
        g: &mut LayerGrads,
        dh: Scratch,
    ) -> RunResult<Scratch> {
        let d = &self.dims;
        let mut needed = ATTENTION_READS.to_vec();
        if d.qk_norm {
            needed.extend(QK_NORM_READS);
        }
        b.ensure(&needed)?;
        let n = d.rows();
        let mut dattn = b.scratch(n * d.q_width(), "dattn")?;
        let o = linear("attn", "o_proj", Some("o"));
        self.linear_backward(b, g, o, &dh, &mut dattn, false)?;
        let (q, k) = (b.get("q")?, b.get("k")?);
        let shape =
            ops::attention_shape(q, k, d.heads, d.kv_heads).map_err(kernel_err("attention"))?;
        let workers = kernels::attention_workers(&shape);
        let mut scratch = b.scratch(
            kernels::attention_backward_scratch_len(&shape, workers),
            "attention workspace",
        )?;
        let mut dq = b.scratch(shape.q_len(), "dq")?;
        let mut dk = b.scratch(shape.kv_len(), "dk")?;
        let mut dv = b.scratch(shape.kv_len(), "dv")?;
        kernels::attention_backward(
            &shape,
            None,
            &q.data,
            &k.data,
            &b.get("v")?.data,
            &b.get("attn_lse")?.data,
            &dattn,
            &mut dq,
            &mut dk,
            &mut dv,
            &mut scratch,
        )
        .map_err(kernel_err("attention"))?;
        drop((scratch, dattn));
        let rope = RopeTable::<f32>::new(d.seq, d.head_dim, d.theta).map_err(kernel_err("rope"))?;
        let unrotate = |grad: Scratch, width: usize, what: &str| -> RunResult<Scratch> {
            let a = Act::new(grad.data.clone(), vec![d.batch, d.seq, width]);
            drop(grad);
            let rotated = ops::rope(&rope, &a, d.head_dim, true).map_err(kernel_err("rope"))?;
            b.charge(rotated.data, what)
        };
        let mut dq_lin = unrotate(dq, d.q_width(), "dq_lin")?;
        let mut dk_lin = unrotate(dk, d.kv_width(), "dk_lin")?;
        if d.qk_norm {
            dq_lin = self.norm_backward(b, g, ("q_lin", "q_norm", "q_rstd"), &dq_lin)?;
            dk_lin = self.norm_backward(b, g, ("k_lin", "k_norm", "k_rstd"), &dk_lin)?;
        }
        let mut dln1 = b.scratch(n * d.hidden, "dln1")?;
        let projections = [
            ("q_proj", "q_bias", "q", &dq_lin),
            ("k_proj", "k_bias", "k", &dk_lin),
            ("v_proj", "v_bias", "v", &dv),
        ];
        for (i, (w, bias, target, dy)) in projections.into_iter().enumerate() {
            let lin = LinearUse {
                x: "ln1",
                w,
                bias: Some(bias),
                target: Some(target),
            };
            self.linear_backward(b, g, lin, dy, &mut dln1, i > 0)?;
        }
        drop((dq_lin, dk_lin, dv));
        let dx_norm =
            self.norm_backward(b, g, ("@input:x", "input_layernorm", "ln1_rstd"), &dln1)?;
        drop(dln1);
        let mut dx = dh;
        for (a, c) in dx.iter_mut().zip(dx_norm.iter()) {
            *a += c;
        }
        Ok(dx)
    }
}
