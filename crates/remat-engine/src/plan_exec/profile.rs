//! Record a training step of any engine model into the planner's graph IR.
//!
//! The step is run a few times by the store-all schedule of its [`Layout`]; every item is
//! timed (the median of the runs is kept) and its output and transient bytes measured from
//! the memory pool. The planner graph has one node per item, with the static memory (what
//! the pool holds when the step starts: parameters, inputs, optimizer state) as its static
//! bytes and seconds as its time unit. Gradient buffers are nodes of their own, allocated at
//! their first write (see [`super::Layout`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{ItemKind, ItemMeasure, Layout, Measured, PlanExecError, RunOptions, run_steps};
use crate::core::graph::{Graph, NodeId};
use crate::core::swap::{CopyEngine, SwapError};

/// How to profile.
#[derive(Clone, Debug)]
pub struct ProfileOptions {
    /// Timed runs (after one warm-up); the median time of each op is kept.
    pub runs: usize,
    /// Name of the planner graph (plans carry it, so a plan is not run on another step).
    pub name: String,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        ProfileOptions {
            runs: 3,
            name: "step".into(),
        }
    }
}

/// A profiled training step: the layout to execute plans on, and the planner graph.
#[derive(Clone, Debug)]
pub struct StepProfile {
    pub layout: Layout,
    pub graph: remat_planner::Graph,
    /// Peak of the pool in the profiling runs (store-all), static memory included.
    pub measured_store_all_peak: u64,
    /// Median wall time of a whole store-all step, seconds.
    pub measured_step_time: f64,
    /// The measured store-all step over the sum of the ops' median times: every op time in
    /// the planner graph is multiplied by it, so the graph's base time is the measured step
    /// (the executor's own work between ops and the machine's load are spread over the ops
    /// in proportion to their time, instead of being missing from every prediction).
    pub time_scale: f64,
}

impl StepProfile {
    pub fn static_bytes(&self) -> u64 {
        self.graph.static_bytes()
    }

    /// Which model (or fused group) each node of the planner graph belongs to, from the
    /// owners the step was recorded under ([`Graph::set_owner`]); `None` for shared nodes
    /// (the end of the step, nodes recorded without an owner). `graph` is the profiled one.
    /// This is the labelling a multi-model scheduler interleaves by.
    pub fn node_owners(&self, graph: &Graph) -> Vec<Option<usize>> {
        self.layout.item_owners(graph)
    }
}

/// Profiles the training step of `graph` ending in `loss`. The graph's random generator is
/// restored afterwards, so the next step draws what it would have drawn unprofiled; the
/// profiling runs' gradients are discarded.
pub fn profile_step(
    graph: &mut Graph,
    loss: NodeId,
    opts: &ProfileOptions,
) -> Result<StepProfile, PlanExecError> {
    profile_step_multi(graph, &[loss], opts)
}

