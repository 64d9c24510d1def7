//! The per-stage totals of a pipelined run and the table `remat train --stages` ends with;
//! the threaded and the MPI run fill them alike.

use std::ops::Range;
use std::time::Duration;

use remat_engine::pipeline::driver::StepReport;
use remat_engine::{Category, PoolStats};
use remat_report::{Layout, render};
use remat_units::human_bytes;

/// What one stage did in one step (on one replica).
pub struct StageStep {
    pub busy: Duration,
    pub recomputes: usize,
    pub peak: u64,
    pub peak_activations: u64,
}

impl StageStep {
    pub fn new(run: &remat_engine::pipeline::StageReport, memory: &PoolStats) -> Self {
        Self {
            busy: run.busy,
            recomputes: run.checkpoint.recomputes,
            peak: memory.peak,
            peak_activations: memory.category(Category::Activations).peak,
        }
    }
}

/// Totals over the steps, per stage (summed over replicas, peaks the highest).
pub struct Totals {
    busy: Vec<Duration>,
    recomputes: Vec<usize>,
    /// Stage-steps counted (stages x replicas x steps): the capacity of the bubble.
    stage_walls: Duration,
    wall: Duration,
    peak: Vec<u64>,
    peak_activations: Vec<u64>,
}

impl Totals {
    pub fn new(stages: usize) -> Self {
        Self {
            busy: vec![Duration::ZERO; stages],
            recomputes: vec![0; stages],
            stage_walls: Duration::ZERO,
            wall: Duration::ZERO,
            peak: vec![0; stages],
            peak_activations: vec![0; stages],
        }
    }

    /// Adds a threaded step (every stage of one pipeline).
    pub fn add(&mut self, step: &StepReport) {
        for (s, (run, memory)) in step.run.stages.iter().zip(&step.memory).enumerate() {
            self.add_stage(s, &StageStep::new(run, memory));
        }
        self.add_wall(step.run.wall, step.run.stages.len());
    }

    pub fn add_stage(&mut self, stage: usize, step: &StageStep) {
        self.busy[stage] += step.busy;
        self.recomputes[stage] += step.recomputes;
        self.peak[stage] = self.peak[stage].max(step.peak);
        self.peak_activations[stage] = self.peak_activations[stage].max(step.peak_activations);
    }

    /// A step's wall time, over which `ranks` stages (of all replicas) were available.
    pub fn add_wall(&mut self, wall: Duration, ranks: usize) {
        self.wall += wall;
        self.stage_walls += wall * ranks as u32;
    }

    /// Idle share of all stages' time over every step.
    pub fn bubble(&self) -> f64 {
        let capacity = self.stage_walls.as_secs_f64();
        if capacity <= 0.0 {
            return 0.0;
        }
        let busy: f64 = self.busy.iter().map(Duration::as_secs_f64).sum();
        (1.0 - busy / capacity).max(0.0)
    }

    /// The per-stage table, the bubble line and the step time.
    pub fn print(
        &self,
        layers: &[Range<usize>],
        micro_batches: usize,
        replicas: usize,
        steps: u64,
        elapsed: Duration,
    ) {
        let header = [
            "stage",
            "blocks",
            "peak memory",
            "peak activations",
            "busy",
            "busy share",
            "recomputes",
        ];
        // Busy share of a stage: its busy time over the time its replicas had.
        let capacity = self.wall.as_secs_f64().max(f64::MIN_POSITIVE) * replicas as f64;
        let rows: Vec<Vec<String>> = layers
            .iter()
            .enumerate()
            .map(|(s, r)| {
                vec![
                    s.to_string(),
                    format!("{}..{}", r.start, r.end),
                    human_bytes(self.peak[s]),
                    human_bytes(self.peak_activations[s]),
                    format!("{:.3} s", self.busy[s].as_secs_f64()),
                    format!("{:.1}%", 100.0 * self.busy[s].as_secs_f64() / capacity),
                    self.recomputes[s].to_string(),
                ]
            })
            .collect();
        println!("\n{}", render(Layout::Aligned, &header, &rows));
        let ideal =
            remat_engine::pipeline::schedule::ideal_bubble_fraction(layers.len(), micro_batches);
        println!(
            "bubble fraction: measured {:.3}, ideal (P-1)/(M+P-1) = {ideal:.3}",
            self.bubble()
        );
        println!(
            "{steps} steps in {:.2} s ({:.3} s per step in the pipeline)",
            elapsed.as_secs_f64(),
            self.wall.as_secs_f64() / steps.max(1) as f64
        );
    }
}
