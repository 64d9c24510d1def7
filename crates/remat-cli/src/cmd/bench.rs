//! `remat bench TARGET`: each target lives in its own module `bench_TARGET.rs`.

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    target: Target,
}

#[derive(clap::Subcommand)]
enum Target {
    /// One GPT training step under store-all, per-block checkpointing and sqrt(L) segments.
    Engine(super::bench_engine::Args),
    /// Every planner strategy on the graphs, against the exact optimum.
    Plan(super::bench_plan::Args),
    /// Reshard a generated multi-GiB checkpoint, against a plain memory copy.
    Reshard(super::bench_reshard::Args),
    /// Auto plans executed by the engine, against the simulator and fixed policies.
    Auto(super::bench_auto::Args),
    /// Declarative recompute specs: saved/recomputed/offloaded bytes and step time.
    Spec(super::bench_spec::Args),
    /// Pipeline schedules and stage checkpoint strategies.
    Pipeline(super::bench_pipeline::Args),
    /// K models trained together against one after another, at one budget (issue 22).
    Multi(super::bench_multi::Args),
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let steal = super::cpu_steal::StealMeter::start();
    match args.target {
        Target::Engine(a) => super::bench_engine::run(a),
        Target::Plan(a) => super::bench_plan::run(a),
        Target::Reshard(a) => super::bench_reshard::run(a),
        Target::Auto(a) => super::bench_auto::run(a),
        Target::Spec(a) => super::bench_spec::run(a),
        Target::Pipeline(a) => super::bench_pipeline::run(a),
        Target::Multi(a) => super::bench_multi::run(a),
    }?;
    if let Some(line) = steal.report() {
        println!("{line}");
    }
    Ok(())
}

/// The median over rounds of `num[i] / den[i]`: a ratio of two things timed in the same
/// rounds, so the machine's drift between rounds cancels (NaN without rounds).
pub fn paired_median(num: &[f64], den: &[f64]) -> f64 {
    if den.is_empty() {
        return f64::NAN;
    }
    remat_engine::profile::median(num.iter().zip(den).map(|(n, d)| n / d.max(1e-12)).collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn paired_median_takes_the_middle_ratio() {
        let ratio = super::paired_median(&[2.0, 9.0, 3.0], &[1.0, 3.0, 2.0]);
        assert_eq!(ratio, 2.0);
        assert!(super::paired_median(&[1.0], &[]).is_nan());
    }
}
