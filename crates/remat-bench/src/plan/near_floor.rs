//! `remat bench plan --near-floor`: plans close to the floor, where users go when memory is
//! really short (issue 30). Transformer joint graphs from the generator
//! ([`TransformerParams::gpt`], 8 and 32 layers), in free order and in node order (as the
//! engine and `remat.torch.capture` lay a step out), at the floor + 5%, 10%, 25% and 50%:
//! recompute-only ([`request::plan_recompute_only`], above the recompute floor of
//! [`remat_planner::floor`]) and with swaps at the bench's bandwidth (above today's floor,
//! [`Graph::memory_floor`]). Each row: the plan's overhead, the lower bound the request
//! proved, the gap between them in points, and the solve time. Every solve gets the same
//! time limit (`--near-floor-time-limit`), so the section takes about 32 of them.

use std::time::{Duration, Instant};

use remat_planner::floor::recompute_floor;
use remat_planner::request::{self, Outcome, RequestError};
use remat_planner::synth::{TransformerParams, transformer};
use remat_planner::{Graph, Problem};
use remat_report::{Layout, print_table};
use remat_units::human_bytes;

use crate::error::{Result, bail};

/// The margins above the floor the section plans at.
pub const MARGINS: [f64; 4] = [0.05, 0.10, 0.25, 0.50];

/// What one run of the section measures.
pub struct NearFloorBench {
    pub layers: Vec<usize>,
    pub bandwidth: f64,
    pub time_limit: Duration,
}

impl NearFloorBench {
    /// The section's settings: 8 and 32 layers, `time_limit_s` seconds per solve (checked).
    pub fn new(time_limit_s: f64, bandwidth: f64) -> Result<NearFloorBench> {
        if !(time_limit_s.is_finite() && time_limit_s > 0.0 && time_limit_s <= 1e6) {
            bail!(
                "--near-floor-time-limit {time_limit_s}: give a number of seconds above 0 (at most 1e6)"
            );
        }
        Ok(NearFloorBench {
            layers: vec![8, 32],
            bandwidth,
            time_limit: Duration::from_secs_f64(time_limit_s),
        })
    }
}

pub fn run(bench: &NearFloorBench) -> Result<()> {
    println!(
        "\nnear the floor: transformer joint graphs at the floor + {}; recompute-only above the recompute floor, swaps at {:.0} GB/s above today's floor; {:.1} s per solve",
        MARGINS.map(|m| format!("{:.0}%", 100.0 * m)).join(", "),
        bench.bandwidth / 1e9,
        bench.time_limit.as_secs_f64()
    );
    let mut floors = Vec::new();
    let mut rows = Vec::new();
    for &layers in &bench.layers {
        let free = transformer(&TransformerParams::gpt(layers))?;
        for (order, graph) in [("free", free.clone()), ("node", free.with_fixed_order())] {
            let recompute = recompute_floor(&graph);
            floors.push(vec![
                format!("{layers} layers, {order} order"),
                graph.len().to_string(),
                human_bytes(graph.store_all_peak()),
                human_bytes(graph.memory_floor()),
                format!(
                    "{}{}",
                    human_bytes(recompute.bytes),
                    if recompute.exact { " (exact)" } else { "" }
                ),
                format!(
                    "+{:.1}%",
                    100.0 * (recompute.bytes as f64 / graph.memory_floor() as f64 - 1.0)
                ),
            ]);
            for recompute_only in [true, false] {
                let floor = if recompute_only {
                    recompute.bytes
                } else {
                    graph.memory_floor()
                };
                for margin in MARGINS {
                    let budget = floor + (floor as f64 * margin) as u64;
                    let label = format!("{layers} layers, {order} order");
                    rows.push(row(&graph, label, recompute_only, margin, budget, bench));
                }
            }
        }
    }
    print_table(
        Layout::Markdown,
        &[
            "graph",
            "nodes",
            "store-all",
            "floor",
            "recompute floor",
            "above floor",
        ],
        &floors,
    );
    println!();
    print_table(
        Layout::Markdown,
        &[
            "graph",
            "plans",
            "budget",
            "overhead",
            "bound",
            "gap (points)",
            "solve s",
        ],
        &rows,
    );
    Ok(())
}

/// One solve: the default search (recompute-only or not) at `budget`.
fn row(
    graph: &Graph,
    label: String,
    recompute_only: bool,
    margin: f64,
    budget: u64,
    bench: &NearFloorBench,
) -> Vec<String> {
    let problem = Problem {
        graph,
        budget_bytes: budget,
        bandwidth: bench.bandwidth,
    };
    let started = Instant::now();
    let Outcome { result, bound, .. } = if recompute_only {
        request::plan_recompute_only(&problem, None, Some(bench.time_limit), |_| {})
    } else {
        request::plan(&problem, None, Some(bench.time_limit), |_| {})
    };
    let seconds = started.elapsed().as_secs_f64();
    let (floor_name, plans) = if recompute_only {
        ("recompute floor", "recompute-only".to_string())
    } else {
        (
            "floor",
            format!("swaps at {:.0} GB/s", bench.bandwidth / 1e9),
        )
    };
    let pct = |x: f64| format!("{:.2}%", 100.0 * x);
    let na = || "n/a".to_string();
    // Without a plan the bound is left out: a recompute-only request's is for plans at
    // 1 B/s, swaps included, and says nothing here.
    let (overhead, bound_cell, gap) = match (&result, &bound) {
        (Ok(planned), Some(b)) => {
            let overhead = planned.report.overhead();
            (
                pct(overhead),
                pct(b.overhead),
                format!("{:.2}", 100.0 * (overhead - b.overhead)),
            )
        }
        (Ok(planned), None) => (pct(planned.report.overhead()), na(), na()),
        (Err(RequestError::Infeasible { best_peak, .. }), _) => (
            format!("none found (least peak {})", human_bytes(*best_peak)),
            na(),
            na(),
        ),
        (Err(RequestError::SwapsNeeded { .. }), _) => {
            ("none found without swaps".to_string(), na(), na())
        }
        (Err(e), _) => (format!("none: {e}"), na(), na()),
    };
    vec![
        label,
        plans,
        format!(
            "{} ({floor_name} + {:.0}%)",
            human_bytes(budget),
            100.0 * margin
        ),
        overhead,
        bound_cell,
        gap,
        format!("{seconds:.2}"),
    ]
}
