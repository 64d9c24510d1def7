//! Issue 22, item 2: a step of fused units (two models of one shape fused, a third of
//! another shape alone) profiled and run by the plan executor. For plans of several
//! strategies at budgets from store-all's peak down, the executed peak equals the
//! simulated one to the byte, and every model's loss and gradients equal training that
//! model alone bit for bit (dropout on, one model at p = 0); the planner nodes carry the
//! unit they belong to.

use std::sync::Arc;

use remat_engine::core::swap::{CopyEngine, HostStore, Throttle};
use remat_engine::models::fused::{ModelSet, SetStep, record_set};
use remat_engine::models::gpt::{Batch, Checkpointing, Gpt, GptConfig};
use remat_engine::models::multi::{ModelStep, take_grads};
use remat_engine::plan_exec::profile::{ProfileOptions, profile_step_multi};
use remat_engine::plan_exec::{ItemKind, check_plan, run_plan};
use remat_engine::{ExecContext, Graph, MemoryPool, Policy, Tensor};
use remat_planner::{PlanError, Problem};

const K: usize = 3;

fn models(pool: &Arc<MemoryPool>) -> Vec<Gpt> {
    let shape = [(16, 0.1), (8, 0.2), (16, 0.0)];
    shape
        .iter()
        .enumerate()
        .map(|(k, &(d_model, dropout))| {
            let config = GptConfig {
                vocab: 11,
                d_model,
                n_layers: 2,
                n_heads: 2,
                n_kv_heads: 2,
                ffn_hidden: 2 * d_model,
                rope_theta: 10000.0,
                norm_eps: 1e-5,
                dropout,
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

fn record(ctx: &ExecContext, models: &[Gpt], batches: &[Batch]) -> (Graph, SetStep) {
    let steps: Vec<ModelStep> = (0..K)
        .map(|k| ModelStep {
            model: &models[k],
            batch: &batches[k],
            seed: 100 + k as u64,
        })
        .collect();
    let set = ModelSet::group(&steps, true);
    assert_eq!(set.units, vec![vec![0, 2], vec![1]]);
    let mut g = Graph::new(ctx);
    let step = record_set(&mut g, &steps, &set, Checkpointing::Graph(Policy::StoreAll)).unwrap();
    (g, step)
}

fn bit_eq(a: &[Vec<Option<Tensor>>], b: &[Vec<Option<Tensor>>]) -> bool {
    a.len() == b.len()
        && a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .all(|(x, y)| match (x, y) {
                (Some(x), Some(y)) => x.bit_eq(y),
                (None, None) => true,
                _ => false,
            })
}

#[test]
fn plans_of_a_fused_step_run_exactly() {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 2).unwrap();
    let models = models(&pool);
    let batches: Vec<Batch> = (0..K).map(batch).collect();
    let ckpt = Checkpointing::Graph(Policy::StoreAll);
    let alone: Vec<_> = (0..K)
        .map(|k| {
            models[k]
                .forward_backward(&ctx, &batches[k], ckpt, 100 + k as u64)
                .unwrap()
        })
        .collect();
    let losses: Vec<f64> = alone.iter().map(|o| o.loss).collect();
    let expected: Vec<Vec<Option<Tensor>>> = alone.into_iter().map(|o| o.grads).collect();

    let (mut graph, step) = record(&ctx, &models, &batches);
    let opts = ProfileOptions {
        runs: 1,
        name: "fused".into(),
    };
    let profile = profile_step_multi(&mut graph, &step.roots, &opts).unwrap();
    assert_eq!(profile.layout.losses(), step.roots);
    // Every op item belongs to its unit: unit 0 is models 0 and 2, unit 1 model 1.
    let owners = profile.node_owners(&graph);
    for (item, owner) in profile.layout.items().iter().zip(&owners) {
        match (item.kind, owner) {
            (ItemKind::End, o) => assert_eq!(*o, None),
            (_, Some(0)) => assert!(
                ["m0+2.", "m0.", "m2."]
                    .iter()
                    .any(|p| item.name.contains(p)),
                "{}",
                item.name
            ),
            (_, Some(1)) => assert!(item.name.contains("m1."), "{}", item.name),
            (_, o) => panic!("{} has owner {o:?}", item.name),
        }
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
                "fused",
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
            let got_losses = step.losses_from(&report.loss_values).unwrap();
            assert_eq!(got_losses, losses, "{name}@{budget}: losses");
            ran += 1;
        }
    }
    assert!(ran >= 4, "only {ran} plans ran");
}
