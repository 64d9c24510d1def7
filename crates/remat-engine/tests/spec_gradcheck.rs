//! Finite-difference checks of the hand-written Qwen3 backward (dense and MoE, full and LoRA
//! mode): for every parameter (adapter) tensor, the entries with the largest analytic
//! gradient are compared with a central difference of the loss. The model is f32 only (the
//! engine's f64 `gradcheck` covers graph ops), so the test checks the entries whose gradient
//! stands well above f32 round-off and uses a relative tolerance.

use remat_engine::core::swap::HostStore;
use remat_engine::spec::models::StepEnv;
use remat_engine::spec::models::qwen3::{BlockKind, Qwen3};
use remat_engine::spec::run::lora::LoraConfig;
use remat_engine::spec::run::meter::Meter;
use remat_engine::spec::shipped::{QWEN3, QWEN3_MOE};
use remat_engine::spec::{Mode, ModelConfig, Plan, Value, compile};

fn config(kind: BlockKind) -> ModelConfig {
    let c = ModelConfig::new("gradcheck")
        .set("vocab_size", Value::Int(24))
        .set("hidden_size", Value::Int(16))
        .set("num_attention_heads", Value::Int(4))
        .set("num_key_value_heads", Value::Int(2))
        .set("head_dim", Value::Int(4))
        .set("num_hidden_layers", Value::Int(2))
        .set("batch", Value::Int(2))
        .set("seq_len", Value::Int(5))
        .set("attention_bias", Value::Bool(true))
        .set("rope_theta", Value::Float(10000.0));
    match kind {
        BlockKind::Dense => c.set("intermediate_size", Value::Int(24)),
        BlockKind::Moe => c
            .set("num_experts", Value::Int(4))
            .set("num_experts_per_tok", Value::Int(2))
            .set("moe_intermediate_size", Value::Int(12))
            .set("shared_expert_intermediate_size", Value::Int(8)),
    }
}

const TOKENS: [u32; 10] = [3, 17, 5, 9, 22, 1, 0, 14, 7, 11];
const TARGETS: [u32; 10] = [8, 2, 19, 4, 13, 6, 23, 10, 1, 15];

fn loss(model: &Qwen3, plan: &Plan) -> f64 {
    let env = StepEnv {
        host: &HostStore::in_memory(),
        meter: &Meter::unbounded(),
        step: 4,
    };
    f64::from(model.step(plan, &TOKENS, &TARGETS, env).unwrap().1.loss)
}

/// A parameter reachable by name for perturbation.
fn param<'m>(model: &'m mut Qwen3, name: &str) -> &'m mut Vec<f32> {
    let parts: Vec<&str> = name.split('.').collect();
    match parts.as_slice() {
        ["embed"] => &mut model.embed.data,
        ["lm_head"] => &mut model.lm_head.data,
        ["final_norm"] => &mut model.final_norm.data,
        ["layers", l, "lora", t, m] => {
            let adapters = &mut model.lora.as_mut().unwrap().1[l.parse::<usize>().unwrap()];
            let a = adapters.get_mut(*t).unwrap();
            if *m == "A" {
                &mut a.a.data
            } else {
                &mut a.b.data
            }
        }
        ["layers", l, p] => {
            &mut model.layers[l.parse::<usize>().unwrap()]
                .get_mut(*p)
                .unwrap()
                .data
        }
        _ => panic!("unknown parameter {name}"),
    }
}

fn check(kind: BlockKind, mode: Mode) {
    let cfg = config(kind);
    let spec = match kind {
        BlockKind::Dense => QWEN3.spec().unwrap(),
        BlockKind::Moe => QWEN3_MOE.spec().unwrap(),
    };
    let lora = LoraConfig {
        rank: 2,
        alpha: 4.0,
        dropout: 0.2,
        targets: ["q", "k", "v", "o", "up", "gate", "down"]
            .map(String::from)
            .to_vec(),
        seed: 5,
    };
    let mut model = Qwen3::new(kind, &cfg, 9)
        .unwrap()
        .with_lora(lora, true)
        .unwrap();
    let plan = compile(&spec, &cfg, mode).unwrap();
    let env = StepEnv {
        host: &HostStore::in_memory(),
        meter: &Meter::unbounded(),
        step: 4,
    };
    let (grads, _) = model.step(&plan, &TOKENS, &TARGETS, env).unwrap();
    let named: Vec<(String, Vec<f32>)> = grads
        .named()
        .into_iter()
        .filter(|(_, g)| !g.is_empty())
        .map(|(n, g)| (n, g.to_vec()))
        .collect();
    assert!(
        named.len() > 10,
        "{kind:?} {mode:?}: only {} gradients",
        named.len()
    );
    let (mut checked, mut failures) = (0, Vec::new());
    for (name, grad) in &named {
        let mut order: Vec<usize> = (0..grad.len()).collect();
        order.sort_by(|&a, &b| grad[b].abs().total_cmp(&grad[a].abs()));
        for &i in order.iter().take(2) {
            let g = f64::from(grad[i]);
            if g.abs() < 2e-3 {
                continue;
            }
            // Small enough that no router logit crosses a top-k tie (the routing is a
            // step function: h = 1e-2 flips a choice in the MoE model), large enough to
            // stay well above f32 round-off of the loss.
            let h = 2e-3f32;
            let w = param(&mut model, name)[i];
            param(&mut model, name)[i] = w + h;
            let up = loss(&model, &plan);
            param(&mut model, name)[i] = w - h;
            let down = loss(&model, &plan);
            param(&mut model, name)[i] = w;
            let fd = (up - down) / (2.0 * f64::from(h));
            checked += 1;
            if (fd - g).abs() > 0.05 * g.abs() + 5e-4 {
                failures.push(format!(
                    "{name}[{i}]: analytic {g:.6}, finite difference {fd:.6}"
                ));
            }
        }
    }
    assert!(
        checked >= 10,
        "{kind:?} {mode:?}: checked only {checked} entries"
    );
    assert!(failures.is_empty(), "{kind:?} {mode:?}: {failures:#?}");
}

#[test]
fn dense_gradients_match_finite_differences() {
    check(BlockKind::Dense, Mode::Full);
    check(BlockKind::Dense, Mode::Lora);
}

#[test]
fn moe_gradients_match_finite_differences() {
    check(BlockKind::Moe, Mode::Full);
    check(BlockKind::Moe, Mode::Lora);
}
