//! The Qwen3 block's forward as spec op calls: every slot name here is the spec's, and a
//! replayed recompute runs exactly these calls again.

use crate::spec::Value;
use crate::spec::run::RunResult;
use crate::spec::run::exec::{Forward, Src};

use super::{BlockKind, Qwen3};

fn eps() -> (&'static str, Value) {
    ("eps", Value::Str("rms_norm_eps".into()))
}

impl Qwen3 {
    /// The block's forward as op calls: the slot names are the spec's.
    pub(crate) fn block_forward(&self, f: &mut Forward) -> RunResult<()> {
        use Src::{Global, Input, OptParam, Param, Slot};
        let d = &self.dims;
        f.call(
            "rmsnorm",
            &[eps()],
            &[Input("x"), Param("input_layernorm")],
            &["ln1", "ln1_rstd"],
            &[],
        )?;
        f.call(
            "qkv_proj",
            &[],
            &[
                Slot("ln1"),
                Param("q_proj"),
                Param("k_proj"),
                Param("v_proj"),
                OptParam("q_bias"),
                OptParam("k_bias"),
                OptParam("v_bias"),
            ],
            &["q_lin", "k_lin", "v"],
            &[Some("q"), Some("k"), Some("v")],
        )?;
        let (q_in, k_in) = if d.qk_norm {
            f.call(
                "head_rmsnorm",
                &[eps()],
                &[Slot("q_lin"), Param("q_norm")],
                &["q_normed", "q_rstd"],
                &[],
            )?;
            f.call(
                "head_rmsnorm",
                &[eps()],
                &[Slot("k_lin"), Param("k_norm")],
                &["k_normed", "k_rstd"],
                &[],
            )?;
            ("q_normed", "k_normed")
        } else {
            ("q_lin", "k_lin")
        };
        let hd = [("head_dim", Value::Str("head_dim".into()))];
        f.call(
            "rope",
            &hd,
            &[Slot(q_in), Global("rope_cos"), Global("rope_sin")],
            &["q"],
            &[],
        )?;
        f.call(
            "rope",
            &hd,
            &[Slot(k_in), Global("rope_cos"), Global("rope_sin")],
            &["k"],
            &[],
        )?;
        let heads = [
            ("heads", Value::Str("num_attention_heads".into())),
            ("kv_heads", Value::Str("num_key_value_heads".into())),
        ];
        f.call(
            "attention",
            &heads,
            &[Slot("q"), Slot("k"), Slot("v")],
            &["attn", "attn_lse"],
            &[],
        )?;
        f.call(
            "linear",
            &[],
            &[Slot("attn"), Param("o_proj")],
            &["attn_proj"],
            &[Some("o")],
        )?;
        f.call("add", &[], &[Input("x"), Slot("attn_proj")], &["h"], &[])?;
        f.call(
            "rmsnorm",
            &[eps()],
            &[Slot("h"), Param("post_attention_layernorm")],
            &["ln2", "ln2_rstd"],
            &[],
        )?;
        match self.kind {
            BlockKind::Dense => {
                f.call(
                    "linear",
                    &[],
                    &[Slot("ln2"), Param("gate_proj")],
                    &["gate"],
                    &[Some("gate")],
                )?;
                f.call(
                    "linear",
                    &[],
                    &[Slot("ln2"), Param("up_proj")],
                    &["up"],
                    &[Some("up")],
                )?;
                f.call("swiglu", &[], &[Slot("gate"), Slot("up")], &["act"], &[])?;
                f.call(
                    "linear",
                    &[],
                    &[Slot("act"), Param("down_proj")],
                    &["mlp_out"],
                    &[Some("down")],
                )?;
                f.call("add", &[], &[Slot("h"), Slot("mlp_out")], &["out"], &[])
            }
            BlockKind::Moe => {
                f.call(
                    "linear",
                    &[],
                    &[Slot("ln2"), Param("router")],
                    &["router_logits"],
                    &[],
                )?;
                let topk = [
                    ("k", Value::Str("num_experts_per_tok".into())),
                    ("normalize", Value::Str("norm_topk_prob".into())),
                ];
                f.call(
                    "topk_softmax",
                    &topk,
                    &[Slot("router_logits")],
                    &["topk_weights", "topk_experts"],
                    &[],
                )?;
                f.call(
                    "moe_gate_up",
                    &[],
                    &[
                        Slot("ln2"),
                        Slot("topk_experts"),
                        Param("experts_gate"),
                        Param("experts_up"),
                    ],
                    &["expert_gate", "expert_up"],
                    &[],
                )?;
                f.call(
                    "swiglu",
                    &[],
                    &[Slot("expert_gate"), Slot("expert_up")],
                    &["expert_act"],
                    &[],
                )?;
                f.call(
                    "moe_down",
                    &[],
                    &[
                        Slot("expert_act"),
                        Slot("topk_experts"),
                        Param("experts_down"),
                    ],
                    &["expert_out"],
                    &[],
                )?;
                if d.shared_intermediate > 0 {
                    f.call(
                        "linear",
                        &[],
                        &[Slot("ln2"), Param("shared_gate_proj")],
                        &["shared_gate"],
                        &[Some("gate")],
                    )?;
                    f.call(
                        "linear",
                        &[],
                        &[Slot("ln2"), Param("shared_up_proj")],
                        &["shared_up"],
                        &[Some("up")],
                    )?;
                    f.call(
                        "swiglu",
                        &[],
                        &[Slot("shared_gate"), Slot("shared_up")],
                        &["shared_act"],
                        &[],
                    )?;
                    f.call(
                        "linear",
                        &[],
                        &[Slot("shared_act"), Param("shared_down_proj")],
                        &["shared_out"],
                        &[Some("down")],
                    )?;
                    f.call(
                        "moe_combine",
                        &[],
                        &[Slot("expert_out"), Slot("topk_weights"), Slot("shared_out")],
                        &["moe_out"],
                        &[],
                    )?;
                } else {
                    f.call(
                        "moe_combine",
                        &[],
                        &[Slot("expert_out"), Slot("topk_weights")],
                        &["moe_out"],
                        &[],
                    )?;
                }
                // moe_combine yields [tokens, hidden]; the residual add keeps h's shape.
                f.call("add", &[], &[Slot("h"), Slot("moe_out")], &["out"], &[])
            }
        }
    }
}
