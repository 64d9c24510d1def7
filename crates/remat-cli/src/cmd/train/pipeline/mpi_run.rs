//! One rank of `mpirun -n S*R remat train --stages S`: stage `rank % S` of pipeline replica
//! `rank / S`, with its own pool, budget and checkpoint manager. Each step the ranks start
//! together (a barrier), run their stage over the MPI transport, all-reduce the gradients
//! over the replicas and send rank 0 what it prints: the losses and the per-stage table.
//!
//! A rank that fails prints why (the error names the stage and micro-batch) and aborts the
//! whole run; a rank ended by the launcher says what it was doing (see
//! `remat_engine::pipeline::mpi::activity`).

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use anyhow::Context;
use remat_engine::models::gpt::hf;
use remat_engine::pipeline::driver::{OneStage, OneStageReport, replica_step_seed};
use remat_engine::pipeline::graph_stage::Boundary;
use remat_engine::pipeline::mpi::{Layout, MpiWorld, Traffic, activity};
use remat_engine::pipeline::partition::balanced_ranges;
use remat_engine::pipeline::staged_gpt::StagedGpt;
use remat_engine::pipeline::wire::{NamedTensors, Wire, WireError};
use remat_engine::pipeline::{HostTensor, Step};
use remat_engine::{Category, MemoryPool, Tensor};

use super::super::flags::Args;
use super::launch::Launch;
use super::shared::{
    RunPlan, TaskSource, build_model, check_replicas, dump_grads, mean, replica_micro_batches,
    step_seed,
};
use super::summary::{StageStep, Totals};

/// Runs this rank; on failure every rank of the run is ended.
pub fn run(
    args: &Args,
    stages: usize,
    task: &TaskSource<'_>,
    launch: Launch,
) -> anyhow::Result<()> {
    let world = MpiWorld::init(stages)
        .with_context(|| format!("rank {} of {}", launch.rank, launch.size))?;
    let layout = world.layout();
    activity::report_when_ended(&format!(
        "remat: rank {} (stage {}, replica {}) was ended by the launcher: ",
        layout.rank, layout.stage, layout.replica
    ));
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| train(&world, args, stages, task)));
    let Some((error, code)) = failure_of(outcome) else {
        return Ok(());
    };
    eprintln!(
        "remat: rank {} (stage {}, replica {}) failed: {error}\nremat: ending every rank of the run",
        layout.rank, layout.stage, layout.replica
    );
    world.abort(code)
}

/// What a rank's training ended with, when it failed: the message every rank's log gets
/// (an error with its causes; a panic with the stage and micro-batch the rank was at) and
/// the exit code the run is aborted with (1, or 101 as for an unwound panic).
fn failure_of(outcome: std::thread::Result<anyhow::Result<()>>) -> Option<(String, i32)> {
    match outcome {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some((format!("{e:#}"), 1)),
        Err(panic) => Some((panic_text(&*panic), 101)),
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into());
    let line = activity::describe(activity::get());
    format!(
        "panicked at {}: {message}",
        String::from_utf8_lossy(line.as_bytes())
    )
}

