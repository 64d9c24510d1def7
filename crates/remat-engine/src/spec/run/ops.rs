//! Implementations of the registered recompute ops (see [`crate::spec::ops`]). The forward
//! pass of a spec-driven block calls exactly these functions, so a recomputed slot is the
//! forward's value bit for bit.

use std::collections::BTreeMap;

use crate::core::kernels::{self, AttentionShape, KernelError, RopeTable};
use crate::spec::{ModelConfig, Value};

use super::act::{Act, linear};
use super::error::{RunError, RunResult};

/// What an op runs with besides its operands.
pub struct OpEnv<'a> {
    pub config: &'a ModelConfig,
    /// `None` in models without attention: the `rope` op is then an error.
    pub rope: Option<&'a RopeTable<f32>>,
    /// The slot being produced, for error messages.
    pub slot: &'a str,
}

/// Attribute values; a string naming a model-config key takes that key's value.
pub fn attr_f64(
    env: &OpEnv,
    op: &str,
    attrs: &BTreeMap<String, Value>,
    key: &str,
) -> RunResult<f64> {
    let bad = |reason: String| RunError::BadOperands {
        op: op.into(),
        slot: env.slot.into(),
        reason,
    };
    let value = attrs
        .get(key)
        .ok_or_else(|| bad(format!("attribute `{key}` is missing")))?;
    let value = match value {
        Value::Str(name) => env.config.get(name).ok_or_else(|| {
            bad(format!(
                "attribute `{key}` names config key `{name}`, which is not set"
            ))
        })?,
        v => v,
    };
    match value {
        Value::Int(i) => Ok(*i as f64),
        Value::Float(x) => Ok(*x),
        Value::Bool(b) => Ok(if *b { 1.0 } else { 0.0 }),
        Value::Str(s) => Err(bad(format!("attribute `{key}` = {s:?} is not a number"))),
    }
}

fn attr_usize(
    env: &OpEnv,
    op: &str,
    attrs: &BTreeMap<String, Value>,
    key: &str,
) -> RunResult<usize> {
    let v = attr_f64(env, op, attrs, key)?;
    if v < 0.0 || v.fract() != 0.0 {
        return Err(RunError::BadOperands {
            op: op.into(),
            slot: env.slot.into(),
            reason: format!("attribute `{key}` = {v} is not a non-negative integer"),
        });
    }
    Ok(v as usize)
}

