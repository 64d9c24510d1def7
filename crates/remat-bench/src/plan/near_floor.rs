//! `remat bench plan --near-floor`: plans close to the floor, where users go when memory is
//! really short (issue 30). Transformer joint graphs from the generator
//! ([`TransformerParams::gpt`], 8 and 32 layers) in free order, in node order (as the engine
//! and `remat.torch.capture` lay a step out) and in the eager order (what PyTorch's eager
//! autograd runs as it is, [`remat_planner::eager`]), and Moccasin's random layered graphs
//! ([`LayeredParams::moccasin`], n = 250, 500, 1,000, seed 1, as the scale section builds
//! them) in free order (they mark no backward pass, so they have no eager form), at the
//! floor + 5%, 10%, 25% and 50% of each form: recompute-only
//! ([`request::plan_recompute_only`], above the recompute floor of [`remat_planner::floor`],
//! in the eager order above the eager floor where that is higher) and with swaps at the
//! bench's bandwidth (above today's floor, [`Graph::memory_floor`], or the eager floor,
//! [`remat_planner::eager::floor`]). Each row: the plan's overhead, the lower bound the
//! request proved, the gap between them in points, and the solve time. Each solve gets the
//! time `remat plan` would give it ([`default_time_limit`]: 1 s on the 8-layer graphs and
//! Moccasin's, 3.96 s on the 32-layer ones, about 160 s in all), or
//! `--near-floor-time-limit` seconds each.

use std::time::{Duration, Instant};

use remat_planner::floor::recompute_floor;
use remat_planner::request::{self, Outcome, RequestError};
use remat_planner::solve::default_time_limit;
use remat_planner::synth::{LayeredParams, TransformerParams, random_layered, transformer};
use remat_planner::{Graph, Problem, eager};
use remat_report::{Layout, print_table};
use remat_units::human_bytes;

use crate::error::{Result, bail};

/// The margins above the floor the section plans at.
pub const MARGINS: [f64; 4] = [0.05, 0.10, 0.25, 0.50];

/// What one run of the section measures.
pub struct NearFloorBench {
    pub layers: Vec<usize>,
    /// Nodes of Moccasin's random layered graphs (seed 1), planned in free order.
    pub layered: Vec<usize>,
    pub bandwidth: f64,
    /// Per solve; `None`: the planner's default for the graph.
    pub time_limit: Option<Duration>,
    /// Only the graphs whose label contains this text, in any case (`None`: all).
    pub only: Option<String>,
}

impl NearFloorBench {
    /// The section's settings: 8 and 32 layers, Moccasin's n = 250, 500 and 1,000,
    /// `time_limit_s` seconds per solve (checked), or the planner's default per graph.
    pub fn new(time_limit_s: Option<f64>, bandwidth: f64) -> Result<NearFloorBench> {
        if let Some(s) = time_limit_s
            && !(s.is_finite() && s > 0.0 && s <= 1e6)
        {
            bail!("--near-floor-time-limit {s}: give a number of seconds above 0 (at most 1e6)");
        }
        Ok(NearFloorBench {
            layers: vec![8, 32],
            layered: vec![250, 500, 1000],
            bandwidth,
            time_limit: time_limit_s.map(Duration::from_secs_f64),
            only: None,
        })
    }

    /// Whether the graph labelled `label` is benched (see [`NearFloorBench::only`]).
    fn includes(&self, label: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|text| label.to_lowercase().contains(&text.to_lowercase()))
    }

    /// The time limit of one solve on `graph`.
    fn limit_for(&self, graph: &Graph) -> Duration {
        self.time_limit
            .unwrap_or_else(|| default_time_limit(graph.len()))
    }
}

/// The graphs of the section, each with its label: the transformers in free, node and
/// eager order, then Moccasin's graphs in free order (those [`NearFloorBench::only`] keeps;
/// none is an error naming the labels).
fn graphs(bench: &NearFloorBench) -> Result<Vec<(String, Graph)>> {
    let mut out = Vec::new();
    for &layers in &bench.layers {
        let free = transformer(&TransformerParams::gpt(layers))?;
        let node = free.clone().with_fixed_order();
        let eager = free.clone().with_eager_order()?;
        for (order, graph) in [("free", free), ("node", node), ("eager", eager)] {
            out.push((format!("{layers} layers, {order} order"), graph));
        }
    }
    for &nodes in &bench.layered {
        let graph = random_layered(&LayeredParams::moccasin(nodes), 1)?;
        out.push((format!("Moccasin n={nodes}, free order"), graph));
    }
    let labels: Vec<String> = out.iter().map(|(label, _)| label.clone()).collect();
    out.retain(|(label, _)| bench.includes(label));
    if out.is_empty() {
        bail!(
            "--near-floor-only {:?}: no graph of the section matches; its graphs: {}",
            bench.only.as_deref().unwrap_or(""),
            labels.join("; ")
        );
    }
    Ok(out)
}

/// The floors a form's budgets are set from: (with swaps, recompute-only, the recompute
/// floor is exact). In the eager order the held values raise both to the eager floor
/// where it is higher.
fn floors(graph: &Graph) -> (u64, u64, bool) {
    let recompute = recompute_floor(graph);
    if graph.order_is_eager() {
        let eager = eager::floor(graph);
        (eager, recompute.bytes.max(eager), recompute.exact)
    } else {
        (graph.memory_floor(), recompute.bytes, recompute.exact)
    }
}

