//! Copies back issued by their readers' deadlines, and frees after their copies out: the
//! plan's last polish when it swaps.
//!
//! Why. The eviction passes issue each copy back as early as hides its own copy time
//! ([`crate::exact::evict::hoist_swap_ins`]), one copy at a time. The host-to-device stream
//! runs copies one after another, so where several come back for readers close together (a
//! training step's end reads every gradient buffer; near the floor the pinned buffers are
//! swapped out in the backward and all come back for it) each copy hides behind the same
//! few computations and they queue: 8 layers at the floor + 5%, 32 GB/s, waited 1.2 ms of
//! a 25 ms step at the end while the device had 200 MB free over the last 0.4 ms.
//!
//! How. Each copy back's deadline is the start of the first computation that reads it,
//! on the compute clock without waits. Backward over deadlines (latest first), as a single
//! machine meets deadlines best: each copy is to end by its deadline or by the start of
//! the copy placed after it, whichever is earlier, so it should start its copy time before
//! that; its `SwapIn` moves earlier until the computations before it start no later than
//! then, or one step more would pass the budget (it holds its bytes from its issue) or
//! cross its own `Free` or `SwapOut`. A copy memory stops early is late; the copies before
//! it then aim at where it really starts. A copy never moves later. The compute clock does
//! not see the stream's queue, so a copy for a near reader issued right behind one for a
//! far reader still waits for it: last, each copy moves ahead of the run of copies just
//! before it whose readers come later, as memory allows (earliest deadline first; 8 layers
//! at the floor + 5%: a 32 KB norm statistic behind an 8.4 MB rope output cost 66 us a
//! layer, 35.71 -> 33.75%). The simulator judges the result, and the plan is kept only when
//! faster.
//!
//! The copies out have the mirror image: a `Free` waits for its tensor's copy out still in
//! flight, and near the floor the passes free a tensor right after its copy is issued. Each
//! `Free` that waited moves later, over computations as long as its wait, while the bytes
//! it keeps on the device fit under the budget at every step it crosses
//! ([`free_after_copies`]; 8 layers + 5% at 32 GB/s: 38.02 -> 37.02%).
//!
//! Both also run on the plan with every `Free` moved to its tensor's last use
//! ([`early_frees`]): the passes free lazily, when a step needs the room, so a waiting
//! `Free` often cannot move over bytes some other tensor holds for no reader (8 layers in
//! the eager order + 25%: `l5.down_proj`'s free waited 245 us while `l5.v_proj`, last read
//! 36 steps before, was freed after it).

use crate::eager;
use crate::exact::evict::{move_swap_in, swap_in_may_cross};
use crate::ir::Graph;
use crate::plan::{Step, live_bytes_after};
use crate::problem::{Planned, Problem, plan_from_steps};
use crate::sim::simulate_traced;

/// `planned` with its copies back issued by their deadlines ([`issue_by_deadlines`]) and
/// then its frees that wait for a copy out moved after it ([`free_after_copies`]), each
/// kept when faster within the budget (the simulator judges, and in the eager order the
/// form's checks); `None` when the plan copies nothing or nothing got faster.
///
/// Both run twice: on the plan's own frees, and on its frees moved to their tensors' last
/// uses first ([`early_frees`]; why: the module docs; in the solver, 8 layers eager + 25%
/// at 32 GB/s: 28.90 -> 28.47%). Up to six schedules are judged.
pub fn polish(problem: &Problem, planned: &Planned, name: &str) -> Option<Planned> {
    let early = early_frees(problem.graph, &planned.plan.steps);
    let mut best = polish_from(problem, planned, planned.plan.steps.clone(), name);
    if early != planned.plan.steps {
        let against = best.as_ref().unwrap_or(planned);
        if let Some(better) = polish_from(problem, against, early, name) {
            best = Some(better);
        }
    }
    best
}

