//! A fused step of K models gives each model's loss, gradients and (after optimizer steps)
//! parameters bit-identical to training it alone, on 1 and 2 threads, with dropout on
//! (one model at p = 0), under store-all, a whole-graph recompute policy and per-block
//! segments; models of two shapes train together, the odd one unfused.

use std::sync::Arc;

use super::*;
use crate::core::optim::{AdamW, AdamWConfig};
use crate::core::pool::MemoryPool;
use crate::core::tensor::Tensor;
use crate::models::gpt::{Batch, Gpt, GptConfig};
use crate::models::multi::step_optimizers;

fn config(d_model: usize, dropout: f32, init_seed: u64) -> GptConfig {
    GptConfig {
        vocab: 13,
        d_model,
        n_layers: 3,
        n_heads: 2,
        n_kv_heads: 1,
        ffn_hidden: 2 * d_model,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        dropout,
        init_seed,
    }
}

fn batch(model: usize, step: u64) -> Batch {
    let (b, s) = (2, 9);
    let tok = |salt: u64| -> Arc<[u32]> {
        (0..b * s)
            .map(|i| {
                let h =
                    crate::core::kernels::philox_hash(model as u64 ^ salt, step * 1000 + i as u64);
                (h % 13) as u32
            })
            .collect()
    };
    Batch {
        tokens: tok(1),
        targets: tok(2),
        batch: b,
        seq: s,
    }
}

fn seed(k: usize, step: u64) -> u64 {
    (k as u64 + 10) ^ (step << 32)
}

fn same_bits(a: &[Option<Tensor>], b: &[Option<Tensor>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| match (x, y) {
            (Some(x), Some(y)) => x.bit_eq(y),
            (None, None) => true,
            _ => false,
        })
}

fn steps<'a>(models: &'a [Gpt], batches: &'a [Batch], step: u64) -> Vec<ModelStep<'a>> {
    models
        .iter()
        .zip(batches)
        .enumerate()
        .map(|(k, (model, batch))| ModelStep {
            model,
            batch,
            seed: seed(k, step),
        })
        .collect()
}

#[test]
fn a_fused_step_gives_each_model_its_solo_loss_and_gradients() {
    let configs = [config(16, 0.1, 1), config(16, 0.0, 2), config(16, 0.25, 3)];
    for threads in [1, 2] {
        let pool = MemoryPool::unbounded();
        let ctx = ExecContext::new(pool.clone(), threads).unwrap();
        let models: Vec<Gpt> = configs
            .iter()
            .map(|c| Gpt::new(&pool, c.clone()).unwrap())
            .collect();
        let batches: Vec<Batch> = (0..3).map(|k| batch(k, 0)).collect();
        let steps = steps(&models, &batches, 0);
        let set = ModelSet::group(&steps, true);
        assert_eq!(set.units, vec![vec![0, 1, 2]]);
        let ckpt = Checkpointing::Graph(Policy::StoreAll);
        let fused = forward_backward_set(&ctx, &steps, &set, ckpt).unwrap();
        for k in 0..3 {
            let alone = models[k]
                .forward_backward(&ctx, &batches[k], ckpt, seed(k, 0))
                .unwrap();
            assert_eq!(fused.losses[k].to_bits(), alone.loss.to_bits(), "loss {k}");
            assert!(
                same_bits(&fused.grads[k], &alone.grads),
                "gradients of model {k}"
            );
        }
    }
}

/// Trains `configs` for three steps with per-model learning rates, fused (`Some(fuse)`)
/// or each alone (`None`), and returns every model's parameters.
fn train(
    configs: &[GptConfig],
    threads: usize,
    ckpt: Checkpointing,
    fuse: Option<bool>,
) -> (Vec<Vec<Tensor>>, Vec<Vec<usize>>) {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), threads).unwrap();
    let models: Vec<Gpt> = configs
        .iter()
        .map(|c| Gpt::new(&pool, c.clone()).unwrap())
        .collect();
    let mut opts: Vec<AdamW> = models
        .iter()
        .enumerate()
        .map(|(k, m)| {
            let c = AdamWConfig {
                lr: 1e-2 / (k + 1) as f64,
                ..AdamWConfig::default()
            };
            AdamW::new(&pool, m.params(), c).unwrap()
        })
        .collect();
    let mut units = Vec::new();
    for step in 0..3u64 {
        let batches: Vec<Batch> = (0..models.len()).map(|k| batch(k, step)).collect();
        let grads = match fuse {
            Some(fuse) => {
                let steps = steps(&models, &batches, step);
                let set = ModelSet::group(&steps, fuse);
                units = set.units.clone();
                forward_backward_set(&ctx, &steps, &set, ckpt)
                    .unwrap()
                    .grads
            }
            None => (0..models.len())
                .map(|k| {
                    let out = models[k].forward_backward(&ctx, &batches[k], ckpt, seed(k, step));
                    out.unwrap().grads
                })
                .collect(),
        };
        ctx.install(|| step_optimizers(&mut opts, &grads)).unwrap();
    }
    let params = models
        .iter()
        .map(|m| m.params().into_iter().map(|(_, t)| t).collect())
        .collect();
    (params, units)
}

