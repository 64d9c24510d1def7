//! `remat bench spec`, mixed plans: for Qwen3, Qwen3-MoE, Mamba and a hybrid model, the
//! mix of keep / recompute / offload chosen per layer and slot at 0.8, 0.6 and 0.4 of
//! keep-all's measured step peak, against each uniform policy (everything kept, every
//! allowed slot recomputed, the shipped spec's policy): measured pool peak, whether it fits
//! the budget, step time and its ratio to keep-all.
//!
//! Timing as in the rest of `bench spec`: every plan of a model runs one step per round,
//! interleaved, after a warm-up round; the median over the rounds is reported.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use remat_engine::core::swap::HostStore;
use remat_engine::session::spec_mix::{TUNE_ROUNDS, mix_model, profile, runner};
use remat_engine::spec::mix::{self, MixModel};
use remat_engine::spec::models::hybrid::Hybrid;
use remat_engine::spec::models::mamba::Mamba;
use remat_engine::spec::models::qwen3::Qwen3;
use remat_engine::spec::models::{SpecGrads, StepEnv, StepStats};
use remat_engine::spec::run::meter::Meter;
use remat_engine::spec::shipped::ShippedBlock;
use remat_engine::spec::{LayerChoice, Mode, ModelConfig, Plan, compile};
use remat_report::{Layout, print_table};
use remat_units::human_bytes;

use crate::error::{Context, Result};

/// Budgets as fractions of keep-all's measured step peak.
pub const FRACTIONS: [f64; 3] = [0.8, 0.6, 0.4];

/// A benchmarked model: its layer types' plans run through one step function.
pub enum Model {
    Qwen3(Qwen3),
    Mamba(Mamba),
    Hybrid(Hybrid),
}

impl Model {
    fn rows(&self) -> usize {
        match self {
            Model::Qwen3(m) => m.dims.batch * m.dims.seq,
            Model::Mamba(m) => m.dims.batch * m.dims.seq,
            Model::Hybrid(m) => {
                let n = |k: &str| m.config.usize_of(k, "hybrid").unwrap_or(0);
                n("batch") * n("seq_len")
            }
        }
    }

    fn step(&self, plans: &[Plan], env: StepEnv) -> Result<(SpecGrads, StepStats)> {
        let rows = self.rows();
        let t: Vec<u32> = (0..rows).map(|i| (i * 31 % 256) as u32).collect();
        let y: Vec<u32> = (0..rows).map(|i| (i * 17 % 256) as u32).collect();
        Ok(match self {
            Model::Qwen3(m) => m.step(&plans[0], &t, &y, env)?,
            Model::Mamba(m) => m.step(&plans[0], &t, &y, env)?,
            Model::Hybrid(m) => m.step(plans, &t, &y, env)?,
        })
    }

