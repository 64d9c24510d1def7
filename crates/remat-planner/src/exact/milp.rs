//! Checkmate's MILP (Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
//! Rematerialization", MLSys 2020), solved with HiGHS. Feature `milp`.
//!
//! The graph's node order is split into `n` stages; stage `t` must compute node `t` (the
//! frontier advances by one node per stage) and may recompute any earlier node. Variables:
//!
//! - `R[t][i]` (binary, `i <= t`): node `i` is computed in stage `t`, in node order;
//! - `S[t][i]` (binary, `i < t`): `i`'s output is on the device when stage `t` starts;
//! - `FREE[t][i][k]` (binary): `i` (an input of `k`, or `k` itself) is freed right after `k`
//!   in stage `t`: `k` ran, `i` is not kept for stage `t + 1` and no later reader of `i` runs
//!   in stage `t`. It is tied to its "hazards" `h = (1 - R[t][k]) + S[t+1][i] + sum R[t][j]`
//!   by `1 - FREE <= h <= kappa (1 - FREE)`, so `FREE = 1` exactly when `h = 0`;
//! - `U[t][k]` (continuous): device memory while `k` runs in stage `t`, built by
//!   `U[t][0] = sum_i M_i S[t][i] + M_0 R[t][0]`,
//!   `U[t][k] = U[t][k-1] - sum_i M_i FREE[t][i][k-1] + M_k R[t][k]`, bounded by the budget.
//!
//! Constraints: `R[t][t] = 1`; an input of a computed node is computed earlier in the stage or
//! stored (`R[t][k] <= R[t][j] + S[t][j]`); only what was on the device can be kept
//! (`S[t+1][i] <= R[t][i] + S[t][i]`); a pinned node ([`Graph::is_pinned`]) is computed
//! only in its own stage (`R[t][i] = 0` for `t > i`), so it must be kept until its last use.
//! Objective: the total compute time `sum C_i R[t][i]`.
//!
//! This accounting is the simulator's (outputs allocated as a node starts, inputs and output
//! coexist, a tensor freed after its last reader), so the extracted schedule's simulated
//! peak is at most the MILP's memory bound and its time is the MILP's objective.
//!
//! **Incumbent and bound.** Under a time limit HiGHS may stop before proving optimality; the
//! answer is then its best schedule so far (if any) together with its dual bound, a proved
//! lower bound on the total time of every schedule of this model: the graph's node order,
//! recomputation but no swapping. [`CheckmateMilp::solve`] returns both as a
//! [`MilpOutcome`], so a caller can print "the optimum is at least X". Infeasibility proofs
//! stay answers ([`MilpError::Infeasible`]); graphs above [`MilpOptions::max_nodes`] are
//! refused with a message that says to use a fast strategy.
//!
//! Why one file of ~610 lines: one MILP, from its variables and rows to the schedule read back
//! from a solution and the strategy around it; its rows are read best beside each other.

use std::time::{Duration, Instant};

use highs::{HighsModelStatus, HighsSolutionStatus, RowProblem, Sense};

use crate::error::PlanError;
use crate::ir::{Graph, NodeId};
use crate::plan::Step;
use crate::problem::{Planned, Problem, plan_from_steps};
use crate::strategy::Strategy;

use super::chain_graph::decisions_of;

pub const NAME: &str = "checkmate-milp";

/// Solver limits.
#[derive(Clone, Copy, Debug)]
pub struct MilpOptions {
    /// Wall-clock limit for the whole solve (HiGHS and its re-solves); the best schedule
    /// found by then is returned with the proved bound, not proven optimal.
    pub time_limit_s: f64,
    /// Relative optimality gap at which HiGHS stops.
    pub mip_rel_gap: f64,
    /// Graphs with more nodes are refused (the model has O(n^2) binaries).
    pub max_nodes: usize,
    /// Answer "infeasible" without HiGHS when the budget is under the graph's floor (a
    /// proof: every node runs once with its inputs and output resident). HiGHS needs
    /// minutes to find the same by branching on real graphs; tests turn it off on small
    /// ones to check that the model agrees.
    pub floor_shortcut: bool,
    /// Stop once HiGHS has found this many improving schedules (a quick incumbent with its
    /// bound, rather than a proof); `None`: no such limit.
    pub max_improving_schedules: Option<i32>,
}