/// Runs `op` on `inputs` (`None` for an absent optional operand).
pub fn execute(
    env: &OpEnv,
    op: &str,
    attrs: &BTreeMap<String, Value>,
    inputs: &[Option<&Act>],
) -> RunResult<Vec<Act>> {
    let bad = |reason: String| RunError::BadOperands {
        op: op.into(),
        slot: env.slot.into(),
        reason,
    };
    let kernel = |source: KernelError| RunError::Kernel {
        op: op.into(),
        slot: env.slot.into(),
        error: source,
    };
    let arg = |i: usize| -> RunResult<&Act> {
        inputs
            .get(i)
            .copied()
            .flatten()
            .ok_or_else(|| bad(format!("operand {i} is missing")))
    };
    let opt = |i: usize| inputs.get(i).copied().flatten();
    match op {
        "rmsnorm" | "head_rmsnorm" => {
            let (x, w) = (arg(0)?, arg(1)?);
            let eps = attr_f64(env, op, attrs, "eps")?;
            let rows = x.data.len() / w.data.len().max(1);
            let mut y = vec![0.0; x.data.len()];
            let mut rstd = vec![0.0; rows];
            kernels::rmsnorm_forward(&x.data, &w.data, eps, &mut y, &mut rstd).map_err(kernel)?;
            let rstd_shape = rstd_shape(&x.shape, w.data.len(), rows, op == "head_rmsnorm");
            Ok(vec![
                Act::new(y, x.shape.clone()),
                Act::new(rstd, rstd_shape),
            ])
        }
        "rmsnorm_apply" | "head_rmsnorm_apply" => {
            let (x, w, rstd) = (arg(0)?, arg(1)?, arg(2)?);
            Ok(vec![rmsnorm_apply(x, w, rstd).map_err(bad)?])
        }
        "linear" => Ok(vec![linear(arg(0)?, arg(1)?, opt(2)).map_err(bad)?]),
        "qkv_proj" => {
            let x = arg(0)?;
            let mut out = Vec::with_capacity(3);
            for i in 0..3 {
                out.push(linear(x, arg(1 + i)?, opt(4 + i)).map_err(bad)?);
            }
            Ok(out)
        }
        "rope" => {
            let x = arg(0)?;
            let head_dim = attr_usize(env, op, attrs, "head_dim")?;
            let table = env
                .rope
                .ok_or_else(|| bad("this model has no RoPE table (no attention)".into()))?;
            Ok(vec![rope(table, x, head_dim, false).map_err(kernel)?])
        }
        "attention" => {
            let (q, k, v) = (arg(0)?, arg(1)?, arg(2)?);
            let heads = attr_usize(env, op, attrs, "heads")?;
            let kv_heads = attr_usize(env, op, attrs, "kv_heads")?;
            attention(q, k, v, heads, kv_heads).map_err(kernel)
        }
        "add" => {
            let (a, b) = (arg(0)?, arg(1)?);
            if a.data.len() != b.data.len() {
                return Err(bad(format!("add of {:?} and {:?}", a.shape, b.shape)));
            }
            let y = a.data.iter().zip(&b.data).map(|(x, y)| x + y).collect();
            Ok(vec![Act::new(y, a.shape.clone())])
        }
        "swiglu" => {
            let (g, u) = (arg(0)?, arg(1)?);
            let mut y = vec![0.0; g.data.len()];
            kernels::swiglu_forward(&g.data, &u.data, &mut y).map_err(kernel)?;
            Ok(vec![Act::new(y, g.shape.clone())])
        }
        "topk_softmax" => {
            let k = attr_usize(env, op, attrs, "k")?;
            let normalize =
                attrs.contains_key("normalize") && attr_f64(env, op, attrs, "normalize")? != 0.0;
            super::moe::topk_softmax(arg(0)?, k, normalize).map_err(bad)
        }
        "moe_gate_up" => super::moe::gate_up(arg(0)?, arg(1)?, arg(2)?, arg(3)?).map_err(bad),
        "moe_down" => Ok(vec![
            super::moe::down(arg(0)?, arg(1)?, arg(2)?).map_err(bad)?,
        ]),
        "moe_combine" => Ok(vec![
            super::moe::combine(arg(0)?, arg(1)?, opt(2)).map_err(bad)?,
        ]),
        "causal_conv1d" => Ok(vec![
            super::ssm::causal_conv1d(arg(0)?, arg(1)?, opt(2)).map_err(bad)?,
        ]),
        "silu" => Ok(vec![super::ssm::silu(arg(0)?)]),
        "softplus" => Ok(vec![super::ssm::softplus(arg(0)?)]),
        "dt_proj" => Ok(vec![
            super::ssm::dt_proj(arg(0)?, arg(1)?, opt(2)).map_err(bad)?,
        ]),
        "selective_scan" => {
            let chunk = attr_usize(env, op, attrs, "chunk")?;
            super::ssm::selective_scan(arg(0)?, arg(1)?, arg(2)?, arg(3)?, arg(4)?, chunk)
                .map_err(bad)
        }
        "mamba_gate" => Ok(vec![super::ssm::gate(arg(0)?, arg(1)?).map_err(bad)?]),
        other => Err(bad(format!("`{other}` has no implementation"))),
    }
}

/// One reciprocal std per normalised row: `[B, T]` for a norm over the hidden size,
/// `[B, T, heads]` for a per-head norm of `[B, T, heads * head_dim]` (as specs declare it;
/// one head too: a single key/value head gives `[B, T, 1]`, not `[B, T]`).
fn rstd_shape(x_shape: &[usize], norm_len: usize, rows: usize, per_head: bool) -> Vec<usize> {
    let (last, lead) = match x_shape.split_last() {
        Some((last, lead)) => (*last, lead.to_vec()),
        None => return vec![rows],
    };
    let mut s = lead;
    if norm_len > 0 && (per_head || last != norm_len) && last % norm_len == 0 {
        s.push(last / norm_len);
    }
    if s.iter().product::<usize>() != rows {
        s = vec![rows];
    }
    s
}

