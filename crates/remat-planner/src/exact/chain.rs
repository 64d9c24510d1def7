//! Optimal checkpointing of a heterogeneous chain by dynamic programming.
//!
//! The chain has states `x_0 .. x_n` (`x_0` is the chain's input, always resident) and
//! stages `1..=n`: the forward step `F_k` computes `x_k` from `x_{k-1}`, and the backward
//! group `G_k` (one or more backward operations) needs `x_{k-1}` and, when
//! [`ChainModel::reads_output`] says so, `x_k`. Backward groups run in the fixed order
//! `G_n, G_{n-1}, .., G_1`. The schedule decides which states to keep and which to recompute
//! from an earlier kept state; the objective is the total time (forward recomputations
//! included) under a memory budget.
//!
//! Like Rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains", 2019) the
//! optimum is built from nested subproblems on an interval `(s, t]` whose left state `x_s`
//! is resident and stays resident:
//!
//! - `R(s, t, m)`: `x_t` is not resident; run `G_t .. G_{s+1}` within `m` memory units
//!   (`x_s` and the backward tensors live meanwhile included, outer checkpoints excluded).
//! - `K(s, t, m)`: same, but `x_t` is resident (kept from the forward sweep) and is freed
//!   right after `G_t`.
//!
//! A subproblem either runs its base case (a single stage) or advances from `x_s` to some
//! `x_j` (freeing the intermediate states as it goes), solves `(j, t]` with `x_s` held aside,
//! and then solves `(s, j]` either keeping `x_j` (`K`) or dropping it (`R`, recomputing it
//! later). Because every choice only depends on the interval and the memory left, the
//! optimum over these nested ("persistent") schedules is an `O(n^3 M)` table; tests check it
//! against an exhaustive search over *all* schedules on small chains, and against Griewank's
//! closed form on the Revolve model.
//!
//! Memory is counted in integer units; [`ByteChain`] maps bytes onto units by rounding sizes
//! up, so a schedule feasible in units is feasible in bytes.

use std::fmt;

/// Time and memory of one chain, in the units the DP works with.
pub trait ChainModel {
    /// Number of stages `n` (states are `x_0 ..= x_n`).
    fn stages(&self) -> usize;
    /// Time of the forward step `F_k`, `1 <= k <= n`.
    fn fwd_time(&self, k: usize) -> f64;
    /// Time of the backward group `G_t`, `1 <= t <= n`.
    fn bwd_time(&self, t: usize) -> f64;
    /// Whether `G_t` reads `x_t` (besides `x_{t-1}`).
    fn reads_output(&self, t: usize) -> bool;
    /// Memory units that state `x_s` takes while it is held as a checkpoint.
    fn kept_units(&self, s: usize) -> usize;
    /// Memory units needed while computing `F_k` when advancing from the resident state `x_s`
    /// (`s < k`) on the way to running `G_t`; `hold` says `x_t` is resident too. Counts `x_s`,
    /// everything resident for this computation and the live backward tensors.
    fn advance_units(&self, s: usize, k: usize, t: usize, hold: bool) -> usize;
    /// Memory units needed to run `G_t` with `x_{t-1}` (and `x_t` if read) resident.
    fn base_units(&self, t: usize) -> usize;
}

/// One step of a chain schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainStep {
    /// Compute `x_k` from `x_{k-1}` (a first computation or a recomputation).
    Forward(usize),
    /// Run the backward group `G_t`.
    Backward(usize),
    /// Release the state `x_k`.
    Free(usize),
}

/// The optimum of a chain under a budget.
#[derive(Clone, Debug, PartialEq)]
pub struct ChainSolution {
    /// Total time: every forward computation (first ones and recomputations) and backward.
    pub time: f64,
    /// The schedule; `x_0` is never computed nor freed.
    pub steps: Vec<ChainStep>,
    /// Number of forward computations beyond the first of each state.
    pub recomputations: usize,
}

/// Why a chain cannot be solved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("chain of {stages} stages does not fit in {budget_units} memory units")]
    Infeasible { stages: usize, budget_units: usize },
    #[error(
        "chain of {stages} stages with {budget_units} memory units needs a {cells}-cell table, over the {limit}-cell limit"
    )]
    TooLarge {
        stages: usize,
        budget_units: usize,
        cells: usize,
        limit: usize,
    },
    #[error("chain has no stage")]
    Empty,
}

