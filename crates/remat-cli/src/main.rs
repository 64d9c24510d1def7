//! `remat`: one binary in front of the engine, the planner and the resharder.
//!
//! Each subcommand lives in its own module under `cmd/` with its own `Args`, so that the
//! commands grow independently; a command never imports another. What two commands share
//! sits beside `cmd/`: `units` (the size, budget and bandwidth flags), `fsutil` (output
//! files), `specs` (spec files and mixes); the flow itself is in the libraries
//! (`remat_engine::session`), tables in `remat_report`, sizes in `remat_units`.

mod cmd;
mod fsutil;
mod specs;
mod units;
mod usage;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "remat",
    version,
    about = "Train bigger models on the memory you have: keep, swap or recompute every activation; reshard checkpoints.",
    after_help = usage::EXIT_STATUS
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (the embedded GPT on a synthetic task by default).
    #[command(after_help = usage::EXIT_STATUS)]
    Train(cmd::train::Args),
    /// Record a training step of an engine model into the planner's graph IR.
    #[command(after_help = usage::EXIT_STATUS)]
    Profile(cmd::profile::Args),
    /// Plan keep/swap/recompute for a graph under a memory budget.
    #[command(after_help = usage::EXIT_STATUS)]
    Plan(cmd::plan::Args),
    /// Reshard a checkpoint from N to M ranks, or verify two layouts.
    #[command(after_help = usage::EXIT_STATUS)]
    Reshard(cmd::reshard::Args),
    /// Inspect or derive declarative recompute specs.
    #[command(after_help = usage::EXIT_STATUS)]
    Spec(cmd::spec::Args),
    /// Benchmarks, reported as ratios measured side by side in one run.
    #[command(after_help = usage::EXIT_STATUS)]
    Bench(cmd::bench::Args),
}

fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => match usage::reworded(&err) {
            Some(text) => {
                eprintln!("error: {text}\n\n{}", usage::HINT);
                return std::process::ExitCode::from(usage::EXIT_USAGE);
            }
            // clap's own words and status: 2 for usage, 0 for --help and --version.
            None => err.exit(),
        },
    };
    let result = match cli.command {
        Command::Train(args) => cmd::train::run(args),
        Command::Profile(args) => cmd::profile::run(args),
        Command::Plan(args) => cmd::plan::run(args),
        Command::Reshard(args) => cmd::reshard::run(args),
        Command::Spec(args) => cmd::spec::run(args),
        Command::Bench(args) => cmd::bench::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) if usage::is_usage(&err) => {
            eprintln!("error: {err:#}\n\n{}", usage::HINT);
            std::process::ExitCode::from(usage::EXIT_USAGE)
        }
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
