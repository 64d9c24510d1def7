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

/// A sentence naming a policy that fits `budget`, or the budget the requested one needs;
/// when none fits, also the smallest peak any built-in policy reaches, and under which.
pub fn for_budget(args: &Args, task: &Task, budget: u64) -> anyhow::Result<String> {
    let wanted = args.checkpointing()?;
    let need = measure_peak(args, task, wanted)?;
    let mut peaks = Vec::new();
    for ckpt in Checkpointing::all() {
        peaks.push((ckpt, measure_peak(args, task, ckpt)?));
    }
    // Prefer the fitting policy that keeps the most (recomputes the least).
    let best_fit = peaks
        .iter()
        .filter(|&&(_, peak)| peak <= budget)
        .max_by_key(|&&(_, peak)| peak);
    let smallest = peaks.iter().min_by_key(|&&(_, peak)| peak);
    let raise = format!(
        "--policy {wanted} needs --memory-budget {} ({need} bytes)",
        format_bytes(need)
    );
    Ok(match (best_fit, smallest) {
        (Some((ckpt, peak)), _) => format!(
            "--policy {ckpt} fits (peak {}); or {raise}",
            format_bytes(*peak)
        ),
        (None, Some((ckpt, peak))) => format!(
            "no built-in policy fits {}: the smallest peak is {} ({peak} bytes), under --policy {ckpt}; {raise}",
            format_bytes(budget),
            format_bytes(*peak)
        ),
        (None, None) => format!("no built-in policy fits {}; {raise}", format_bytes(budget)),
    })
}
