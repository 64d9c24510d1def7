//! What to suggest when training runs out of its memory budget: each policy's peak,
//! measured by one step on an unbounded pool (the accounting is exact, so the same step
//! under the same policy peaks at the same byte count).

use remat_engine::MemoryPool;
use remat_engine::models::gpt::Checkpointing;

use super::Args;
use super::budget::format_bytes;
use super::task::Task;

/// Peak bytes of one training step (with optimizer state) under `ckpt`.
pub fn measure_peak(args: &Args, task: &Task, ckpt: Checkpointing) -> anyhow::Result<u64> {
    let pool = MemoryPool::unbounded();
    let mut files = args.files.clone();
    files.dump_grads = None;
    let probe = Args {
        policy: crate::cmd::train_auto::PolicyChoice::Fixed(ckpt),
        steps: 1,
        files,
        log_every: Some(u64::MAX),
        ..args.clone()
    };
    super::session::train(&probe, task, &pool, true)?;
    Ok(pool.stats().peak)
}

/// A sentence naming a policy that fits `budget`, or the budget the requested one needs.
pub fn for_budget(args: &Args, task: &Task, budget: u64) -> anyhow::Result<String> {
    let wanted = args.checkpointing()?;
    let need = measure_peak(args, task, wanted)?;
    let mut fits = Vec::new();
    for ckpt in Checkpointing::all() {
        let peak = measure_peak(args, task, ckpt)?;
        if peak <= budget {
            fits.push((ckpt, peak));
        }
    }
    // Prefer the fitting policy that keeps the most (recomputes the least).
    fits.sort_by_key(|&(_, peak)| std::cmp::Reverse(peak));
    let raise = format!(
        "--policy {wanted} needs --memory-budget {} ({need} bytes)",
        format_bytes(need)
    );
    Ok(match fits.first() {
        Some((ckpt, peak)) => format!(
            "--policy {ckpt} fits (peak {}); or {raise}",
            format_bytes(*peak)
        ),
        None => format!("no built-in policy fits {}; {raise}", format_bytes(budget)),
    })
}
