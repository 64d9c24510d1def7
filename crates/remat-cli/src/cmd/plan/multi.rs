//! `remat plan A.json B.json ... --budget B`: several graphs trained together under one
//! budget (MuTWO's multi-model setting, [`remat_planner::multi`]).
//!
//! Prints the plan of the K models together (the interleaved order by default, planned by
//! the anytime search as for one graph, or by `--strategy`, `mutwo` for Algorithm C alone),
//! a table of its swaps (which model's compute overlapped each copy, and the stall each
//! exposed), each model's compute and exposed stall, and the same budget planned two other
//! ways: the K graphs together one after another, and each graph alone (trained one after
//! another, each with the whole device).

use std::path::{Path, PathBuf};
use std::time::Instant;

use remat_planner::Graph;
use remat_planner::Planned;
use remat_planner::import::{ImportOptions, load};
use remat_planner::multi::{
    ModelStall, MultiPlanned, MultiRequest, Multiplexed, Order, SwapHiding, plan, plan_each_alone,
};
use remat_planner::output::{check_outputs, write_all_atomic};
use remat_planner::request;
use remat_report::{Layout, print_table};
use remat_units::human_bytes;

use crate::units::{parse_bandwidth, parse_budget};

/// What `remat plan` was asked, for several graphs.
pub struct MultiArgs<'a> {
    pub graphs: &'a [PathBuf],
    pub budget: &'a [String],
    pub strategy: Option<&'a str>,
    pub order: &'a str,
    pub bandwidth: &'a str,
    pub options: ImportOptions,
    pub time_limit: Option<std::time::Duration>,
    pub out: Option<&'a Path>,
}

/// `--order` names.
pub fn parse_order(text: &str) -> anyhow::Result<Order> {
    Order::ALL
        .into_iter()
        .find(|o| o.name() == text)
        .ok_or_else(|| {
            let known: Vec<&str> = Order::ALL.iter().map(|o| o.name()).collect();
            crate::usage!("--order {text}: unknown order; known: {}", known.join(", "))
        })
}

pub fn run(args: MultiArgs) -> anyhow::Result<()> {
    let order = parse_order(args.order)?;
    let [budget_text] = args.budget else {
        return Err(crate::usage!(
            "give one --budget with several graphs (got {})",
            args.budget.len()
        ));
    };
    let graphs = args
        .graphs
        .iter()
        .map(|p| load(p, args.options).map_err(anyhow::Error::from))
        .collect::<anyhow::Result<Vec<Graph>>>()?;
    let multi = Multiplexed::union(&graphs)?;
    let bandwidth = parse_bandwidth(args.bandwidth)?;
    let interleaving = multi.interleave(order)?;
    // A fraction is of the store-all peak of the K models in the requested order.
    let budget = parse_budget(budget_text, interleaving.graph())?;
    if let Some(out) = args.out {
        check_outputs(&[("--out", out)])?;
    }
    print_models(&multi, &graphs, bandwidth)?;
    let request = MultiRequest {
        budget_bytes: budget,
        bandwidth,
        order,
        strategy: args.strategy.map(str::to_string),
        time_limit: args.time_limit,
    };
    let started = Instant::now();
    let planned = plan(&multi, &request)?;
    let seconds = started.elapsed().as_secs_f64();
    let as_planned = Planned {
        plan: planned.plan.clone(),
        report: planned.report.clone(),
    };
    println!("order         {}", order.name());
    print!("{}", request::summary(multi.graph(), &as_planned));
    println!("solve time    {seconds:.3} s");
    let unit = multi.graph().time_unit_s();
    print_swaps(&multi, &planned.swaps, unit);
    print_stalls(&multi, &planned.models, planned.report.total_time, unit);
    compare(&multi, &graphs, &request, &planned)?;
    if let Some(path) = args.out {
        write_all_atomic(&[(path.to_path_buf(), planned.plan.to_json()?.into_bytes())])?;
        println!("plan written to {}", path.display());
    }
    Ok(())
}

/// The models, and the combined graph's store-all peak in each order.
fn print_models(multi: &Multiplexed, graphs: &[Graph], bandwidth: f64) -> anyhow::Result<()> {
    for (m, g) in graphs.iter().enumerate() {
        println!(
            "model {m}       {}: {} nodes, store-all peak {}, static {}",
            g.name(),
            g.len(),
            human_bytes(g.store_all_peak()),
            human_bytes(g.static_bytes())
        );
    }
    println!(
        "together      {} nodes, floor {}",
        multi.graph().len(),
        human_bytes(multi.floor())
    );
    for order in Order::ALL {
        let report = multi.interleave(order)?.store_all_report(bandwidth)?;
        println!(
            "store-all     {} in order {}",
            human_bytes(report.peak_bytes),
            order.name()
        );
    }
    Ok(())
}

