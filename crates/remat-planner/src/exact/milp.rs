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

use highs::{HighsModelStatus, HighsSolutionStatus, RowProblem, Sense};

use crate::error::PlanError;
use crate::ir::{Graph, NodeId};
use crate::plan::Step;
use crate::strategy::{Planned, Problem, Strategy, plan_from_steps};

use super::chain_graph::decisions_of;

pub const NAME: &str = "checkmate-milp";

/// Solver limits.
#[derive(Clone, Copy, Debug)]
pub struct MilpOptions {
    /// Wall-clock limit for HiGHS; the best schedule found by then is returned, not proven
    /// optimal.
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
}

impl Default for MilpOptions {
    fn default() -> Self {
        MilpOptions {
            time_limit_s: 120.0,
            mip_rel_gap: 1e-6,
            max_nodes: 200,
            floor_shortcut: true,
        }
    }
}

/// The MILP's answer.
#[derive(Clone, Debug)]
pub struct MilpSolution {
    pub steps: Vec<Step>,
    /// Total compute time of the schedule (the objective).
    pub objective: f64,
    /// HiGHS proved the schedule optimal (within `mip_rel_gap`).
    pub optimal: bool,
}

/// Why the MILP produced no schedule.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MilpError {
    #[error("graph `{graph}`: HiGHS proved that no schedule fits in {budget} bytes")]
    Infeasible { graph: String, budget: u64 },
    #[error("graph `{graph}`: HiGHS stopped with status {status} and no feasible schedule")]
    NoSolution { graph: String, status: String },
    #[error("graph `{graph}`: HiGHS failed: {what}")]
    Solver { graph: String, what: String },
    #[error("graph `{graph}` has {nodes} nodes; the MILP is limited to {limit}")]
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
    if n == 0 {
        return Ok(MilpSolution {
            steps: Vec::new(),
            objective: 0.0,
            optimal: true,
        });
    }
    // HiGHS accepts a memory row violated by up to its feasibility tolerance (1e-6 of the
    // budget, kilobytes on real graphs), so the simulator checks the extracted schedule in
    // exact bytes; a schedule over the budget by such a sliver makes us solve again with the
    // cap lowered by the excess plus the tolerance band.
    let mut effective = cap;
    for _ in 0..3 {
        let (steps, optimal) = match solve_once(graph, cap, effective, options) {
            Ok(found) => found,
            Err(MilpError::Infeasible { .. }) => return Err(infeasible()),
            Err(e) => return Err(e),
        };
        let report =
            crate::sim::simulate_steps(graph, &steps, 1.0).map_err(|e| MilpError::Solver {
                graph: graph.name().into(),
                what: format!("extracted schedule does not run: {e}"),
            })?;
        if report.peak_bytes <= budget_bytes {
            return Ok(MilpSolution {
                objective: report.total_time,
                steps,
                optimal,
            });
        }
        let band = (cap as f64 * 2e-6) as u64 + 1;
        effective = effective.saturating_sub(report.peak_bytes - budget_bytes + band);
    }
    Err(MilpError::NoSolution {
        graph: graph.name().into(),
        status: "every schedule found exceeds the budget within HiGHS's tolerance".into(),
    })
}

/// Builds and solves the model once with memory rows capped at `effective` bytes (sizes are
/// scaled by `cap` so coefficients stay near 1). Returns the schedule and whether HiGHS
/// proved it optimal.
fn solve_once(
    graph: &Graph,
    cap: u64,
    effective: u64,
    options: &MilpOptions,
) -> Result<(Vec<Step>, bool), MilpError> {
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
        .try_set_option("time_limit", options.time_limit_s)
        .map_err(|e| solver("time_limit", &e))?;
    model
        .try_set_option("mip_rel_gap", options.mip_rel_gap)
        .map_err(|e| solver("mip_rel_gap", &e))?;
    model
        .try_set_option("threads", 1)
        .map_err(|e| solver("threads", &e))?;
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
    if solved.primal_solution_status() != HighsSolutionStatus::Feasible {
        return Err(MilpError::NoSolution {
            graph: graph.name().into(),
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
    let steps = extract_schedule(graph, &r, &s);
    Ok((steps, status == HighsModelStatus::Optimal))
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

impl Strategy for CheckmateMilp {
    fn name(&self) -> String {
        NAME.into()
    }
    fn summary(&self) -> &'static str {
        "Checkmate's optimal MILP via HiGHS (small graphs; exact)"
    }
    fn is_exact(&self) -> bool {
        true
    }
    fn plan(&self, problem: &Problem) -> Result<Planned, PlanError> {
        let solution = solve_milp(problem.graph, problem.budget_bytes, &self.options).map_err(
            |e| match e {
                MilpError::Infeasible { .. } => PlanError::ProvedInfeasible {
                    strategy: NAME.into(),
                    budget: problem.budget_bytes,
                    why: e.to_string(),
                },
                // Too large, out of time or a solver failure: no answer either way.
                other => PlanError::NotApplicable {
                    strategy: NAME.into(),
                    why: other.to_string(),
                },
            },
        )?;
        // An exact strategy that could not prove its answer optimal declines rather than
        // pass a heuristic schedule off as the ground truth.
        if !solution.optimal {
            return Err(PlanError::NotApplicable {
                strategy: NAME.into(),
                why: format!(
                    "HiGHS reached its {} s time limit before proving a schedule optimal",
                    self.options.time_limit_s
                ),
            });
        }
        let decisions = decisions_of(problem.graph, &solution.steps);
        plan_from_steps(problem, NAME, solution.steps, decisions)
    }
}