impl Default for MilpOptions {
    fn default() -> Self {
        MilpOptions {
            time_limit_s: 120.0,
            mip_rel_gap: 1e-6,
            max_nodes: 200,
            floor_shortcut: true,
            max_improving_schedules: None,
        }
    }
}

/// The MILP's answer.
#[derive(Clone, Debug)]
pub struct MilpSolution {
    pub steps: Vec<Step>,
    /// Total compute time of the schedule (the objective).
    pub objective: f64,
    /// The schedule is proved optimal: its time is within `mip_rel_gap` of the bound.
    pub optimal: bool,
    /// Proved lower bound on the total time of any schedule of the model (HiGHS's dual
    /// bound, and at least the graph's base time).
    pub lower_bound: f64,
}

/// What the MILP found and proved for a problem within its time limit.
#[derive(Clone, Debug)]
pub struct MilpOutcome {
    /// The best schedule found (HiGHS's incumbent), checked by the simulator; `None` when
    /// HiGHS found none in time.
    pub planned: Option<Planned>,
    /// Proved lower bound on the total time (graph time units) of any schedule that keeps
    /// the graph's node order and recomputes without swapping: no such plan is faster.
    pub lower_bound_time: f64,
    /// The plan's time meets the bound (within the relative gap): it is optimal.
    pub proved_optimal: bool,
}

impl MilpOutcome {
    /// The bound as an overhead over the graph's base time (no plan of the model has less).
    pub fn lower_bound_overhead(&self, graph: &Graph) -> f64 {
        let base = graph.base_time();
        if base > 0.0 {
            (self.lower_bound_time - base).max(0.0) / base
        } else {
            0.0
        }
    }
}

/// Why the MILP produced no schedule.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MilpError {
    #[error("graph `{graph}`: HiGHS proved that no schedule fits in {budget} bytes")]
    Infeasible { graph: String, budget: u64 },
    #[error(
        "graph `{graph}`: HiGHS stopped ({status}) with no schedule under the budget; the optimum is at least {lower_bound:.6e}"
    )]
    NoSolution {
        graph: String,
        status: String,
        /// Proved lower bound on the total time (see [`MilpSolution::lower_bound`]).
        lower_bound: f64,
    },
    #[error("graph `{graph}`: HiGHS failed: {what}")]
    Solver { graph: String, what: String },
    #[error(
        "graph `{graph}` has {nodes} nodes, too many for the exact MILP (limit {limit}: its model has O(n^2) binaries): use a fast strategy, such as the default search"
    )]
    TooLarge {
        graph: String,
        nodes: usize,
        limit: usize,
    },
}

/// Column indices of the model's variables.
struct Vars {
    r: Vec<Vec<highs::Col>>,
    s: Vec<Vec<highs::Col>>,
    /// Row-major copy of the column order, to read the solution back.
    r_idx: Vec<Vec<usize>>,
    s_idx: Vec<Vec<usize>>,
}

struct Builder<'g> {
    graph: &'g Graph,
    pb: RowProblem,
    /// Memory scale: sizes are divided by the budget so coefficients stay near 1.
    scale: f64,
}

impl Builder<'_> {
    fn binary(&mut self, cost: f64) -> (highs::Col, usize) {
        let col = self.pb.add_integer_column(cost, 0..=1);
        (col, col.index())
    }
    fn mem(&self, v: NodeId) -> f64 {
        self.graph.node(v).output_bytes as f64 / self.scale
    }
}

