//! MuTWO's scheduling policy (Purandare et al., "mu-TWO: 3x Faster Multi-Model Training
//! with Orchestration and Memory Optimization", MLSys 2023, appendix A), for one model.
//!
//! Algorithm B repeatedly takes two candidates among the activations still kept:
//! - the swap candidate, with the largest inactive time; its overhead is Algorithm C: the
//!   part of its copy-in that compute cannot hide, walking the prefetch prompt back from its
//!   first backward use over backward nodes (and the recomputations that run there), but
//!   not into the peak-memory interval, and serialized behind the previous prompt since one
//!   copy stream serves all prefetches;
//! - the recompute candidate, with the largest recompute ratio (bytes per unit of total
//!   recompute time); its overhead is Algorithm D: its total recompute time.
//!
//! The cheaper one is applied; Algorithms E and F then update recompute sources and times
//! (a recomputed or swapped tensor stops being a source; its own sources replace it), the
//! prompts of earlier swaps move later when new recomputations overlap their copies, and the
//! memory simulator decides whether to stop. Where the paper's Algorithm G estimates the peak
//! from per-node counters, we lower the current decisions and run the real simulator: the
//! stop test then uses the very numbers the plan is judged by.
//!
//! Swap-out deviation: a swap whose copy-out would still be running in the peak interval
//! is not taken (see `Scheduler::copy_out_clears_peak`).
//!
//! Several models: Algorithm C's cases 2-3 also overlap a swap with forward nodes of
//! *another* model trained in the same step. The walk here goes back over whatever nodes run
//! before the use, so it does exactly that when the graph holds several models in an
//! interleaved order: [`crate::multi`] renumbers the combined graph in MuTWO's order (model
//! `i`'s backward beside model `i + 1`'s forward) and plans it with this scheduler. With one
//! model there are no other nodes, and only the model's own backward nodes hide a prefetch.

use super::Strategy;
use crate::attrs::{TensorAttrs, prefix_times, tensor_attrs};
use crate::error::PlanError;
use crate::problem::{Planned, Problem, plan_from_decisions, plan_from_decisions_with};
use std::time::Instant;

use crate::ir::{Graph, NodeId, Phase};
use crate::lower::{Helpers, lower};
use crate::plan::{Decision, Step};
use crate::sim::simulate_steps;

pub struct MuTwo;

impl Strategy for MuTwo {
    fn name(&self) -> String {
        "mutwo".into()
    }
    fn summary(&self) -> &'static str {
        "MuTWO: swap or recompute the cheaper candidate until the simulated peak fits"
    }
    fn search_cost(&self) -> super::SearchCost {
        super::SearchCost::UNTIL_DEADLINE
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        let mut state = Scheduler::new(problem);
        let decisions = state.run()?;
        plan_from_decisions(problem, &self.name(), decisions)
    }
    fn plan_until(&self, problem: &Problem, deadline: Instant) -> Result<Planned, PlanError> {
        let mut state = Scheduler::new(problem);
        state.deadline = Some(deadline);
        let decisions = state.run().map_err(|e| rename(e, &self.name()))?;
        plan_from_decisions(problem, &self.name(), decisions)
    }
}

/// MuTWO followed by a refinement of our own: Algorithm B stops as soon as the peak fits,
/// but a choice made early may have been made unnecessary by later ones (a recomputation
/// that lowered the peak interval makes an earlier swap redundant, say). Undo the choices
/// in reverse order whenever the plan still fits and gets no slower, then keep the faster
/// of the two helper semantics of [`crate::lower::Helpers`]. Costs one simulation per
/// choice on top of MuTWO.
pub struct MuTwoRefined;

impl Strategy for MuTwoRefined {
    fn name(&self) -> String {
        "mutwo-refined".into()
    }
    fn summary(&self) -> &'static str {
        "MuTWO, then undo the choices the budget does not need"
    }
    fn search_cost(&self) -> super::SearchCost {
        super::SearchCost::UNTIL_DEADLINE
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        self.plan_by(problem, None)
    }
    fn plan_until(&self, problem: &Problem, deadline: Instant) -> Result<Planned, PlanError> {
        self.plan_by(problem, Some(deadline))
    }
}

