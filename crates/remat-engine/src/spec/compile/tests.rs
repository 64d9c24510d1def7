use super::*;
use crate::spec::shipped::QWEN3;

fn config(sets: &[&str]) -> ModelConfig {
    let mut c = QWEN3.config().unwrap().set("vocab_size", Value::Int(50));
    for s in sets {
        c.apply_override(s).unwrap();
    }
    c
}

/// Found by an audit: a slot of 2^32 x 2^32 x 4 f32 wrapped to 0 bytes.
#[test]
fn byte_counts_that_overflow_name_the_slot() {
    let mut spec = QWEN3.spec().unwrap();
    let slot = spec.slots.iter_mut().find(|s| s.name == "ln1").unwrap();
    slot.shape = ["4294967296", "4294967296", "4"].map(String::from).to_vec();
    let err = compile(&spec, &config(&[]), Mode::Full)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("slot `ln1`") && err.contains("overflow"),
        "{err}"
    );
    let err = compile(
        &QWEN3.spec().unwrap(),
        &config(&["hidden_size=9223372036854775807"]),
        Mode::Full,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("overflow"), "{err}");
}

/// Found by an audit: 10^9 layers were planned one by one (and allocated for).
#[test]
fn layer_counts_are_bounded_and_uniform_layers_share_a_plan() {
    let err = compile(
        &QWEN3.spec().unwrap(),
        &config(&["num_hidden_layers=1000000000"]),
        Mode::Full,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("layer count 1000000000"), "{err}");
    let plan = compile(
        &QWEN3.spec().unwrap(),
        &config(&[&format!("num_hidden_layers={MAX_LAYERS}")]),
        Mode::Lora,
    )
    .unwrap();
    assert_eq!(plan.layers.len(), MAX_LAYERS);
    let (first, last) = (&plan.layers[0], &plan.layers[MAX_LAYERS - 1]);
    assert_eq!(last.layer, MAX_LAYERS - 1);
    assert_eq!((&first.steps, &first.slots), (&last.steps, &last.slots));
}