/// Solves Checkmate's MILP for `graph` under `budget_bytes` (static memory included).
pub fn solve_milp(
    graph: &Graph,
    budget_bytes: u64,
    options: &MilpOptions,
) -> Result<MilpSolution, MilpError> {
    let n = graph.len();
    if n > options.max_nodes {
        return Err(MilpError::TooLarge {
            graph: graph.name().into(),
            nodes: n,
            limit: options.max_nodes,
        });
    }
    let infeasible = || MilpError::Infeasible {
        graph: graph.name().into(),
        budget: budget_bytes,
    };
    let cap = budget_bytes
        .checked_sub(graph.static_bytes())
        .ok_or_else(infeasible)?;
    // Every node runs at least once with its inputs and output on the device, so no schedule
    // goes below the floor: that is a proof of infeasibility, and one HiGHS takes minutes
    // to find by branching when the budget is a byte under the floor.
    if options.floor_shortcut && budget_bytes < graph.memory_floor() {
        return Err(infeasible());
    }
    let base = graph.base_time();
    let deadline = Instant::now() + Duration::from_secs_f64(options.time_limit_s.max(0.0));
    // HiGHS accepts a memory row violated by up to its feasibility tolerance (1e-6 of the
    // budget, kilobytes on real graphs), so the simulator checks the extracted schedule in
    // exact bytes; a schedule over the budget by such a sliver makes us solve again with the
    // cap lowered by the excess plus the tolerance band. Only the first model (the true cap,
    // a slight relaxation through the tolerance) proves anything: its infeasibility and its
    // dual bound hold for the budget; a lowered cap's do not.
    let mut effective = cap;
    let mut lower_bound = base;
    let mut status = String::from("no solve");
    for attempt in 0..3 {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .as_secs_f64();
        if attempt > 0 && left <= 0.0 {
            break;
        }
        let found = match solve_once(graph, cap, effective, left, options) {
            Err(MilpError::Infeasible { .. }) if attempt == 0 => return Err(infeasible()),
            Err(MilpError::Infeasible { .. }) => break,
            other => other?,
        };
        if attempt == 0 {
            lower_bound = found.dual_bound.max(base);
        }
        status = found.status;
        let Some(steps) = found.steps else { break };
        let report =
            crate::sim::simulate_steps(graph, &steps, 1.0).map_err(|e| MilpError::Solver {
                graph: graph.name().into(),
                what: format!("extracted schedule does not run: {e}"),
            })?;
        if report.peak_bytes <= budget_bytes {
            let objective = report.total_time;
            // The bound may exceed the objective by HiGHS's tolerances only.
            let lower_bound = lower_bound.min(objective);
            let optimal = objective - lower_bound
                <= options.mip_rel_gap * objective.abs() + 1e-9 * objective.abs().max(1.0);
            return Ok(MilpSolution {
                objective,
                steps,
                optimal,
                lower_bound,
            });
        }
        let band = (cap as f64 * 2e-6) as u64 + 1;
        effective = effective.saturating_sub(report.peak_bytes - budget_bytes + band);
        status = "every schedule found exceeds the budget within HiGHS's tolerance".into();
    }
    Err(MilpError::NoSolution {
        graph: graph.name().into(),
        status,
        lower_bound,
    })
}

/// One HiGHS solve: the schedule (if HiGHS found one), whether HiGHS proved it optimal for
/// the model it solved, its dual bound and its status.
struct Attempt {
    steps: Option<Vec<Step>>,
    dual_bound: f64,
    status: String,
}

