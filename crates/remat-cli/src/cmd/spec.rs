//! `remat spec`: inspect a declarative recompute spec's compiled per-layer plan.

use std::path::{Path, PathBuf};

use anyhow::Context;
use remat_engine::session::spec_mix::{StepFn, TUNE_ROUNDS, choose, mix_model, profile};
use remat_engine::spec::mix::solve;
use remat_engine::spec::{Disposition, LayerPlan, Mode, Operand, Plan, Prefetch, compile};
use remat_report::{Layout, print_table};
use remat_units::{Amount, Budget, human_bytes};

use crate::specs::{load_spec_and_config, print_mix, print_tuned};

/// What a fraction `--memory-budget` is taken of: the peak of the fastest allowed mix.
const REFERENCE: &str = "the predicted peak with no budget";

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Compile a spec against a model config and print the per-layer plan and bytes.
    Inspect(InspectArgs),
    /// Write a spec from a block's recorded forward: every op output a slot rebuilt by
    /// replaying its op (a starting point for a new architecture).
    Derive(DeriveArgs),
}

#[derive(clap::Args)]
pub struct DeriveArgs {
    /// The block to record: qwen3, qwen3-moe or mamba.
    #[arg(long, default_value = "qwen3")]
    block: String,
    /// Model config (default: the shipped example config of --block).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a config value: KEY=VALUE (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Output file: .toml or .json.
    #[arg(long, short)]
    out: PathBuf,
}

#[derive(clap::Args)]
pub struct InspectArgs {
    /// A spec file (.toml or .json), or a shipped block: qwen3, qwen3-moe.
    spec: String,
    /// Model config (.toml, or .json such as a Hugging Face config.json). Defaults to the
    /// shipped example config when SPEC names a shipped block.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a config value: KEY=VALUE (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Training mode the plan is for: full or lora.
    #[arg(long, default_value = "full")]
    mode: Mode,
    /// Print every layer's steps even when they repeat the previous layer's.
    #[arg(long)]
    all_layers: bool,
    /// Profile the model (random weights, the config's batch and sequence length) and
    /// print the mix of keep, recompute and offload per layer that fits this many pool
    /// bytes (parameters and optimizer state included, as `remat train --memory-budget`)
    /// at the least predicted step time: bytes (40MiB, 1.5GB) or a fraction in (0, 1] of
    /// the predicted peak with no budget (0.5).
    #[arg(long, value_parser = crate::units::budget_arg, allow_hyphen_values = true)]
    memory_budget: Option<Budget>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Inspect(a) => inspect(a),
        Command::Derive(a) => derive(a),
    }
}

fn derive(args: DeriveArgs) -> anyhow::Result<()> {
    use remat_engine::spec::models::mamba::Mamba;
    use remat_engine::spec::models::qwen3::{BlockKind, Qwen3};
    let kind = match args.block.as_str() {
        "qwen3" => Some(BlockKind::Dense),
        "qwen3-moe" => Some(BlockKind::Moe),
        "mamba" => None,
        other => {
            return Err(crate::usage!(
                "unknown --block `{other}` (expected exactly qwen3, qwen3-moe or mamba)"
            ));
        }
    };
    let (block, mut config) = load_spec_and_config(&args.block, args.config.as_deref(), &args.set)?;
    if config.get("vocab_size").is_none() {
        config = config.set("vocab_size", remat_engine::spec::Value::Int(64));
    }
    let plan = compile(&block, &config, Mode::Full)?;
    let derived = match kind {
        Some(kind) => Qwen3::new(kind, &plan.config, 0)?.derive_spec(&plan)?,
        None => Mamba::new(&plan.config, 0)?.derive_spec(&plan)?,
    };
    let text = if args.out.extension().is_some_and(|e| e == "json") {
        derived.to_json()?
    } else {
        derived.to_toml()?
    };
    write_atomically(&args.out, text.as_bytes())?;
    println!(
        "wrote {} ({} slots from {} recorded ops of block `{}`)",
        args.out.display(),
        derived.slots.len(),
        derived
            .slots
            .iter()
            .filter(|s| !s.recompute_from.is_empty())
            .count(),
        args.block
    );
    Ok(())
}

/// Temporary name, fsync, rename: a reader never sees a half-written spec (see
/// `crate::fsutil`).
fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    crate::fsutil::write_atomically("--out", path, bytes)
}

fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let (block, config) = load_spec_and_config(&args.spec, args.config.as_deref(), &args.set)?;
    let plan = compile(&block, &config, args.mode)
        .with_context(|| format!("compiling spec {}", args.spec))?;
    println!(
        "spec `{}` ({}), config {}, mode {}, {} layers",
        block.name,
        args.spec,
        config.source,
        args.mode.name(),
        plan.layers.len()
    );
    // Consecutive layers with identical plans print once, as a range.
    let mut shown = 0;
    while shown < plan.layers.len() {
        let first = &plan.layers[shown];
        print_layer(&plan, first);
        let mut next = shown + 1;
        while !args.all_layers && next < plan.layers.len() && same_plan(first, &plan.layers[next]) {
            next += 1;
        }
        if next > shown + 1 {
            println!(
                "\nlayers {}..={}: same plan as layer {}",
                shown + 1,
                next - 1,
                shown
            );
        }
        shown = next;
    }
    print_bytes(&plan);
    if let Some(budget) = &args.memory_budget {
        inspect_mix(&plan, budget)?;
    }
    Ok(())
}

/// `--memory-budget`: builds the spec's model with random weights, profiles it and prints
/// the chosen mix per layer. A fraction is of the predicted peak with no budget (the
/// fastest allowed mix, parameters and optimizer state included).
fn inspect_mix(plan: &Plan, budget: &Budget) -> anyhow::Result<()> {
    use remat_engine::spec::models::StepEnv;
    use remat_engine::spec::models::mamba::Mamba;
    use remat_engine::spec::models::qwen3::{BlockKind, Qwen3};
    use remat_engine::spec::run::lora::LoraConfig;
    let mut config = plan.config.clone();
    if config.get("vocab_size").is_none() {
        config = config.set("vocab_size", remat_engine::spec::Value::Int(64));
    }
    let lora = |targets: &[&str]| LoraConfig {
        rank: 8,
        alpha: 16.0,
        dropout: 0.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
        seed: 1,
    };
    let lora_mode = plan.mode == Mode::Lora;
    let name = &plan.spec().name;
    let plan = compile(plan.spec(), &config, plan.mode)?;
    let (step, params, trainable): (Box<StepFn<anyhow::Error>>, usize, usize) =
        match BlockKind::of_spec(name) {
            Some(kind) => {
                let mut m = Qwen3::new(kind, &plan.config, 0)?;
                if lora_mode {
                    m = m.with_lora(lora(&["q", "k", "v", "o", "gate", "up", "down"]), false)?;
                }
                m.check_plan(&plan)?;
                let counts = (
                    m.trainable(Mode::Full) + m.trainable(Mode::Lora),
                    m.trainable(plan.mode),
                );
                let rows = m.dims.batch * m.dims.seq;
                let step = move |plans: &[Plan], env: StepEnv| {
                    let (t, y) = tokens(rows, m.dims.vocab);
                    Ok(m.step(&plans[0], &t, &y, env)?)
                };
                (Box::new(step), counts.0, counts.1)
            }
            None => {
                let mut m = Mamba::new(&plan.config, 0).with_context(|| {
                    format!("spec `{name}` is not a qwen3, qwen3-moe or mamba block")
                })?;
                if lora_mode {
                    m = m.with_lora(lora(&["in", "x", "out"]), false)?;
                }
                m.check_plan(&plan)?;
                let counts = (
                    m.trainable(Mode::Full) + m.trainable(Mode::Lora),
                    m.trainable(plan.mode),
                );
                let rows = m.dims.batch * m.dims.seq;
                let step = move |plans: &[Plan], env: StepEnv| {
                    let (t, y) = tokens(rows, m.dims.vocab);
                    Ok(m.step(&plans[0], &t, &y, env)?)
                };
                (Box::new(step), counts.0, counts.1)
            }
        };
    let layers = plan.layers.len();
    let model = mix_model(std::slice::from_ref(&plan), vec![0; layers], plan.mode)?;
    println!(
        "
profiling the model (random weights) for --memory-budget ..."
    );
    let profile = profile(&model, 3, step.as_ref())?;
    let base = 4 * params as u64 + 8 * trainable as u64;
    let budget = match budget.amount() {
        Amount::Bytes(bytes) => bytes,
        Amount::Fraction { .. } => {
            let unbudgeted = base + solve(&model, &profile, u64::MAX)?.peak;
            let bytes = budget.of(unbudgeted, REFERENCE)?;
            println!(
                "--memory-budget {0}: {0} of {REFERENCE} ({1}) is {2} ({3} bytes)",
                budget.text(),
                human_bytes(unbudgeted),
                human_bytes(bytes),
                bytes
            );
            bytes
        }
    };
    let tuned = choose(&model, &profile, budget, base, TUNE_ROUNDS, step.as_ref())?;
    print_tuned(&tuned, base);
    println!("mix for --memory-budget {}:", human_bytes(budget));
    print_mix(&model, &profile, tuned.mix(), base);
    Ok(())
}

