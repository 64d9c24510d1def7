//! Which model's compute hides which swap: read off the simulator's timed replay of a plan
//! ([`crate::sim::simulate_traced`]).
//!
//! A swap is one copy-out of a tensor and the copy-ins that bring it back. Its copies
//! overlap the computations that run on the compute stream meanwhile: those computations
//! hide it, and their models are named with the time each overlapped. What the compute
//! stream waited for it is its exposed stall: a `Free` waiting for the copy-out, or a
//! computation waiting for the copy-in of an input (a computation waiting on several
//! copies charges its wait to the input that arrived last, the one it waited for).

use serde::Serialize;

use super::Multiplexed;
use crate::ir::NodeId;
use crate::plan::Step;
use crate::sim::StepTime;

/// One swap of a multiplexed plan. Times are in the graph's time unit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SwapHiding {
    /// The tensor, as a node of the given graph.
    pub tensor: NodeId,
    pub name: String,
    /// Its model (`None`: a tensor several models share).
    pub model: Option<usize>,
    pub bytes: u64,
    /// When its copy to the host ran.
    pub copy_out: (f64, f64),
    /// When each copy back ran (none when it was never brought back).
    pub copy_in: Vec<(f64, f64)>,
    /// Compute time of each model's nodes during the copy-out, ascending by model (`None`,
    /// shared nodes, last); only models that overlapped it.
    pub out_hidden_by: Vec<(Option<usize>, f64)>,
    /// The same during its copies back: what Algorithm C's prefetch hid behind.
    pub in_hidden_by: Vec<(Option<usize>, f64)>,
    /// Time the compute stream waited for this swap's copies.
    pub exposed: f64,
}

impl SwapHiding {
    /// Time its copies back overlapped compute of models other than its own.
    pub fn hidden_by_others(&self) -> f64 {
        self.in_hidden_by
            .iter()
            .filter(|(m, _)| *m != self.model)
            .fold(0.0, |sum, (_, t)| sum + t)
    }
}

/// One model's share of a multiplexed step (or, with `model: None`, the shared nodes').
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelStall {
    pub model: Option<usize>,
    /// First computations of its nodes.
    pub compute_time: f64,
    /// Its nodes computed again.
    pub recompute_time: f64,
    /// Time the compute stream waited for copies of its tensors.
    pub stall_time: f64,
    /// Its tensors swapped out, and their bytes (every swap-out counted).
    pub swaps: usize,
    pub swapped_bytes: u64,
}

/// The swaps of `steps` (a plan over `multi`'s graph, timed by `trace`, one entry per step)
/// and each model's time; the models' stalls sum to the replay's stall time.
pub fn explain(
    multi: &Multiplexed,
    steps: &[Step],
    trace: &[StepTime],
) -> (Vec<SwapHiding>, Vec<ModelStall>) {
    let g = multi.graph();
    let mut models: Vec<ModelStall> = (0..multi.models())
        .map(Some)
        .chain(std::iter::once(None))
        .map(|model| ModelStall {
            model,
            compute_time: 0.0,
            recompute_time: 0.0,
            stall_time: 0.0,
            swaps: 0,
            swapped_bytes: 0,
        })
        .collect();
    let slot = |m: Option<usize>| m.unwrap_or(multi.models());
    let mut swaps: Vec<SwapHiding> = Vec::new();
    // The swap a tensor's host copy belongs to, and when its device bytes became usable.
    let mut current: Vec<Option<usize>> = vec![None; g.len()];
    let mut ready_at = vec![0.0f64; g.len()];
    let mut fetched = vec![false; g.len()];
    let mut computed = vec![false; g.len()];
    let mut computes: Vec<(f64, f64, Option<usize>)> = Vec::new();
    for (&step, time) in steps.iter().zip(trace) {
        match step {
            Step::Compute { node } => {
                let model = multi.label(node);
                if time.wait > 0.0 {
                    let waited_for = g
                        .node(node)
                        .inputs
                        .iter()
                        .copied()
                        .max_by(|&a, &b| ready_at[a].total_cmp(&ready_at[b]));
                    let swap = waited_for.filter(|&i| fetched[i]).and_then(|i| current[i]);
                    charge(&mut swaps, &mut models, swap, model, time.wait, slot);
                }
                let cost = time.end - time.start;
                let entry = &mut models[slot(model)];
                if computed[node] {
                    entry.recompute_time += cost;
                } else {
                    entry.compute_time += cost;
                }
                computed[node] = true;
                ready_at[node] = time.start;
                fetched[node] = false;
                computes.push((time.start, time.end, model));
            }
            Step::SwapOut { tensor } => {
                let model = multi.label(tensor);
                let bytes = g.node(tensor).output_bytes;
                current[tensor] = Some(swaps.len());
                swaps.push(SwapHiding {
                    tensor,
                    name: g.node(tensor).name.clone(),
                    model,
                    bytes,
                    copy_out: (time.start, time.end),
                    copy_in: Vec::new(),
                    out_hidden_by: Vec::new(),
                    in_hidden_by: Vec::new(),
                    exposed: 0.0,
                });
                let entry = &mut models[slot(model)];
                entry.swaps += 1;
                entry.swapped_bytes = entry.swapped_bytes.saturating_add(bytes);
            }
            Step::Free { tensor } => {
                if time.wait > 0.0 {
                    let model = multi.label(tensor);
                    charge(
                        &mut swaps,
                        &mut models,
                        current[tensor],
                        model,
                        time.wait,
                        slot,
                    );
                }
            }
            Step::SwapIn { tensor } => {
                if let Some(s) = current[tensor] {
                    swaps[s].copy_in.push((time.start, time.end));
                }
                ready_at[tensor] = time.end;
                fetched[tensor] = true;
            }
        }
    }
    for swap in &mut swaps {
        swap.out_hidden_by = overlap(&computes, &[swap.copy_out], multi.models());
        swap.in_hidden_by = overlap(&computes, &swap.copy_in, multi.models());
    }
    // The shared row only when some node is shared.
    if multi.labels().iter().all(Option::is_some) {
        models.pop();
    }
    (swaps, models)
}

