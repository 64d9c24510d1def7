//! `remat train --block qwen3|qwen3-moe|mamba [--spec FILE] [--mode full|lora]`: trains a
//! Qwen3-style or Mamba model whose blocks run through a compiled recompute spec, on the same task as
//! `remat train` (the embedded reversal task or `--data`). `--spec FILE` alone names its
//! block. Every buffer (parameters, optimizer state, gradients, activations, scratch) is
//! charged to one memory pool, so `--memory-budget` applies and the reported peak is
//! measured; flags of the GPT path that would do nothing here are refused.
//!
//! The flow (block resolution, plans, the mix for `--policy auto`, the model, AdamW, the
//! steps) is the engine's [`remat_engine::session::spec_train`]; this file holds the flags
//! it refuses and prints what the run reports.

use indicatif::{ProgressBar, ProgressStyle};
use remat_engine::session::spec_train::{self, Progress, SpecTrainSetup};
use remat_engine::session::task::Task;
use remat_report::{Layout, print_table};
use remat_units::human_bytes;

use super::flags::{Args, PolicyChoice, parse_policy};
use crate::specs::{print_mix, print_tuned};

/// `remat train` flags that the spec-driven path does not use: refused rather than ignored.
/// The spec decides what each layer keeps, recomputes or offloads, so a checkpointing
/// policy or pipeline stages would silently do nothing.
fn reject_unused_flags(args: &Args) -> anyhow::Result<()> {
    let flag = if let PolicyChoice::Auto(strategy) = &args.policy {
        match (strategy, args.memory_budget) {
            (Some(_), _) => Some("--policy auto:STRATEGY"),
            (None, None) => {
                return Err(crate::usage!(
                    "--policy auto with --block/--spec needs --memory-budget: the mix of keep, recompute and offload is chosen to fit it"
                ));
            }
            (None, Some(_)) => None,
        }
    } else if args.policy.fixed()? != parse_policy("store-all").map_err(anyhow::Error::msg)? {
        Some("--policy")
    } else if args.pipeline.stages.is_some() {
        Some("--stages")
    } else if args.compare {
        Some("--compare")
    } else if args.files.swap_dir.is_some() {
        Some("--swap-dir")
    } else {
        None
    };
    match flag {
        Some(flag) => anyhow::bail!(
            "{flag} does not apply with --block/--spec: the spec decides what each layer saves, recomputes or offloads (edit the spec, or see `remat spec inspect`), or --policy auto with --memory-budget chooses a mix per layer and slot"
        ),
        None => Ok(()),
    }
}

/// Runs spec-driven training with `remat train`'s common flags.
pub fn run(args: &Args, task: &Task) -> anyhow::Result<()> {
    reject_unused_flags(args)?;
    let sa = &args.spec_args;
    let setup = SpecTrainSetup {
        spec: sa.spec.as_deref(),
        block: sa.block.as_deref(),
        block_config: sa.block_config.as_deref(),
        block_set: &sa.block_set,
        mode: sa.mode,
        lora_rank: sa.lora_rank,
        lora_alpha: sa.lora_alpha,
        lora_dropout: sa.lora_dropout,
        seed: args.seed.one(),
        batch: args.batch,
        lr: args.lr.one() as f32,
        steps: args.steps,
        threads: args.threads(),
        memory_budget: args.memory_budget,
        auto_budget: match &args.policy {
            PolicyChoice::Auto(None) => args.memory_budget,
            _ => None,
        },
        init: args.files.init.as_deref(),
        dump_grads: args.files.dump_grads.as_deref(),
    };
    let log_every = args.log_every.unwrap_or((args.steps / 15).max(1));
    let mut bar: Option<ProgressBar> = None;
    let mut print = |event: Progress<'_>| match event {
        Progress::Loaded(path) => println!("loaded parameters from {}", path.display()),
        Progress::Profiling => println!("profiling the model for --policy auto ..."),
        Progress::Mixed {
            model,
            profile,
            tuned,
            base,
        } => {
            print_tuned(tuned, base);
            print_mix(model, profile, tuned.mix(), base);
        }
        Progress::Started(started) => {
            println!(
                "{} block, spec {}, {} mode: {} layers, hidden {}, {} trainable parameters; {}{}",
                started.block,
                started.spec_source,
                started.mode.name(),
                started.layers,
                started.hidden,
                started.trainable,
                task.describe(),
                args.memory_budget.map_or(String::new(), |b| format!(
                    "; memory budget {}",
                    human_bytes(b)
                ))
            );
            let b = ProgressBar::new(args.steps);
            b.set_style(
                ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar = Some(b);
        }
        Progress::DumpedGrads(path) => {
            let say = || {
                println!(
                    "wrote the first step's gradients and its batch and loss to {}",
                    path.display()
                )
            };
            match &bar {
                Some(b) => b.suspend(say),
                None => say(),
            }
        }
        Progress::Step { step, loss } => {
            let Some(b) = &bar else { return };
            b.set_message(format!("loss {loss:.4}"));
            b.inc(1);
            if step % log_every == 0 || step + 1 == args.steps {
                // Through `suspend`: `bar.println` prints nothing when stderr is not a
                // terminal (indicatif hides the bar), so piped runs lost every loss line.
                b.suspend(|| println!("step {step:>5}  loss {loss:.4}"));
            }
        }
    };
    let summary = spec_train::run(&setup, task, &mut print)?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let tokens = (args.steps as usize * args.batch * task.seq()) as f64;
    let elapsed = summary.seconds;
    print_table(
        Layout::Indented,
        &[
            "first loss",
            "last loss",
            "pool peak",
            "saved slots (all layers)",
            "shared recompute buffers",
            "host store peak",
            "step time",
            "tokens/s",
        ],
        &[vec![
            format!("{:.4}", summary.first_loss.unwrap_or(0.0)),
            format!("{:.4}", summary.last_loss),
            human_bytes(summary.pool_peak),
            human_bytes(summary.saved_peak),
            human_bytes(summary.shared_peak),
            human_bytes(summary.host_peak),
            format!("{:.1} ms", 1e3 * elapsed / args.steps.max(1) as f64),
            format!("{:.0}", tokens / elapsed),
        ]],
    );
    println!(
        "pool peak is measured: parameters, optimizer state, gradients, every activation and backward scratch buffer of the step"
    );
    Ok(())
}