/// [`profile_step`] for a step with several loss roots (K models recorded into one graph,
/// see [`Layout::build_multi`]). Which model each planner node belongs to:
/// [`StepProfile::node_owners`].
pub fn profile_step_multi(
    graph: &mut Graph,
    losses: &[NodeId],
    opts: &ProfileOptions,
) -> Result<StepProfile, PlanExecError> {
    let rng = graph.rng.clone();
    let rough = Layout::build_multi(graph, losses, &Measured::unknown(graph.nodes.len()))?;
    let steps = rough.store_all_steps();
    let runs = opts.runs.max(1);
    let mut measures: Vec<Vec<ItemMeasure>> = Vec::with_capacity(runs);
    let mut step_times = Vec::with_capacity(runs);
    let mut peak = 0;
    for run in 0..=runs {
        graph.rng = rng.clone();
        let result = run_steps(
            graph,
            &rough,
            &steps,
            None,
            RunOptions {
                measure_items: true,
                ..RunOptions::default()
            },
        );
        graph.rng = rng.clone();
        let report = result?;
        if run > 0 {
            peak = peak.max(report.peak_bytes);
            step_times.push(report.step_time.as_secs_f64());
            measures.push(report.items);
        }
    }
    for node in graph.nodes.iter_mut().filter(|n| n.is_leaf()) {
        node.grad = None;
    }
    let measured = measurements(graph.nodes.len(), &rough, &measures);
    let layout = Layout::build_multi(graph, losses, &measured)?;
    let (mut times, bytes) = item_costs(&rough, &layout, &measures);
    let step_time = median(step_times);
    let op_sum: f64 = times.iter().sum();
    let time_scale = if op_sum > 0.0 && step_time.is_finite() && step_time > 0.0 {
        step_time / op_sum
    } else {
        1.0
    };
    for t in &mut times {
        *t *= time_scale;
    }
    let static_bytes = graph.ctx.pool().live();
    // Gradient buffers are pinned so no strategy plans to recompute one (check_plan would
    // refuse such a plan at run time; the pin keeps strategies from producing it). The
    // order is fixed: the executor draws dropout masks from one random stream and sums
    // gradient contributions in node order, so a reordered plan would change the bits of
    // the result; planners then keep the profiled order of first computations.
    let ir = remat_planner::Graph::new(
        opts.name.clone(),
        layout.ir_nodes(&times, &bytes),
        static_bytes,
        1.0,
    )
    .and_then(|graph| graph.with_pinned(layout.pinned_items()))
    .map(remat_planner::Graph::with_fixed_order)
    .map_err(|e| PlanExecError::Invalid(format!("profiled graph {} is invalid: {e}", opts.name)))?;
    Ok(StepProfile {
        layout,
        graph: ir,
        measured_store_all_peak: peak,
        measured_step_time: step_time,
        time_scale,
    })
}

/// Aux presence and workspaces per engine node, from the rough layout's runs.
fn measurements(nodes: usize, rough: &Layout, measures: &[Vec<ItemMeasure>]) -> Measured {
    let mut m = Measured {
        has_aux: vec![false; nodes],
        fwd_workspace: vec![0; nodes],
        bwd_workspace: vec![0; nodes],
    };
    for (i, item) in rough.items().iter().enumerate() {
        let ws = measures
            .iter()
            .map(|r| r[i].workspace_bytes)
            .max()
            .unwrap_or(0);
        match item.kind {
            ItemKind::Forward { node } => {
                m.has_aux[node] = measures.first().is_some_and(|r| r[i].tensors > 1);
                m.fwd_workspace[node] = ws;
            }
            ItemKind::Backward { node } => m.bwd_workspace[node] = ws,
            ItemKind::Workspace { .. } | ItemKind::Grad { .. } | ItemKind::End => {}
        }
    }
    m
}

/// Median time and output bytes of each item of the final layout.
fn item_costs(
    rough: &Layout,
    layout: &Layout,
    measures: &[Vec<ItemMeasure>],
) -> (Vec<f64>, Vec<u64>) {
    let mut times = vec![0.0; layout.len()];
    let mut bytes = vec![0u64; layout.len()];
    for (i, item) in layout.items().iter().enumerate() {
        let rough_item = match item.kind {
            ItemKind::Forward { node } => rough.forward_item(NodeId(node)),
            ItemKind::Backward { node } => rough.backward_item(NodeId(node)),
            ItemKind::Workspace { .. } | ItemKind::Grad { .. } | ItemKind::End => None,
        };
        if let Some(r) = rough_item {
            times[i] = median(measures.iter().map(|m| m[r].time.as_secs_f64()).collect());
            bytes[i] = measures.first().map_or(0, |m| m[r].output_bytes);
        }
    }
    (times, bytes)
}

/// The median of `v` ([`remat_units::median`]: the mean of the two middle values for an
/// even count, so with two runs their mean, not the larger one); 0 without any.
fn median(v: Vec<f64>) -> f64 {
    remat_units::median(&v).unwrap_or(0.0)
}