/// Charges a wait to a swap (when known) and to its tensor's model, else to `fallback`'s.
fn charge(
    swaps: &mut [SwapHiding],
    models: &mut [ModelStall],
    swap: Option<usize>,
    fallback: Option<usize>,
    wait: f64,
    slot: impl Fn(Option<usize>) -> usize,
) {
    let model = match swap.and_then(|s| swaps.get_mut(s)) {
        Some(s) => {
            s.exposed += wait;
            s.model
        }
        None => fallback,
    };
    models[slot(model)].stall_time += wait;
}

/// Compute time per model inside the intervals; `computes` is sorted by start (one compute
/// stream runs them back to back).
fn overlap(
    computes: &[(f64, f64, Option<usize>)],
    intervals: &[(f64, f64)],
    models: usize,
) -> Vec<(Option<usize>, f64)> {
    let mut per_model = vec![0.0f64; models + 1];
    for &(a, b) in intervals {
        let first = computes.partition_point(|c| c.1 <= a);
        for &(start, end, model) in computes[first..].iter().take_while(|c| c.0 < b) {
            let shared = end.min(b) - start.max(a);
            if shared > 0.0 {
                per_model[model.unwrap_or(models)] += shared;
            }
        }
    }
    per_model
        .into_iter()
        .enumerate()
        .filter(|&(_, t)| t > 0.0)
        .map(|(m, t)| ((m < models).then_some(m), t))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::graph::tests::tiny;
    use super::*;
    use crate::sim::simulate_traced;

    #[test]
    fn a_swap_hidden_behind_the_other_models_forward_by_hand() {
        // Models a and b (tiny: f0 f1 loss b1 b0, forward 1 unit, backward 2, 10 bytes).
        // a's f0 (node 0) is swapped out after a's f1, hidden behind a's loss and b's
        // f0; it comes back before a's b0, hidden behind a's b1 and b's f1 (1 byte per unit).
        let m = Multiplexed::union(&[tiny("a", 10, 0), tiny("b", 10, 0)]).unwrap();
        let c = |node| Step::Compute { node };
        let steps = vec![
            c(0),
            c(1),
            Step::SwapOut { tensor: 0 }, // copy 2..12
            c(2),                        // a loss 2..4
            c(5),                        // b f0 4..5
            c(6),                        // b f1 5..6
            Step::Free { tensor: 0 },    // waits 6 until 12
            Step::SwapIn { tensor: 0 },  // copy 12..22
            c(3),                        // a b1 12..14
            c(7),                        // b loss 14..16
            c(4),                        // a b0 waits until 22: 6, runs 22..24
            c(8),
            c(9),
        ];
        let (report, trace) = simulate_traced(m.graph(), &steps, 1.0).unwrap();
        let (swaps, models) = explain(&m, &steps, &trace);
        assert_eq!(swaps.len(), 1);
        let s = &swaps[0];
        assert_eq!((s.tensor, s.model, s.bytes), (0, Some(0), 10));
        assert_eq!(s.copy_out, (2.0, 12.0));
        assert_eq!(s.copy_in, vec![(12.0, 22.0)]);
        assert_eq!(s.out_hidden_by, vec![(Some(0), 2.0), (Some(1), 2.0)]);
        assert_eq!(s.in_hidden_by, vec![(Some(0), 2.0), (Some(1), 2.0)]);
        assert_eq!(s.hidden_by_others(), 2.0);
        assert_eq!(s.exposed, 6.0 + 6.0);
        assert_eq!(report.stall_time, 12.0);
        assert_eq!(models.len(), 2, "no shared nodes, no shared row");
        assert_eq!(models[0].stall_time, 12.0);
        assert_eq!(models[1].stall_time, 0.0);
        assert_eq!((models[0].swaps, models[0].swapped_bytes), (1, 10));
        assert_eq!(models[0].compute_time, 8.0);
        assert_eq!(models[1].compute_time, 8.0);
    }
}