fn assert_same_params(a: &[Vec<Tensor>], b: &[Vec<Tensor>], what: &str) {
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert!(p.bit_eq(q), "{what}: model {k} parameter {i} differs");
        }
    }
}

#[test]
fn fused_training_matches_solo_training_under_every_checkpointing() {
    let configs = [config(16, 0.1, 1), config(16, 0.0, 2), config(16, 0.25, 3)];
    let policies = [
        Checkpointing::Graph(Policy::StoreAll),
        Checkpointing::Graph(Policy::EveryN(2)),
        Checkpointing::PerBlock,
    ];
    for threads in [1, 2] {
        for ckpt in policies {
            let (solo, _) = train(&configs, threads, ckpt, None);
            let (fused, units) = train(&configs, threads, ckpt, Some(true));
            assert_eq!(units, vec![vec![0, 1, 2]]);
            assert_same_params(&fused, &solo, &format!("{ckpt} on {threads} threads"));
        }
    }
}

#[test]
fn models_of_two_shapes_train_together_the_odd_one_unfused() {
    let configs = [config(16, 0.1, 1), config(8, 0.2, 2), config(16, 0.0, 3)];
    let ckpt = Checkpointing::Graph(Policy::StoreAll);
    let (solo, _) = train(&configs, 2, ckpt, None);
    let (fused, units) = train(&configs, 2, ckpt, Some(true));
    assert_eq!(units, vec![vec![0, 2], vec![1]]);
    assert_same_params(&fused, &solo, "two shapes fused");
    let (unfused, units) = train(&configs, 2, ckpt, Some(false));
    assert_eq!(units, vec![vec![0], vec![1], vec![2]]);
    assert_same_params(&unfused, &solo, "two shapes unfused");
}

#[test]
fn unit_nodes_are_owned_by_their_unit_and_losses_read_per_model() {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::single_threaded().unwrap();
    let configs = [config(8, 0.1, 1), config(16, 0.1, 2), config(8, 0.1, 3)];
    let models: Vec<Gpt> = configs
        .iter()
        .map(|c| Gpt::new(&pool, c.clone()).unwrap())
        .collect();
    let batches: Vec<Batch> = (0..3).map(|k| batch(k, 0)).collect();
    let steps = steps(&models, &batches, 0);
    let set = ModelSet::group(&steps, true);
    assert_eq!(set.label(0), "m0+2");
    assert_eq!(set.unit_of(), vec![0, 1, 0]);
    let mut g = Graph::new(&ctx);
    let step = record_set(&mut g, &steps, &set, Checkpointing::PerBlock).unwrap();
    for id in g.node_ids() {
        let owner = g.owner(id).unwrap().expect("every node has an owner");
        let name = g.name(id).unwrap().to_string();
        match owner {
            0 => assert!(
                name.starts_with("m0+2.") || name.starts_with("m0.") || name.starts_with("m2."),
                "{name}"
            ),
            _ => assert!(name.starts_with("m1."), "{name}"),
        }
    }
    assert_eq!(g.shape(step.roots[0]).unwrap(), &[2]);
    g.forward().unwrap();
    let losses = step.losses(&g).unwrap();
    assert_eq!(losses.len(), 3);
    assert!(
        losses.iter().all(|l| l.is_finite() && *l > 0.0),
        "{losses:?}"
    );
    let err = step.losses_from(&[vec![1.0]]).unwrap_err().to_string();
    assert!(err.contains("model 1's loss"), "{err}");
}

#[test]
fn a_set_fusing_models_of_different_shapes_is_refused() {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::single_threaded().unwrap();
    let models = [
        Gpt::new(&pool, config(8, 0.0, 1)).unwrap(),
        Gpt::new(&pool, config(16, 0.0, 2)).unwrap(),
    ];
    let batches: Vec<Batch> = (0..2).map(|k| batch(k, 0)).collect();
    let steps = steps(&models, &batches, 0);
    let set = ModelSet {
        units: vec![vec![0, 1]],
    };
    let mut g = Graph::new(&ctx);
    let err = record_set(&mut g, &steps, &set, Checkpointing::PerBlock)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fuses models 0 and 1 of different shapes"),
        "{err}"
    );
    let set = ModelSet {
        units: vec![vec![0]],
    };
    let err = record_set(&mut g, &steps, &set, Checkpointing::PerBlock)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model 1 is in no unit"), "{err}");
}