/// Builds and solves the model once with memory rows capped at `effective` bytes (sizes are
/// scaled by `cap` so coefficients stay near 1), for at most `time_limit_s` seconds.
fn solve_once(
    graph: &Graph,
    cap: u64,
    effective: u64,
    time_limit_s: f64,
    options: &MilpOptions,
) -> Result<Attempt, MilpError> {
    let scale = cap.max(1) as f64;
    let mut b = Builder {
        graph,
        pb: RowProblem::default(),
        scale,
    };
    let vars = add_stage_vars(&mut b);
    add_dependency_rows(&mut b, &vars);
    add_memory_rows(&mut b, &vars, effective as f64 / scale);
    let solver = |what: &str, status: &dyn std::fmt::Debug| MilpError::Solver {
        graph: graph.name().into(),
        what: format!("{what}: {status:?}"),
    };
    let mut model =
        b.pb.try_optimise(Sense::Minimise)
            .map_err(|e| solver("model rejected", &e))?;
    for (option, value) in [("output_flag", 0.0), ("log_to_console", 0.0)] {
        model
            .try_set_option(option, value != 0.0)
            .map_err(|e| solver(option, &e))?;
    }
    model
        .try_set_option("time_limit", time_limit_s.max(0.0))
        .map_err(|e| solver("time_limit", &e))?;
    model
        .try_set_option("mip_rel_gap", options.mip_rel_gap)
        .map_err(|e| solver("mip_rel_gap", &e))?;
    model
        .try_set_option("threads", 1)
        .map_err(|e| solver("threads", &e))?;
    if let Some(limit) = options.max_improving_schedules {
        model
            .try_set_option("mip_max_improving_sols", limit.max(1))
            .map_err(|e| solver("mip_max_improving_sols", &e))?;
    }
    let solved = model.try_solve().map_err(|e| solver("solve", &e))?;
    let status = solved.status();
    if matches!(
        status,
        HighsModelStatus::Infeasible | HighsModelStatus::UnboundedOrInfeasible
    ) {
        return Err(MilpError::Infeasible {
            graph: graph.name().into(),
            budget: effective,
        });
    }
    // HiGHS's proved bound on the objective; -inf (or NaN) when it stopped before bounding.
    let dual_bound = solved
        .double_info_value(c"mip_dual_bound")
        .ok()
        .filter(|b| b.is_finite())
        .unwrap_or(f64::NEG_INFINITY);
    if solved.primal_solution_status() != HighsSolutionStatus::Feasible {
        return Ok(Attempt {
            steps: None,
            dual_bound,
            status: format!("{status:?}"),
        });
    }
    let solution = solved.get_solution();
    let cols = solution.columns();
    let on = |i: usize| cols[i] > 0.5;
    let r: Vec<Vec<bool>> = vars
        .r_idx
        .iter()
        .map(|row| row.iter().map(|&i| on(i)).collect())
        .collect();
    let s: Vec<Vec<bool>> = vars
        .s_idx
        .iter()
        .map(|row| row.iter().map(|&i| on(i)).collect())
        .collect();
    Ok(Attempt {
        steps: Some(extract_schedule(graph, &r, &s)),
        dual_bound,
        status: format!("{status:?}"),
    })
}

fn add_stage_vars(b: &mut Builder) -> Vars {
    let n = b.graph.len();
    let mut vars = Vars {
        r: Vec::new(),
        s: Vec::new(),
        r_idx: Vec::new(),
        s_idx: Vec::new(),
    };
    for t in 0..n {
        let (mut r, mut ri) = (Vec::new(), Vec::new());
        for i in 0..=t {
            let (col, idx) = b.binary(b.graph.node(i).compute_time);
            r.push(col);
            ri.push(idx);
        }
        // The frontier: stage t computes node t.
        b.pb.add_row(1.0..=1.0, [(r[t], 1.0)]);
        // A pinned node is never recomputed: its value cannot be rebuilt (it accumulates).
        for (i, &col) in r.iter().enumerate().take(t) {
            if b.graph.is_pinned(i) {
                b.pb.add_row(0.0..=0.0, [(col, 1.0)]);
            }
        }
        let (mut s, mut si) = (Vec::new(), Vec::new());
        for _ in 0..t {
            let (col, idx) = b.binary(0.0);
            s.push(col);
            si.push(idx);
        }
        vars.r.push(r);
        vars.s.push(s);
        vars.r_idx.push(ri);
        vars.s_idx.push(si);
    }
    vars
}