/// [`polish`] of `steps` (`against`'s steps or a schedule with the same times): the copies
/// back by deadlines, and the frees after copies out on `steps` and on that, each result
/// kept when faster than `against` and the ones before it.
fn polish_from(
    problem: &Problem,
    against: &Planned,
    steps: Vec<Step>,
    name: &str,
) -> Option<Planned> {
    let graph = problem.graph;
    let per_byte = 1.0 / (problem.bandwidth * graph.time_unit_s());
    let mut best: Option<Planned> = None;
    let mut judge = |steps: Vec<Step>| {
        let current = best.as_ref().unwrap_or(against);
        if steps == current.plan.steps {
            return;
        }
        let decisions = eager::decisions(graph, &steps);
        if let Ok(changed) = plan_from_steps(problem, name, steps, decisions)
            && changed.report.total_time < current.report.total_time
        {
            best = Some(changed);
        }
    };
    let mut bases = vec![steps];
    if bases[0].iter().any(|s| matches!(s, Step::SwapIn { .. })) {
        let moved = issue_by_deadlines(graph, problem.budget_bytes, bases[0].clone(), per_byte);
        judge(moved.clone());
        bases.push(moved);
    }
    // The frees after copies out on both, the copies' moves kept or not: the frees' moves
    // may be what makes them pay.
    for steps in bases {
        if steps.iter().any(|s| matches!(s, Step::SwapOut { .. }))
            && let Ok((_, times)) = simulate_traced(graph, &steps, problem.bandwidth)
        {
            let waits: Vec<f64> = times.iter().map(|t| t.wait).collect();
            judge(free_after_copies(
                graph,
                problem.budget_bytes,
                steps,
                &waits,
            ));
        }
    }
    best
}

/// Each `Free` moved to right after the last step that uses its tensor (a computation
/// reading it, its own computation or copy back), unless a copy out of the tensor was
/// issued since it was last made or brought back: that `Free` waits for the copy, and
/// stays. Memory only drops; times do not change.
pub fn early_frees(graph: &Graph, steps: &[Step]) -> Vec<Step> {
    let n = steps.len();
    // For each tensor: (step of its last use, whether a copy out was issued since).
    let mut last_use: Vec<Option<(usize, bool)>> = vec![None; graph.len()];
    let mut moved_after: Vec<Vec<Step>> = vec![Vec::new(); n];
    let mut stays = vec![true; n];
    for (k, step) in steps.iter().enumerate() {
        match *step {
            Step::Compute { node } => {
                for &input in &graph.node(node).inputs {
                    if let Some((_, out)) = last_use[input] {
                        last_use[input] = Some((k, out));
                    }
                }
                last_use[node] = Some((k, false));
            }
            Step::SwapIn { tensor } => last_use[tensor] = Some((k, false)),
            Step::SwapOut { tensor } => {
                if let Some((at, _)) = last_use[tensor] {
                    last_use[tensor] = Some((at, true));
                }
            }
            Step::Free { tensor } => {
                if let Some((at, false)) = last_use[tensor]
                    && at + 1 < k
                {
                    moved_after[at].push(*step);
                    stays[k] = false;
                }
                last_use[tensor] = None;
            }
        }
    }
    let mut out = Vec::with_capacity(n);
    for (k, moved) in moved_after.into_iter().enumerate() {
        if stays[k] {
            out.push(steps[k]);
        }
        out.extend(moved);
    }
    out
}

/// `steps` with each `Free` that waited for its tensor's copy out (`waits[k]` for step `k`,
/// as [`simulate_traced`] reports them) moved later, over computations that take as long as
/// it waited, while the device bytes of every step it crosses, plus the tensor's, stay
/// within `budget_bytes` and it crosses no other step of the same tensor: the copy then
/// ends behind those computations instead of holding up the compute stream. Memory only
/// grows between the old and the new place, by the tensor's bytes, so a schedule within
/// the budget stays within it.
pub fn free_after_copies(
    graph: &Graph,
    budget_bytes: u64,
    mut steps: Vec<Step>,
    waits: &[f64],
) -> Vec<Step> {
    let Some(cap) = budget_bytes.checked_sub(graph.static_bytes()) else {
        return steps;
    };
    let mut live = live_bytes_after(graph, &steps);
    // Latest first, so a move does not shift the frees still to be moved.
    let waiting: Vec<usize> = (0..steps.len())
        .filter(|&k| {
            matches!(steps[k], Step::Free { .. }) && waits.get(k).is_some_and(|&w| w > 0.0)
        })
        .collect();
    for &j in waiting.iter().rev() {
        let Step::Free { tensor } = steps[j] else {
            continue;
        };
        let bytes = graph.node(tensor).output_bytes;
        let mut covered = 0.0;
        let mut to = j;
        while to + 1 < steps.len() && covered < waits[j] {
            let k = to + 1;
            let own = match steps[k] {
                Step::Compute { node } => node == tensor,
                Step::Free { tensor: t }
                | Step::SwapOut { tensor: t }
                | Step::SwapIn { tensor: t } => t == tensor,
            };
            if own || live[k] + bytes > cap {
                break;
            }
            if let Step::Compute { node } = steps[k] {
                covered += graph.node(node).compute_time;
            }
            to = k;
        }
        if to == j {
            continue;
        }
        // The free now runs after steps j+1..=to: each holds the tensor's bytes too.
        let step = steps.remove(j);
        steps.insert(to, step);
        let mut moved: Vec<u64> = live[j + 1..=to].iter().map(|held| held + bytes).collect();
        moved.push(live[to]);
        live.splice(j..=to, moved);
    }
    steps
}