/// Largest DP table (cells of R plus K) the solver allocates (~ 0.6 GB of f64 plus choices
/// would be too much for a planner call; 2^24 cells is ~ 200 MB at worst).
pub const MAX_CELLS: usize = 1 << 24;

const NO_CHOICE: u32 = u32::MAX;
/// Choice codes: `j << 1 | keep`, with `j == t` meaning "advance to x_t then K", and
/// `BASE` meaning the single-stage base case.
const BASE: u32 = u32::MAX - 1;

struct Tables {
    n: usize,
    m: usize,
    r: Vec<f64>,
    k: Vec<f64>,
    r_choice: Vec<u32>,
    k_choice: Vec<u32>,
}

impl Tables {
    fn idx(&self, s: usize, t: usize, m: usize) -> usize {
        (s * (self.n + 1) + t) * (self.m + 1) + m
    }
}

/// Solve the chain optimally within `budget_units` memory units.
pub fn solve_chain<M: ChainModel>(
    model: &M,
    budget_units: usize,
) -> Result<ChainSolution, ChainError> {
    let tables = checked_tables(model, budget_units)?;
    solution_at(model, &tables, budget_units)
}

/// The least budget (in units, at most `budget_units`) the chain fits in, with the optimal
/// schedule at that budget. One table answers every budget up to its size, so this costs
/// one [`solve_chain`], not a search over budgets.
pub fn solve_chain_least<M: ChainModel>(
    model: &M,
    budget_units: usize,
) -> Result<(usize, ChainSolution), ChainError> {
    let tables = checked_tables(model, budget_units)?;
    let top = |m| tables.idx(0, tables.n, m);
    let least = (0..=budget_units)
        .find(|&m| tables.r[top(m)].is_finite())
        .ok_or(ChainError::Infeasible {
            stages: tables.n,
            budget_units,
        })?;
    Ok((least, solution_at(model, &tables, least)?))
}

/// A filled table, for planners that combine the DP's subproblems (the offloading DP uses
/// `R(s, t, m)` for every segment of the chain).
pub struct ChainTable<'m, M> {
    model: &'m M,
    tables: Tables,
}

impl<M: ChainModel> ChainTable<'_, M> {
    /// Time of `R(s, t, m)`, or of `K(s, t, m)` (`x_t` resident at the start) when
    /// `keep_t` (infinite when it does not fit; `m` above the table's size is clamped).
    pub fn time(&self, keep_t: bool, s: usize, t: usize, m: usize) -> f64 {
        let i = self.tables.idx(s, t, m.min(self.tables.m));
        if keep_t {
            self.tables.k[i]
        } else {
            self.tables.r[i]
        }
    }
    /// The schedule of a finite `R` or `K(s, t, m)`: `x_s` resident throughout and never
    /// freed; with `keep_t`, `x_t` is freed after `G_t`.
    pub fn schedule(&self, keep_t: bool, s: usize, t: usize, m: usize) -> Vec<ChainStep> {
        let m = m.min(self.tables.m);
        reconstruct_interval(self.model, &self.tables, keep_t, (s, t, m))
    }
}

/// Fills the table for every interval and every budget up to `budget_units`.
pub fn fill_chain<M: ChainModel>(
    model: &M,
    budget_units: usize,
) -> Result<ChainTable<'_, M>, ChainError> {
    Ok(ChainTable {
        model,
        tables: checked_tables(model, budget_units)?,
    })
}

/// Inner-loop iterations of one table fill: every interval `(s, t]` tries every split `j`
/// at every budget, about n^3/3 x (M+1) (twice: `R` and `K`).
pub fn fill_work(stages: usize, budget_units: usize) -> f64 {
    let n = stages as f64;
    n * n * n / 3.0 * (budget_units as f64 + 1.0)
}

