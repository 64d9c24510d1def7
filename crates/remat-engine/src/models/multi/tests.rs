use std::sync::Arc;

use super::*;
use crate::core::optim::AdamWConfig;
use crate::core::pool::MemoryPool;
use crate::models::gpt::GptConfig;

fn config(d_model: usize, dropout: f32, init_seed: u64) -> GptConfig {
    GptConfig {
        vocab: 13,
        d_model,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 2,
        ffn_hidden: 2 * d_model,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        dropout,
        init_seed,
    }
}

fn batch(seed: u64, step: u64) -> Batch {
    let (b, s) = (3, 8);
    let tok = |salt: u64| -> Arc<[u32]> {
        (0..b * s)
            .map(|i| {
                (crate::core::kernels::philox_hash(seed ^ salt, step * 1000 + i as u64) % 13) as u32
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

/// Three models (two widths, dropout on, own seeds and learning rates): after three steps
/// together, each one's parameters equal training it alone, bit for bit, on 1 and 2 threads.
#[test]
fn k_models_together_train_as_each_alone() {
    let configs = [config(16, 0.1, 1), config(8, 0.2, 2), config(16, 0.1, 3)];
    let lrs = [3e-3, 1e-3, 1e-2];
    for threads in [1, 2] {
        let train = |together: bool| -> Vec<Vec<Vec<f64>>> {
            let pool = MemoryPool::unbounded();
            let ctx = ExecContext::new(pool.clone(), threads).unwrap();
            let models: Vec<Gpt> = configs
                .iter()
                .map(|c| Gpt::new(&pool, c.clone()).unwrap())
                .collect();
            let mut opts: Vec<AdamW> = models
                .iter()
                .zip(lrs)
                .map(|(m, lr)| {
                    let c = AdamWConfig {
                        lr,
                        ..AdamWConfig::default()
                    };
                    AdamW::new(&pool, m.params(), c).unwrap()
                })
                .collect();
            for step in 0..3u64 {
                let batches: Vec<Batch> = (0..3).map(|k| batch(k, step)).collect();
                let seed = |k: usize| (k as u64 + 10) ^ (step << 32);
                let ckpt = Checkpointing::Graph(Policy::StoreAll);
                let grads = if together {
                    let steps: Vec<ModelStep> = models
                        .iter()
                        .zip(&batches)
                        .enumerate()
                        .map(|(k, (model, batch))| ModelStep {
                            model,
                            batch,
                            seed: seed(k),
                        })
                        .collect();
                    forward_backward_multi(&ctx, &steps, ckpt).unwrap().grads
                } else {
                    (0..3)
                        .map(|k| {
                            let out = models[k]
                                .forward_backward(&ctx, &batches[k], ckpt, seed(k))
                                .unwrap();
                            out.grads
                        })
                        .collect()
                };
                step_optimizers(&mut opts, &grads).unwrap();
            }
            models
                .iter()
                .map(|m| m.params().iter().map(|(_, t)| t.to_f64_vec()).collect())
                .collect()
        };
        let (together, alone) = (train(true), train(false));
        for k in 0..3 {
            for (p, (a, b)) in together[k].iter().zip(&alone[k]).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "threads {threads}: model {k} parameter {p} differs");
            }
        }
    }
}

#[test]
fn every_model_node_is_owned_and_named_by_its_model() {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let models: Vec<Gpt> = (0..2)
        .map(|k| Gpt::new(&pool, config(8, 0.1, k)).unwrap())
        .collect();
    let batches: Vec<Batch> = (0..2).map(|k| batch(k, 0)).collect();
    let steps: Vec<ModelStep> = (0..2)
        .map(|k| ModelStep {
            model: &models[k],
            batch: &batches[k],
            seed: k as u64,
        })
        .collect();
    let mut g = Graph::new(&ctx);
    let step = record_multi(&mut g, &steps, Checkpointing::PerBlock).unwrap();
    assert_eq!(step.losses.len(), 2);
    for id in g.node_ids() {
        let owner = g.owner(id).unwrap().expect("every node has a model");
        assert!(g.name(id).unwrap().starts_with(&format!("m{owner}.")));
    }
    assert!(record_multi(&mut g, &[], Checkpointing::PerBlock).is_err());
}

#[test]
fn backward_many_refuses_a_loss_given_twice() {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let model = Gpt::new(&pool, config(8, 0.0, 0)).unwrap();
    let b = batch(0, 0);
    let mut g = Graph::new(&ctx);
    let step = model
        .record(&mut g, &b, Checkpointing::Graph(Policy::StoreAll))
        .unwrap();
    g.forward().unwrap();
    let err = g.backward_many(&[step.loss, step.loss]).unwrap_err();
    assert!(err.to_string().contains("twice"), "{err}");
}
