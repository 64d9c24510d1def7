//! `--policy auto`: profile a recorded training step, plan it for a memory budget, and run
//! every later step by the plan (issue 5, section 3). The candidates are every planner
//! strategy and the engine's fixed checkpointing policies; the fastest predicted plan that
//! fits the budget and that the executor runs exactly is kept.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use remat_planner::multi::MultiPlanned;
use remat_planner::{PlanError, Planned, Problem};

pub use super::error::mib;
use super::error::{During, Result, SessionError};
use super::multiplexed;
use crate::core::graph::{Graph, NodeId};
use crate::core::policy::Policy;
use crate::core::swap::{CopyEngine, HostStore, SwapError, Throttle};
use crate::models::gpt::Checkpointing;
use crate::plan_exec::profile::{
    CopyUnderCompute, ProfileOptions, StepProfile, calibrate_swap_cost, measure_copy_under_compute,
    profile_step_multi,
};
use crate::plan_exec::{Considered, StepReport, choose_plan, kept_nodes, run_plan, same_nodes};

/// What `--policy auto` needs besides the model.
#[derive(Clone, Debug)]
pub struct AutoSettings {
    /// Device budget in bytes, static memory (parameters, gradients, optimizer state) included.
    pub budget: u64,
    /// A registered strategy, or `None` for the fastest plan of all that fit.
    pub strategy: Option<String>,
    /// Keep swapped tensors in a memory-mapped file in this directory instead of in memory.
    pub swap_dir: Option<PathBuf>,
    /// Host-device bandwidth to plan with (bytes/s), copies then taken as free for the
    /// compute; if `None`, both are measured on the copy engine while the step computes.
    pub bandwidth: Option<f64>,
    /// Timed profiling runs.
    pub profile_runs: usize,
    /// The engine's fixed policies as candidate plans: name and the engine nodes each keeps
    /// (indexed like the profiled graph; see [`fixed_policy_sets`]).
    pub fixed: Vec<(String, Vec<bool>)>,
}

/// The engine's fixed checkpointing policies the auto choice and the benchmark weigh
/// against the planner's strategies.
pub fn fixed_policies(layers: usize) -> Vec<Checkpointing> {
    let mut v = vec![
        Checkpointing::Graph(Policy::StoreAll),
        Checkpointing::PerBlock,
        Checkpointing::SqrtBlocks,
        Checkpointing::Graph(Policy::Sqrt),
        Checkpointing::Graph(Policy::RecomputeAll),
    ];
    v.extend([2, 3, 4, 6, 8].map(|n| Checkpointing::Graph(Policy::EveryN(n))));
    if layers >= 4 {
        v.push(Checkpointing::Blocks(2));
    }
    v
}

/// The kept engine nodes of each fixed policy: `record` records the profiled step under a
/// policy. A recording whose nodes differ from `reference`'s is skipped (its kept set would
/// not index the profiled layout).
pub fn fixed_policy_sets<E>(
    reference: &Graph,
    policies: &[Checkpointing],
    mut record: impl FnMut(Checkpointing) -> std::result::Result<Graph, E>,
) -> std::result::Result<Vec<(String, Vec<bool>)>, E> {
    let mut sets = Vec::with_capacity(policies.len());
    for &ckpt in policies {
        let g = record(ckpt)?;
        if same_nodes(reference, &g) {
            sets.push((ckpt.to_string(), kept_nodes(&g)));
        }
    }
    Ok(sets)
}

/// A profiled and planned training step, ready to run step after step.
pub struct AutoSession {
    pub profile: StepProfile,
    pub planned: Planned,
    /// Every candidate plan weighed, with its predicted time or why it was left out.
    pub considered: Vec<Considered>,
    pub copy: CopyEngine,
    pub bandwidth: f64,
    /// Compute seconds a byte of swap traffic takes from the step (charged to predictions).
    pub copy_cost: f64,
    pub budget: u64,
    /// Under `--policy auto:multiplexed[-search]` (K models): the multiplexed plan with
    /// which model's compute hides which swap.
    pub multiplexed: Option<MultiPlanned>,
}

/// Copies 32 MiB out and back through the copy engine (after one warm-up round that pays
/// the page faults): its bytes per second, one way.
pub fn measure_copy_bandwidth(copy: &CopyEngine) -> std::result::Result<f64, SwapError> {
    let n = 8 << 20;
    let mut buf = vec![1.0f32; n];
    let mut secs = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        let (slot, out) = copy.offload(buf, "bandwidth probe")?.wait()?.value;
        buf = copy.prefetch(slot, out, true)?.wait()?.value;
        secs = secs.min(start.elapsed().as_secs_f64().max(1e-9));
    }
    copy.reset_stats();
    Ok(2.0 * (n * 4) as f64 / secs)
}

impl AutoSession {
    /// Profiles the step recorded in `graph` (ending in `loss`) and plans it for the budget.
    /// A budget no plan meets is an error stating the smallest feasible budget.
    pub fn prepare(
        graph: &mut Graph,
        loss: NodeId,
        name: &str,
        settings: &AutoSettings,
    ) -> Result<Self> {
        Self::prepare_multi(graph, &[loss], name, settings)
    }