fn checked_tables<M: ChainModel>(model: &M, budget_units: usize) -> Result<Tables, ChainError> {
    let n = model.stages();
    if n == 0 {
        return Err(ChainError::Empty);
    }
    let cells = (n + 1) * (n + 1) * (budget_units + 1) * 2;
    if cells > MAX_CELLS {
        return Err(ChainError::TooLarge {
            stages: n,
            budget_units,
            cells,
            limit: MAX_CELLS,
        });
    }
    Ok(fill_tables(model, budget_units))
}

fn solution_at<M: ChainModel>(
    model: &M,
    tables: &Tables,
    m: usize,
) -> Result<ChainSolution, ChainError> {
    let top = tables.idx(0, tables.n, m);
    if !tables.r[top].is_finite() {
        return Err(ChainError::Infeasible {
            stages: tables.n,
            budget_units: m,
        });
    }
    let steps = reconstruct(model, tables, m);
    let forwards = steps
        .iter()
        .filter(|s| matches!(s, ChainStep::Forward(_)))
        .count();
    Ok(ChainSolution {
        time: tables.r[top],
        recomputations: forwards.saturating_sub(distinct_forwards(&steps)),
        steps,
    })
}

fn distinct_forwards(steps: &[ChainStep]) -> usize {
    let mut seen: Vec<usize> = steps
        .iter()
        .filter_map(|s| {
            if let ChainStep::Forward(k) = s {
                Some(*k)
            } else {
                None
            }
        })
        .collect();
    seen.sort_unstable();
    seen.dedup();
    seen.len()
}

/// Prefix sums of forward times: `fwd(s+1 ..= j) = pre[j] - pre[s]`.
fn forward_prefix<M: ChainModel>(model: &M) -> Vec<f64> {
    let mut pre = vec![0.0; model.stages() + 1];
    for k in 1..=model.stages() {
        pre[k] = pre[k - 1] + model.fwd_time(k);
    }
    pre
}

fn fill_tables<M: ChainModel>(model: &M, budget: usize) -> Tables {
    let n = model.stages();
    let size = (n + 1) * (n + 1) * (budget + 1);
    let mut tab = Tables {
        n,
        m: budget,
        r: vec![f64::INFINITY; size],
        k: vec![f64::INFINITY; size],
        r_choice: vec![NO_CHOICE; size],
        k_choice: vec![NO_CHOICE; size],
    };
    let pre = forward_prefix(model);
    // Intervals by increasing length, so every subproblem is ready when needed.
    for len in 1..=n {
        for s in 0..=n - len {
            let t = s + len;
            fill_k(model, &mut tab, &pre, s, t);
            fill_r(model, &mut tab, &pre, s, t);
        }
    }
    tab
}

/// Cost of continuing with `(s, j]` after `(j, t]` is done and `x_j` is resident: keep it
/// (`K`) or free it and recompute it later (`R`). Returns (time, keep).
fn continue_cost<M: ChainModel>(
    model: &M,
    tab: &Tables,
    s: usize,
    j: usize,
    m: usize,
) -> (f64, bool) {
    let i = tab.idx(s, j, m);
    let drop = tab.r[i];
    if model.reads_output(j) && tab.k[i] < drop {
        (tab.k[i], true)
    } else {
        (drop, false)
    }
}

fn fill_k<M: ChainModel>(model: &M, tab: &mut Tables, pre: &[f64], s: usize, t: usize) {
    if !model.reads_output(t) {
        return;
    }
    if t == s + 1 {
        for m in model.base_units(t)..=tab.m {
            let i = tab.idx(s, t, m);
            tab.k[i] = model.bwd_time(t);
            tab.k_choice[i] = BASE;
        }
        return;
    }
    let mut need = 0usize;
    for j in s + 1..t {
        need = need.max(model.advance_units(s, j, t, true));
        let held = model.kept_units(s);
        for m in need.max(held)..=tab.m {
            let sub = tab.k[tab.idx(j, t, m - held)];
            if !sub.is_finite() {
                continue;
            }
            let (rest, keep) = continue_cost(model, tab, s, j, m);
            let total = pre[j] - pre[s] + sub + rest;
            let i = tab.idx(s, t, m);
            if total < tab.k[i] {
                tab.k[i] = total;
                tab.k_choice[i] = (j as u32) << 1 | u32::from(keep);
            }
        }
    }
}