fn train(
    world: &MpiWorld,
    args: &Args,
    stages: usize,
    task: &TaskSource<'_>,
) -> anyhow::Result<()> {
    let layout = world.layout();
    let root = layout.rank == 0;
    if let Some(r) = args.pipeline.replicas {
        anyhow::ensure!(
            r as usize == layout.replicas,
            "--replicas {r}, but mpirun started {} ranks for {stages} stages: {} replica(s)",
            layout.world,
            layout.replicas
        );
    }
    check_replicas(args, layout.replicas)?;
    let plan = RunPlan::new(args, stages);
    let model = build_model(args, args.model_config(task.vocab), root)?;
    let staged = StagedGpt(&model);
    let mut stage = OneStage::new(&staged, layout.stage, stages, plan.resources)?;
    let transport = world.transport::<Boundary>();
    if root {
        println!(
            "{}",
            plan.describe(args, stages, layout.replicas, "MPI ranks")
        );
        println!("task: {}", task.description);
    }
    let mut totals = Totals::new(stages);
    let mut traffic = Traffic::default();
    let started = Instant::now();
    let mut seq = 0;
    let watch = |step: Step| {
        activity::set(activity::Activity::Computing {
            stage: layout.stage,
            step,
        })
    };
    for step in 0..args.steps {
        let batch = (task.batch)(step);
        seq = batch.seq;
        let micro = replica_micro_batches(
            &batch,
            layout.replicas,
            layout.replica,
            args.pipeline.micro_batches,
        )?;
        let seed = replica_step_seed(step_seed(args, step), layout.replica);
        world.barrier();
        transport.reset_traffic();
        let report = stage
            .step(micro, seed, plan.config, &transport, &watch)
            .with_context(|| format!("training step {step}"))?;
        transport.flush();
        world.all_reduce_grads(stage.stage().grads())?;
        let stats = RankStats::new(&report, transport.traffic());
        let gathered = world.gather(&stats, "step report")?;
        let loss = gathered.map(|all| absorb(&mut totals, &mut traffic, &layout, &all));
        if let Some(path) = args.files.dump_grads.as_ref().filter(|_| step == 0) {
            let mine = match layout.replica {
                0 => host_grads(&stage.grads())?,
                _ => NamedTensors(Vec::new()),
            };
            if let Some(all) = world.gather(&mine, "gradients")? {
                let grads = stage_order_grads(all, &layout)?;
                let record = hf::StepRecord {
                    batch: &batch,
                    loss: loss.unwrap_or(f64::NAN),
                    config: &model.config,
                };
                dump_grads(&grads, &record, path)?;
            }
        }
        stage.optimizer_step(plan.adam)?;
        if let Some(loss) = loss.filter(|_| step % plan.log_every == 0 || step + 1 == args.steps) {
            println!("step {step:>5}  loss {loss:.4}");
        }
    }
    if root {
        let layers = balanced_ranges(args.layers(), stages)?;
        let micro = args.pipeline.micro_batches;
        totals.print(
            &layers,
            micro,
            layout.replicas,
            args.steps,
            started.elapsed(),
        );
        print_traffic(args, &layout, &traffic, seq);
    }
    Ok(())
}

/// Adds every rank's report of a step to the totals; returns the step's mean loss.
fn absorb(totals: &mut Totals, traffic: &mut Traffic, layout: &Layout, all: &[RankStats]) -> f64 {
    let mut wall = Duration::ZERO;
    let mut losses = Vec::new();
    for (rank, stats) in all.iter().enumerate() {
        totals.add_stage(rank % layout.stages, &stats.stage);
        wall = wall.max(stats.wall);
        traffic.activation_bytes += stats.traffic.activation_bytes;
        traffic.gradient_bytes += stats.traffic.gradient_bytes;
        traffic.wire_bytes += stats.traffic.wire_bytes;
        traffic.messages += stats.traffic.messages;
        // Ranks in order: replica by replica, so the losses are in global micro-batch order.
        losses.extend(&stats.losses);
    }
    totals.add_wall(wall, layout.world);
    mean(&losses)
}

/// Bytes sent per step against what the schedule moves: every micro-batch's activation
/// across each of the S-1 boundaries of each replica, and its gradient back.
fn print_traffic(args: &Args, layout: &Layout, traffic: &Traffic, seq: usize) {
    let steps = args.steps.max(1);
    let rows = args.batch / (layout.replicas * args.pipeline.micro_batches);
    let message = (rows * seq * args.d_model.one() * 4) as u64;
    let crossings = ((layout.stages - 1) * args.pipeline.micro_batches * layout.replicas) as u64;
    let expected = crossings * message;
    let (act, grad) = (
        traffic.activation_bytes / steps,
        traffic.gradient_bytes / steps,
    );
    let verdict = match act == expected && grad == expected {
        true => "as the schedule moves",
        false => "NOT what the schedule moves",
    };
    println!(
        "sent per step: {act} B of activations and {grad} B of gradients = {crossings} x {message} B each way, {verdict} ({} B on the wire with framing, {} messages)",
        traffic.wire_bytes / steps,
        traffic.messages / steps
    );
}

fn host_grads(grads: &[(String, Tensor)]) -> anyhow::Result<NamedTensors> {
    grads
        .iter()
        .map(|(name, g)| {
            let t = HostTensor::f32(g.shape().to_vec(), g.to_vec::<f32>()?)?;
            Ok((name.clone(), t))
        })
        .collect::<anyhow::Result<Vec<_>>>()
        .map(NamedTensors)
}

