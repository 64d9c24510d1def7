//! LoRA adapters and trainable counts shared by the spec-driven models (Qwen3, Mamba,
//! hybrid): each model says which projection a target attaches to; the checks, the
//! initialisation streams and the counting are the same for all three, so that a target on
//! the same projection starts from the same values whichever model carries it.

use std::collections::BTreeMap;

use crate::spec::compile::Mode;
use crate::spec::run::Act;
use crate::spec::run::lora::{Adapter, LayerAdapters, LoraConfig};
use crate::spec::run::{RunError, RunResult};

use super::init::{filled, uniform};

/// The first initialisation stream of the adapters; each adapter takes the next two
/// (`A`, then `B`), layer by layer and target by target in `cfg.targets` order.
const FIRST_STREAM: u64 = 1000;

/// Refuses hyper-parameters no adapter can train with. The output is scaled by
/// `alpha / rank`: a zero rank divides by zero, and a NaN, infinite or non-positive alpha
/// trains to a NaN loss (or not at all) without any other error.
pub(crate) fn check_lora(cfg: &LoraConfig) -> RunResult<()> {
    let bad = |what: String| Err(RunError::Model(what));
    if cfg.rank == 0 {
        return bad("LoRA rank must be greater than 0 (got 0)".into());
    }
    if !(0.0..1.0).contains(&cfg.dropout) {
        return bad(format!(
            "LoRA dropout must be in [0, 1) (got {})",
            cfg.dropout
        ));
    }
    if !(cfg.alpha.is_finite() && cfg.alpha > 0.0) {
        return bad(format!(
            "LoRA alpha must be a finite number greater than 0 (got {})",
            cfg.alpha
        ));
    }
    Ok(())
}

/// Adapters for `layers` layers: for each target of `cfg` that `base_shape(layer, target)`
/// finds a projection `[out, in]` for, `A [rank, in]` uniform with scale `1/sqrt(in)` and
/// `B [out, rank]` zero as in the LoRA paper, or uniform when `random_b` (tests use it so
/// adapters change the outputs). Targets without a projection in a layer are skipped.
pub(crate) fn init_adapters(
    cfg: &LoraConfig,
    random_b: bool,
    layers: usize,
    base_shape: impl Fn(usize, &str) -> Option<(usize, usize)>,
) -> RunResult<Vec<LayerAdapters>> {
    let mut adapters = Vec::with_capacity(layers);
    let mut stream = FIRST_STREAM;
    for layer in 0..layers {
        let mut map = LayerAdapters::new();
        for t in &cfg.targets {
            let Some((out, inp)) = base_shape(layer, t) else {
                continue;
            };
            stream += 2;
            let a = uniform(cfg.seed, stream, cfg.rank * inp, 1.0 / (inp as f32).sqrt())?;
            let b = if random_b {
                uniform(cfg.seed, stream + 1, out * cfg.rank, 0.5)?
            } else {
                filled(out * cfg.rank, |_| 0.0)?
            };
            map.insert(
                t.clone(),
                Adapter {
                    a: Act::new(a, vec![cfg.rank, inp]),
                    b: Act::new(b, vec![out, cfg.rank]),
                },
            );
        }
        adapters.push(map);
    }
    Ok(adapters)
}

/// Values trained in `mode`: the adapters' in LoRA mode (0 without adapters), every
/// parameter's (`whole`: embedding, final norm, head; then each layer's) in full mode.
pub(crate) fn trainable_values(
    mode: Mode,
    adapters: Option<&[LayerAdapters]>,
    whole: &[&Act],
    layers: &[BTreeMap<String, Act>],
) -> usize {
    match mode {
        Mode::Lora => adapters.map_or(0, |a| {
            a.iter()
                .flat_map(|m| m.values())
                .map(|x| x.a.data.len() + x.b.data.len())
                .sum()
        }),
        Mode::Full => {
            whole.iter().map(|a| a.data.len()).sum::<usize>()
                + layers
                    .iter()
                    .flat_map(|m| m.values())
                    .map(|a| a.data.len())
                    .sum::<usize>()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(rank: usize, alpha: f32, dropout: f64) -> LoraConfig {
        LoraConfig {
            rank,
            alpha,
            dropout,
            targets: vec!["q".into(), "up".into()],
            seed: 7,
        }
    }

    #[test]
    fn bad_hyper_parameters_are_refused_by_name() {
        let cases = [
            (cfg(0, 8.0, 0.0), "LoRA rank"),
            (cfg(4, f32::NAN, 0.0), "LoRA alpha"),
            (cfg(4, -1.0, 0.0), "LoRA alpha"),
            (cfg(4, 8.0, 1.0), "LoRA dropout"),
        ];
        for (bad, field) in cases {
            let e = check_lora(&bad).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        check_lora(&cfg(4, 8.0, 0.1)).unwrap();
    }

    #[test]
    fn adapters_follow_the_base_shapes_and_skip_missing_targets() {
        // Layer 0 has both projections, layer 1 only `q`.
        let shape = |layer: usize, t: &str| match (layer, t) {
            (_, "q") => Some((6, 4)),
            (0, "up") => Some((10, 4)),
            _ => None,
        };
        let c = cfg(2, 4.0, 0.0);
        let zero_b = init_adapters(&c, false, 2, shape).unwrap();
        assert_eq!(zero_b[0].len(), 2);
        assert_eq!(zero_b[1].len(), 1);
        assert_eq!(zero_b[0]["up"].a.shape, vec![2, 4]);
        assert_eq!(zero_b[0]["up"].b.shape, vec![10, 2]);
        assert!(zero_b[0]["q"].b.data.iter().all(|&v| v == 0.0));
        // Every adapter draws its own stream: no two A matrices repeat.
        assert_ne!(zero_b[0]["q"].a.data, zero_b[1]["q"].a.data);
        let random_b = init_adapters(&c, true, 2, shape).unwrap();
        assert_eq!(random_b[0]["q"].a, zero_b[0]["q"].a);
        assert!(random_b[0]["q"].b.data.iter().any(|&v| v != 0.0));
        let lora = trainable_values(Mode::Lora, Some(&zero_b), &[], &[]);
        assert_eq!(lora, 3 * 2 * 4 + 2 * (6 + 6) + 2 * 10);
        assert_eq!(trainable_values(Mode::Lora, None, &[], &[]), 0);
    }
}