/// A deterministic batch of `rows` tokens and targets below `vocab`.
fn tokens(rows: usize, vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let v = vocab.max(1) as u32;
    let t = (0..rows as u32).map(|i| (i * 7 + 3) % v).collect();
    let y = (0..rows as u32).map(|i| (i * 5 + 1) % v).collect();
    (t, y)
}

fn same_plan(a: &LayerPlan, b: &LayerPlan) -> bool {
    a.steps == b.steps && a.slots == b.slots && a.prefetch == b.prefetch
}

fn operand_name(plan: &Plan, operand: &Operand) -> String {
    let spec = plan.spec();
    match *operand {
        Operand::Slot(s) => spec.slots[s].name.clone(),
        Operand::Input(i) => format!("@input:{}", spec.inputs[i].name),
        Operand::Param(p) => format!("@param:{}", spec.params[p].name),
        Operand::Global(g) => format!("@global:{}", spec.globals[g].name),
        Operand::Absent => "(absent)".into(),
    }
}

fn print_layer(plan: &Plan, layer: &LayerPlan) {
    let spec = plan.spec();
    println!("\nlayer {}", layer.layer);
    let prefetch: Vec<String> = layer
        .prefetch
        .iter()
        .map(|p| match *p {
            Prefetch::Input(i) => format!("@input:{}", spec.inputs[i].name),
            Prefetch::Slot(s) => spec.slots[s].name.clone(),
        })
        .collect();
    if !prefetch.is_empty() {
        println!("  prefetch from host: {}", prefetch.join(", "));
    }
    let rows: Vec<Vec<String>> = layer
        .steps
        .iter()
        .enumerate()
        .map(|(i, step)| {
            let inputs: Vec<String> = step.inputs.iter().map(|o| operand_name(plan, o)).collect();
            let outputs: Vec<String> = step
                .outputs
                .iter()
                .map(|o| o.map_or("-".into(), |s| spec.slots[s].name.clone()))
                .collect();
            vec![
                (i + 1).to_string(),
                step.op.clone(),
                inputs.join(", "),
                outputs.join(", "),
                step.policy.name().into(),
                step.lora_targets.join(","),
            ]
        })
        .collect();
    print_table(
        Layout::Indented,
        &["#", "op", "inputs", "outputs", "policy", "lora"],
        &rows,
    );
    let slot_rows: Vec<Vec<String>> = layer
        .slots
        .iter()
        .filter(|s| s.disposition != Disposition::Absent)
        .map(|s| {
            let shape: Vec<String> = s.shape.iter().map(|d| d.to_string()).collect();
            vec![
                s.name.clone(),
                format!("[{}]", shape.join(", ")),
                s.dtype.name().into(),
                s.disposition.name().into(),
                human_bytes(s.bytes),
                s.buffer
                    .map_or(String::new(), |b| spec.slots[b].name.clone()),
            ]
        })
        .collect();
    print_table(
        Layout::Indented,
        &["slot", "shape", "dtype", "disposition", "bytes", "buffer"],
        &slot_rows,
    );
}

fn print_bytes(plan: &Plan) {
    println!("\nactivation bytes per layer ({} mode)", plan.mode.name());
    let mut rows: Vec<Vec<String>> = plan
        .layers
        .iter()
        .map(|l| {
            vec![
                l.layer.to_string(),
                human_bytes(l.bytes.saved),
                human_bytes(l.bytes.recomputed),
                human_bytes(l.bytes.offloaded),
            ]
        })
        .collect();
    rows.push(vec![
        "total".into(),
        human_bytes(plan.saved_bytes()),
        human_bytes(plan.recomputed_bytes()),
        human_bytes(plan.offloaded_bytes()),
    ]);
    print_table(
        Layout::Indented,
        &["layer", "saved (device)", "recomputed", "offloaded (host)"],
        &rows,
    );
    let buffers: Vec<String> = plan
        .shared_buffers
        .iter()
        .map(|b| format!("{} {}", b.name, human_bytes(b.bytes)))
        .collect();
    println!(
        "recompute buffers shared by all layers: {} ({})",
        human_bytes(plan.shared_buffer_bytes()),
        if buffers.is_empty() {
            "none".into()
        } else {
            buffers.join(", ")
        }
    );
    println!(
        "device activation bytes between forward and backward: {} saved + {} shared = {}",
        human_bytes(plan.saved_bytes()),
        human_bytes(plan.shared_buffer_bytes()),
        human_bytes(plan.device_bytes())
    );
}
