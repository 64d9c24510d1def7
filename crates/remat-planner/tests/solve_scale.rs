//! Measurements of the anytime solver at scale (run by hand, release build):
//! `cargo test -p remat-planner --release --test solve_scale -- --ignored --nocapture`.
//! Prints solve time and overhead of `evict`, `mutwo` and the default search side by side
//! on random layered DAGs, transformer-like graphs and, when `$REMAT_MOCCASIN_DIR` holds
//! Moccasin's published `rl{250,500,1000}.json`, on those at the paper's byte budgets.
//! Figures, not assertions: timings vary with the machine.

mod common;

use std::time::{Duration, Instant};

use remat_planner::request;
use remat_planner::solve::default_time_limit;
use remat_planner::{Graph, Planned, Problem, Strategy};

fn row(graph: &Graph, budget: u64, bandwidth: f64) {
    let problem = Problem {
        graph,
        budget_bytes: budget,
        bandwidth,
    };
    let cell = |r: Option<Planned>, t: Duration| match r {
        Some(p) => format!(
            "{:7.3}% {:6.3}s{}",
            100.0 * p.report.overhead(),
            t.as_secs_f64(),
            if p.plan.reorders() { " R" } else { "  " }
        ),
        None => format!("   none {:6.3}s  ", t.as_secs_f64()),
    };
    let mut cells = Vec::new();
    for s in [
        Box::new(remat_planner::exact::evict::Evict) as Box<dyn Strategy>,
        Box::new(remat_planner::strategy::mutwo::MuTwo),
    ] {
        if graph.len() > 1500 {
            cells.push("   skipped        ".to_string());
            continue;
        }
        let t = Instant::now();
        let r = s.plan(&problem);
        cells.push(cell(r.ok(), t.elapsed()));
    }
    let t = Instant::now();
    let limit = default_time_limit(graph.len());
    let best = request::plan(&problem, None, Some(limit), |_| {});
    let took = t.elapsed();
    let bound = best.bound.as_ref().map_or(0.0, |b| b.overhead);
    cells.push(cell(best.result.ok(), took));
    println!(
        "{:32} n={:5} budget {:.2} ({:9} B) | evict {} | mutwo {} | default {} | bound {:.3}%",
        graph.name(),
        graph.len(),
        (budget - graph.static_bytes()) as f64
            / (graph.store_all_peak() - graph.static_bytes()) as f64,
        budget,
        cells[0],
        cells[1],
        cells[2],
        100.0 * bound
    );
}

#[test]
#[ignore = "measurement, run by hand in release"]
fn measure_scale() {
    // Recompute-only comparisons use a slow link (swaps cost more than they save).
    let slow = 1e3;
    for n in [250, 1000, 5000] {
        if n > 1000 && std::env::var_os("REMAT_SCALE_LARGE").is_none() {
            continue;
        }
        let g = common::random_layered(n, (n as f64).sqrt() as usize, 7, n as u64);
        for f in [0.9, 0.8, 0.6] {
            row(&g, (g.store_all_peak() as f64 * f) as u64, slow);
        }
    }
    for layers in [8, 32, 128] {
        let g = common::transformer(layers);
        for f in [0.7, 0.5, 0.3] {
            row(&g, common::activation_budget(&g, f), slow);
        }
    }
    if let Some(dir) = std::env::var_os("REMAT_MOCCASIN_DIR") {
        let dir = std::path::PathBuf::from(dir);
        let options = remat_planner::import::ImportOptions { time_unit_s: 1e-6 };
        for (n, budgets) in [
            (250, [132_156, 117_472]),
            (500, [255_996, 227_552]),
            (1000, [547_758, 486_896]),
        ] {
            let path = dir.join(format!("rl{n}.json"));
            let Ok(g) = remat_planner::import::load(&path, options) else {
                println!("cannot load {}", path.display());
                continue;
            };
            for b in budgets {
                row(&g, b, slow);
            }
        }
    }
}

/// Each registered strategy's time in linear passes ([`calibrate`]) against
/// [`estimated_seconds`]: the figures behind each strategy's `search_cost`.
#[test]
#[ignore = "measurement, run by hand in release"]
fn measure_search_costs() {
    use remat_planner::registry;
    use remat_planner::search::{calibrate, estimated_seconds};
    for g in [
        common::random_layered(500, 22, 7, 5),
        common::random_layered(1000, 31, 7, 5),
        common::transformer(32),
    ] {
        let problem = Problem {
            graph: &g,
            budget_bytes: (g.store_all_peak() as f64 * 0.7) as u64,
            bandwidth: 1e3,
        };
        let rate = calibrate(&problem);
        println!("{} n={} rate {:.3e} s/node", g.name(), g.len(), rate);
        for s in registry() {
            if s.name() == "anytime" || s.name() == "evict" {
                continue;
            }
            let t = Instant::now();
            let _ = s.plan(&problem);
            let took = t.elapsed().as_secs_f64();
            let n = g.len() as f64;
            let passes = took / (rate * n) / (n / 1000.0).powi(s.search_cost().exponent - 1);
            println!(
                "  {:14} {:8.3}s  estimate {:8.3}s  measured passes {:10.1}",
                s.name(),
                took,
                estimated_seconds(s.as_ref(), g.len(), rate),
                passes
            );
        }
    }
}
