//! `remat profile`: record a training step of an engine model into the planner's graph IR.

use std::path::PathBuf;

use remat_units::human_bytes;

use remat_engine::session::model::{ModelOptions, profile_model};

/// Which model, and its size.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// `gpt` (the decoder of `remat train`) or `mlp` (the engine's MLP chain). The Qwen3
    /// blocks run on the spec runtime and cannot be profiled.
    #[arg(long, default_value = "gpt")]
    pub model: String,
    /// GPT: blocks; MLP: hidden layers.
    #[arg(long, default_value = "4", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub layers: usize,
    /// GPT: model width; MLP: hidden width.
    #[arg(long, default_value = "128", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub d_model: usize,
    /// GPT: attention heads.
    #[arg(long, default_value = "4", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub heads: usize,
    /// GPT: tokens per sequence.
    #[arg(long, default_value = "64", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub seq: usize,
    /// Sequences (GPT) or rows (MLP) per batch.
    #[arg(long, default_value = "8", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub batch: usize,
    /// GPT: vocabulary size.
    #[arg(long, default_value = "256", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub vocab: usize,
    /// GPT: residual dropout probability.
    #[arg(long, default_value = "0", value_parser = crate::units::dropout_arg, allow_hyphen_values = true)]
    pub dropout: f32,
    /// Kernel threads (results are bit-exact for a given count).
    #[arg(long, default_value = "2", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub threads: usize,
}

impl ModelArgs {
    /// The library's description of the model these flags name.
    pub fn options(&self) -> ModelOptions {
        ModelOptions {
            model: self.model.clone(),
            layers: self.layers,
            d_model: self.d_model,
            heads: self.heads,
            seq: self.seq,
            batch: self.batch,
            vocab: self.vocab,
            dropout: self.dropout,
            threads: self.threads,
        }
    }
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Timed runs per op (after a warm-up); the median is kept.
    #[arg(long, default_value = "5", value_parser = crate::units::count_arg::<usize>, allow_hyphen_values = true)]
    pub runs: usize,
    /// Where to write the graph (remat's JSON schema, read by `remat plan`).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // Before profiling: a directory or device at --out would only fail at the end.
    crate::fsutil::check_target("--out", &args.out)?;
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(format!(
        "profiling {} ({} runs)",
        args.model.options().label(),
        args.runs + 1
    ));
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let (_, _, _, _, profile) = profile_model(&args.model.options(), args.runs)?;
    spinner.finish_and_clear();
    let g = &profile.graph;
    crate::fsutil::write_atomically(
        "--out",
        &args.out,
        remat_planner::import::remat_json::to_json(g).as_bytes(),
    )?;
    let fwd = g
        .nodes()
        .iter()
        .filter(|n| n.phase == remat_planner::Phase::Forward)
        .count();
    println!(
        "{}: {} nodes ({} forward, {} backward) -> {}",
        g.name(),
        g.len(),
        fwd,
        g.len() - fwd,
        args.out.display()
    );
    println!("static memory     {:>12}", human_bytes(g.static_bytes()));
    println!(
        "store-all peak    {:>12} (activations {})",
        human_bytes(g.store_all_peak()),
        human_bytes(g.store_all_peak() - g.static_bytes())
    );
    println!("memory floor      {:>12}", human_bytes(g.memory_floor()));
    let recompute = remat_planner::floor::recompute_floor(g);
    println!(
        "recompute floor   {:>12} ({})",
        human_bytes(recompute.bytes),
        if recompute.exact {
            "exact"
        } else {
            "lower bound, without swaps"
        }
    );
    println!(
        "step time         {:>12.2} ms (sum of op medians {:.2} ms; op times scaled by {:.2} to match the step)",
        profile.measured_step_time * 1e3,
        g.base_time() / profile.time_scale * 1e3,
        profile.time_scale
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_width_whose_mlp_overflows_is_an_error() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            model: ModelArgs,
        }
        let cli = <Cli as clap::Parser>::try_parse_from(["x", "--d-model", "4611686018427387904"]);
        let err = cli
            .unwrap()
            .model
            .options()
            .gpt_config()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--d-model") && err.contains("overflows"),
            "{err}"
        );
    }
}
