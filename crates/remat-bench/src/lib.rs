//! remat-bench: the benchmarks behind `remat bench TARGET`, apart from the commands people
//! use to train and plan. Each target measures remat side by side with what it is compared
//! against, in one run, and reports ratios (never a timed assertion in a test).
//!
//! The benchmarks drive the same library flows as the commands
//! (`remat_engine::session`, the planner's and the resharder's entry points), print with
//! the same tables (`remat_report`), and are reached only through `remat bench`: the arrows
//! point `remat-cli -> remat-bench -> engine, planner, reshard, report`, never back.
//!
//! One module per target: [`engine`], [`plan`], [`reshard`], [`auto`], [`spec`],
//! [`pipeline`], [`multi`]; [`torch`] runs the PyTorch peer of `engine` (its Python side
//! lives with the Python code, in `python/bench_peers/`), [`cpu_steal`] reports how much
//! CPU time the machine took from the run, and [`ratio`] is how two things timed in the same
//! rounds compare.

pub mod auto;
pub mod cpu_steal;
pub mod engine;
pub mod error;
pub mod multi;
pub mod pipeline;
pub mod pipeline_mpi;
pub mod plan;
pub mod ratio;
pub mod reshard;
pub mod spec;
pub mod spec_mix;
pub mod torch;

pub use error::{BenchError, Result};

/// `remat bench TARGET`'s flags.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    target: Target,
}

#[derive(clap::Subcommand)]
enum Target {
    /// One GPT training step under store-all, per-block checkpointing and sqrt(L) segments.
    Engine(engine::Args),
    /// Every planner strategy on the graphs, against the exact optimum.
    Plan(plan::Args),
    /// Reshard a generated multi-GiB checkpoint, against a plain memory copy.
    Reshard(reshard::Args),
    /// Auto plans executed by the engine, against the simulator and fixed policies.
    Auto(auto::Args),
    /// Declarative recompute specs: saved/recomputed/offloaded bytes and step time.
    Spec(spec::Args),
    /// Pipeline schedules and stage checkpoint strategies.
    Pipeline(pipeline::Args),
    /// K models trained together against one after another, at one budget (issue 22).
    Multi(multi::Args),
}

/// Runs the benchmark `args` names, then reports the CPU time the machine took from it.
pub fn run(args: Args) -> Result<()> {
    let steal = cpu_steal::StealMeter::start();
    match args.target {
        Target::Engine(a) => engine::run(a),
        Target::Plan(a) => plan::run(a),
        Target::Reshard(a) => reshard::run(a),
        Target::Auto(a) => auto::run(a),
        Target::Spec(a) => spec::run(a),
        Target::Pipeline(a) => pipeline::run(a),
        Target::Multi(a) => multi::run(a),
    }?;
    if let Some(line) = steal.report() {
        println!("{line}");
    }
    Ok(())
}