fn add_dependency_rows(b: &mut Builder, vars: &Vars) {
    let n = b.graph.len();
    for t in 0..n {
        for k in 0..=t {
            for &j in &b.graph.node(k).inputs {
                // R[t][k] <= R[t][j] + S[t][j]
                b.pb.add_row(
                    ..=0.0,
                    [
                        (vars.r[t][k], 1.0),
                        (vars.r[t][j], -1.0),
                        (vars.s[t][j], -1.0),
                    ],
                );
            }
        }
        if t + 1 < n {
            for i in 0..=t {
                // S[t+1][i] <= R[t][i] + S[t][i]
                let mut row = vec![(vars.s[t + 1][i], 1.0), (vars.r[t][i], -1.0)];
                if i < t {
                    row.push((vars.s[t][i], -1.0));
                }
                b.pb.add_row(..=0.0, row);
            }
        }
    }
}

fn add_memory_rows(b: &mut Builder, vars: &Vars, cap: f64) {
    let n = b.graph.len();
    for t in 0..n {
        let mut prev: Option<highs::Col> = None;
        let mut freed_prev: Vec<(highs::Col, f64)> = Vec::new();
        for k in 0..=t {
            let u = b.pb.add_column(0.0, 0.0..=cap);
            // U[t][k] - U[t][k-1] + freed(k-1) - M_k R[t][k] = 0 (U[t][-1] = stored bytes).
            let mut row = vec![(u, 1.0), (vars.r[t][k], -b.mem(k))];
            match prev {
                Some(p) => row.push((p, -1.0)),
                None => row.extend((0..t).map(|i| (vars.s[t][i], -b.mem(i)))),
            }
            row.extend(freed_prev.iter().map(|&(col, m)| (col, m)));
            b.pb.add_row(0.0..=0.0, row);
            freed_prev = add_free_vars(b, vars, t, k);
            prev = Some(u);
        }
    }
}

/// FREE[t][i][k] for `i` in inputs(k) + {k}, tied to its hazards; returns (column, M_i).
fn add_free_vars(b: &mut Builder, vars: &Vars, t: usize, k: usize) -> Vec<(highs::Col, f64)> {
    let n = b.graph.len();
    let graph = b.graph;
    let candidates = graph
        .node(k)
        .inputs
        .iter()
        .copied()
        .chain(std::iter::once(k));
    let mut freed = Vec::new();
    for i in candidates {
        let (free, _) = b.binary(0.0);
        // hazards = (1 - R[t][k]) + S[t+1][i] + sum_{j in users(i), k < j <= t} R[t][j]
        let mut hazards = vec![(vars.r[t][k], -1.0)];
        if t + 1 < n {
            hazards.push((vars.s[t + 1][i], 1.0));
        }
        hazards.extend(
            graph
                .users(i)
                .iter()
                .filter(|&&j| j > k && j <= t)
                .map(|&j| (vars.r[t][j], 1.0)),
        );
        let kappa = hazards.len() as f64;
        // 1 - FREE <= hazards  <=>  FREE + hazards' >= 0, where hazards' = hazards - 1.
        let mut low = hazards.clone();
        low.push((free, 1.0));
        b.pb.add_row(0.0.., low);
        // hazards <= kappa (1 - FREE)  <=>  hazards' + kappa FREE <= kappa - 1.
        let mut high = hazards;
        high.push((free, kappa));
        b.pb.add_row(..=kappa - 1.0, high);
        freed.push((free, b.mem(i)));
    }
    freed
}

/// Turns R and S into steps: each stage computes its R nodes in order and frees a tensor
/// right after its last reader in the stage unless S keeps it for the next stage; stored
/// tensors the stage neither reads nor keeps are freed when it starts.
fn extract_schedule(graph: &Graph, r: &[Vec<bool>], s: &[Vec<bool>]) -> Vec<Step> {
    let n = graph.len();
    let mut on_device = vec![false; n];
    let mut steps = Vec::new();
    let kept_next = |t: usize, i: usize| t + 1 < n && s[t + 1][i];
    for (t, computes) in r.iter().enumerate() {
        // last_reader[i]: the last node of this stage reading i (or i itself).
        let mut last_reader: Vec<Option<NodeId>> = vec![None; n];
        for k in (0..=t).filter(|&k| computes[k]) {
            last_reader[k] = Some(last_reader[k].unwrap_or(k).max(k));
            for &j in &graph.node(k).inputs {
                last_reader[j] = Some(k);
            }
        }
        for i in 0..n {
            if on_device[i] && last_reader[i].is_none() && !kept_next(t, i) {
                steps.push(Step::Free { tensor: i });
                on_device[i] = false;
            }
        }
        for k in (0..=t).filter(|&k| computes[k]) {
            if !on_device[k] {
                steps.push(Step::Compute { node: k });
                on_device[k] = true;
            }
            let done = graph
                .node(k)
                .inputs
                .iter()
                .copied()
                .chain(std::iter::once(k));
            for i in done.filter(|&i| last_reader[i] == Some(k)) {
                if on_device[i] && !kept_next(t, i) {
                    steps.push(Step::Free { tensor: i });
                    on_device[i] = false;
                }
            }
        }
    }
    steps
}