/// Who hid what: one row per swap.
fn print_swaps(multi: &Multiplexed, swaps: &[SwapHiding], unit: f64) {
    if swaps.is_empty() {
        println!("swaps         none: the plan keeps or recomputes every tensor");
        return;
    }
    let rows: Vec<Vec<String>> = swaps
        .iter()
        .map(|s| {
            let copy_in: f64 = s.copy_in.iter().map(|(a, b)| b - a).sum();
            vec![
                s.name.clone(),
                model_cell(multi, s.model),
                human_bytes(s.bytes),
                ms(s.copy_out.1 - s.copy_out.0, unit),
                hidden_cell(multi, &s.out_hidden_by, unit),
                ms(copy_in, unit),
                hidden_cell(multi, &s.in_hidden_by, unit),
                ms(s.exposed, unit),
            ]
        })
        .collect();
    print_table(
        Layout::Markdown,
        &[
            "swapped tensor",
            "model",
            "bytes",
            "copy out ms",
            "compute during copy out (ms)",
            "copies in ms",
            "compute during copy in (ms)",
            "exposed ms",
        ],
        &rows,
    );
}

/// Each model's share of the step.
fn print_stalls(multi: &Multiplexed, models: &[ModelStall], total: f64, unit: f64) {
    let rows: Vec<Vec<String>> = models
        .iter()
        .map(|s| {
            vec![
                model_cell(multi, s.model),
                ms(s.compute_time, unit),
                ms(s.recompute_time, unit),
                ms(s.stall_time, unit),
                format!(
                    "{:.2}%",
                    100.0 * s.stall_time / total.max(f64::MIN_POSITIVE)
                ),
                s.swaps.to_string(),
                human_bytes(s.swapped_bytes),
            ]
        })
        .collect();
    print_table(
        Layout::Markdown,
        &[
            "model",
            "compute ms",
            "recompute ms",
            "exposed stall ms",
            "stall / step",
            "swaps",
            "swapped",
        ],
        &rows,
    );
}

/// The same budget and strategy: the K graphs together in the requested order, together one
/// after another, and each graph alone.
fn compare(
    multi: &Multiplexed,
    graphs: &[Graph],
    request: &MultiRequest,
    planned: &MultiPlanned,
) -> anyhow::Result<()> {
    let unit = multi.graph().time_unit_s();
    let mut rows = vec![row(
        &format!("together, {}", request.order.name()),
        planned.report.total_time,
        planned.report.peak_bytes,
        planned.report.stall_time,
        planned.report.recompute_time,
        unit,
    )];
    if request.order != Order::OneAfterAnother {
        let apart = MultiRequest {
            order: Order::OneAfterAnother,
            ..request.clone()
        };
        rows.push(match plan(multi, &apart) {
            Ok(p) => row(
                "together, one-after-another",
                p.report.total_time,
                p.report.peak_bytes,
                p.report.stall_time,
                p.report.recompute_time,
                unit,
            ),
            Err(e) => failed_row("together, one-after-another", &e.to_string()),
        });
    }
    rows.push(match plan_each_alone(graphs, request) {
        Ok(alone) => {
            let sum = |f: fn(&Planned) -> f64| alone.iter().map(f).sum::<f64>();
            row(
                "each alone, one after another",
                sum(|p| p.report.total_time),
                alone.iter().map(|p| p.report.peak_bytes).max().unwrap_or(0),
                sum(|p| p.report.stall_time),
                sum(|p| p.report.recompute_time),
                unit,
            )
        }
        Err(e) => failed_row("each alone, one after another", &e.to_string()),
    });
    println!(
        "at budget {} with {} (times in ms of simulated step)",
        human_bytes(request.budget_bytes),
        request.strategy.as_deref().unwrap_or("the search")
    );
    print_table(
        Layout::Markdown,
        &[
            "K models",
            "step ms",
            "peak",
            "exposed stall ms",
            "stall / step",
            "recompute ms",
        ],
        &rows,
    );
    Ok(())
}

fn row(name: &str, total: f64, peak: u64, stall: f64, recompute: f64, unit: f64) -> Vec<String> {
    vec![
        name.to_string(),
        ms(total, unit),
        human_bytes(peak),
        ms(stall, unit),
        format!("{:.2}%", 100.0 * stall / total.max(f64::MIN_POSITIVE)),
        ms(recompute, unit),
    ]
}

fn failed_row(name: &str, why: &str) -> Vec<String> {
    let mut cells = vec![name.to_string(), format!("no plan: {why}")];
    cells.extend(std::iter::repeat_n("-".to_string(), 4));
    cells
}

fn model_cell(multi: &Multiplexed, model: Option<usize>) -> String {
    match model {
        Some(m) => format!("{m} ({})", multi.model_name(m)),
        None => "shared".to_string(),
    }
}

/// `0 (a) 1.20, 1 (b) 0.40`: each model's compute during a copy, in ms.
fn hidden_cell(multi: &Multiplexed, by: &[(Option<usize>, f64)], unit: f64) -> String {
    if by.is_empty() {
        return "-".to_string();
    }
    by.iter()
        .map(|&(m, t)| format!("{} {}", model_cell(multi, m), ms(t, unit)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn ms(time: f64, unit: f64) -> String {
    format!("{:.3}", time * unit * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_are_parsed_by_name_and_unknown_ones_listed() {
        assert_eq!(parse_order("interleaved").unwrap(), Order::Interleaved);
        assert_eq!(parse_order("as-given").unwrap(), Order::AsGiven);
        let err = format!("{:#}", parse_order("zigzag").unwrap_err());
        assert!(
            err.starts_with("--order zigzag") && err.contains("one-after-another"),
            "{err}"
        );
    }
}