/// `y = x * rstd * w` per row, in the same order of operations as the forward kernel.
fn rmsnorm_apply(x: &Act, w: &Act, rstd: &Act) -> Result<Act, String> {
    let dim = w.data.len();
    if dim == 0 || x.data.len() != rstd.data.len() * dim {
        return Err(format!(
            "x of {} elements is not {} rows (rstd) of weight length {dim}",
            x.data.len(),
            rstd.data.len()
        ));
    }
    let mut y = vec![0.0; x.data.len()];
    for ((yr, xr), &s) in y.chunks_mut(dim).zip(x.data.chunks(dim)).zip(&rstd.data) {
        for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(&w.data) {
            *o = v * s * g;
        }
    }
    Ok(Act::new(y, x.shape.clone()))
}

/// RoPE over `[B, T, heads * head_dim]` (or its backward with `inverse`).
pub fn rope(
    table: &RopeTable<f32>,
    x: &Act,
    head_dim: usize,
    inverse: bool,
) -> Result<Act, KernelError> {
    let (b, t, width) = match x.shape.as_slice() {
        [b, t, w] => (*b, *t, *w),
        s => {
            return Err(KernelError::Invalid {
                kernel: "rope",
                what: format!("expected [batch, seq, heads * head_dim], got {s:?}"),
            });
        }
    };
    if head_dim == 0 || !width.is_multiple_of(head_dim) {
        return Err(KernelError::Invalid {
            kernel: "rope",
            what: format!("width {width} is not a multiple of head_dim {head_dim}"),
        });
    }
    if b == 0 || t == 0 || b.checked_mul(t).and_then(|n| n.checked_mul(width)) != Some(x.data.len())
    {
        return Err(KernelError::Invalid {
            kernel: "rope",
            what: format!(
                "shape [{b}, {t}, {width}] needs a positive batch and sequence length and {} values, got {}",
                b.saturating_mul(t).saturating_mul(width),
                x.data.len()
            ),
        });
    }
    let mut y = vec![0.0; x.data.len()];
    for bi in 0..b {
        for h in 0..width / head_dim {
            let off = bi * t * width + h * head_dim;
            let (src, dst) = (&x.data[off..], &mut y[off..]);
            if inverse {
                kernels::rope_backward_rows(table, t, src, width, dst, width)?;
            } else {
                kernels::rope_forward_rows(table, t, src, width, dst, width)?;
            }
        }
    }
    Ok(Act::new(y, x.shape.clone()))
}

pub fn attention_shape(
    q: &Act,
    k: &Act,
    heads: usize,
    kv_heads: usize,
) -> Result<AttentionShape, KernelError> {
    let (b, t, width) = match q.shape.as_slice() {
        [b, t, w] => (*b, *t, *w),
        s => {
            return Err(KernelError::Invalid {
                kernel: "attention",
                what: format!("expected q of [batch, seq, heads * head_dim], got {s:?}"),
            });
        }
    };
    let head_dim = width.checked_div(heads).unwrap_or(0);
    let shape = AttentionShape {
        batch: b,
        seq: t,
        n_heads: heads,
        n_kv_heads: kv_heads,
        head_dim,
    };
    shape.validate()?;
    if k.data.len() != shape.kv_len() {
        return Err(KernelError::Invalid {
            kernel: "attention",
            what: format!(
                "k of {} elements, expected {}",
                k.data.len(),
                shape.kv_len()
            ),
        });
    }
    Ok(shape)
}

fn attention(
    q: &Act,
    k: &Act,
    v: &Act,
    heads: usize,
    kv_heads: usize,
) -> Result<Vec<Act>, KernelError> {
    let shape = attention_shape(q, k, heads, kv_heads)?;
    let workers = kernels::attention_workers(&shape);
    let mut scratch = vec![0.0; kernels::attention_forward_scratch_len(&shape, workers)];
    let mut out = vec![0.0; shape.q_len()];
    let mut lse = vec![0.0; shape.lse_len()];
    kernels::attention_forward(
        &shape,
        None,
        &q.data,
        &k.data,
        &v.data,
        &mut out,
        &mut lse,
        &mut scratch,
    )?;
    Ok(vec![
        Act::new(out, q.shape.clone()),
        Act::new(lse, vec![shape.batch, shape.n_heads, shape.seq]),
    ])
}
