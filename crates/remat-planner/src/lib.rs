//! remat-planner: decide, for every activation of a training step, whether to keep it, swap
//! it to host memory or recompute it, under a device memory budget. Pure: no tensors.
//!
//! - [`ir`]: the graph IR ([`Graph`], [`Node`], [`Phase`]): operations in execution order,
//!   each producing one tensor, with compute time and output bytes, plus static memory.
//! - [`attrs`]: MuTWO's derived per-tensor attributes (idle interval, inactive time, swap
//!   time, recompute sources and ratio).
//! - [`import`]: remat's own JSON schema and the networkx node-link JSON of Checkmate's graphs.
//! - [`plan`]: the plan format ([`Plan`]: an explicit schedule of [`Step`]s plus a
//!   [`Decision`] per tensor), serialized as versioned JSON for the engine.
//! - [`sim`]: the simulator ([`simulate`]): validates a schedule, naming the first broken
//!   step, and measures peak memory, time (compute, recompute, exposed swap) and the memory
//!   timeline. [`sim::Machine`] applies one step at a time.
//! - [`eager`]: the eager-order plan form (what PyTorch's autograd runs as it is): its
//!   rules checked step by step, its floor, and any node-order schedule put into it.
//! - [`lower`]: the shared lowering from per-tensor decisions to a schedule.
//! - [`problem`]: what to plan for ([`Problem`]: graph, budget, bandwidth), what a strategy
//!   returns ([`Planned`]: the plan and the simulator's report) and the one way a strategy
//!   makes one from decisions or steps.
//! - [`strategy`]: the [`Strategy`] trait and the per-tensor strategies (baselines, MuTWO;
//!   [`exact`] has the exact ones, [`solve`] the anytime solver).
//! - [`registry`](mod@registry): every strategy ([`registry()`]) and [`lookup`] by name.
//! - [`search`]: the fastest plan under a budget over every strategy in a time limit, and
//!   the rules by which it skips a strategy for time.
//! - [`request`]: the front door. [`request::plan`] is the one entry point of planning: a
//!   named strategy or the search over all, with the infeasible case explained in bytes.
//! - [`budget`]: a budget for a graph, bytes or a fraction of its store-all peak (`8GiB`,
//!   `0.7`), read by `remat_units`.
//! - [`output`]: output files written all or nothing (checked first, temporary, synced, renamed).
//! - [`multi`]: K models trained together (MuTWO's setting): the multiplexed graph with a
//!   model label per node, the interleaved order, plans for the K models under one budget
//!   and which model's compute hides which swap.
//! - [`solve`]: the anytime general-DAG solver (memory-aware orders, eviction on top,
//!   improved until a deadline) and the lower bound on any schedule's overhead.
//! - [`plot`]: memory-timeline charts as SVG or PNG; [`synth`]: synthetic graphs for benches.
//!
//! Memory accounting, exactly (the engine is compared to it to the byte): device memory is
//! the static bytes plus the bytes of every tensor on the device. `Compute(v)` allocates v's
//! output when it starts, while all its inputs are on the device, so inputs and output
//! coexist; nothing is freed implicitly: `Free(t)` releases t's bytes, `SwapIn(t)` allocates
//! them when issued. The peak is the largest value after any allocation.

pub mod attrs;
pub mod budget;
pub mod eager;
pub mod error;
pub mod exact;
pub mod floor;
pub mod import;
pub mod ir;
pub mod lower;
pub mod multi;
pub mod output;
pub mod plan;
pub mod plot;
pub mod problem;
pub mod registry;
pub mod request;
pub mod search;
pub mod sim;
pub mod solve;
pub mod strategy;
pub mod synth;

pub use error::{ImportError, PlanError, SimError};
pub use ir::{Graph, GraphError, Node, NodeId, Phase};
pub use plan::{Decision, PLAN_FORMAT_VERSION, Plan, PlanOrder, Step};
pub use problem::{Planned, Problem};
pub use registry::{lookup, registry};
pub use sim::{SimReport, simulate, simulate_steps};
pub use strategy::Strategy;