/// What copies cost while the step computes (see [`measure_copy_under_compute`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CopyUnderCompute {
    /// Bytes per second the copies move while the step computes (one way: a round trip
    /// moves its bytes twice, each direction on its own worker).
    pub bandwidth: f64,
    /// Seconds of step time lost per byte copied (either way) while the step computes: on
    /// a CPU the copy workers run on the cores the step computes on, so a swap that the
    /// planner hides behind compute still slows the compute down.
    pub compute_seconds_per_byte: f64,
}

/// Measures what swaps get and cost while the step computes: the profiled step runs by
/// its store-all schedule in rounds of two, once alone and once while copies stream
/// through `copy` (out and back, `probe_bytes` at a time). The bandwidth is what the copies
/// reached while copying; the compute cost is the copying step's extra time over the
/// step alone, per byte copied meanwhile (steps alone and copying alternate, so a drifting
/// machine speed affects both). The graph's random generator and gradients are left as
/// they were.
pub fn measure_copy_under_compute(
    graph: &mut Graph,
    profile: &StepProfile,
    copy: &CopyEngine,
    rounds: usize,
    probe_bytes: usize,
) -> Result<CopyUnderCompute, PlanExecError> {
    let words = (probe_bytes / 4).max(1);
    let steps = profile.layout.store_all_steps();
    let rng = graph.rng.clone();
    let stop = AtomicBool::new(false);
    let copying = AtomicBool::new(false);
    let trips = AtomicU64::new(0);
    let (moved, busy, times, result) = std::thread::scope(|scope| {
        let copier = scope.spawn(|| -> Result<(u64, Duration), SwapError> {
            let mut buf = vec![0.5f32; words];
            let (mut moved, mut busy) = (0u64, Duration::ZERO);
            while !stop.load(Ordering::Relaxed) {
                if !copying.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                let start = Instant::now();
                let (slot, out) = copy.offload(buf, "bandwidth probe")?.wait()?.value;
                // As the executor does: the swapped-out buffer is freed, and the swap-in
                // fills a newly allocated one (its pages are new to the process, and
                // faulting them in is part of what a swap costs the cores).
                drop(out);
                buf = copy
                    .prefetch(slot, vec![0.0f32; words], true)?
                    .wait()?
                    .value;
                busy += start.elapsed();
                moved += 2 * (words as u64 * 4);
                trips.fetch_add(1, Ordering::Relaxed);
            }
            Ok((moved, busy))
        });
        // (alone, copying) step times. At least `rounds` rounds, and more while fewer than
        // MIN_TRIPS round trips are done (a small step ends before one copy does).
        let mut times: (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
        let mut result = Ok(());
        'rounds: while times.1.len() < rounds.max(1)
            || (trips.load(Ordering::Relaxed) < MIN_TRIPS && !copier.is_finished())
        {
            for with_copies in [false, true] {
                copying.store(with_copies, Ordering::Relaxed);
                graph.rng = rng.clone();
                let run = run_steps(graph, &profile.layout, &steps, None, RunOptions::default());
                match run {
                    Ok(report) if with_copies => times.1.push(report.step_time.as_secs_f64()),
                    Ok(report) => times.0.push(report.step_time.as_secs_f64()),
                    Err(e) => {
                        result = Err(e);
                        break 'rounds;
                    }
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        let copied = copier
            .join()
            .map_err(|_| PlanExecError::Invalid("the bandwidth probe thread panicked".into()));
        match copied {
            Ok(Ok((moved, busy))) => (moved, busy, times, result),
            Ok(Err(e)) => (0, Duration::ZERO, times, result.and(Err(e.into()))),
            Err(e) => (0, Duration::ZERO, times, result.and(Err(e))),
        }
    });
    restore_after_probe(graph, rng, copy);
    result?;
    if moved == 0 {
        return Err(PlanExecError::Invalid(
            "the bandwidth probe moved no bytes while the step computed".into(),
        ));
    }
    let bandwidth = moved as f64 / busy.as_secs_f64().max(1e-9);
    let (alone, with_copies) = (median(times.0), median(times.1));
    let compute_seconds_per_byte =
        ((with_copies - alone).max(0.0) / (bandwidth * with_copies).max(1.0)).max(0.0);
    Ok(CopyUnderCompute {
        bandwidth,
        compute_seconds_per_byte,
    })
}

/// Round trips the bandwidth probe completes at least.
const MIN_TRIPS: u64 = 4;

/// Seconds of step time a byte of swap traffic costs when a real plan swaps: a swap-heavy
/// plan (MuTWO at the tightest of a few budgets that it meets) and the store-all plan run
/// alternately, `rounds` times each after a warm-up; the measured time difference beyond
/// the simulator's predicted one, per byte copied out and in. The probe of
/// [`measure_copy_under_compute`] streams one buffer; a plan swaps many tensors of many
/// sizes at the moments the schedule puts them, and this measures that. `None` when no
/// swapping plan is found. The graph's random generator and gradients are left as they were.
pub fn calibrate_swap_cost(
    graph: &mut Graph,
    profile: &StepProfile,
    copy: &CopyEngine,
    bandwidth: f64,
    rounds: usize,
) -> Result<Option<f64>, PlanExecError> {
    let g = &profile.graph;
    let activations = g.store_all_peak().saturating_sub(g.static_bytes());
    let plan_for = |budget: u64, strategy: &str| {
        let problem = remat_planner::Problem {
            graph: g,
            budget_bytes: budget,
            bandwidth,
        };
        remat_planner::lookup(strategy)
            .ok()?
            .plan(&problem)
            .ok()
            .filter(|p| super::plan_fits_executor(&profile.layout, &p.plan))
    };
    let Some(store_all) = plan_for(u64::MAX, "store-all") else {
        return Ok(None);
    };
    let swapping = [0.3, 0.5, 0.7, 0.9].iter().find_map(|f| {
        let budget = g.static_bytes() + (f * activations as f64) as u64;
        plan_for(budget, "mutwo")
            .map(|p| (super::swap_traffic(g, &p.plan), p))
            .filter(|(traffic, _)| *traffic > 0)
    });
    let Some((traffic, swapping)) = swapping else {
        return Ok(None);
    };
    let rng = graph.rng.clone();
    let mut step = |plan: &remat_planner::Plan| -> Result<f64, PlanExecError> {
        graph.rng = rng.clone();
        let report = super::run_plan(graph, &profile.layout, g.name(), plan, Some(copy))?;
        Ok(report.step_time.as_secs_f64())
    };
    let mut differences = Vec::with_capacity(rounds.max(1));
    let result = (|| {
        step(&swapping.plan)?;
        step(&store_all.plan)?;
        for _ in 0..rounds.max(1) {
            let with_swaps = step(&swapping.plan)?;
            differences.push(with_swaps - step(&store_all.plan)?);
        }
        Ok::<(), PlanExecError>(())
    })();
    restore_after_probe(graph, rng, copy);
    result?;
    let predicted = swapping.report.total_time - store_all.report.total_time;
    Ok(Some(
        ((median(differences) - predicted) / traffic as f64).max(0.0),
    ))
}

/// Leaves the step as a probe found it: the random generator at its state before the
/// probe's runs, no gradients from them, the copy engine's counters cleared.
fn restore_after_probe(graph: &mut Graph, rng: crate::core::rng::RngStreams, copy: &CopyEngine) {
    graph.rng = rng;
    for node in graph.nodes.iter_mut().filter(|n| n.is_leaf()) {
        node.grad = None;
    }
    copy.reset_stats();
}
