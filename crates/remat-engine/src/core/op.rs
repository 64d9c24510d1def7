//! The op abstraction. An op is a type implementing [`Op`] in its own file under `src/core/ops/`
//! with its forward and backward side by side; nothing central lists the ops. An op declares
//! which of its inputs (and whether its output) its backward reads, which is all
//! checkpointing needs: a value that no backward reads is freed after its last forward use,
//! and a dropped value is rebuilt by running its op's `forward` again on the same inputs.

use std::fmt;
use std::sync::Arc;

use crate::core::dtype::DType;
use crate::core::error::{EngineError, Result};
use crate::core::pool::{Category, MemoryPool};
use crate::core::rng::{RngState, RngStreams};
use crate::core::tensor::Tensor;

/// A differentiable operation with one output.
pub trait Op: Send + Sync + fmt::Debug {
    /// A short kind name (`"matmul"`), used in node names and errors.
    fn kind(&self) -> &'static str;

    /// The output shape for these input shapes, or a message saying what is wrong.
    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String>;

    /// The output dtype; by default the first input's.
    fn output_dtype(&self, inputs: &[DType]) -> DType {
        inputs.first().copied().unwrap_or(DType::F32)
    }

    /// Whether backward reads input `slot`.
    fn saves_input(&self, _slot: usize) -> bool {
        false
    }

    /// Whether backward reads the output.
    fn saves_output(&self) -> bool {
        false
    }

    /// Computes the output (and any auxiliary tensors backward needs, e.g. a reciprocal
    /// std). Must be deterministic given the inputs, the thread count and the RNG state
    /// drawn through [`OpCtx::rng`]: a recompute calls it again and must get the same bits.
    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput>;

    /// Gradients of the inputs (`None` where [`OpCtx::needs_grad`] is false).
    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        saved: &Saved<'_>,
        grad_out: &Tensor,
    ) -> Result<Vec<Option<Tensor>>>;

    /// Floating-point operations of one forward, for profiling (0 when negligible).
    fn flops(&self, _inputs: &[&[usize]]) -> u64 {
        0
    }
}

/// What a forward produced.
#[derive(Debug)]
pub struct OpOutput {
    pub value: Tensor,
    /// Tensors only backward reads; they live and die with the node's value.
    pub aux: Vec<Tensor>,
}

impl From<Tensor> for OpOutput {
    fn from(value: Tensor) -> Self {
        OpOutput {
            value,
            aux: Vec::new(),
        }
    }
}

/// What backward gets: the inputs and output it declared, the aux tensors, the shapes.
#[derive(Debug)]
pub struct Saved<'a> {
    /// `Some` for every slot the op declared with [`Op::saves_input`].
    pub inputs: Vec<Option<&'a Tensor>>,
    pub input_shapes: Vec<&'a [usize]>,
    pub input_dtypes: Vec<DType>,
    pub output: Option<&'a Tensor>,
    pub aux: &'a [Tensor],
    pub output_shape: &'a [usize],
}

impl<'a> Saved<'a> {
    /// Saved input `slot`, or an error if the op did not declare it.
    pub fn input(&self, slot: usize) -> Result<&'a Tensor> {
        self.inputs
            .get(slot)
            .copied()
            .flatten()
            .ok_or_else(|| EngineError::Invalid(format!("input {slot} was not saved")))
    }

    pub fn output(&self) -> Result<&'a Tensor> {
        self.output
            .ok_or_else(|| EngineError::Invalid("output was not saved".into()))
    }
}

/// The phase an op runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Forward,
    Recompute,
    Backward,
}

/// Where random states come from: drawn and recorded in forward, replayed in recompute.
#[derive(Debug)]
pub(crate) enum RngSource<'a> {
    Record {
        /// Every stream of the graph: a fused op of several models draws one state from
        /// each model's stream ([`OpCtx::rng_in_stream`]).
        streams: &'a mut RngStreams,
        /// The node's own stream ([`OpCtx::rng`]).
        stream: usize,
        drawn: &'a mut Vec<RngState>,
    },
    Replay {
        saved: &'a [RngState],
        next: usize,
    },
    /// Recompute of a node whose checkpoint options say `save_rng = false`.
    NotSaved,
    /// Backward: ops read the states their forward drew.
    Backward {
        saved: &'a [RngState],
    },
}

/// Services an op gets while it runs: allocation from the pool (charged to the node),
/// random states, and the thread count.
#[derive(Debug)]
pub struct OpCtx<'a> {
    pub(crate) pool: &'a Arc<MemoryPool>,
    pub(crate) node: usize,
    pub(crate) node_name: &'a str,
    pub(crate) phase: Phase,
    pub(crate) threads: usize,
    pub(crate) rng: RngSource<'a>,
    /// Per input slot: does it need a gradient, and is it a leaf (parameter/input).
    pub(crate) grad_slots: &'a [(bool, bool)],
}

impl<'a> OpCtx<'a> {
    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn node_name(&self) -> &str {
        self.node_name
    }