/// `steps` with each `SwapIn` moved earlier as the module docs say; unchanged when
/// `budget_bytes` is under the static bytes or nothing moves. `per_byte`: copy time per
/// byte in the graph's time unit.
pub fn issue_by_deadlines(
    graph: &Graph,
    budget_bytes: u64,
    mut steps: Vec<Step>,
    per_byte: f64,
) -> Vec<Step> {
    let Some(cap) = budget_bytes.checked_sub(graph.static_bytes()) else {
        return steps;
    };
    // live[k]: device bytes (static excluded) once step k has run; clock[k]: compute time
    // of the steps before k.
    let mut live = live_bytes_after(graph, &steps);
    let mut clock = compute_clock(graph, &steps);
    // The copies back with their deadlines, latest deadline first (ties: the later issued
    // first, so their order on the stream stays).
    let mut copies: Vec<(f64, usize)> = copy_deadlines(graph, &steps, &clock)
        .into_iter()
        .enumerate()
        .filter(|(_, deadline)| deadline.is_finite())
        .map(|(j, deadline)| (deadline, j))
        .collect();
    copies.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
    // Where each copy is now: moving one shifts those between its old and new place.
    let mut at: Vec<usize> = copies.iter().map(|&(_, j)| j).collect();
    let mut stream_free_by = f64::INFINITY;
    for c in 0..copies.len() {
        let j = at[c];
        let Step::SwapIn { tensor } = steps[j] else {
            continue;
        };
        let bytes = graph.node(tensor).output_bytes;
        let start_by = copies[c].0.min(stream_free_by) - bytes as f64 * per_byte;
        let mut to = j;
        while to > 0
            && clock[to] > start_by
            && swap_in_may_cross(&steps, &live, to - 1, tensor, bytes, cap)
        {
            to -= 1;
        }
        stream_free_by = clock[to].max(start_by);
        if to == j {
            continue;
        }
        move_swap_in(&mut steps, &mut live, j, to, bytes);
        clock.remove(j);
        let issued = clock[to];
        clock.insert(to, issued);
        for other in &mut at[c + 1..] {
            if (to..j).contains(other) {
                *other += 1;
            }
        }
    }
    earlier_deadlines_first(graph, cap, steps)
}

/// `steps` with each copy back issued before the copies back just ahead of it on the
/// stream whose readers come later (the stream runs copies in issue order, so a small copy
/// for a near reader queued behind a large one for a far reader waits for it: 8 layers at
/// the floor + 5%, a 32 KB norm statistic behind an 8.4 MB rope output, 66 us a layer), as
/// far as memory allows and never before its own `Free` or `SwapOut`. Each moves past a
/// run of such copies only, to the first of them, never past a copy with an earlier or
/// equal deadline.
/// The compute time of the steps before each step: the compute clock without waits.
pub(crate) fn compute_clock(graph: &Graph, steps: &[Step]) -> Vec<f64> {
    let mut now = 0.0;
    steps
        .iter()
        .map(|step| {
            let before = now;
            if let Step::Compute { node } = *step {
                now += graph.node(node).compute_time;
            }
            before
        })
        .collect()
}

