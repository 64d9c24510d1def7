//! `remat bench plan --multi`: K = 1, 2, 4 copies of a synthetic transformer planned
//! together ([`remat_planner::multi`]) at one budget, side by side with the same K models
//! planned one after another in one step and with each model planned alone.
//!
//! The budget is a multiple of one model's store-all peak (`--multi-budget`, default 1.1):
//! one model fits whole, K models together do not (K copies hold K times the static memory,
//! and store-all in any order holds at least one model's activations on top). Every number
//! is the simulator's: step time, peak, exposed swap stall (also as a share of the step),
//! recompute time, swaps, and the compute time of *other* models that ran while a swap was
//! copied back (what the multiplexed Algorithm C hides behind). Per K, the table compares
//! the interleaved order with one after another, for MuTWO alone and for the search.

use std::time::{Duration, Instant};

use remat_planner::multi::{MultiPlanned, MultiRequest, Multiplexed, Order, plan, plan_each_alone};
use remat_planner::synth::{TransformerParams, transformer};
use remat_report::{Layout, print_table};
use remat_units::human_bytes;

use crate::error::Result;

/// What one run of the multi-model bench measures.
pub struct MultiBench {
    pub layers: usize,
    pub budget_of_one: f64,
    pub bandwidth: f64,
    pub time_limit: Duration,
}

pub fn run(bench: &MultiBench) -> Result<()> {
    let one = transformer(&TransformerParams::gpt(bench.layers))?;
    let budget = (one.store_all_peak() as f64 * bench.budget_of_one) as u64;
    let unit_ms = one.time_unit_s() * 1e3;
    println!(
        "multi-model planning: K copies of {} ({} nodes, store-all peak {}, static {}), budget {} ({} x one model's peak), {:.0} GB/s",
        one.name(),
        one.len(),
        human_bytes(one.store_all_peak()),
        human_bytes(one.static_bytes()),
        human_bytes(budget),
        bench.budget_of_one,
        bench.bandwidth / 1e9
    );
    let mut rows = Vec::new();
    for k in [1usize, 2, 4] {
        let graphs = vec![one.clone(); k];
        let multi = Multiplexed::union(&graphs)?;
        for strategy in [Some("mutwo"), None] {
            let request = MultiRequest {
                strategy: strategy.map(str::to_string),
                time_limit: Some(bench.time_limit),
                ..MultiRequest::new(budget, bench.bandwidth)
            };
            let orders: &[Order] = if k == 1 {
                &[Order::AsGiven]
            } else {
                &[Order::Interleaved, Order::OneAfterAnother]
            };
            for &order in orders {
                let started = Instant::now();
                let result = plan(
                    &multi,
                    &MultiRequest {
                        order,
                        ..request.clone()
                    },
                );
                let ms = started.elapsed().as_secs_f64() * 1e3;
                let label = format!("{} together, {}", k, order.name());
                rows.push(multi_row(k, &label, &request, result, ms, unit_ms));
            }
            if k > 1 {
                rows.push(alone_row(k, &graphs, &request, unit_ms));
            }
        }
    }
    print_table(
        Layout::Markdown,
        &[
            "K",
            "plan",
            "strategy",
            "step ms",
            "peak",
            "exposed stall ms",
            "stall / step",
            "recompute ms",
            "swaps",
            "hidden by other models ms",
            "solve ms",
        ],
        &rows,
    );
    println!(
        "step ms is the simulated step of all K models; 'each alone' trains them one after another, each with the whole budget (one model's static memory resident at a time)"
    );
    Ok(())
}

fn strategy_cell(request: &MultiRequest) -> String {
    request.strategy.clone().unwrap_or_else(|| "search".into())
}

fn multi_row(
    k: usize,
    label: &str,
    request: &MultiRequest,
    result: Result<MultiPlanned, remat_planner::multi::MultiError>,
    solve_ms: f64,
    unit_ms: f64,
) -> Vec<String> {
    let mut row = vec![k.to_string(), label.to_string(), strategy_cell(request)];
    match result {
        Ok(p) => {
            let r = &p.report;
            let hidden: f64 = p.swaps.iter().map(|s| s.hidden_by_others()).sum();
            row.extend([
                format!("{:.3}", r.total_time * unit_ms),
                human_bytes(r.peak_bytes),
                format!("{:.3}", r.stall_time * unit_ms),
                format!(
                    "{:.2}%",
                    100.0 * r.stall_time / r.total_time.max(f64::MIN_POSITIVE)
                ),
                format!("{:.3}", r.recompute_time * unit_ms),
                p.swaps.len().to_string(),
                format!("{:.3}", hidden * unit_ms),
            ]);
        }
        Err(e) => {
            let text = e.to_string();
            let short = if text.contains("infeasible") {
                "over budget"
            } else {
                "no plan"
            };
            row.push(short.to_string());
            row.extend(std::iter::repeat_n("-".to_string(), 6));
        }
    }
    row.push(format!("{solve_ms:.0}"));
    row
}

fn alone_row(
    k: usize,
    graphs: &[remat_planner::Graph],
    request: &MultiRequest,
    unit_ms: f64,
) -> Vec<String> {
    let started = Instant::now();
    let result = plan_each_alone(graphs, request);
    let ms = started.elapsed().as_secs_f64() * 1e3;
    let mut row = vec![k.to_string(), "each alone".into(), strategy_cell(request)];
    match result {
        Ok(alone) => {
            let sum = |f: &dyn Fn(&remat_planner::Planned) -> f64| alone.iter().map(f).sum::<f64>();
            let total = sum(&|p| p.report.total_time);
            let stall = sum(&|p| p.report.stall_time);
            row.extend([
                format!("{:.3}", total * unit_ms),
                human_bytes(alone.iter().map(|p| p.report.peak_bytes).max().unwrap_or(0)),
                format!("{:.3}", stall * unit_ms),
                format!("{:.2}%", 100.0 * stall / total.max(f64::MIN_POSITIVE)),
                format!("{:.3}", sum(&|p| p.report.recompute_time) * unit_ms),
                "-".into(),
                "-".into(),
            ]);
        }
        Err(_) => {
            row.push("no plan".into());
            row.extend(std::iter::repeat_n("-".to_string(), 6));
        }
    }
    row.push(format!("{ms:.0}"));
    row
}