/// Checkmate's MILP as a registered strategy.
pub struct CheckmateMilp {
    pub options: MilpOptions,
}

impl CheckmateMilp {
    /// Solves `problem` within the time limit: the best schedule found (checked by the
    /// simulator), the proved lower bound on its model's optimum, and whether the schedule
    /// is proved optimal. A proof that no schedule fits is [`PlanError::ProvedInfeasible`];
    /// a graph too large for the model, or a solver failure, is
    /// [`PlanError::NotApplicable`] saying so.
    pub fn solve(&self, problem: &Problem) -> Result<MilpOutcome, PlanError> {
        let solution = match solve_milp(problem.graph, problem.budget_bytes, &self.options) {
            Ok(solution) => solution,
            Err(MilpError::NoSolution { lower_bound, .. }) => {
                return Ok(MilpOutcome {
                    planned: None,
                    lower_bound_time: lower_bound,
                    proved_optimal: false,
                });
            }
            Err(e @ MilpError::Infeasible { .. }) => {
                return Err(PlanError::ProvedInfeasible {
                    strategy: NAME.into(),
                    budget: problem.budget_bytes,
                    why: e.to_string(),
                });
            }
            Err(other) => {
                return Err(PlanError::NotApplicable {
                    strategy: NAME.into(),
                    why: other.to_string(),
                });
            }
        };
        let decisions = decisions_of(problem.graph, &solution.steps);
        let planned = plan_from_steps(problem, NAME, solution.steps, decisions)?;
        Ok(MilpOutcome {
            planned: Some(planned),
            lower_bound_time: solution.lower_bound,
            proved_optimal: solution.optimal,
        })
    }
}

impl Strategy for CheckmateMilp {
    fn name(&self) -> String {
        NAME.into()
    }
    fn summary(&self) -> &'static str {
        "Checkmate's MILP via HiGHS (small graphs; optimal when solved in time, else its best schedule)"
    }
    fn is_exact(&self) -> bool {
        true
    }
    /// HiGHS's best schedule within the time limit, proved optimal or not (use
    /// [`CheckmateMilp::solve`] to know which, and for the bound). With no schedule found
    /// in time it declines, stating the bound.
    /// In a search under a time limit, HiGHS gets the time up to the deadline (or its own
    /// limit, if shorter) and returns its best schedule by then.
    fn search_cost(&self) -> crate::strategy::SearchCost {
        crate::strategy::SearchCost::UNTIL_DEADLINE
    }
    fn plan_until(&self, problem: &Problem, deadline: Instant) -> Result<Planned, PlanError> {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .as_secs_f64();
        let mut hurried = CheckmateMilp {
            options: self.options,
        };
        hurried.options.time_limit_s = self.options.time_limit_s.min(left);
        hurried.plan(problem)
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        let outcome = self.solve(problem)?;
        let bound = outcome.lower_bound_overhead(problem.graph);
        outcome.planned.ok_or_else(|| PlanError::NotApplicable {
            strategy: NAME.into(),
            why: format!(
                "HiGHS found no schedule within its {:.2} s time limit; it proved the optimum's overhead is at least {:.2}%",
                self.options.time_limit_s,
                100.0 * bound
            ),
        })
    }
}