    pub fn node_index(&self) -> usize {
        self.node
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The gemm parallelism matching the thread count (the same in forward and recompute,
    /// which keeps results bit-identical).
    pub fn gemm_parallelism(&self) -> gemm::Parallelism {
        crate::core::linalg::parallelism(self.threads)
    }

    fn alloc_in(
        &self,
        shape: &[usize],
        dtype: DType,
        category: Category,
        init: Init,
    ) -> Result<Tensor> {
        let made = match init {
            Init::Zeroed => Tensor::zeros(self.pool, shape, dtype, category, Some(self.node)),
            Init::Overwritten => {
                Tensor::for_overwrite(self.pool, shape, dtype, category, Some(self.node))
            }
        };
        made.map_err(|e| e.at(self.node_name))
    }

    fn output_category(&self) -> Category {
        match self.phase {
            Phase::Backward => Category::Temporaries,
            _ => Category::Activations,
        }
    }

    fn grad_category(&self, slot: usize) -> Category {
        if self.grad_slots.get(slot).is_some_and(|s| s.1) {
            Category::Gradients
        } else {
            Category::Temporaries
        }
    }

    /// The node's output (an activation; zero-filled).
    pub fn alloc_output(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        self.alloc_in(shape, dtype, self.output_category(), Init::Zeroed)
    }

    /// The node's output with unspecified contents, for a kernel that writes every element
    /// (see [`Tensor::for_overwrite`]).
    pub fn alloc_output_overwritten(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        self.alloc_in(shape, dtype, self.output_category(), Init::Overwritten)
    }

    /// Scratch memory, freed when the returned tensor is dropped (before the op returns).
    pub fn alloc_temp(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        self.alloc_in(shape, dtype, Category::Temporaries, Init::Zeroed)
    }

    /// The gradient buffer of input `slot` (zero-filled): charged as a gradient when that
    /// input is a leaf (parameter), as a temporary when it flows on through the graph.
    pub fn alloc_grad(&self, slot: usize, shape: &[usize], dtype: DType) -> Result<Tensor> {
        self.alloc_in(shape, dtype, self.grad_category(slot), Init::Zeroed)
    }

    /// [`Self::alloc_grad`] with unspecified contents, for a kernel that writes every element.
    pub fn alloc_grad_overwritten(
        &self,
        slot: usize,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        self.alloc_in(shape, dtype, self.grad_category(slot), Init::Overwritten)
    }

    /// The gradient buffer of input `slot` (unspecified contents) when that input needs a
    /// gradient, else scratch of the same shape: for a kernel that writes it in any case.
    pub fn alloc_grad_or_scratch(
        &self,
        slot: usize,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        if self.needs_grad(slot) {
            self.alloc_grad_overwritten(slot, shape, dtype)
        } else {
            self.alloc_temp(shape, dtype)
        }
    }

    /// The first aux tensor forward saved (`what` names it in the error if it is missing).
    pub fn saved_aux<'s>(&self, saved: &Saved<'s>, what: &str) -> Result<&'s Tensor> {
        saved
            .aux
            .first()
            .ok_or_else(|| self.shape_error(format!("the saved {what} is missing")))
    }

    /// Whether input `slot` needs a gradient.
    pub fn needs_grad(&self, slot: usize) -> bool {
        self.grad_slots.get(slot).is_some_and(|s| s.0)
    }

    /// The backward result of an op with one input: `[None]` when that input needs no
    /// gradient (`grad` is not called), else `[Some(grad(cx))]`.
    pub fn single_grad(
        &mut self,
        grad: impl FnOnce(&mut Self) -> Result<Tensor>,
    ) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![if self.needs_grad(0) {
            Some(grad(self)?)
        } else {
            None
        }])
    }

    /// A random state addressing `count` counters. In forward it is drawn from the graph's
    /// generator and recorded with the node; a recompute or backward gets the recorded one.
    pub fn rng(&mut self, count: u64) -> Result<RngState> {
        let stream = match &self.rng {
            RngSource::Record { stream, .. } => *stream,
            _ => 0,
        };
        self.rng_in_stream(stream, count)
    }

    /// [`Self::rng`] drawing from stream `stream` instead of the node's own: a node that
    /// fuses the same op of several models draws each model's state from that model's
    /// stream, in a fixed order, so each model sees the numbers it draws alone. Recompute
    /// replays the states in the order they were drawn; backward reads them all through
    /// [`Self::rng_states`].
    pub fn rng_in_stream(&mut self, stream: usize, count: u64) -> Result<RngState> {
        match &mut self.rng {
            RngSource::Record { streams, drawn, .. } => {
                let s = streams.stream(stream).draw(count);
                drawn.push(s);
                Ok(s)
            }
            RngSource::Replay { saved, next } => {
                let s = saved.get(*next).copied();
                *next += 1;
                s.ok_or_else(|| self.rng_missing("it drew fewer random states in forward"))
            }
            RngSource::NotSaved => Err(self.rng_missing(
                "its checkpoint options say save_rng = false, so a recompute cannot replay \
                 the random numbers of the forward pass",
            )),
            RngSource::Backward { saved } => saved
                .first()
                .copied()
                .ok_or_else(|| self.rng_missing("its forward drew no random state")),
        }
    }

    /// All states the forward drew (backward of ops drawing several).
    pub fn rng_states(&self) -> &[RngState] {
        match &self.rng {
            RngSource::Backward { saved } | RngSource::Replay { saved, .. } => saved,
            _ => &[],
        }
    }

    fn rng_missing(&self, why: &str) -> EngineError {
        EngineError::Unrebuildable {
            reason: format!(
                "random op {} has no recorded RNG state: {why}",
                self.node_name
            ),
            chain: vec![self.node_name.to_string()],
        }
    }

    /// A shape error naming this node.
    pub fn shape_error(&self, message: impl Into<String>) -> EngineError {
        EngineError::Shape {
            node: self.node_name.to_string(),
            message: message.into(),
        }
    }
}

/// How a new buffer starts.
#[derive(Clone, Copy)]
enum Init {
    Zeroed,
    /// Unspecified contents; the kernel writes every element.
    Overwritten,
}
