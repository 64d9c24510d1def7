//! remat-engine: tensors, a byte-budgeted memory pool, CPU kernels, autograd and exact
//! activation checkpointing.
//!
//! # Layers
//!
//! Each folder imports only the ones listed before it:
//! - [`core`]: dtype, tensor, memory pool, host swap store, kernels, ops, the autograd
//!   [`Graph`], checkpointing and policies, AdamW. It knows no model.
//! - [`models`]: models recorded on the graph (GPT, MLP, K models fused or multiplexed),
//!   their training batch and the Hugging Face file format.
//! - [`spec`]: declarative recompute specs, their compiler, the runtime that executes a
//!   compiled plan, and the spec-driven models beside it ([`spec::models`]: Qwen3, Mamba,
//!   hybrid).
//! - [`plan_exec`]: a recorded step laid out as planner items, profiled into the planner's
//!   graph ([`plan_exec::profile`]), a plan chosen and executed exactly.
//! - [`pipeline`]: pipeline stages with a per-micro-batch checkpoint manager.
//! - [`session`]: the training flows the command and the benchmarks drive (profile ->
//!   plan -> execute, K models together, a spec model's mix for a budget).
//!
//! [`output_file`] writes files all or nothing for the file formats.
//!
//! # Building and running a graph
//!
//! ```
//! use remat_engine::{Category, ExecContext, Graph, MemoryPool, Tensor};
//!
//! # fn main() -> Result<(), remat_engine::EngineError> {
//! let pool = MemoryPool::with_budget(1 << 20);
//! let ctx = ExecContext::new(pool.clone(), 1)?;
//! let w = Tensor::from_vec(&pool, "w", &[2, 2], vec![1.0f32, 2.0, 3.0, 4.0], Category::Parameters)?;
//! let x = Tensor::from_vec(&pool, "x", &[1, 2], vec![1.0f32, -1.0], Category::Activations)?;
//! let y = Tensor::from_vec(&pool, "y", &[1, 2], vec![0.0f32, 0.0], Category::Activations)?;
//!
//! let mut g = Graph::new(&ctx);
//! let (xn, yn, wn) = (g.input("x", x), g.input("y", y), g.param("w", &w));
//! let h = g.matmul(xn, wn)?;          // records the node, checks shapes
//! let loss = g.mse(h, yn)?;
//! g.forward()?;                       // computes, freeing values at their last use
//! let _loss = g.scalar(loss)?;
//! g.backward(loss)?;                  // rebuilds dropped values on demand
//! let dw = g.grad(wn)?.expect("w requires grad");
//! assert_eq!(dw.shape(), &[2, 2]);
//! println!("peak {} bytes", pool.stats().peak);
//! # Ok(()) }
//! ```
//!
//! Graphs are recorded first (shapes checked at once) and executed by [`Graph::forward`],
//! so every value's last forward use is known and the value is freed right after it unless
//! backward reads it and its [`Retention`] keeps it. A graph serves one step: after
//! [`Graph::backward`] it is spent; parameters are shared (not copied) between graphs.
//!
//! # Checkpointing
//!
//! - [`Graph::checkpoint`] (or [`Graph::set_retention`] with [`Retention::Recompute`]) marks
//!   a node as a checkpoint: its output is freed after its last forward use and rebuilt
//!   when backward reads it, by re-running its op (and, when they were dropped too, its
//!   ancestors, checkpointed or plain, collected with an explicit stack and run in index
//!   order). Rebuilt values are held until their last backward read, then freed; under
//!   [`core::checkpoint::RebuildMode::FreeAfterUse`] (what recompute-all sets) they are freed
//!   right after the node that read them and rebuilt again when needed (least memory,
//!   O(n^2) recomputes on a chain).
//! - [`CheckpointOptions`]: `save_inputs` pins the node's inputs until its backward (a
//!   one-step rebuild); `force` drops the node even when a consumer pins it; `verbose` logs
//!   each recompute (`tracing`, target `remat::recompute`); `save_rng` lets a random op be
//!   replayed (without it, recomputing one is an error); `max_recompute_depth` bounds the
//!   chain one rebuild may recompute; `detach_inputs` rebuilds only from held inputs.
//! - [`Policy`] marks a whole graph: store-all, recompute-all, every-N, by-depth,
//!   sqrt(n). [`Graph::segment`] checkpoints what a closure records (say one transformer
//!   block), keeping only its inputs and output, like `torch.utils.checkpoint`.
//! - Errors are typed and name the nodes: [`EngineError::RecomputeDepthExceeded`] and
//!   [`EngineError::Unrebuildable`] carry the chain, [`EngineError::ModifiedInPlace`] the
//!   tensor whose version moved between forward and backward (e.g. an optimizer step).
//! - Random ops draw `(seed, offset)` states from the graph's counter-based generator
//!   ([`core::rng`]) through [`OpCtx::rng`]; the node records them, so a recompute
//!   replays them. A node fusing the same op of several models ([`core::ops::fused`])
//!   draws one state from each model's stream with [`OpCtx::rng_in_stream`].
//! - Bit exactness: kernels split work by output element only (never a reduction across
//!   threads), and a recompute runs the same op with the same [`ExecContext`] thread count,
//!   so gradients under any retention equal store-all's bit for bit.
//! - Retention is consulted per node at every step; [`GraphObserver`] sees every node
//!   execution (forward, recompute, backward) with its time and output bytes.
//!
//! # Adding an op
//!
//! Write a type implementing [`Op`] in its own file under `src/core/ops/` (forward and backward
//! side by side), declare which inputs and whether the output its backward reads
//! ([`Op::saves_input`], [`Op::saves_output`]), allocate through the [`OpCtx`] (outputs,
//! temporaries, gradients: all charged to the pool and to the node), draw randomness with
//! [`OpCtx::rng`], and add a builder method in an `impl Graph` block in the same file.
//! Check the gradient with [`core::gradcheck::check_op`] (f64 finite differences).
//!
//! # Memory accounting
//!
//! A [`MemoryPool`] counts requested bytes exactly (`numel * dtype size`) per [`Category`].
//! When a pool has a budget, going over it is [`EngineError::OutOfMemory`] naming the node.
//! What is allocated when:
//! - forward: each op's output (activations; aux tensors too), freed when its last forward
//!   consumer ran unless held for backward; reshape is a view costing nothing.
//! - backward, per node in reverse order: dropped values it reads are rebuilt (activations),
//!   then its input gradients are allocated (temporaries, or gradients for leaves), then its
//!   output gradient is freed, then values with no backward reads left are freed.
//!   Rebuilt values are held until their last backward use (a segment is recomputed once),
//!   or, under [`core::checkpoint::RebuildMode::FreeAfterUse`], until the node that read them ran.
//! - the optimizer's state is [`Category::OptimizerState`]. [`MemoryPool::enable_event_log`]
//!   records the timeline with the node of every allocation.
//! - not in the pool: graph metadata, and gemm's packing workspace (a per-thread slab the
//!   size of the L2 cache, plus transient buffers inside one call). A test with a counting
//!   global allocator checks that, between steps, the process's live tensor bytes equal
//!   the pool's live bytes exactly.

pub mod core;
pub mod models;
pub mod output_file;
pub mod pipeline;
pub mod plan_exec;
pub mod session;
pub mod spec;

pub use crate::core::checkpoint::{CheckpointOptions, Retention};
pub use crate::core::context::ExecContext;
pub use crate::core::dtype::{DType, Element};
pub use crate::core::error::{EngineError, Result};
pub use crate::core::graph::{Graph, GraphObserver, GraphStats, NodeEvent, NodeId, NodeKind};
pub use crate::core::op::{Op, OpCtx, OpOutput, Phase, Saved};
pub use crate::core::optim::{AdamW, AdamWConfig};
pub use crate::core::policy::Policy;
pub use crate::core::pool::{Category, MemoryPool, PoolEvent, PoolStats};
pub use crate::core::rng::{CounterRng, RngState, RngStreams};
pub use crate::core::tensor::Tensor;
