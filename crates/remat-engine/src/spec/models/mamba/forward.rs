//! The Mamba block's forward as spec op calls: every slot name here is the spec's, and a
//! replayed recompute runs exactly these calls again.

use crate::spec::Value;
use crate::spec::run::RunResult;
use crate::spec::run::exec::{Forward, Src};

use super::Mamba;

impl Mamba {
    pub(crate) fn block_forward(&self, f: &mut Forward) -> RunResult<()> {
        use Src::{Input, OptParam, Param, Slot};
        let eps = ("eps", Value::Str("layer_norm_epsilon".into()));
        f.call(
            "rmsnorm",
            &[eps],
            &[Input("x"), Param("norm")],
            &["ln", "ln_rstd"],
            &[],
        )?;
        f.call(
            "linear",
            &[],
            &[Slot("ln"), Param("in_proj"), OptParam("in_proj_bias")],
            &["xz"],
            &[Some("in")],
        )?;
        f.call(
            "causal_conv1d",
            &[],
            &[Slot("xz"), Param("conv1d_weight"), OptParam("conv1d_bias")],
            &["conv"],
            &[],
        )?;
        f.call("silu", &[], &[Slot("conv")], &["u"], &[])?;
        f.call(
            "linear",
            &[],
            &[Slot("u"), Param("x_proj")],
            &["x_dbc"],
            &[Some("x")],
        )?;
        f.call(
            "dt_proj",
            &[],
            &[Slot("x_dbc"), Param("dt_proj"), Param("dt_proj_bias")],
            &["dt_raw"],
            &[],
        )?;
        f.call("softplus", &[], &[Slot("dt_raw")], &["dt"], &[])?;
        let chunk = [("chunk", Value::Str("scan_chunk".into()))];
        f.call(
            "selective_scan",
            &chunk,
            &[
                Slot("u"),
                Slot("dt"),
                Param("A_log"),
                Slot("x_dbc"),
                Param("D"),
            ],
            &["y", "scan_states"],
            &[],
        )?;
        f.call("mamba_gate", &[], &[Slot("y"), Slot("xz")], &["gated"], &[])?;
        f.call(
            "linear",
            &[],
            &[Slot("gated"), Param("out_proj"), OptParam("out_proj_bias")],
            &["mixer_out"],
            &[Some("out")],
        )?;
        f.call("add", &[], &[Input("x"), Slot("mixer_out")], &["out"], &[])
    }
}
