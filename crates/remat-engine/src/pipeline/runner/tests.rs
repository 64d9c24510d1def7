//! The runner on a toy model: layers `y = tanh(w * x + b)` applied elementwise, loss
//! `0.5 * sum(y^2)` on the last stage. Small enough to reason about, real enough that a
//! wrong order of accumulation, a lost message or a stale state changes the gradient bits.

use super::*;
use crate::pipeline::activation::HostTensor;

#[derive(Debug, thiserror::Error)]
#[error("toy failure")]
struct ToyError;

struct ToyState {
    /// Each layer's input, then the stage output last.
    values: Vec<Vec<f32>>,
}

impl Activation for ToyState {
    fn byte_size(&self) -> usize {
        self.values.iter().map(|v| v.len() * 4).sum()
    }
    fn shape(&self) -> Vec<usize> {
        vec![self.values.len(), self.values[0].len()]
    }
}

struct ToyStage {
    layers: Vec<(f32, f32)>,
    grads: Vec<(f32, f32)>,
    batch: Vec<HostTensor>,
    first: bool,
    last: bool,
    fail_at: Option<usize>,
    forward_calls: usize,
    drift_on_recompute: bool,
}

impl ToyStage {
    fn new(layers: Vec<(f32, f32)>, batch: Vec<HostTensor>, first: bool, last: bool) -> Self {
        let grads = vec![(0.0, 0.0); layers.len()];
        Self {
            layers,
            grads,
            batch,
            first,
            last,
            fail_at: None,
            forward_calls: 0,
            drift_on_recompute: false,
        }
    }
}

impl StageWork for ToyStage {
    type Input = HostTensor;
    type State = ToyState;
    type Message = HostTensor;
    type Error = ToyError;

    fn load_input(
        &mut self,
        m: usize,
        received: Option<HostTensor>,
    ) -> Result<HostTensor, ToyError> {
        match (self.first, received) {
            (true, None) => Ok(self.batch[m].clone()),
            (false, Some(x)) => Ok(x),
            _ => Err(ToyError),
        }
    }

    fn forward(
        &mut self,
        m: usize,
        input: &HostTensor,
    ) -> Result<Forwarded<ToyState, HostTensor>, ToyError> {
        if self.fail_at == Some(m) {
            return Err(ToyError);
        }
        self.forward_calls += 1;
        let mut values = vec![input.as_f32().ok_or(ToyError)?.to_vec()];
        for &(w, b) in &self.layers {
            let x = values.last().unwrap();
            values.push(x.iter().map(|v| (w * v + b).tanh()).collect());
        }
        if self.drift_on_recompute && self.forward_calls > self.batch.len().max(1) {
            values.last_mut().unwrap()[0] += 1e-3;
        }
        let out = values.last().unwrap().clone();
        let digest = digest_f32(&out);
        let output = (!self.last).then(|| HostTensor::f32(input.shape.clone(), out).unwrap());
        Ok(Forwarded {
            state: ToyState { values },
            output,
            digest,
        })
    }

    fn backward(
        &mut self,
        _m: usize,
        state: ToyState,
        grad: Option<HostTensor>,
    ) -> Result<Option<HostTensor>, ToyError> {
        let mut dy: Vec<f32> = match grad {
            Some(g) => g.as_f32().ok_or(ToyError)?.to_vec(),
            None => state.values.last().unwrap().clone(),
        };
        for (l, &(w, _)) in self.layers.iter().enumerate().rev() {
            let (x, y) = (&state.values[l], &state.values[l + 1]);
            let dz: Vec<f32> = dy.iter().zip(y).map(|(d, y)| d * (1.0 - y * y)).collect();
            let gw: f32 = dz.iter().zip(x).map(|(d, x)| d * x).sum();
            let gb: f32 = dz.iter().sum();
            self.grads[l].0 += gw;
            self.grads[l].1 += gb;
            dy = dz.iter().map(|d| d * w).collect();
        }
        let shape = vec![dy.len()];
        Ok((!self.first).then(|| HostTensor::f32(shape, dy).unwrap()))
    }
}

fn layers(n: usize) -> Vec<(f32, f32)> {
    (0..n)
        .map(|l| (0.9 + 0.07 * l as f32, 0.05 * l as f32 - 0.1))
        .collect()
}

fn batch(micro_batches: usize) -> Vec<HostTensor> {
    (0..micro_batches)
        .map(|m| {
            let data = (0..16)
                .map(|i| ((m * 16 + i) as f32 * 0.37).sin())
                .collect();
            HostTensor::f32(vec![16], data).unwrap()
        })
        .collect()
}

/// Splits `layers` over `stages` stages as evenly as possible (earlier stages get the extra).
fn split(all: &[(f32, f32)], stages: usize, micro_batches: usize) -> Vec<ToyStage> {
    let bounds = crate::pipeline::partition::balanced_ranges(all.len(), stages).unwrap();
    let last = stages - 1;
    bounds
        .iter()
        .enumerate()
        .map(|(s, r)| {
            ToyStage::new(
                all[r.clone()].to_vec(),
                batch(micro_batches),
                s == 0,
                s == last,
            )
        })
        .collect()
}

fn grad_bits(stages: &[ToyStage]) -> Vec<(u32, u32)> {
    stages
        .iter()
        .flat_map(|s| s.grads.iter().map(|(w, b)| (w.to_bits(), b.to_bits())))
        .collect()
}

fn config(schedule: Schedule, micro_batches: usize, strategy: Strategy) -> PipelineConfig {
    PipelineConfig {
        schedule,
        micro_batches,
        strategy,
    }
}

