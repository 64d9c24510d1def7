//! `remat train`: trains the GPT of `remat_engine::models::gpt` on the embedded
//! sequence-reversal task (or `--data FILE`, character-level) under a checkpointing policy
//! and a memory budget; `--compare` runs every policy side by side.
//!
//! Layout: every mode's flags in `train/flags.rs` (the modes read them from there, never
//! from each other); the data is `remat_engine::session::task`; the training loop and its
//! summary in `train/session.rs`; `--compare` in `train/compare.rs`; the out-of-memory hint
//! in `train/hint.rs`; `--policy auto` in `train/auto.rs`; `--models K` in
//! `train/multi.rs`; `--stages` in `train/pipeline.rs`; spec-driven blocks in
//! `train/spec.rs`. This file only picks the mode. Flags added by later features should
//! dispatch to their own modules.

mod auto;
mod compare;
mod fixed;
mod flags;
mod hint;
mod multi;
mod per_model;
mod pipeline;
mod session;
mod spec;

use remat_engine::models::gpt::Checkpointing;

use flags::PolicyChoice;

pub use flags::Args;

/// Refuses flags the fixed-policy GPT loops (`session`, `--compare`) would silently ignore.
fn check_gpt_flags(args: &Args) -> anyhow::Result<()> {
    if args.files.swap_dir.is_some() {
        anyhow::bail!(
            "--swap-dir is only used with --policy auto (which swaps activations); \
             a fixed --policy never swaps: drop --swap-dir or use --policy auto"
        );
    }
    if args.spec_args.mode != remat_engine::spec::compile::Mode::Full {
        anyhow::bail!(
            "--mode {} trains a spec-driven block: it needs --block (or --spec); \
             the built-in GPT always trains every weight",
            args.spec_args.mode.name()
        );
    }
    if !args.compare {
        return Ok(());
    }
    if args.files.dump_grads.is_some() {
        anyhow::bail!(
            "--dump-grads cannot be combined with --compare: --compare runs every policy and \
             writes no file (drop --compare to dump the first step's gradients)"
        );
    }
    let wanted = args.checkpointing()?;
    let default = Checkpointing::Graph(remat_engine::Policy::StoreAll);
    if wanted != default && Checkpointing::all().contains(&wanted) {
        anyhow::bail!(
            "--policy {wanted} has no effect with --compare, which already runs every built-in \
             policy ({}); drop --policy, or give one outside that list (e.g. every:2) to add \
             it as a row",
            Checkpointing::all()
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let task = args.task()?;
    if let Some(models) = args.models {
        return multi::run(&args, &task, models);
    }
    crate::usage::ensure(
        args.fuse_width.is_none(),
        "--fuse-width needs --models K: it caps how many of K models trained together are \
         fused into one unit (drop --fuse-width, or give --models)",
    )?;
    crate::usage::ensure(
        !args.no_fuse,
        "--no-fuse needs --models K: it runs the ops of K models trained together one \
         after another instead of fused (drop --no-fuse, or give --models)",
    )?;
    for single in [
        args.lr.check_single("--lr"),
        args.seed.check_single("--seed"),
        args.dropout.check_single("--dropout"),
        args.d_model.check_single("--d-model"),
    ] {
        single.map_err(crate::usage::of)?;
    }
    // Before --policy auto: the spec path refuses the flags it does not use.
    if args.spec_args.block.is_some() || args.spec_args.spec.is_some() {
        return spec::run(&args, &task);
    }
    // Before any mode prints its header: a model the flags cannot make is told first.
    args.check_model_flags(task.vocab())?;
    if let PolicyChoice::Auto(strategy) = &args.policy {
        auto::check_flags(&args).map_err(crate::usage::of)?;
        if let Some(name) = strategy {
            remat_planner::registry::lookup(name)
                .map_err(|e| crate::usage!("--policy auto:{name}: {e}"))?;
        }
        return auto::run(&args, &task, strategy.clone());
    }
    if let Some(stages) = args.pipeline.stages {
        let batch = |step| task.batch(args.seed.one(), step, args.batch);
        let source = pipeline::TaskSource {
            vocab: task.vocab(),
            description: task.describe(),
            batch: &batch,
        };
        return pipeline::run(&args, stages, &source);
    }
    check_gpt_flags(&args).map_err(crate::usage::of)?;
    if args.compare {
        compare::run(&args, &task)
    } else {
        session::run(&args, &task)
    }
}
