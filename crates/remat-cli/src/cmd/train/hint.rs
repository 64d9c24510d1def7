//! What to suggest when training runs out of its memory budget: each policy's peak,
//! measured by one step on a pool bounded by [`probe_cap`] (never an unbounded one: a
//! model that cannot fit must not take the machine down while we measure it) (the accounting is exact, so the same step
//! under the same policy peaks at the same byte count).

use remat_engine::models::gpt::Checkpointing;
use remat_engine::session::task::Task;
use remat_engine::{EngineError, MemoryPool};
use remat_units::human_bytes;

use super::flags::{Args, PolicyChoice};

/// The most a probe may allocate: half of the memory the system reports available (the
/// failed run's memory is already freed), or 1 GiB when that cannot be read. A probe
/// beyond it stops with the pool's out-of-memory error instead of exhausting the machine.
pub fn probe_cap() -> u64 {
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        });
    available.map_or(1 << 30, |kib| kib.saturating_mul(1024) / 2)
}

/// Peak bytes of one training step (with optimizer state) under `ckpt`, measured on a
/// pool bounded by `cap`; `None` when the step needs more than `cap`.
pub fn measure_peak(
    args: &Args,
    task: &Task,
    ckpt: Checkpointing,
    cap: u64,
) -> anyhow::Result<Option<u64>> {
    let pool = MemoryPool::with_budget(cap);
    let mut files = args.files.clone();
    files.dump_grads = None;
    let probe = Args {
        policy: PolicyChoice::Fixed(ckpt),
        steps: 1,
        files,
        log_every: Some(u64::MAX),
        ..args.clone()
    };
    match super::fixed::train(&probe, task, &pool, true) {
        Ok(_) => Ok(Some(pool.stats().peak)),
        Err(err) => match err.downcast_ref::<EngineError>() {
            Some(EngineError::OutOfMemory { .. }) => Ok(None),
            _ => Err(err),
        },
    }
}

/// A sentence naming a policy that fits `budget`, or the budget the requested one needs;
/// when none fits, also the smallest peak any built-in policy reaches, and under which.
pub fn for_budget(args: &Args, task: &Task, budget: u64) -> anyhow::Result<String> {
    let cap = probe_cap();
    let wanted = args.checkpointing()?;
    let need = measure_peak(args, task, wanted, cap)?;
    let mut peaks = Vec::new();
    for ckpt in Checkpointing::all() {
        if let Some(peak) = measure_peak(args, task, ckpt, cap)? {
            peaks.push((ckpt, peak));
        }
    }
    // Prefer the fitting policy that keeps the most (recomputes the least).
    let best_fit = peaks
        .iter()
        .filter(|&&(_, peak)| peak <= budget)
        .max_by_key(|&&(_, peak)| peak);
    let smallest = peaks.iter().min_by_key(|&&(_, peak)| peak);
    let raise = match need {
        Some(need) => format!(
            "--policy {wanted} needs --memory-budget {} ({need} bytes)",
            human_bytes(need)
        ),
        None => format!(
            "--policy {wanted} needs more than {} (half the memory available here, the most \
             the hint measures with)",
            human_bytes(cap)
        ),
    };
    Ok(match (best_fit, smallest) {
        (Some((ckpt, peak)), _) => format!(
            "--policy {ckpt} fits (peak {}); or {raise}",
            human_bytes(*peak)
        ),
        (None, Some((ckpt, peak))) => format!(
            "no built-in policy fits {}: the smallest peak is {} ({peak} bytes), under --policy {ckpt}; {raise}",
            human_bytes(budget),
            human_bytes(*peak)
        ),
        (None, None) => format!("no built-in policy fits {}; {raise}", human_bytes(budget)),
    })
}