    /// [`AutoSession::prepare`] for a step with several loss roots (K models recorded into
    /// one graph, `remat train --models K`).
    pub fn prepare_multi(
        graph: &mut Graph,
        losses: &[NodeId],
        name: &str,
        settings: &AutoSettings,
    ) -> Result<Self> {
        let store = match &settings.swap_dir {
            Some(dir) => {
                HostStore::on_disk(dir).during_with(|| format!("--swap-dir {}", dir.display()))?
            }
            None => HostStore::in_memory(),
        };
        let copy = CopyEngine::new(Arc::new(store), Throttle::default());
        let opts = ProfileOptions {
            runs: settings.profile_runs,
            name: name.to_string(),
        };
        let profile =
            profile_step_multi(graph, losses, &opts).during("profiling the training step")?;
        let copies = match settings.bandwidth {
            Some(bandwidth) => CopyUnderCompute {
                bandwidth,
                compute_seconds_per_byte: 0.0,
            },
            None => {
                let probed = measure_copy_under_compute(graph, &profile, &copy, 3, PROBE_BYTES)
                    .during("measuring the copy bandwidth while the step computes")?;
                let calibrated = calibrate_swap_cost(graph, &profile, &copy, probed.bandwidth, 5)
                    .during("measuring what swaps cost the step")?;
                CopyUnderCompute {
                    compute_seconds_per_byte: calibrated.unwrap_or(probed.compute_seconds_per_byte),
                    ..probed
                }
            }
        };
        let bandwidth = copies.bandwidth;
        let problem = Problem {
            graph: &profile.graph,
            budget_bytes: settings.budget,
            bandwidth,
        };
        let route = settings
            .strategy
            .as_deref()
            .and_then(multiplexed::inner_strategy);
        let (planned, considered, multiplexed) = match route {
            Some(inner) => {
                let (multi, planned, considered) =
                    multiplexed::plan(graph, &profile, settings.budget, bandwidth, inner)?;
                (planned, considered, Some(multi))
            }
            None => {
                let (planned, considered) = plan(
                    &problem,
                    &profile,
                    settings.strategy.as_deref(),
                    &settings.fixed,
                    copies.compute_seconds_per_byte,
                )?;
                (planned, considered, None)
            }
        };
        Ok(AutoSession {
            profile,
            planned,
            considered,
            copy,
            bandwidth,
            copy_cost: copies.compute_seconds_per_byte,
            budget: settings.budget,
            multiplexed,
        })
    }

    /// Runs one training step (recorded like the profiled one) by the plan.
    pub fn step(&self, graph: &mut Graph) -> Result<StepReport> {
        Ok(run_plan(
            graph,
            &self.profile.layout,
            self.profile.graph.name(),
            &self.planned.plan,
            Some(&self.copy),
        )?)
    }
}

/// Bytes probed per copy when measuring the bandwidth under compute.
pub const PROBE_BYTES: usize = 8 << 20;

/// Bytes of the forward-pass outputs by what the plan does to them (kept, swapped,
/// recomputed). Gradient bundles, workspaces and gradient buffers are not activations.
pub fn forward_bytes_by_fate(
    graph: &remat_planner::Graph,
    report: &remat_planner::SimReport,
) -> (u64, u64, u64) {
    let mut sums = (0, 0, 0);
    for (id, fate) in report.fates.iter().enumerate() {
        let node = graph.node(id);
        if node.phase != remat_planner::Phase::Forward || !node.name.starts_with("fwd:") {
            continue;
        }
        match fate {
            remat_planner::sim::Fate::Kept => sums.0 += node.output_bytes,
            remat_planner::sim::Fate::Swapped => sums.1 += node.output_bytes,
            remat_planner::sim::Fate::Recomputed => sums.2 += node.output_bytes,
        }
    }
    sums
}

/// Plans with one strategy or the fastest predicted of all (planner strategies and the
/// engine's fixed policies), among plans the executor runs; infeasible budgets name the
/// smallest peak.
pub fn plan(
    problem: &Problem,
    profile: &StepProfile,
    strategy: Option<&str>,
    fixed: &[(String, Vec<bool>)],
    copy_cost: f64,
) -> Result<(Planned, Vec<Considered>)> {
    let result = choose_plan(problem, &profile.layout, strategy, fixed, copy_cost)
        .map(|choice| (choice.planned, choice.considered));
    result.map_err(|e| match e {
        PlanError::Infeasible {
            budget,
            best_peak,
            strategy,
        }
        | PlanError::OverBudget {
            budget,
            best_peak,
            strategy,
        } => SessionError::NoPlanFits {
            budget,
            best_peak,
            strategy,
            static_bytes: problem.graph.static_bytes(),
        },
        other => SessionError::from(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_policies_add_two_block_segments_from_four_layers() {
        let names = |l| {
            fixed_policies(l)
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(2).len(), 10);
        assert_eq!(names(4).len(), 11);
        assert_eq!(names(4)[0], "store-all");
        assert_eq!(mib(3 << 19), "1.50");
    }

    #[test]
    fn no_plan_fits_names_the_smallest_budget() {
        let err = SessionError::NoPlanFits {
            budget: 1 << 20,
            best_peak: 3 << 20,
            strategy: "mutwo".into(),
            static_bytes: 1 << 19,
        };
        assert_eq!(
            err.to_string(),
            "no plan fits a memory budget of 1048576 bytes (1.00 MiB): the smallest feasible \
             budget is 3145728 bytes (3.00 MiB, reached by mutwo); static memory alone is \
             512.00 KiB"
        );
    }
}
