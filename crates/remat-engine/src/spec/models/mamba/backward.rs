//! The Mamba block's hand-written backward. It reads slots through [`Backward`] (saved,
//! prefetched or rebuilt by the layer's plan, it does not know which); every gradient
//! buffer it allocates is charged to the step's pool.

use crate::core::kernels;
use crate::spec::compile::Mode;
use crate::spec::run::Act;
use crate::spec::run::exec::{Backward, Scratch};
use crate::spec::run::lora;
use crate::spec::run::{RunError, RunResult, linalg, ssm};

use super::super::grads::LayerGrads;
use super::super::head::kernel_err;
use super::{BACKWARD_READS, Mamba};

fn param<'a>(b: &'a Backward, name: &str) -> RunResult<&'a Act> {
    b.weights()
        .params
        .get(name)
        .ok_or_else(|| RunError::Model(format!("layer {}: no parameter `{name}`", b.layer)))
}

fn add_into(dst: &mut [f32], src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(o, v)| *o += v);
}

/// Adds `src` into the gradient of parameter `name` (full mode only).
fn grad_into(b: &Backward, g: &mut LayerGrads, name: &str, src: &[f32]) -> RunResult<()> {
    if b.mode() == Mode::Full {
        add_into(g.param(name, src.len())?, src);
    }
    Ok(())
}

/// Backward of one linear use `y = x W^T (+ bias) (+ LoRA target)`: returns `dx`.
fn linear_backward(
    b: &Backward,
    g: &mut LayerGrads,
    (x, w_name, bias, target): (&str, &str, Option<&str>, &str),
    dy: &[f32],
) -> RunResult<Scratch> {
    let w = param(b, w_name)?;
    let (n, k) = match w.shape[..] {
        [n, k] => (n, k),
        _ => {
            return Err(RunError::Model(format!(
                "layer {}: parameter `{w_name}` has shape {:?}, expected a matrix",
                b.layer, w.shape
            )));
        }
    };
    let m = dy.len() / n.max(1);
    let mut dx = b.scratch(m * k, &format!("d{x}"))?;
    linalg::linear_dx(dy, &w.data, m, k, n, &mut dx, false, 1.0);
    let xv = b.get(x)?;
    match b.mode() {
        Mode::Full => {
            linalg::linear_dw(dy, &xv.data, m, k, n, g.param(w_name, w.data.len())?, 1.0);
            if let Some(bias) = bias.filter(|name| b.weights().params.contains_key(*name)) {
                let db = g.param(bias, n)?;
                for row in dy.chunks(n) {
                    add_into(db, row);
                }
            }
        }
        Mode::Lora => {
            let adapter = b.weights().adapters.and_then(|a| a.get(target));
            if let (Some(adapter), Some(cfg)) = (adapter, b.lora_config()) {
                let grad = g.adapter(target, adapter.a.data.len(), adapter.b.data.len())?;
                lora::backward(cfg, b.mask(), target, adapter, &xv.data, dy, &mut dx, grad);
            }
        }
    }
    Ok(dx)
}

impl Mamba {
    /// One block's backward: takes the gradient of its output, returns its input's.
    pub(crate) fn block_backward(
        &self,
        b: &mut Backward,
        dout: Scratch,
        g: &mut LayerGrads,
    ) -> RunResult<Scratch> {
        b.ensure(&BACKWARD_READS)?;
        let layer = b.layer;
        let err = |e: String| RunError::Model(format!("layer {layer}: {e}"));
        let dgated = linear_backward(
            b,
            g,
            ("gated", "out_proj", Some("out_proj_bias"), "out"),
            &dout,
        )?;
        let xz = b.get("xz")?;
        let mut dxz = b.scratch(xz.data.len(), "dxz")?;
        let dy = b.charge(ssm::gate_backward(b.get("y")?, xz, &dgated, &mut dxz), "dy")?;
        drop(dgated);
        let chunk = self.dims.chunk;
        let sg = ssm::selective_scan_backward(
            b.get("u")?,
            b.get("dt")?,
            param(b, "A_log")?,
            b.get("x_dbc")?,
            param(b, "D")?,
            b.get("scan_states")?,
            chunk,
            &dy,
        )
        .map_err(err)?;
        drop(dy);
        grad_into(b, g, "A_log", &sg.da_log)?;
        grad_into(b, g, "D", &sg.dd)?;
        let mut dx_dbc = b.charge(sg.dx_dbc, "dx_dbc")?;
        let mut du = b.charge(sg.du, "du")?;
        let ddt_raw = b.charge(
            ssm::softplus_backward(&b.get("dt_raw")?.data, &sg.ddt),
            "ddt_raw",
        )?;
        drop(sg.ddt);
        let wdt = param(b, "dt_proj")?;
        let mut dwdt = b.scratch(wdt.data.len(), "ddt_proj (partial)")?;
        let mut dbdt = b.scratch(self.dims.inner, "ddt_proj_bias (partial)")?;
        ssm::dt_proj_backward(
            b.get("x_dbc")?,
            wdt,
            &ddt_raw,
            &mut dx_dbc,
            &mut dwdt,
            Some(&mut dbdt),
        )
        .map_err(err)?;
        drop(ddt_raw);
        grad_into(b, g, "dt_proj", &dwdt)?;
        grad_into(b, g, "dt_proj_bias", &dbdt)?;
        drop((dwdt, dbdt));
        let du_x = linear_backward(b, g, ("u", "x_proj", None, "x"), &dx_dbc)?;
        drop(dx_dbc);
        add_into(&mut du, &du_x);
        drop(du_x);
        let dconv = b.charge(ssm::silu_backward(&b.get("conv")?.data, &du), "dconv")?;
        drop(du);
        let w = param(b, "conv1d_weight")?;
        let mut dw = b.scratch(w.data.len(), "dconv1d_weight (partial)")?;
        let mut dbias = b.scratch(self.dims.inner, "dconv1d_bias (partial)")?;
        ssm::causal_conv1d_backward(b.get("xz")?, w, &dconv, &mut dxz, &mut dw, Some(&mut dbias))
            .map_err(err)?;
        drop(dconv);
        grad_into(b, g, "conv1d_weight", &dw)?;
        if self.dims.conv_bias {
            grad_into(b, g, "conv1d_bias", &dbias)?;
        }
        drop((dw, dbias));
        let dln = linear_backward(b, g, ("ln", "in_proj", Some("in_proj_bias"), "in"), &dxz)?;
        drop(dxz);
        let norm = param(b, "norm")?;
        let mut dx_norm = b.scratch(dln.len(), "dx (norm)")?;
        let mut dnorm = b.scratch(norm.data.len(), "dnorm (partial)")?;
        kernels::rmsnorm_backward(
            &b.get("@input:x")?.data,
            &norm.data,
            &b.get("ln_rstd")?.data,
            &dln,
            &mut dx_norm,
            Some(&mut dnorm),
        )
        .map_err(kernel_err("rmsnorm"))?;
        drop(dln);
        grad_into(b, g, "norm", &dnorm)?;
        let mut dx = dout;
        add_into(&mut dx, &dx_norm);
        Ok(dx)
    }
}
