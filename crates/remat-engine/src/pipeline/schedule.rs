//! Pipeline schedules as pure step generators, and a dependency-driven simulator that checks
//! them (no deadlock) and predicts their bubble.
//!
//! Every stage runs its micro-batches' backward passes in ascending order under both
//! schedules, so that per-stage gradient accumulation adds micro-batch gradients in the same
//! order as a single-stage run of the same batch (floating-point addition is not associative).

use std::fmt;
use std::str::FromStr;

/// How micro-batches are ordered on each stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// All forward passes, then all backward passes: every micro-batch is in flight at once.
    GPipe,
    /// One forward, one backward (PipeDream-Flush): after a warm-up of `P - 1 - stage`
    /// forwards, each forward is followed by the oldest pending backward, so a stage holds at
    /// most `P - stage` micro-batches.
    OneFOneB,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        })
    }
}

impl FromStr for Schedule {
    type Err = ScheduleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" => Ok(Schedule::OneFOneB),
            _ => Err(ScheduleError::UnknownSchedule(s.to_string())),
        }
    }
}

/// One unit of a stage's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Forward(usize),
    Backward(usize),
}

impl Step {
    pub fn micro_batch(self) -> usize {
        match self {
            Step::Forward(m) | Step::Backward(m) => m,
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Forward(m) => write!(f, "F{m}"),
            Step::Backward(m) => write!(f, "B{m}"),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
    #[error("unknown schedule `{0}`: expected gpipe or 1f1b")]
    UnknownSchedule(String),
    #[error("a pipeline needs at least one stage")]
    NoStages,
    #[error("stage {stage} does not exist in a pipeline of {stages} stages")]
    StageOutOfRange { stage: usize, stages: usize },
    #[error("stage {stage}: step {step} names a micro-batch beyond the {micro_batches} scheduled")]
    MicroBatchOutOfRange {
        stage: usize,
        step: Step,
        micro_batches: usize,
    },
    #[error("schedule deadlocks: stage {stage} waits forever before step {step}")]
    Deadlock { stage: usize, step: Step },
}

/// The ordered steps of `stage` in a pipeline of `stages` stages over `micro_batches`.
pub fn stage_steps(
    schedule: Schedule,
    stages: usize,
    micro_batches: usize,
    stage: usize,
) -> Result<Vec<Step>, ScheduleError> {
    if stages == 0 {
        return Err(ScheduleError::NoStages);
    }
    if stage >= stages {
        return Err(ScheduleError::StageOutOfRange { stage, stages });
    }
    let forwards = (0..micro_batches).map(Step::Forward);
    let backwards = (0..micro_batches).map(Step::Backward);
    Ok(match schedule {
        Schedule::GPipe => forwards.chain(backwards).collect(),
        Schedule::OneFOneB => one_f_one_b(stages, micro_batches, stage),
    })
}

fn one_f_one_b(stages: usize, micro_batches: usize, stage: usize) -> Vec<Step> {
    let warmup = (stages - 1 - stage).min(micro_batches);
    let mut steps: Vec<Step> = (0..warmup).map(Step::Forward).collect();
    for m in 0..micro_batches - warmup {
        steps.push(Step::Forward(warmup + m));
        steps.push(Step::Backward(m));
    }
    steps.extend((micro_batches - warmup..micro_batches).map(Step::Backward));
    steps
}

/// Every stage's steps, stage 0 first.
pub fn all_stage_steps(
    schedule: Schedule,
    stages: usize,
    micro_batches: usize,
) -> Result<Vec<Vec<Step>>, ScheduleError> {
    (0..stages)
        .map(|s| stage_steps(schedule, stages, micro_batches, s))
        .collect()
}

/// The most micro-batches forwarded but not yet backwarded at any point of `steps`: how many
/// micro-batches' activations the stage must hold (or be able to recompute) at once.
pub fn max_in_flight(steps: &[Step]) -> usize {
    let mut live = 0usize;
    let mut peak = 0;
    for step in steps {
        match step {
            Step::Forward(_) => {
                live += 1;
                peak = peak.max(live);
            }
            Step::Backward(_) => live = live.saturating_sub(1),
        }
    }
    peak
}

/// The idle share of a synchronous pipeline with equal stages: (P - 1) / (M + P - 1).
pub fn ideal_bubble_fraction(stages: usize, micro_batches: usize) -> f64 {
    if stages == 0 || micro_batches == 0 {
        return 0.0;
    }
    (stages - 1) as f64 / (micro_batches + stages - 1) as f64
}

/// When each stage works, as the simulator predicts it.
#[derive(Clone, Debug, PartialEq)]
pub struct SimulatedTimeline {
    /// Time from the first step's start to the last step's end.
    pub makespan: u64,
    /// Busy time of each stage.
    pub busy: Vec<u64>,
    /// (start, end, step) of each stage's steps, in execution order.
    pub spans: Vec<Vec<(u64, u64, Step)>>,
}

impl SimulatedTimeline {
    /// Idle share of all stages' time: 1 - sum(busy) / (P * makespan).
    pub fn bubble_fraction(&self) -> f64 {
        let capacity = self.makespan as f64 * self.busy.len() as f64;
        if capacity == 0.0 {
            return 0.0;
        }
        1.0 - self.busy.iter().sum::<u64>() as f64 / capacity
    }
}

/// Runs the schedule on an idealised pipeline where every forward takes `forward_cost` and
/// every backward `backward_cost` time units, honouring the data dependencies: a forward needs
/// the previous stage's forward of that micro-batch, a backward the next stage's backward.
pub fn simulate(
    schedule: Schedule,
    stages: usize,
    micro_batches: usize,
    forward_cost: u64,
    backward_cost: u64,
) -> Result<SimulatedTimeline, ScheduleError> {
    let steps = all_stage_steps(schedule, stages, micro_batches)?;
    simulate_steps(&steps, micro_batches, forward_cost, backward_cost)
}

/// [`simulate`] for any per-stage step lists (one list per stage, stage 0 first), such as a
/// hand-written order to check for deadlock.
pub fn simulate_steps(
    steps: &[Vec<Step>],
    micro_batches: usize,
    forward_cost: u64,
    backward_cost: u64,
) -> Result<SimulatedTimeline, ScheduleError> {
    let stages = steps.len();
    if stages == 0 {
        return Err(ScheduleError::NoStages);
    }
    for (stage, list) in steps.iter().enumerate() {
        if let Some(&step) = list.iter().find(|s| s.micro_batch() >= micro_batches) {
            return Err(ScheduleError::MicroBatchOutOfRange {
                stage,
                step,
                micro_batches,
            });
        }
    }
    // Finish times of each (stage, micro-batch) forward and backward, once known.
    let mut fwd_done = vec![vec![None; micro_batches]; stages];
    let mut bwd_done = vec![vec![None; micro_batches]; stages];
    let mut next = vec![0usize; stages];
    let mut clock = vec![0u64; stages];
    let mut spans = vec![Vec::new(); stages];
    loop {
        let mut progressed = false;
        for s in 0..stages {
            while let Some(&step) = steps[s].get(next[s]) {
                let (dependency, cost) = match step {
                    Step::Forward(_) if s == 0 => (Some(0), forward_cost),
                    Step::Forward(m) => (fwd_done[s - 1][m], forward_cost),
                    Step::Backward(m) if s + 1 == stages => (fwd_done[s][m], backward_cost),
                    Step::Backward(m) => (bwd_done[s + 1][m], backward_cost),
                };
                let Some(ready) = dependency else { break };
                let start = clock[s].max(ready);
                let end = start + cost;
                match step {
                    Step::Forward(m) => fwd_done[s][m] = Some(end),
                    Step::Backward(m) => bwd_done[s][m] = Some(end),
                }
                spans[s].push((start, end, step));
                clock[s] = end;
                next[s] += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    if let Some(stage) = (0..stages).find(|&s| next[s] < steps[s].len()) {
        let step = steps[stage][next[stage]];
        return Err(ScheduleError::Deadlock { stage, step });
    }
    let busy = spans
        .iter()
        .map(|s| s.iter().map(|(a, b, _)| b - a).sum())
        .collect();
    Ok(SimulatedTimeline {
        makespan: clock.iter().copied().max().unwrap_or(0),
        busy,
        spans,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Step::{Backward as B, Forward as F};

    #[test]
    fn gpipe_runs_all_forwards_then_all_backwards() {
        for stage in 0..3 {
            let steps = stage_steps(Schedule::GPipe, 3, 3, stage).unwrap();
            assert_eq!(steps, vec![F(0), F(1), F(2), B(0), B(1), B(2)]);
        }
    }

    #[test]
    fn one_f_one_b_orders_per_stage() {
        let steps = all_stage_steps(Schedule::OneFOneB, 4, 6).unwrap();
        assert_eq!(
            steps[0],
            vec![
                F(0),
                F(1),
                F(2),
                F(3),
                B(0),
                F(4),
                B(1),
                F(5),
                B(2),
                B(3),
                B(4),
                B(5)
            ]
        );
        assert_eq!(
            steps[2],
            vec![
                F(0),
                F(1),
                B(0),
                F(2),
                B(1),
                F(3),
                B(2),
                F(4),
                B(3),
                F(5),
                B(4),
                B(5)
            ]
        );
        assert_eq!(
            steps[3],
            vec![
                F(0),
                B(0),
                F(1),
                B(1),
                F(2),
                B(2),
                F(3),
                B(3),
                F(4),
                B(4),
                F(5),
                B(5)
            ]
        );
    }

    #[test]
    fn one_f_one_b_with_fewer_micro_batches_than_stages() {
        let steps = stage_steps(Schedule::OneFOneB, 4, 2, 0).unwrap();
        assert_eq!(steps, vec![F(0), F(1), B(0), B(1)]);
    }

    /// Every micro-batch appears once forward, once backward, forward first; backwards ascend.
    fn assert_well_formed(steps: &[Step], micro_batches: usize) {
        let forwards: Vec<_> = steps
            .iter()
            .filter_map(|s| match s {
                F(m) => Some(*m),
                B(_) => None,
            })
            .collect();
        let backwards: Vec<_> = steps
            .iter()
            .filter_map(|s| match s {
                B(m) => Some(*m),
                F(_) => None,
            })
            .collect();
        let all: Vec<_> = (0..micro_batches).collect();
        assert_eq!(forwards, all);
        assert_eq!(backwards, all);
        for m in 0..micro_batches {
            let f = steps.iter().position(|s| *s == F(m)).unwrap();
            let b = steps.iter().position(|s| *s == B(m)).unwrap();
            assert!(f < b, "F{m} after B{m}");
        }
    }

    #[test]
    fn in_flight_micro_batches() {
        for stages in 1..=6 {
            for micro_batches in 0..=12 {
                for stage in 0..stages {
                    let gpipe = stage_steps(Schedule::GPipe, stages, micro_batches, stage).unwrap();
                    let ofob =
                        stage_steps(Schedule::OneFOneB, stages, micro_batches, stage).unwrap();
                    assert_well_formed(&gpipe, micro_batches);
                    assert_well_formed(&ofob, micro_batches);
                    assert_eq!(max_in_flight(&gpipe), micro_batches);
                    assert_eq!(max_in_flight(&ofob), (stages - stage).min(micro_batches));
                }
            }
        }
    }

    #[test]
    fn schedules_never_deadlock_and_match_the_ideal_bubble() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for (fc, bc) in [(1, 1), (1, 2), (3, 5)] {
                for stages in 1..=5 {
                    for micro_batches in 1..=10 {
                        let t = simulate(schedule, stages, micro_batches, fc, bc).unwrap();
                        let ideal = ideal_bubble_fraction(stages, micro_batches);
                        assert!(
                            (t.bubble_fraction() - ideal).abs() < 1e-12,
                            "{schedule} P={stages} M={micro_batches} f={fc} b={bc}: {} vs {ideal}",
                            t.bubble_fraction()
                        );
                        let m = micro_batches as u64;
                        let p = stages as u64;
                        assert_eq!(t.makespan, (m + p - 1) * (fc + bc));
                    }
                }
            }
        }
    }

    #[test]
    fn a_bad_order_is_reported_as_deadlock() {
        // Stage 1 wants micro-batch 1 first, but stage 0 sends it only after B0, which needs
        // stage 1 to have run F0.
        let steps = vec![vec![F(0), B(0), F(1), B(1)], vec![F(1), F(0), B(0), B(1)]];
        assert_eq!(
            simulate_steps(&steps, 2, 1, 1),
            Err(ScheduleError::Deadlock {
                stage: 0,
                step: B(0)
            })
        );
        assert!(matches!(
            simulate_steps(&[vec![F(2)]], 2, 1, 1),
            Err(ScheduleError::MicroBatchOutOfRange { stage: 0, .. })
        ));
        let t = simulate(Schedule::GPipe, 3, 0, 1, 1).unwrap();
        assert_eq!((t.makespan, t.bubble_fraction()), (0, 0.0));
        assert_eq!(
            simulate(Schedule::GPipe, 0, 4, 1, 1),
            Err(ScheduleError::NoStages)
        );
    }

    #[test]
    fn errors_and_parsing() {
        assert_eq!(
            stage_steps(Schedule::GPipe, 2, 4, 2),
            Err(ScheduleError::StageOutOfRange {
                stage: 2,
                stages: 2
            })
        );
        assert_eq!("1f1b".parse(), Ok(Schedule::OneFOneB));
        assert_eq!("gpipe".parse(), Ok(Schedule::GPipe));
        assert_eq!(
            "pipedream".parse::<Schedule>().unwrap_err().to_string(),
            "unknown schedule `pipedream`: expected gpipe or 1f1b"
        );
        assert_eq!(ideal_bubble_fraction(4, 8), 3.0 / 11.0);
    }
}