impl MuTwoRefined {
    /// With a deadline, MuTWO stops there without a plan, and the refinement stops there
    /// with the best plan so far.
    fn plan_by(&self, problem: &Problem, deadline: Option<Instant>) -> Result<Planned, PlanError> {
        let name = self.name();
        let mut scheduler = Scheduler::new(problem);
        scheduler.deadline = deadline;
        let mut current = scheduler.run().map_err(|e| rename(e, &name))?;
        let mut best = plan_from_decisions(problem, &name, current.clone())?;
        for &(t, _) in scheduler.trace.iter().rev() {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(best);
            }
            let saved = std::mem::replace(&mut current[t], Decision::Keep);
            match plan_from_decisions(problem, &name, current.clone()) {
                Ok(p) if p.report.total_time <= best.report.total_time => best = p,
                _ => current[t] = saved,
            }
        }
        if let Ok(p) = plan_from_decisions_with(problem, &name, current, Helpers::KeepNeeded)
            && p.report.total_time < best.report.total_time
        {
            best = p;
        }
        Ok(best)
    }
}

fn rename(err: PlanError, name: &str) -> PlanError {
    match err {
        PlanError::OverBudget {
            budget, best_peak, ..
        } => PlanError::OverBudget {
            strategy: name.to_string(),
            budget,
            best_peak,
        },
        PlanError::NotApplicable { why, .. } => PlanError::NotApplicable {
            strategy: name.to_string(),
            why,
        },
        other => other,
    }
}

/// Which action Algorithm B applied to a candidate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Choice {
    Swap { prompt: NodeId },
    Recompute,
}

pub(crate) struct Scheduler<'p> {
    problem: &'p Problem<'p>,
    graph: &'p Graph,
    pub(crate) attrs: Vec<TensorAttrs>,
    pub(crate) candidates: Vec<NodeId>,
    pub(crate) decisions: Vec<Decision>,
    swaps: Vec<NodeId>,
    pub(crate) recomps: Vec<NodeId>,
    /// Algorithm B's `last_prompt`: the prompt of the most recently scheduled swap
    /// (`last_swap`), initially the last node of the graph. Algorithm C compares a new
    /// candidate's use against it (case 1) and starts its backward walk there (cases 2-3).
    last_prompt: NodeId,
    /// The swap whose prefetch starts at `last_prompt`: its copy is the one a new prefetch
    /// may have to wait for (case 1(b)).
    last_swap: Option<NodeId>,
    reached_peak: bool,
    /// Device bytes when each node of the current plan starts (for the peak interval).
    node_mem: Vec<u64>,
    prefix: Vec<f64>,
    /// Choices in order, for tests and explanations.
    pub(crate) trace: Vec<(NodeId, Choice)>,
    /// When set, [`Scheduler::run`] gives up at this instant (a search's time limit).
    pub(crate) deadline: Option<Instant>,
}