    /// Shipped plans (one per block type) for `mode`, and each layer's type.
    fn shipped(&self, mode: Mode) -> Result<(Vec<Plan>, Vec<usize>)> {
        let one = |name: &str, cfg: &ModelConfig, layers: usize| -> Result<_> {
            let spec = ShippedBlock::by_name(name)
                .context("no shipped spec")?
                .spec()?;
            Ok((vec![compile(&spec, cfg, mode)?], vec![0; layers]))
        };
        match self {
            Model::Qwen3(m) => one(m.kind.spec_name(), &m.config, m.dims.layers),
            Model::Mamba(m) => one("mamba", &m.config, m.dims.layers),
            Model::Hybrid(m) => {
                let plans = m
                    .blocks
                    .iter()
                    .map(|b| {
                        let spec = ShippedBlock::by_name(&b.name)
                            .context("no shipped spec")?
                            .spec()?;
                        Ok(compile(&spec, &b.config, mode)?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok((plans, m.layer_block.clone()))
            }
        }
    }
}

/// One plan set of a model with its measurements.
struct Case {
    policy: String,
    /// The budget fraction a mix was chosen for.
    fraction: Option<f64>,
    plans: Vec<Plan>,
    predicted: Option<u64>,
    peak: u64,
    times: Vec<f64>,
}

/// The upper median step time (NaN without rounds).
fn median(times: &[f64]) -> f64 {
    remat_units::upper_median(times).unwrap_or(f64::NAN)
}

fn measure(model: &Model, case: &mut Case, timed: bool) -> Result<()> {
    let (host, meter) = (HostStore::in_memory(), Meter::unbounded());
    let env = StepEnv {
        host: &host,
        meter: &meter,
        step: 0,
    };
    let start = Instant::now();
    let (grads, stats) = model.step(&case.plans, env)?;
    let seconds = start.elapsed().as_secs_f64();
    drop(grads);
    if timed {
        case.times.push(seconds);
    }
    case.peak = case.peak.max(stats.activations.peak);
    Ok(())
}

/// The uniform choices: every layer keeping everything, or rebuilding every unit.
fn uniform(mix: &MixModel, rebuild_all: bool) -> Result<Vec<Plan>> {
    let (classes, layer_class) = mix.classes()?;
    let choices: Vec<LayerChoice> = layer_class
        .iter()
        .map(|&c| {
            let class = &classes[c];
            let mask = if rebuild_all { class.subsets() - 1 } else { 0 };
            class.choice(&mix.blocks[class.block].resolved, mask, &[])
        })
        .collect();
    Ok(mix.plans(&choices)?)
}

/// Benchmarks one model in `mode`; the mix is chosen as `remat train --policy auto` does
/// (the run-off of `spec_mix::choose`) (a LoRA model carries its adapters): returns its table
/// rows.
pub fn bench_model(
    name: &str,
    model: &Model,
    mode: Mode,
    rounds: usize,
) -> Result<Vec<Vec<String>>> {
    let (shipped, layer_block) = model.shipped(mode)?;
    let mix_model = mix_model(&shipped, layer_block, mode)?;
    let step = |plans: &[Plan], env: StepEnv| model.step(plans, env);
    let profile = profile(&mix_model, 3, &step)?;
    let mut cases = vec![
        Case::new("all kept", uniform(&mix_model, false)?),
        Case::new("all recomputed", uniform(&mix_model, true)?),
        Case::new("shipped spec", shipped),
    ];
    measure(model, &mut cases[0], false)?;
    let keep_peak = cases[0].peak;
    let floor = mix::floor(&profile);
    for fraction in FRACTIONS {
        let budget = (keep_peak as f64 * fraction) as u64;
        let mut run = runner(&step);
        let tuned = mix::tune(&mix_model, &profile, budget, TUNE_ROUNDS, &mut run);
        match tuned.map(|t| t.mix().clone()) {
            Ok(chosen) => {
                let choices: Vec<_> = chosen.layers.iter().map(|l| l.choice.clone()).collect();
                let mut case = Case::new("mix", mix_model.plans(&choices)?);
                case.fraction = Some(fraction);
                case.predicted = Some(chosen.peak);
                cases.push(case);
            }
            Err(mix::MixError::BelowFloor { .. }) => {
                let mut case = Case::new("mix: below the floor", Vec::new());
                case.fraction = Some(fraction);
                cases.push(case);
            }
            Err(e) => return Err(e.into()),
        }
    }
    let bar = ProgressBar::new(((rounds + 1) * cases.len()) as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(name.to_string());
    for round in 0..=rounds {
        for case in cases.iter_mut().filter(|c| !c.plans.is_empty()) {
            measure(model, case, round > 0)?;
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    Ok(rows(name, mode, &cases, keep_peak, floor))
}

impl Case {
    fn new(policy: &str, plans: Vec<Plan>) -> Self {
        Self {
            policy: policy.into(),
            fraction: None,
            plans,
            predicted: None,
            peak: 0,
            times: Vec::new(),
        }
    }
}

fn rows(name: &str, mode: Mode, cases: &[Case], keep_peak: u64, floor: u64) -> Vec<Vec<String>> {
    let base = median(&cases[0].times);
    let mut out = Vec::new();
    for fraction in FRACTIONS {
        let budget = (keep_peak as f64 * fraction) as u64;
        let uniform = cases.iter().filter(|c| c.fraction.is_none());
        let mix = cases.iter().filter(|c| c.fraction == Some(fraction));
        let fastest_fit = cases
            .iter()
            .filter(|c| c.fraction.is_none() && c.peak <= budget)
            .map(|c| median(&c.times))
            .min_by(f64::total_cmp);
        for c in uniform.chain(mix) {
            let t = median(&c.times);
            let fits = !c.plans.is_empty() && c.peak <= budget;
            let verdict = match (c.fraction, c.plans.is_empty(), fastest_fit) {
                (None, _, _) => String::new(),
                (Some(_), true, _) => format!("floor {}", human_bytes(floor)),
                (Some(_), false, Some(f)) => format!("{:.3} x fastest fitting uniform", t / f),
                (Some(_), false, None) => "runs where no uniform policy fits".into(),
            };
            out.push(vec![
                name.to_string(),
                match mode {
                    Mode::Full => "full",
                    Mode::Lora => "LoRA",
                }
                .into(),
                format!("{fraction:.1} ({})", human_bytes(budget)),
                c.policy.clone(),
                if c.plans.is_empty() {
                    "-".into()
                } else {
                    human_bytes(c.peak)
                },
                c.predicted.map_or("-".into(), human_bytes),
                if fits { "yes" } else { "no" }.into(),
                if c.plans.is_empty() {
                    "-".into()
                } else {
                    format!("{:.1} ms", 1e3 * t)
                },
                if c.plans.is_empty() {
                    "-".into()
                } else {
                    format!("{:.3}", t / base)
                },
                verdict,
            ]);
        }
    }
    out
}

/// The hybrid benchmark model: Mamba and Qwen3 layers alternating.
pub fn hybrid_config(layers: i64, hidden: i64, seq: i64, batch: i64) -> Result<ModelConfig> {
    let types: Vec<&str> = (0..layers)
        .map(|l| if l % 2 == 0 { "mamba" } else { "qwen3" })
        .collect();
    let text = format!(
        "layer_types = \"{}\"\nhidden_size = {hidden}\nvocab_size = 256\nbatch = {batch}\nseq_len = {seq}\n\n[mamba]\nintermediate_size = {}\nstate_size = 16\nconv_kernel = 4\ntime_step_rank = {}\nscan_chunk = 16\n\n[qwen3]\nnum_attention_heads = 8\nnum_key_value_heads = 4\nhead_dim = {}\nintermediate_size = {}\nrope_theta = 1000000.0\n",
        types.join(" "),
        2 * hidden,
        (hidden / 16).max(1),
        hidden / 8,
        3 * hidden
    );
    Ok(ModelConfig::parse(&text, "bench hybrid")?)
}

pub fn print(rows: &[Vec<String>]) {
    print_table(
        Layout::Indented,
        &[
            "model",
            "mode",
            "budget (x keep-all)",
            "policy",
            "pool peak",
            "predicted",
            "fits",
            "step time",
            "x keep-all",
            "mix vs uniform",
        ],
        rows,
    );
    println!(
        "full fine-tuning and LoRA (adapters on every target, the base frozen); budgets are fractions of keep-all's measured step peak (activations, scratch, gradients); \"all recomputed\" rebuilds every slot whose declared policy allows it; the mix is chosen from a profile (3 timed runs) at the least predicted time whose predicted peak fits"
    );
}