const STRATEGIES: [Strategy; 5] = [
    Strategy::StoreAll,
    Strategy::RecomputeAll,
    Strategy::Selective { interval: 2 },
    Strategy::Selective { interval: 0 },
    Strategy::MemoryBased {
        threshold_bytes: 700,
    },
];

#[test]
fn gradients_equal_single_stage_under_every_schedule_and_strategy() {
    let all = layers(7);
    for micro_batches in [0, 1, 3, 6] {
        let mut reference = split(&all, 1, micro_batches);
        run_pipeline(
            &mut reference,
            config(Schedule::GPipe, micro_batches, Strategy::StoreAll),
        )
        .unwrap();
        let expected = grad_bits(&reference);
        for stages in [2, 3, 4] {
            for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                for strategy in STRATEGIES {
                    let mut works = split(&all, stages, micro_batches);
                    let report =
                        run_pipeline(&mut works, config(schedule, micro_batches, strategy))
                            .unwrap();
                    assert_eq!(
                        grad_bits(&works),
                        expected,
                        "P={stages} M={micro_batches} {schedule} {strategy}"
                    );
                    assert_eq!(report.stages.len(), stages);
                }
            }
        }
    }
}

#[test]
fn recompute_all_reruns_every_forward_and_store_all_none() {
    let mut works = split(&layers(4), 2, 5);
    let report = run_pipeline(
        &mut works,
        config(Schedule::OneFOneB, 5, Strategy::RecomputeAll),
    )
    .unwrap();
    for stage in &report.stages {
        assert_eq!(stage.checkpoint.recomputes, 5);
        assert_eq!(stage.checkpoint.peak_stored_bytes, 0);
        assert!(
            stage
                .spans
                .iter()
                .filter(|s| matches!(s.step, Step::Backward(_)))
                .all(|s| s.recomputed)
        );
    }
    let mut works = split(&layers(4), 2, 5);
    let report = run_pipeline(
        &mut works,
        config(Schedule::OneFOneB, 5, Strategy::StoreAll),
    )
    .unwrap();
    assert!(report.stages.iter().all(|s| s.checkpoint.recomputes == 0));
}

#[test]
fn one_f_one_b_holds_fewer_states_than_gpipe() {
    let (stages, micro_batches) = (4, 8);
    // Two layers per stage on 16 floats: a state is 3 * 64 bytes.
    let state_bytes = 3 * 64;
    let run = |schedule| {
        let mut works = split(&layers(8), stages, micro_batches);
        run_pipeline(
            &mut works,
            config(schedule, micro_batches, Strategy::StoreAll),
        )
        .unwrap()
    };
    let gpipe = run(Schedule::GPipe);
    let ofob = run(Schedule::OneFOneB);
    for s in 0..stages {
        assert_eq!(gpipe.stages[s].max_in_flight, micro_batches);
        assert_eq!(ofob.stages[s].max_in_flight, stages - s);
        assert_eq!(
            gpipe.stages[s].checkpoint.peak_stored_bytes,
            micro_batches * state_bytes
        );
        assert_eq!(
            ofob.stages[s].checkpoint.peak_stored_bytes,
            (stages - s) * state_bytes
        );
    }
}

#[test]
fn a_failing_stage_is_reported_as_the_root_cause() {
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let mut works = split(&layers(6), 3, 4);
        works[1].fail_at = Some(2);
        let err = run_pipeline(&mut works, config(schedule, 4, Strategy::StoreAll)).unwrap_err();
        assert!(
            matches!(
                err,
                StageError::Work {
                    stage: 1,
                    micro_batch: 2,
                    ..
                }
            ),
            "{schedule}: {err}"
        );
        assert_eq!(err.to_string(), "stage 1, micro-batch 2: toy failure");
    }
}

#[test]
fn a_nondeterministic_forward_is_caught_at_recompute() {
    let mut works = split(&layers(4), 2, 3);
    works[1].drift_on_recompute = true;
    let err = run_pipeline(
        &mut works,
        config(Schedule::GPipe, 3, Strategy::RecomputeAll),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            StageError::RecomputeMismatch {
                stage: 1,
                micro_batch: 0
            }
        ),
        "{err}"
    );
}

#[test]
fn report_spans_follow_the_schedule_and_busy_time_adds_up() {
    let mut works = split(&layers(6), 3, 5);
    let report = run_pipeline(
        &mut works,
        config(Schedule::OneFOneB, 5, Strategy::Selective { interval: 2 }),
    )
    .unwrap();
    for (s, stage) in report.stages.iter().enumerate() {
        let steps: Vec<Step> = stage.spans.iter().map(|x| x.step).collect();
        assert_eq!(
            steps,
            schedule::stage_steps(Schedule::OneFOneB, 3, 5, s).unwrap()
        );
        let total: Duration = stage.spans.iter().map(|x| x.end - x.start).sum();
        assert_eq!(total, stage.busy);
        assert!(stage.spans.windows(2).all(|w| w[0].end <= w[1].start));
        assert!(stage.recompute <= stage.busy);
        // Selective:2 over 5 keeps 0, 2, 4 and recomputes 1 and 3.
        assert_eq!(stage.checkpoint.recomputes, 2);
    }
    let bubble = report.bubble_fraction();
    assert!((0.0..=1.0).contains(&bubble));
    assert_eq!(report.ideal_bubble_fraction(), 2.0 / 7.0);
}

#[test]
fn digest_sees_every_bit() {
    let a = [1.0f32, -0.0, 3.5];
    let b = [1.0f32, 0.0, 3.5];
    assert_ne!(digest_f32(&a), digest_f32(&b));
    assert_eq!(digest_f32(&a), digest_f32(&a.clone()));
}