impl<'p> Scheduler<'p> {
    pub(crate) fn new(problem: &'p Problem<'p>) -> Scheduler<'p> {
        let graph = problem.graph;
        let attrs = tensor_attrs(graph, problem.bandwidth);
        let candidates = (0..graph.len())
            .filter(|&id| graph.node(id).phase == Phase::Forward && attrs[id].idle.is_some())
            .collect();
        Scheduler {
            problem,
            graph,
            attrs,
            candidates,
            decisions: vec![Decision::Keep; graph.len()],
            swaps: Vec::new(),
            recomps: Vec::new(),
            last_prompt: graph.len().saturating_sub(1),
            last_swap: None,
            reached_peak: false,
            node_mem: vec![0; graph.len()],
            prefix: prefix_times(graph),
            trace: Vec::new(),
            deadline: None,
        }
    }

    fn window(&self, t: NodeId) -> (NodeId, NodeId) {
        self.attrs[t].idle.unwrap_or((t, t))
    }

    /// Algorithm B. Returns the decisions of the first plan whose simulated peak fits.
    pub(crate) fn run(&mut self) -> Result<Vec<Decision>, PlanError> {
        let mut smallest = self.measure()?;
        if smallest <= self.problem.budget_bytes {
            return Ok(self.decisions.clone());
        }
        while !self.candidates.is_empty() {
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(PlanError::NotApplicable {
                    strategy: "mutwo".into(),
                    why: format!(
                        "out of time after {} of its choices, before the peak fitted",
                        self.trace.len()
                    ),
                });
            }
            self.step();
            let peak = self.measure()?;
            smallest = smallest.min(peak);
            if peak <= self.problem.budget_bytes {
                return Ok(self.decisions.clone());
            }
        }
        Err(PlanError::OverBudget {
            strategy: "mutwo".into(),
            budget: self.problem.budget_bytes,
            best_peak: smallest,
        })
    }

    /// One iteration of Algorithm B's loop, without the stop test.
    pub(crate) fn step(&mut self) {
        let s_cand = self.argmax(|a| a.inactive_time);
        let (s_overhead, prompt) = self.swap_overhead(s_cand);
        // A pinned tensor (or one whose rebuild needs a pinned tensor already dead) can
        // only be swapped: it is never the recompute candidate, and when no candidate may
        // be recomputed the swap candidate is taken.
        let r_cand = self.argmax_where(TensorAttrs::recompute_ratio, |t| self.graph.may_drop(t));
        let choice = match r_cand {
            Some(r_cand)
                if !(s_overhead < self.attrs[r_cand].total_recomp_time
                    && self.copy_out_clears_peak(s_cand)) =>
            {
                (r_cand, Choice::Recompute)
            }
            _ => (s_cand, Choice::Swap { prompt }),
        };
        self.apply(choice.0, choice.1);
    }

    /// Algorithm B lines 11-22: records the choice for `cand` and updates recompute
    /// sources, the remaining candidates and the prompts of earlier swaps.
    pub(crate) fn apply(&mut self, cand: NodeId, choice: Choice) {
        let (start, use_at) = self.window(cand);
        match choice {
            Choice::Swap { prompt } => {
                self.decisions[cand] = Decision::Swap {
                    swap_out_after: start,
                    prefetch_at: prompt,
                    use_at,
                };
                // Algorithm B line 11: `last_prompt = Swap(s_cand, prompt_node)`.
                self.last_prompt = prompt;
                self.last_swap = Some(cand);
                self.swaps.push(cand);
            }
            Choice::Recompute => {
                self.decisions[cand] = Decision::Recompute {
                    from: self.attrs[cand].recomp_srcs.clone(),
                    drop_after: start,
                    use_at,
                };
                self.recomps.push(cand);
            }
        }
        self.trace.push((cand, choice));
        self.candidates.retain(|&c| c != cand);
        let recomp_cnt = self.update_recomps(cand);
        self.update_candidates(cand, recomp_cnt);
        self.update_swap_prompts();
    }

    /// The candidate maximizing `key`, the earliest on ties (deterministic plans).
    fn argmax(&self, key: impl Fn(&TensorAttrs) -> f64) -> NodeId {
        self.argmax_where(key, |_| true)
            .unwrap_or(self.candidates[0])
    }

    /// The candidate passing `allowed` that maximizes `key`, the earliest on ties.
    fn argmax_where(
        &self,
        key: impl Fn(&TensorAttrs) -> f64,
        allowed: impl Fn(NodeId) -> bool,
    ) -> Option<NodeId> {
        let mut best: Option<NodeId> = None;
        for &c in self.candidates.iter().filter(|&&c| allowed(c)) {
            if best.is_none_or(|b| key(&self.attrs[c]) > key(&self.attrs[b])) {
                best = Some(c);
            }
        }
        best
    }

    /// Recompute time scheduled just before node `v` (recomputations whose use is `v`).
    fn recomp_time_at(&self, v: NodeId) -> f64 {
        self.recomps
            .iter()
            .filter(|&&r| self.window(r).1 == v)
            .map(|&r| self.attrs[r].recomp_time)
            .sum()
    }

    /// Algorithm C: (exposed swap time, prefetch prompt) for swapping `cand`.
    ///
    /// The prompt is the node before which the copy-in is issued (the lowering emits the
    /// `SwapIn` just before that node computes), so the nodes that hide the copy are the
    /// prompt itself up to the node before the use. The paper's pseudocode steps one node
    /// further back after the last node it consumed (`prefetch_prompt.prev`, line 40); we
    /// return the last consumed node, which hides the same copy and holds its bytes for
    /// one node less.
    pub(crate) fn swap_overhead(&mut self, cand: NodeId) -> (f64, NodeId) {
        let (start, bw_access) = self.window(cand);
        // Lines 3-5: recomputations run just before the use also hide the copy.
        let mut swap_time = self.attrs[cand].swap_time - self.recomp_time_at(bw_access);
        if self.reached_peak {
            if bw_access < self.last_prompt {
                // Case 1(a): the copy cannot overlap anything inside the peak interval,
                // and the copy stream is free (the last prefetch starts after this use).
                return (swap_time.max(0.0), bw_access);
            }
            // Case 1(b): it also waits for the in-flight copy of the last prompt.
            return (swap_time.max(0.0) + self.in_flight_at(bw_access), bw_access);
        }
        // Cases 2 and 3 (lines 32-41): hide the copy behind backward nodes before the use.
        let Some(mut p) = first_overlap_node(bw_access, self.last_prompt) else {
            return (swap_time.max(0.0), bw_access);
        };
        let mut prompt = bw_access;
        // Never before the swap-out's node: the copy-in cannot start before the copy-out.
        while swap_time > 0.0 && p > start {
            if self.node_mem[p] > self.problem.budget_bytes {
                // `not_reached_peak` fails: prefetching inside the peak interval would raise
                // the peak (case 3 from now on: later candidates take case 1).
                self.reached_peak = true;
                break;
            }
            swap_time -= self.graph.node(p).compute_time + self.recomp_time_at(p);
            prompt = p;
            p -= 1;
        }
        (swap_time.max(0.0), prompt)
    }

    /// Swap-out deviation: the paper's memory simulator (its Algorithm G) frees an
    /// offloaded tensor at its last forward access, but its bytes stay on the device until
    /// the copy-out finishes, and copy-outs queue on one device-to-host stream. A swap whose
    /// copy is still running at a node of the peak interval frees nothing there, so taking
    /// it would spend the candidate without lowering the peak (and Algorithm B could run
    /// out of candidates above the budget). Copy-outs are estimated in order of their
    /// swap-out node, each starting when its node ends and the stream is free.
    fn copy_out_clears_peak(&self, cand: NodeId) -> bool {
        let mut outs: Vec<(NodeId, NodeId)> = self
            .swaps
            .iter()
            .chain(std::iter::once(&cand))
            .map(|&s| (self.window(s).0, s))
            .collect();
        outs.sort_unstable();
        let mut stream_free = 0.0f64;
        let mut done = 0.0;
        for (after, s) in outs {
            stream_free = stream_free.max(self.prefix[after + 1]) + self.attrs[s].swap_time;
            if s == cand {
                done = stream_free;
            }
        }
        let start = self.window(cand).0;
        (start + 1..self.graph.len())
            .take_while(|&v| self.prefix[v] < done)
            .all(|v| self.node_mem[v] <= self.problem.budget_bytes)
    }

    /// Copy time of the swap prefetched at `last_prompt` still running when `v` starts.
    fn in_flight_at(&self, v: NodeId) -> f64 {
        self.last_swap.map_or(0.0, |s| {
            let elapsed = self.prefix[v.max(self.last_prompt)] - self.prefix[self.last_prompt];
            (self.attrs[s].swap_time - elapsed).max(0.0)
        })
    }

    /// Algorithm E: `cand` leaves the sources of earlier recomputations, replaced by its own
    /// sources; returns how many times it is recomputed in its lifetime.
    pub(crate) fn update_recomps(&mut self, cand: NodeId) -> u32 {
        let mut recomp_cnt = 1;
        let cand_srcs = self.attrs[cand].recomp_srcs.clone();
        let cand_time = self.attrs[cand].recomp_time;
        for &rp in &self.recomps {
            if rp == cand {
                continue;
            }
            let srcs = &mut self.attrs[rp].recomp_srcs;
            if let Some(pos) = srcs.iter().position(|&s| s == cand) {
                srcs.swap_remove(pos);
                merge(srcs, &cand_srcs);
                self.attrs[rp].recomp_time += cand_time;
                recomp_cnt += 1;
            }
        }
        self.attrs[cand].recomp_cnt = recomp_cnt;
        recomp_cnt
    }

    /// Algorithm F: the remaining candidates see `t` swapped or recomputed.
    pub(crate) fn update_candidates(&mut self, t: NodeId, recomp_cnt: u32) {
        let t_srcs = self.attrs[t].recomp_srcs.clone();
        let t_time = self.attrs[t].recomp_time;
        let t_active = (self.attrs[t].first_bw_access, self.attrs[t].last_bw_access);
        for i in 0..self.candidates.len() {
            let cand = self.candidates[i];
            if self.attrs[cand].recomp_srcs.contains(&t) {
                let first_bw = self.attrs[cand].first_bw_access;
                let t_resident = matches!((first_bw, t_active), (Some(f), (Some(a), Some(b))) if a <= f && f <= b);
                if !t_resident {
                    let srcs = &mut self.attrs[cand].recomp_srcs;
                    srcs.retain(|&s| s != t);
                    merge(srcs, &t_srcs);
                    self.attrs[cand].recomp_time += t_time;
                    let per_run = self.attrs[cand].recomp_time;
                    let uses = self
                        .recomps
                        .iter()
                        .filter(|&&rp| self.attrs[rp].recomp_srcs.contains(&cand))
                        .count();
                    self.attrs[cand].total_recomp_time = per_run * (1 + uses) as f64;
                }
            }
            if t_srcs.contains(&cand) && self.recomps.contains(&t) {
                self.attrs[cand].total_recomp_time =
                    f64::from(recomp_cnt) * self.attrs[cand].recomp_time;
            }
        }
    }

    /// Algorithm B line 22: prompts of scheduled swaps move later when new recomputations
    /// in their prefetch window hide part of the copy (less time holding the prefetched
    /// bytes). Each swap's walk is redone as in Algorithm C, latest use first, starting no
    /// later than the prompt of the swap using its data after it (one copy stream serves
    /// all prefetches), and never earlier than its current prompt. `last_prompt` then
    /// follows the most recent swap to its new prompt.
    pub(crate) fn update_swap_prompts(&mut self) {
        let mut swaps = self.swaps.clone();
        swaps.sort_by_key(|&s| std::cmp::Reverse(self.window(s).1));
        let mut bound = self.graph.len().saturating_sub(1);
        for s in swaps {
            let Decision::Swap {
                swap_out_after,
                prefetch_at,
                use_at,
            } = self.decisions[s]
            else {
                continue;
            };
            let mut remaining = self.attrs[s].swap_time - self.recomp_time_at(use_at);
            let mut prompt = use_at;
            let mut next = first_overlap_node(use_at, bound);
            // Prompts only move later: the walk stops at the current one.
            while let Some(p) =
                next.filter(|&p| remaining > 0.0 && p > swap_out_after && p >= prefetch_at)
            {
                remaining -= self.graph.node(p).compute_time + self.recomp_time_at(p);
                prompt = p;
                next = p.checked_sub(1);
            }
            let prompt = prompt.max(prefetch_at);
            self.decisions[s] = Decision::Swap {
                swap_out_after,
                prefetch_at: prompt,
                use_at,
            };
            bound = bound.min(prompt);
            if self.last_swap == Some(s) {
                self.last_prompt = prompt;
            }
        }
    }

    /// Simulates the current decisions; records per-node memory; returns the peak.
    fn measure(&mut self) -> Result<u64, PlanError> {
        let lowered = lower(self.graph, &self.decisions, self.problem.bandwidth)?;
        let report = simulate_steps(self.graph, &lowered.steps, self.problem.bandwidth).map_err(
            |error| PlanError::InvalidSchedule {
                strategy: "mutwo".into(),
                error,
            },
        )?;
        let mut at_step = vec![0u64; lowered.steps.len()];
        for point in &report.timeline {
            if let Some(slot) = at_step.get_mut(point.step) {
                *slot = (*slot).max(point.bytes);
            }
        }
        let mut seen = vec![false; self.graph.len()];
        for (i, step) in lowered.steps.iter().enumerate() {
            if let Step::Compute { node } = *step
                && !seen[node]
            {
                seen[node] = true;
                self.node_mem[node] = at_step[i];
            }
        }
        Ok(report.peak_bytes)
    }
}

/// The first node (walking back) whose compute can hide a copy-in used at `use_at`, given
/// the prompt `last_prompt` of the prefetch issued before it (Algorithm C lines 32-36): the
/// node before the use when the use comes before `last_prompt`, else `last_prompt` itself,
/// since the copy stream is busy until then. Deviation: when the use *is* `last_prompt`
/// the paper would count the using node's own compute; the data must be there before it
/// runs, so the walk starts one node earlier. None when no node precedes the use.
fn first_overlap_node(use_at: NodeId, last_prompt: NodeId) -> Option<NodeId> {
    if use_at <= last_prompt {
        use_at.checked_sub(1)
    } else {
        Some(last_prompt)
    }
}

/// Adds the sources in `extra` not already in `srcs`.
fn merge(srcs: &mut Vec<NodeId>, extra: &[NodeId]) {
    for &s in extra {
        if !srcs.contains(&s) {
            srcs.push(s);
        }
    }
}

#[cfg(test)]
mod tests;