pub fn run(bench: &NearFloorBench) -> Result<()> {
    let graphs = graphs(bench)?;
    println!(
        "\nnear the floor: transformer joint graphs (free, node and eager order) and Moccasin's random layered graphs at the floor + {}; recompute-only above the recompute floor, swaps at {:.0} GB/s above today's floor (the eager order: above the eager floor where higher); {} per solve",
        MARGINS.map(|m| format!("{:.0}%", 100.0 * m)).join(", "),
        bench.bandwidth / 1e9,
        bench.time_limit.map_or_else(
            || "the planner's default time limit".to_string(),
            |t| format!("{:.1} s", t.as_secs_f64())
        )
    );
    let started = Instant::now();
    let mut floor_rows = Vec::new();
    let mut rows = Vec::new();
    for (label, graph) in graphs {
        let (floor, recompute, exact) = floors(&graph);
        floor_rows.push(vec![
            label.clone(),
            graph.len().to_string(),
            human_bytes(graph.store_all_peak()),
            human_bytes(floor),
            format!(
                "{}{}",
                human_bytes(recompute),
                if exact { " (exact)" } else { "" }
            ),
            format!("+{:.1}%", 100.0 * (recompute as f64 / floor as f64 - 1.0)),
        ]);
        for recompute_only in [true, false] {
            let floor = if recompute_only { recompute } else { floor };
            for margin in MARGINS {
                let budget = floor + (floor as f64 * margin) as u64;
                rows.push(row(
                    &graph,
                    label.clone(),
                    recompute_only,
                    margin,
                    budget,
                    bench,
                ));
            }
        }
    }
    print_table(
        Layout::Markdown,
        &[
            "graph",
            "nodes",
            "store-all",
            "floor (of the form)",
            "recompute floor",
            "above floor",
        ],
        &floor_rows,
    );
    println!();
    print_table(
        Layout::Markdown,
        &[
            "graph",
            "plans",
            "budget",
            "overhead",
            "recomputed + waited",
            "bound",
            "gap (points)",
            "solve s",
        ],
        &rows,
    );
    println!(
        "near the floor: {} solves in {:.1} s",
        rows.len(),
        started.elapsed().as_secs_f64()
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
        request::plan_recompute_only(&problem, None, Some(bench.limit_for(graph)), |_| {})
    } else {
        request::plan(&problem, None, Some(bench.limit_for(graph)), |_| {})
    };
    let seconds = started.elapsed().as_secs_f64();
    let (floor_name, plans) = match (recompute_only, graph.order_is_eager()) {
        (true, _) => ("recompute floor", "recompute-only".to_string()),
        (false, eager) => (
            if eager { "eager floor" } else { "floor" },
            format!("swaps at {:.0} GB/s", bench.bandwidth / 1e9),
        ),
    };
    let pct = |x: f64| format!("{:.2}%", 100.0 * x);
    let na = || "n/a".to_string();
    // Without a plan the bound is left out: a recompute-only request's is for plans at
    // 1 B/s, swaps included, and says nothing here.
    // Where a plan's overhead goes: recomputation, and exposed copies (the compute stream
    // waiting on the link).
    let split = match &result {
        Ok(planned) if planned.report.base_time > 0.0 => {
            let r = &planned.report;
            format!(
                "{} + {}",
                pct(r.recompute_time / r.base_time),
                pct(r.stall_time / r.base_time)
            )
        }
        _ => "n/a".to_string(),
    };
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
        (Err(RequestError::SwapsNeeded { least_peak, .. }), _) => (
            least_peak.map_or_else(
                || "none found without swaps".to_string(),
                |peak| {
                    format!(
                        "none found without swaps (least peak {})",
                        human_bytes(peak)
                    )
                },
            ),
            na(),
            na(),
        ),
        (Err(RequestError::BelowEagerFloor { floor, .. }), _) => (
            format!("under the eager floor {}", human_bytes(*floor)),
            na(),
            na(),
        ),
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
        split,
        bound_cell,
        gap,
        format!("{seconds:.2}"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_keeps_the_graphs_whose_label_matches_in_any_case() {
        let mut bench = NearFloorBench::new(Some(1.0), 32e9).unwrap();
        bench.layers = vec![2];
        bench.layered = vec![60];
        bench.only = Some("2 LAYERS, EAGER".into());
        let labels: Vec<String> = graphs(&bench).unwrap().into_iter().map(|g| g.0).collect();
        assert_eq!(labels, ["2 layers, eager order"]);
        bench.only = Some("moccasin".into());
        let labels: Vec<String> = graphs(&bench).unwrap().into_iter().map(|g| g.0).collect();
        assert_eq!(labels, ["Moccasin n=60, free order"]);
    }

    #[test]
    fn only_matching_nothing_is_refused_naming_the_graphs() {
        let mut bench = NearFloorBench::new(None, 32e9).unwrap();
        bench.layers = vec![2];
        bench.layered = vec![60];
        bench.only = Some("9 layers".into());
        let error = graphs(&bench).err().unwrap().to_string();
        assert!(error.contains("--near-floor-only \"9 layers\""), "{error}");
        assert!(error.contains("2 layers, node order"), "{error}");
    }
}