/// Replica 0's stages' gradients (ranks 0..S), in stage order, as tensors to write.
fn stage_order_grads(
    all: Vec<NamedTensors>,
    layout: &Layout,
) -> anyhow::Result<Vec<(String, Tensor)>> {
    let pool = MemoryPool::unbounded();
    let mut out = Vec::new();
    for named in all.into_iter().take(layout.stages) {
        for (name, t) in named.0 {
            let data = t
                .as_f32()
                .with_context(|| format!("the gradient of {name} is not f32"))?
                .to_vec();
            out.push((
                name.clone(),
                Tensor::from_vec(&pool, &name, &t.shape, data, Category::Gradients)?,
            ));
        }
    }
    Ok(out)
}

/// The fixed fields of a [`RankStats`] on the wire (the losses follow).
const FIELDS: usize = 9;

/// What one rank tells rank 0 after a step.
struct RankStats {
    stage: StageStep,
    wall: Duration,
    traffic: Traffic,
    /// Its micro-batches' losses (the last stage's; empty elsewhere).
    losses: Vec<f64>,
}

impl RankStats {
    fn new(report: &OneStageReport, traffic: Traffic) -> Self {
        Self {
            stage: StageStep::new(&report.run, &report.memory),
            wall: report.run.spans.last().map_or(Duration::ZERO, |s| s.end),
            traffic,
            losses: report.losses.iter().filter_map(|l| *l).collect(),
        }
    }

    fn fields(&self) -> [u64; FIELDS] {
        let s = &self.stage;
        let t = &self.traffic;
        [
            s.busy.as_nanos() as u64,
            s.recomputes as u64,
            s.peak,
            s.peak_activations,
            self.wall.as_nanos() as u64,
            t.activation_bytes,
            t.gradient_bytes,
            t.wire_bytes,
            t.messages,
        ]
    }
}

impl Wire for RankStats {
    fn encode(&self, out: &mut Vec<u8>) {
        for v in self.fields() {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for l in &self.losses {
            out.extend_from_slice(&l.to_bits().to_le_bytes());
        }
    }

    fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        const FIXED: usize = FIELDS * 8;
        if bytes.len() < FIXED || !bytes.len().is_multiple_of(8) {
            return Err(WireError::Invalid {
                what: "step report",
                detail: format!("{} bytes is not {FIXED} plus 8 per loss", bytes.len()),
            });
        }
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        let ns = Duration::from_nanos;
        Ok(Self {
            stage: StageStep {
                busy: ns(words[0]),
                recomputes: words[1] as usize,
                peak: words[2],
                peak_activations: words[3],
            },
            wall: ns(words[4]),
            traffic: Traffic {
                activation_bytes: words[5],
                gradient_bytes: words[6],
                wire_bytes: words[7],
                messages: words[8],
            },
            losses: words[FIELDS..].iter().map(|&b| f64::from_bits(b)).collect(),
        })
    }

    fn payload_bytes(&self) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_in_a_stage_becomes_a_failure_naming_what_the_rank_was_doing() {
        activity::set(activity::Activity::Computing {
            stage: 1,
            step: remat_engine::pipeline::Step::Forward(3),
        });
        let outcome = std::panic::catch_unwind(|| -> anyhow::Result<()> {
            panic!("index out of bounds in the stage's kernel")
        });
        let (message, code) = failure_of(outcome).expect("a panic is a failure");
        assert_eq!(code, 101);
        assert!(message.starts_with("panicked at "), "{message}");
        assert!(message.contains("index out of bounds"), "{message}");
        assert!(
            message.contains("stage 1") && message.contains("micro-batch 3"),
            "{message}"
        );
    }

    #[test]
    fn an_error_is_a_failure_with_its_causes_and_success_is_none() {
        assert!(failure_of(Ok(Ok(()))).is_none());
        let error = anyhow::anyhow!("out of memory: 4096 B over the budget").context("stage 0");
        let (message, code) = failure_of(Ok(Err(error))).expect("an error is a failure");
        assert_eq!(code, 1);
        assert_eq!(message, "stage 0: out of memory: 4096 B over the budget");
    }
}
