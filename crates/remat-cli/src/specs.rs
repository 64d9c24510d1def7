//! Spec-driven models as the commands read and print them (`remat spec inspect`, `remat
//! train --block/--spec`): a spec and its config loaded from a path or a shipped block's
//! name, and the mix of keep, recompute and offload chosen for a budget
//! ([`remat_engine::session::spec_mix`]) printed per layer.

use remat_engine::spec::mix::{self, Mix, MixModel, Profile, Tuned};
use remat_report::{Layout, print_table};
use remat_units::human_bytes;

/// Loads SPEC (a path or a shipped block name) and its config with overrides applied.
pub use remat_engine::session::spec_train::load_spec_and_config;

/// The chosen mix per layer: what is rebuilt and offloaded, the bytes kept, the time.
pub fn print_mix(model: &MixModel, profile: &Profile, mix: &Mix, base: u64) {
    let rows: Vec<Vec<String>> = mix
        .layers
        .iter()
        .enumerate()
        .map(|(l, layer)| {
            let block = &model.blocks[model.layer_block[l]].resolved.spec.name;
            let list = |v: &[String]| {
                if v.is_empty() {
                    "-".to_string()
                } else {
                    v.join(" ")
                }
            };
            vec![
                l.to_string(),
                block.clone(),
                list(&layer.recomputed),
                list(&layer.offloaded),
                human_bytes(layer.kept),
                human_bytes(layer.offloaded_bytes),
                format!("{:.2} ms", 1e3 * layer.seconds),
            ]
        })
        .collect();
    print_table(
        Layout::Indented,
        &[
            "layer",
            "block",
            "recomputed",
            "offloaded",
            "kept on device",
            "on host",
            "added time",
        ],
        &rows,
    );
    println!(
        "predicted: peak {} ({} step + {} parameters and optimizer state), step {:.1} ms ({:.1} ms with everything kept); floor {}",
        human_bytes(base + mix.peak),
        human_bytes(mix.peak),
        human_bytes(base),
        1e3 * mix.seconds,
        1e3 * profile.base_seconds,
        human_bytes(base + mix::floor(profile)),
    );
}

/// The run-off of [`choose`](remat_engine::session::spec_mix::choose): each candidate's budget rung, predicted peak and time, and
/// measured time; the chosen one marked. Prints nothing when only one candidate ran.
pub fn print_tuned(tuned: &Tuned, base: u64) {
    if tuned.tried.len() < 2 || tuned.tried.iter().all(|t| t.seconds.is_none()) {
        return;
    }
    let rows: Vec<Vec<String>> = tuned
        .tried
        .iter()
        .enumerate()
        .map(|(i, t)| {
            vec![
                human_bytes(base + t.budget),
                human_bytes(base + t.mix.peak),
                format!("{:.1} ms", 1e3 * t.mix.seconds),
                t.seconds
                    .map_or("-".into(), |s| format!("{:.1} ms", 1e3 * s)),
                if i == tuned.chosen { "chosen" } else { "" }.into(),
            ]
        })
        .collect();
    println!(
        "run-off between the exact mixes of a ladder of budgets (median of the timed rounds):"
    );
    print_table(
        Layout::Indented,
        &[
            "solved for",
            "predicted peak",
            "predicted step",
            "measured step",
            "",
        ],
        &rows,
    );
}