fn fill_r<M: ChainModel>(model: &M, tab: &mut Tables, pre: &[f64], s: usize, t: usize) {
    if t == s + 1 && !model.reads_output(t) {
        for m in model.base_units(t)..=tab.m {
            let i = tab.idx(s, t, m);
            tab.r[i] = model.bwd_time(t);
            tab.r_choice[i] = BASE;
        }
        return;
    }
    let mut need = 0usize;
    for j in s + 1..=t {
        need = need.max(model.advance_units(s, j, t, false));
        if j == t {
            if model.reads_output(t) {
                for m in need..=tab.m {
                    let i = tab.idx(s, t, m);
                    let total = pre[t] - pre[s] + tab.k[i];
                    if total < tab.r[i] {
                        tab.r[i] = total;
                        tab.r_choice[i] = (t as u32) << 1;
                    }
                }
            }
            continue;
        }
        let held = model.kept_units(s);
        for m in need.max(held)..=tab.m {
            let sub = tab.r[tab.idx(j, t, m - held)];
            if !sub.is_finite() {
                continue;
            }
            let (rest, keep) = continue_cost(model, tab, s, j, m);
            let total = pre[j] - pre[s] + sub + rest;
            let i = tab.idx(s, t, m);
            if total < tab.r[i] {
                tab.r[i] = total;
                tab.r_choice[i] = (j as u32) << 1 | u32::from(keep);
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Task {
    Solve {
        keep_t: bool,
        s: usize,
        t: usize,
        m: usize,
    },
    Emit(ChainStep),
}

/// Walk the choice tables with an explicit stack and emit the schedule.
fn reconstruct<M: ChainModel>(model: &M, tab: &Tables, m: usize) -> Vec<ChainStep> {
    reconstruct_interval(model, tab, false, (0, tab.n, m))
}

/// The schedule of `R(s, t, m)`, or of `K(s, t, m)` when `keep_t`.
fn reconstruct_interval<M: ChainModel>(
    model: &M,
    tab: &Tables,
    keep_t: bool,
    (s, t, m): (usize, usize, usize),
) -> Vec<ChainStep> {
    let mut steps = Vec::new();
    let mut stack = vec![Task::Solve { keep_t, s, t, m }];
    while let Some(task) = stack.pop() {
        match task {
            Task::Emit(step) => steps.push(step),
            Task::Solve { keep_t, s, t, m } => expand(model, tab, keep_t, (s, t, m), &mut stack),
        }
    }
    steps
}

/// Push (in reverse order) the tasks one subproblem decomposes into.
fn expand<M: ChainModel>(
    model: &M,
    tab: &Tables,
    keep_t: bool,
    (s, t, m): (usize, usize, usize),
    stack: &mut Vec<Task>,
) {
    let i = tab.idx(s, t, m);
    let choice = if keep_t {
        tab.k_choice[i]
    } else {
        tab.r_choice[i]
    };
    debug_assert_ne!(
        choice, NO_CHOICE,
        "reconstruction reached an infeasible cell"
    );
    if choice == BASE {
        if keep_t {
            stack.push(Task::Emit(ChainStep::Free(t)));
        }
        stack.push(Task::Emit(ChainStep::Backward(t)));
        return;
    }
    let j = (choice >> 1) as usize;
    let keep_j = choice & 1 == 1;
    let mut later = Vec::new();
    if j == t {
        later.push(Task::Solve {
            keep_t: true,
            s,
            t,
            m,
        });
    } else {
        later.push(Task::Solve {
            keep_t,
            s: j,
            t,
            m: m - model.kept_units(s),
        });
        if !keep_j {
            later.push(Task::Emit(ChainStep::Free(j)));
        }
        later.push(Task::Solve {
            keep_t: keep_j,
            s,
            t: j,
            m,
        });
    }
    stack.extend(later.into_iter().rev());
    // Advance x_s -> x_j, freeing each intermediate once its successor exists.
    for k in (s + 1..=j).rev() {
        if k - 1 > s {
            stack.push(Task::Emit(ChainStep::Free(k - 1)));
        }
        stack.push(Task::Emit(ChainStep::Forward(k)));
    }
}

/// Griewank's model: unit forward steps, free adjoint steps that need only `x_{t-1}`,
/// memory = number of snapshots (the working state is not counted).
#[derive(Clone, Copy, Debug)]
pub struct RevolveChain {
    pub steps: usize,
}

impl ChainModel for RevolveChain {
    fn stages(&self) -> usize {
        self.steps
    }
    fn fwd_time(&self, _k: usize) -> f64 {
        1.0
    }
    fn bwd_time(&self, _t: usize) -> f64 {
        0.0
    }
    fn reads_output(&self, _t: usize) -> bool {
        false
    }
    fn kept_units(&self, _s: usize) -> usize {
        1
    }
    fn advance_units(&self, _s: usize, _k: usize, _t: usize, _hold: bool) -> usize {
        0
    }
    fn base_units(&self, _t: usize) -> usize {
        0
    }
}

/// A chain with per-stage times and byte sizes, accounted as the simulator does: an
/// operation's output coexists with its inputs, a state is released right after its last
/// reader, backward tensors live per a fixed profile.
#[derive(Clone, Debug, PartialEq)]
pub struct ByteChain {
    /// Bytes of `x_0 ..= x_n` (`x_0`, the input, is usually 0: it lives outside the plan).
    pub state_bytes: Vec<u64>,
    /// `F_k` time at index `k` (index 0 unused).
    pub fwd_time: Vec<f64>,
    /// `G_t` time at index `t` (index 0 unused).
    pub bwd_time: Vec<f64>,
    /// `G_t` reads `x_t` (index 0 unused).
    pub reads_output: Vec<bool>,
    /// Bytes of backward tensors live between groups, just before `G_t` starts (index `t`).
    pub grad_live_before: Vec<u64>,
    /// Peak bytes of backward tensors while `G_t` runs (its own outputs included).
    pub grad_peak_during: Vec<u64>,
    /// Bytes per memory unit of the DP; sizes are rounded up to whole units.
    pub unit_bytes: u64,
}

impl ByteChain {
    /// The largest unit that divides every byte quantity of the chain: with it, rounding
    /// sizes up to whole units loses nothing, and the DP is exact in bytes.
    pub fn lossless_unit(&self) -> u64 {
        let gcd = |mut a: u64, mut b: u64| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        self.state_bytes
            .iter()
            .chain(&self.grad_live_before)
            .chain(&self.grad_peak_during)
            .fold(0, |g, &b| gcd(g, b))
            .max(1)
    }
    fn units(&self, bytes: u64) -> usize {
        bytes.div_ceil(self.unit_bytes.max(1)) as usize
    }
    /// The budget in units: rounded down, so unit-feasible implies byte-feasible.
    pub fn budget_units(&self, budget_bytes: u64) -> usize {
        (budget_bytes / self.unit_bytes.max(1)) as usize
    }
}

impl ChainModel for ByteChain {
    fn stages(&self) -> usize {
        self.state_bytes.len().saturating_sub(1)
    }
    fn fwd_time(&self, k: usize) -> f64 {
        self.fwd_time[k]
    }
    fn bwd_time(&self, t: usize) -> f64 {
        self.bwd_time[t]
    }
    fn reads_output(&self, t: usize) -> bool {
        self.reads_output[t]
    }
    fn kept_units(&self, s: usize) -> usize {
        self.units(self.state_bytes[s])
    }
    fn advance_units(&self, s: usize, k: usize, t: usize, hold: bool) -> usize {
        let mut units =
            self.kept_units(s) + self.kept_units(k) + self.units(self.grad_live_before[t]);
        if k - 1 > s {
            units += self.kept_units(k - 1);
        }
        if hold {
            units += self.kept_units(t);
        }
        units
    }
    fn base_units(&self, t: usize) -> usize {
        let mut units = self.kept_units(t - 1) + self.units(self.grad_peak_during[t]);
        if self.reads_output[t] {
            units += self.kept_units(t);
        }
        units
    }
}

impl fmt::Display for ChainStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChainStep::Forward(k) => write!(f, "F{k}"),
            ChainStep::Backward(t) => write!(f, "B{t}"),
            ChainStep::Free(k) => write!(f, "free x{k}"),
        }
    }
}

#[cfg(test)]
mod tests;