/// For each copy back (`SwapIn`), its deadline: the compute clock (`clock`, one entry a
/// step) at the first computation after it that reads the tensor; infinity for every other
/// step and for a copy back nothing reads. One backward scan.
fn copy_deadlines(graph: &Graph, steps: &[Step], clock: &[f64]) -> Vec<f64> {
    let mut deadline = vec![f64::INFINITY; steps.len()];
    let mut next_read = vec![f64::INFINITY; graph.len()];
    for (j, step) in steps.iter().enumerate().rev() {
        match *step {
            Step::Compute { node } => {
                for &input in &graph.node(node).inputs {
                    next_read[input] = clock[j];
                }
            }
            Step::SwapIn { tensor } => deadline[j] = next_read[tensor],
            _ => {}
        }
    }
    deadline
}

/// How far back (in steps) a copy back looks for the copies queued ahead of it.
const REORDER_SCAN_STEPS: usize = 2048;

fn earlier_deadlines_first(graph: &Graph, cap: u64, mut steps: Vec<Step>) -> Vec<Step> {
    let mut live = live_bytes_after(graph, &steps);
    let mut deadline = copy_deadlines(graph, &steps, &compute_clock(graph, &steps));
    for k in 0..steps.len() {
        let Step::SwapIn { tensor } = steps[k] else {
            continue;
        };
        let bytes = graph.node(tensor).output_bytes;
        let mut to = k;
        let mut target = k;
        while to > 0
            && k - to < REORDER_SCAN_STEPS
            && swap_in_may_cross(&steps, &live, to - 1, tensor, bytes, cap)
        {
            to -= 1;
            if matches!(steps[to], Step::SwapIn { .. }) {
                if deadline[to] > deadline[k] {
                    target = to;
                } else {
                    break;
                }
            }
        }
        if target < k {
            move_swap_in(&mut steps, &mut live, k, target, bytes);
            let moved = deadline.remove(k);
            deadline.insert(target, moved);
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::test_node as node;
    use crate::sim::simulate_steps;

    /// `a` and `b` copied out, three computations, and an end that reads both: copied back
    /// right before the end (each copy alone hides behind nothing), the second queues
    /// behind the first. 100 bytes copy in 2 units.
    fn two_copies_for_one_reader() -> (Graph, Vec<Step>) {
        let graph = Graph::new(
            "two copies",
            vec![
                node("a", 100, 1.0, vec![]),
                node("b", 100, 1.0, vec![]),
                node("w1", 10, 4.0, vec![]),
                node("w2", 10, 4.0, vec![2]),
                node("w3", 10, 4.0, vec![3]),
                node("end", 0, 1.0, vec![0, 1, 4]),
            ],
            0,
            1.0,
        )
        .expect("a valid graph");
        use Step::*;
        let steps = vec![
            Compute { node: 0 },
            SwapOut { tensor: 0 },
            Compute { node: 1 },
            SwapOut { tensor: 1 },
            Compute { node: 2 },
            Free { tensor: 0 },
            Free { tensor: 1 },
            Compute { node: 3 },
            Free { tensor: 2 },
            Compute { node: 4 },
            Free { tensor: 3 },
            SwapIn { tensor: 0 },
            SwapIn { tensor: 1 },
            Compute { node: 5 },
        ];
        (graph, steps)
    }

    const PER_BYTE: f64 = 0.02;

    #[test]
    fn copies_for_one_reader_are_spread_over_the_compute_before_it() {
        let (graph, steps) = two_copies_for_one_reader();
        let before = simulate_steps(&graph, &steps, 1.0 / PER_BYTE).expect("valid");
        assert_eq!(before.stall_time, 4.0);
        let moved = issue_by_deadlines(&graph, 1_000, steps, PER_BYTE);
        let after = simulate_steps(&graph, &moved, 1.0 / PER_BYTE).expect("valid");
        // Both copies now run during w3, `b` first as before.
        assert_eq!(after.stall_time, 0.0, "{moved:?}");
        assert_eq!(after.total_time, before.total_time - 4.0);
        let position = |t: usize| moved.iter().position(|s| *s == Step::SwapIn { tensor: t });
        assert!(position(1) < position(0));
    }

    #[test]
    fn a_copy_back_stays_where_the_budget_has_no_room_for_it_earlier() {
        let (graph, steps) = two_copies_for_one_reader();
        // The plan's own peak: both copies and w3 at the end. Only one copy fits during w3.
        let moved = issue_by_deadlines(&graph, 210, steps, PER_BYTE);
        let after = simulate_steps(&graph, &moved, 1.0 / PER_BYTE).expect("valid");
        assert!(after.peak_bytes <= 210, "{after:?}");
        assert_eq!(after.stall_time, 2.0, "{moved:?}");
    }

    /// `a` copied out and freed at once (the free waits for the copy), then two
    /// computations that could have hidden the copy. 100 bytes copy in 4 units.
    fn a_free_that_waits() -> (Graph, Vec<Step>) {
        let graph = Graph::new(
            "free waits",
            vec![
                node("a", 100, 1.0, vec![]),
                node("w1", 10, 2.0, vec![]),
                node("w2", 10, 2.0, vec![1]),
                node("end", 0, 1.0, vec![0, 2]),
            ],
            0,
            1.0,
        )
        .expect("a valid graph");
        use Step::*;
        let steps = vec![
            Compute { node: 0 },
            SwapOut { tensor: 0 },
            Free { tensor: 0 },
            Compute { node: 1 },
            Compute { node: 2 },
            Free { tensor: 1 },
            SwapIn { tensor: 0 },
            Compute { node: 3 },
        ];
        (graph, steps)
    }

    fn moved_frees(budget: u64) -> (f64, f64, Vec<Step>) {
        let (graph, steps) = a_free_that_waits();
        let bandwidth = 1.0 / 0.04;
        let (before, times) = simulate_traced(&graph, &steps, bandwidth).expect("valid");
        let waits: Vec<f64> = times.iter().map(|t| t.wait).collect();
        assert_eq!(waits[2], 4.0);
        let moved = free_after_copies(&graph, budget, steps, &waits);
        let after = simulate_steps(&graph, &moved, bandwidth).expect("valid");
        assert!(after.peak_bytes <= budget, "{after:?}");
        (before.total_time, after.total_time, moved)
    }

    #[test]
    fn a_free_waiting_for_its_copy_moves_after_the_compute_that_hides_it() {
        let (before, after, moved) = moved_frees(1_000);
        assert_eq!(after, before - 4.0, "{moved:?}");
        assert_eq!(moved[4], Step::Free { tensor: 0 });
    }

    #[test]
    fn a_free_moves_no_further_than_the_budget_lets_it() {
        // `a` beside w1 fits (110 bytes), beside w1 and w2 it would not (120).
        let (before, after, moved) = moved_frees(115);
        assert_eq!(after, before - 2.0, "{moved:?}");
        assert_eq!(moved[3], Step::Free { tensor: 0 });
    }

    /// `a` (100 bytes, read at the end) and `b` (10 bytes, read one computation after its
    /// copy back is issued) come back in that order; the compute clock says `b`'s copy has
    /// time, but the stream runs `a`'s first: `b`'s reader waits 1.2 units.
    fn a_small_copy_behind_a_large_one() -> (Graph, Vec<Step>) {
        let graph = Graph::new(
            "queued copy",
            vec![
                node("a", 100, 1.0, vec![]),
                node("b", 10, 1.0, vec![]),
                node("w1", 10, 4.0, vec![]),
                node("w3", 0, 1.0, vec![2]),
                node("near", 0, 1.0, vec![1, 3]),
                node("w2", 0, 6.0, vec![4]),
                node("far", 0, 1.0, vec![0, 5]),
            ],
            0,
            1.0,
        )
        .expect("a valid graph");
        use Step::*;
        let steps = vec![
            Compute { node: 0 },
            SwapOut { tensor: 0 },
            Compute { node: 1 },
            SwapOut { tensor: 1 },
            Compute { node: 2 },
            Free { tensor: 0 },
            Free { tensor: 1 },
            SwapIn { tensor: 0 },
            SwapIn { tensor: 1 },
            Compute { node: 3 },
            Free { tensor: 2 },
            Compute { node: 4 },
            Free { tensor: 1 },
            Free { tensor: 3 },
            Compute { node: 5 },
            Free { tensor: 4 },
            Compute { node: 6 },
        ];
        (graph, steps)
    }

    /// `a` copied out and freed at once, so the free waits 2 units for the copy, and copied
    /// back right before the end (2 units more); `x`, last read by `y`, is freed lazily
    /// after `w`. At `w` the device holds `x`, `y` and `w` (210 bytes): with the budget at
    /// 250, `a`'s free can move over `w` only once `x` leaves at its last use.
    fn a_free_that_waits_behind_a_lazy_free() -> (Problem<'static>, Vec<Step>) {
        let graph = Graph::new(
            "lazy free",
            vec![
                node("a", 100, 1.0, vec![]),
                node("x", 100, 1.0, vec![]),
                node("y", 10, 1.0, vec![1]),
                node("w", 100, 4.0, vec![2]),
                node("v", 10, 4.0, vec![3]),
                node("end", 0, 1.0, vec![0, 4]),
            ],
            0,
            1.0,
        )
        .expect("a valid graph");
        use Step::*;
        let steps = vec![
            Compute { node: 0 },
            Compute { node: 1 },
            Compute { node: 2 },
            SwapOut { tensor: 0 },
            Free { tensor: 0 },
            Compute { node: 3 },
            Free { tensor: 1 },
            Free { tensor: 2 },
            Compute { node: 4 },
            Free { tensor: 3 },
            SwapIn { tensor: 0 },
            Compute { node: 5 },
        ];
        let problem = Problem {
            graph: Box::leak(Box::new(graph)),
            budget_bytes: 250,
            bandwidth: 1.0 / PER_BYTE,
        };
        (problem, steps)
    }

    #[test]
    fn a_free_waiting_for_its_copy_out_moves_over_room_a_lazy_free_left() {
        let (problem, steps) = a_free_that_waits_behind_a_lazy_free();
        let decisions = eager::decisions(problem.graph, &steps);
        let planned = plan_from_steps(&problem, "test", steps, decisions).expect("valid");
        assert_eq!(planned.report.stall_time, 4.0, "{:?}", planned.report);
        // On the plan's own frees, `a`'s free has nowhere to go.
        let traced = simulate_traced(problem.graph, &planned.plan.steps, problem.bandwidth);
        let waits: Vec<f64> = traced.expect("valid").1.iter().map(|t| t.wait).collect();
        let lazy = free_after_copies(problem.graph, 250, planned.plan.steps.clone(), &waits);
        assert_eq!(lazy, planned.plan.steps);
        let polished = polish(&problem, &planned, "test").expect("faster");
        let steps = &polished.plan.steps;
        let at = |s: Step| steps.iter().position(|x| *x == s);
        assert!(
            at(Step::Free { tensor: 1 }) < at(Step::SwapOut { tensor: 0 }),
            "{steps:?}"
        );
        assert!(
            at(Step::Free { tensor: 0 }) > at(Step::Compute { node: 3 }),
            "{steps:?}"
        );
        assert!(
            at(Step::SwapIn { tensor: 0 }) < at(Step::Compute { node: 4 }),
            "{steps:?}"
        );
        assert!(polished.report.peak_bytes <= 250);
        assert_eq!(polished.report.stall_time, 0.0, "{steps:?}");
        assert_eq!(polished.report.total_time, planned.report.total_time - 4.0);
    }

    #[test]
    fn a_copy_for_a_nearer_reader_goes_first_on_the_stream() {
        let (graph, steps) = a_small_copy_behind_a_large_one();
        let before = simulate_steps(&graph, &steps, 1.0 / PER_BYTE).expect("valid");
        assert!((before.stall_time - 1.2).abs() < 1e-9, "{before:?}");
        let moved = issue_by_deadlines(&graph, 120, steps, PER_BYTE);
        let after = simulate_steps(&graph, &moved, 1.0 / PER_BYTE).expect("valid");
        assert_eq!(after.stall_time, 0.0, "{moved:?}");
        assert!(after.peak_bytes <= 120);
        let position = |t: usize| moved.iter().position(|s| *s == Step::SwapIn { tensor: t });
        assert!(position(1) < position(0), "{moved:?}");
    }
}
