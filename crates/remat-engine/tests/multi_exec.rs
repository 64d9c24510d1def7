//! Issue 22: K models recorded into one graph, each with its own loss root, profiled and
//! run by the plan executor. For plans of several strategies at budgets from store-all's
//! peak down, the executed peak equals the simulated one to the byte and every model's
//! gradients equal the engine's own store-all backward bit for bit (dropout on); the
//! planner nodes carry the model they belong to.

use std::sync::Arc;

use remat_engine::core::swap::{CopyEngine, HostStore, Throttle};
use remat_engine::models::gpt::{Batch, Checkpointing, Gpt, GptConfig};
use remat_engine::models::multi::{ModelStep, MultiStep, record_multi, take_grads};
use remat_engine::plan_exec::profile::{ProfileOptions, profile_step_multi};
use remat_engine::plan_exec::{ItemKind, check_plan, run_plan};
use remat_engine::{ExecContext, Graph, MemoryPool, Policy, Tensor};
use remat_planner::{PlanError, Problem};

const K: usize = 2;

fn models(pool: &Arc<MemoryPool>) -> Vec<Gpt> {
    (0..K)
        .map(|k| {
            let config = GptConfig {
                vocab: 11,
                d_model: 16,
                n_layers: 2,
                n_heads: 2,
                n_kv_heads: 2,
                ffn_hidden: 32,
                rope_theta: 10000.0,
                norm_eps: 1e-5,
                dropout: 0.1,
                init_seed: k as u64,
            };
            Gpt::new(pool, config).unwrap()
        })
        .collect()
}

fn batch(k: usize) -> Batch {
    let (b, s) = (4, 8);
    let tok = |salt: usize| -> Arc<[u32]> {
        (0..b * s)
            .map(|i| ((i * 7 + k * 3 + salt) % 11) as u32)
            .collect()
    };
    Batch {
        tokens: tok(1),
        targets: tok(2),
        batch: b,
        seq: s,
    }
}

fn record(ctx: &ExecContext, models: &[Gpt], batches: &[Batch]) -> (Graph, MultiStep) {
    let steps: Vec<ModelStep> = (0..K)
        .map(|k| ModelStep {
            model: &models[k],
            batch: &batches[k],
            seed: 100 + k as u64,
        })
        .collect();
    let mut g = Graph::new(ctx);
    let step = record_multi(&mut g, &steps, Checkpointing::Graph(Policy::StoreAll)).unwrap();
    (g, step)
}

fn bit_eq(a: &[Vec<Option<Tensor>>], b: &[Vec<Option<Tensor>>]) -> bool {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .all(|(x, y)| match (x, y) {
            (Some(x), Some(y)) => x.bit_eq(y),
            (None, None) => true,
            _ => false,
        })
}

#[test]
fn plans_of_the_k_model_step_run_exactly() {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let models = models(&pool);
    let batches: Vec<Batch> = (0..K).map(batch).collect();

    let (mut reference, step) = record(&ctx, &models, &batches);
    reference.forward().unwrap();
    let losses: Vec<f64> = step
        .losses
        .iter()
        .map(|&l| reference.scalar(l).unwrap())
        .collect();
    reference.backward_many(&step.losses).unwrap();
    let expected = take_grads(&mut reference, &step.params).unwrap();
    drop(reference);

    let (mut graph, step) = record(&ctx, &models, &batches);
    let opts = ProfileOptions {
        runs: 1,
        name: "multi".into(),
    };
    let profile = profile_step_multi(&mut graph, &step.losses, &opts).unwrap();
    assert_eq!(profile.layout.losses(), step.losses);

    // Every op item belongs to the model whose name prefix it carries.
    let owners = profile.node_owners(&graph);
    assert_eq!(owners.len(), profile.graph.len());
    for (item, owner) in profile.layout.items().iter().zip(&owners) {
        match item.kind {
            ItemKind::End => assert_eq!(*owner, None),
            _ => {
                let k = owner.unwrap_or_else(|| panic!("{} has no owner", item.name));
                assert!(item.name.contains(&format!("m{k}.")), "{}", item.name);
            }
        }
    }
    for k in 0..K {
        assert!(owners.contains(&Some(k)));
    }

    let copy = CopyEngine::new(Arc::new(HostStore::in_memory()), Throttle::default());
    let g = &profile.graph;
    let peak = g.store_all_peak();
    let floor = g.static_bytes() + (peak - g.static_bytes()) / 2;
    let mut ran = 0;
    for budget in [peak, floor + (peak - floor) / 2, floor] {
        let problem = Problem {
            graph: g,
            budget_bytes: budget,
            bandwidth: 4e9,
        };
        for name in ["store-all", "checkmate-approx", "mutwo", "mutwo-refined"] {
            let Ok(strategy) = remat_planner::lookup(name) else {
                continue;
            };
            let planned = match strategy.plan(&problem) {
                Ok(p) => p,
                Err(PlanError::OverBudget { .. } | PlanError::NotApplicable { .. }) => continue,
                Err(e) => panic!("{name}@{budget}: {e}"),
            };
            if check_plan(&profile.layout, &planned.plan.steps).is_err() {
                continue;
            }
            for p in &step.params {
                for &id in p {
                    graph.take_grad(id).unwrap();
                }
            }
            for k in 0..K {
                graph.set_stream_seed(k, 100 + k as u64);
            }
            let report = run_plan(
                &mut graph,
                &profile.layout,
                "multi",
                &planned.plan,
                Some(&copy),
            )
            .unwrap_or_else(|e| panic!("{name}@{budget}: {e}"));
            assert_eq!(
                report.peak_bytes, planned.report.peak_bytes,
                "{name}@{budget}: executed vs simulated peak"
            );
            let got = take_grads(&mut graph, &step.params).unwrap();
            assert!(bit_eq(&got, &expected), "{name}@{budget}: gradients differ");
            let per_model = report.stall_by_owner(&owners, K);
            assert_eq!(per_model.iter().sum::<std::time::Duration>(), report.stall);
            let got_losses: Vec<f64> = report.losses.iter().map(|l| l.unwrap()).collect();
            assert_eq!(got_losses, losses, "{name}@{budget}: losses");
            ran += 1;
        }
    }
    assert!(ran >= 4, "only {ran} plans ran");
}
