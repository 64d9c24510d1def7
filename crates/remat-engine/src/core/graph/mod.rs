//! The autograd graph: an index arena of nodes recorded by the model code, executed by
//! [`Graph::forward`] and differentiated by [`Graph::backward`], with per-node retention
//! decisions (keep / recompute) consulted at every step. No recursion anywhere: forward and
//! backward walk the arena in index order (inputs always precede their consumers), rebuilds
//! use an explicit stack.

mod backward;
mod forward;
mod rebuild;

use std::time::Duration;

use crate::core::checkpoint::{CheckpointOptions, RebuildMode, Retention};
use crate::core::context::ExecContext;
use crate::core::dtype::DType;
use crate::core::error::{EngineError, Result};
use crate::core::op::{Op, OpCtx, OpOutput, Phase};
use crate::core::rng::{RngState, RngStreams};
use crate::core::tensor::Tensor;

/// A node of one graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub(crate) usize);

impl NodeId {
    pub fn index(self) -> usize {
        self.0
    }
}

/// What a node is.
#[derive(Debug)]
pub enum NodeKind {
    /// Data fed in (no gradient unless asked).
    Input,
    /// A trainable leaf: its gradient is accumulated in the graph.
    Parameter,
    Op(Box<dyn Op>),
}

#[derive(Debug)]
pub(crate) struct Node {
    pub name: String,
    pub kind: NodeKind,
    pub inputs: Vec<NodeId>,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub requires_grad: bool,
    pub retention: Retention,
    pub segment: Option<usize>,
    /// The random stream its forward draws from (see [`Graph::set_rng_stream`]).
    pub rng_stream: usize,
    /// The model it belongs to when several are recorded together (see [`Graph::set_owner`]).
    pub owner: Option<usize>,
    // Execution state.
    pub value: Option<Tensor>,
    /// Storage version when the value was produced (leaves: when forward started).
    pub value_version: u64,
    pub aux: Vec<Tensor>,
    /// How many aux tensors forward produced (to know when they were dropped).
    pub aux_count: usize,
    pub rng: Vec<RngState>,
    pub executed: bool,
    pub released: bool,
    pub grad: Option<Tensor>,
    pub recomputes: u64,
}

impl Node {
    pub fn is_leaf(&self) -> bool {
        !matches!(self.kind, NodeKind::Op(_))
    }

    pub fn op(&self) -> Option<&dyn Op> {
        match &self.kind {
            NodeKind::Op(op) => Some(op.as_ref()),
            _ => None,
        }
    }

    /// The node's op, or an error naming the node when it is a leaf.
    pub(crate) fn op_or_leaf_error(&self) -> Result<&dyn Op> {
        self.op()
            .ok_or_else(|| EngineError::Invalid(format!("{} is a leaf", self.name)))
    }

    /// Runs the node's op forward in `cx` on `inputs` (a forward or a recompute, by the
    /// graph or by the plan executor) and checks the output has the recorded shape.
    pub(crate) fn run_forward(&self, cx: &mut OpCtx<'_>, inputs: &[Tensor]) -> Result<OpOutput> {
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let out = self.op_or_leaf_error()?.forward(cx, &refs)?;
        if out.value.shape() != self.shape.as_slice() {
            return Err(EngineError::Shape {
                node: self.name.clone(),
                message: format!(
                    "forward produced shape {:?}, recorded shape is {:?}",
                    out.value.shape(),
                    self.shape
                ),
            });
        }
        Ok(out)
    }
}

/// One node execution, reported to a [`GraphObserver`].
#[derive(Clone, Debug)]
pub struct NodeEvent<'a> {
    pub phase: Phase,
    pub node: NodeId,
    pub name: &'a str,
    pub kind: &'a str,
    pub inputs: &'a [NodeId],
    pub output_bytes: u64,
    pub elapsed: Duration,
}

/// Hooks at node execution (profiling, swap prefetch prompts, ...).
pub trait GraphObserver: Send {
    /// Before a node runs (forward, recompute or backward).
    fn before_node(&mut self, _phase: Phase, _node: NodeId) {}
    /// After a node ran.
    fn after_node(&mut self, _event: &NodeEvent<'_>) {}
}

/// Counters of one graph's executions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub forward_nodes: u64,
    pub recomputed_nodes: u64,
    pub backward_nodes: u64,
}

/// Per-node bookkeeping computed when forward starts.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// Consumer slots not yet executed in forward.
    pub fwd_remaining: Vec<usize>,
    /// Backward reads still to come.
    pub bwd_remaining: Vec<usize>,
    /// Held until backward regardless of its own retention (a checkpointed consumer with
    /// `save_inputs`).
    pub pinned: Vec<bool>,
}

/// The autograd graph. `Send`: a graph (with its values) can move to another thread.
pub struct Graph {
    pub(crate) ctx: ExecContext,
    pub(crate) nodes: Vec<Node>,
    pub(crate) rng: RngStreams,
    pub(crate) plan: Plan,
    pub(crate) stats: GraphStats,
    pub(crate) observer: Option<Box<dyn GraphObserver>>,
    /// Set once backward ran: the activations are gone, the graph is spent.
    pub(crate) spent: bool,
    pub(crate) rebuild_mode: RebuildMode,
    segment: Option<usize>,
    next_segment: usize,
    /// Stream and owner given to the nodes recorded next.
    rng_stream: usize,
    owner: Option<usize>,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("nodes", &self.nodes.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl Graph {
    pub fn new(ctx: &ExecContext) -> Self {
        Self {
            ctx: ctx.clone(),
            nodes: Vec::new(),
            rng: RngStreams::new(0),
            plan: Plan::default(),
            stats: GraphStats::default(),
            observer: None,
            spent: false,
            rebuild_mode: RebuildMode::default(),
            segment: None,
            next_segment: 0,
            rng_stream: 0,
            owner: None,
        }
    }

    /// Seeds the generator random ops draw from (stream 0; before forward).
    pub fn set_seed(&mut self, seed: u64) {
        self.rng.set_seed(0, seed);
    }

    /// Seeds random stream `stream` (before forward).
    pub fn set_stream_seed(&mut self, stream: usize, seed: u64) {
        self.rng.set_seed(stream, seed);
    }

    /// Nodes recorded from now on draw their random states from stream `stream` (0 unless
    /// set). Several models recorded into one graph each use their own stream, so each
    /// draws the dropout masks it draws when recorded alone.
    pub fn set_rng_stream(&mut self, stream: usize) {
        self.rng_stream = stream;
    }

    /// Nodes recorded from now on belong to `owner` (a model, or a group of fused models;
    /// `None`: shared). Read back with [`Graph::owner`]; the profiler maps it onto the
    /// planner graph's nodes for multi-model scheduling.
    pub fn set_owner(&mut self, owner: Option<usize>) {
        self.owner = owner;
    }

    /// The owner a node was recorded under.
    pub fn owner(&self, id: NodeId) -> Result<Option<usize>> {
        Ok(self.node(id)?.owner)
    }

    pub fn context(&self) -> &ExecContext {
        &self.ctx
    }

    pub fn set_observer(&mut self, observer: Option<Box<dyn GraphObserver>>) {
        self.observer = observer;
    }

    /// The error for running a spent graph again.
    pub(crate) fn check_not_spent(&self, what: &str) -> Result<()> {
        if self.spent {
            return Err(EngineError::Invalid(format!(
                "{what} on a graph whose backward already ran (its activations were freed); \
                 record a new graph for the next step"
            )));
        }
        Ok(())
    }

    pub fn stats(&self) -> GraphStats {
        self.stats
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        (0..self.nodes.len()).map(NodeId)
    }

    pub(crate) fn node(&self, id: NodeId) -> Result<&Node> {
        self.nodes.get(id.0).ok_or(EngineError::UnknownNode(id.0))
    }

    pub(crate) fn node_mut(&mut self, id: NodeId) -> Result<&mut Node> {
        self.nodes
            .get_mut(id.0)
            .ok_or(EngineError::UnknownNode(id.0))
    }

    fn push_leaf(&mut self, name: &str, kind: NodeKind, value: Tensor, grad: bool) -> NodeId {
        let id = NodeId(self.nodes.len());
        self.nodes.push(Node {
            name: name.to_string(),
            kind,
            inputs: Vec::new(),
            shape: value.shape().to_vec(),
            dtype: value.dtype(),
            requires_grad: grad,
            retention: Retention::Keep,
            segment: None,
            rng_stream: self.rng_stream,
            owner: self.owner,
            value_version: value.version(),
            value: Some(value),
            aux: Vec::new(),
            aux_count: 0,
            rng: Vec::new(),
            executed: false,
            released: false,
            grad: None,
            recomputes: 0,
        });
        id
    }

    /// Feeds data in (no gradient).
    pub fn input(&mut self, name: &str, value: Tensor) -> NodeId {
        self.push_leaf(name, NodeKind::Input, value, false)
    }

    /// Feeds data in and asks for its gradient.
    pub fn input_with_grad(&mut self, name: &str, value: Tensor) -> NodeId {
        self.push_leaf(name, NodeKind::Input, value, true)
    }

    /// A trainable parameter (shared storage: the graph holds a reference, not a copy).
    pub fn param(&mut self, name: &str, value: &Tensor) -> NodeId {
        self.push_leaf(name, NodeKind::Parameter, value.clone(), true)
    }

    /// Records an op applied to `inputs`; the output shape is checked now, the value is
    /// computed by [`Graph::forward`]. Inside [`Graph::segment`] the node is a checkpoint.
    pub fn apply(&mut self, op: impl Op + 'static, inputs: &[NodeId]) -> Result<NodeId> {
        self.apply_boxed(Box::new(op), inputs)
    }

    pub fn apply_boxed(&mut self, op: Box<dyn Op>, inputs: &[NodeId]) -> Result<NodeId> {
        let index = self.nodes.len();
        let name = format!("{}#{index}", op.kind());
        let mut shapes = Vec::with_capacity(inputs.len());
        let mut dtypes = Vec::with_capacity(inputs.len());
        let mut requires_grad = false;
        for &i in inputs {
            let n = self.node(i)?;
            shapes.push(n.shape.as_slice());
            dtypes.push(n.dtype);
            requires_grad |= n.requires_grad;
        }
        let shape = op
            .output_shape(&shapes)
            .map_err(|message| EngineError::Shape {
                node: name.clone(),
                message,
            })?;
        let dtype = op.output_dtype(&dtypes);
        let retention = match self.segment {
            Some(_) => Retention::Recompute(CheckpointOptions::policy()),
            None => Retention::Keep,
        };
        self.nodes.push(Node {
            name,
            kind: NodeKind::Op(op),
            inputs: inputs.to_vec(),
            shape,
            dtype,
            requires_grad,
            retention,
            segment: self.segment,
            rng_stream: self.rng_stream,
            owner: self.owner,
            value: None,
            value_version: 0,
            aux: Vec::new(),
            aux_count: 0,
            rng: Vec::new(),
            executed: false,
            released: false,
            grad: None,
            recomputes: 0,
        });
        Ok(NodeId(index))
    }

    /// Renames a node (names appear in errors and profiles).
    pub fn set_name(&mut self, id: NodeId, name: impl Into<String>) -> Result<()> {
        self.node_mut(id)?.name = name.into();
        Ok(())
    }

    pub fn name(&self, id: NodeId) -> Result<&str> {
        Ok(&self.node(id)?.name)
    }

    pub fn shape(&self, id: NodeId) -> Result<&[usize]> {
        Ok(&self.node(id)?.shape)
    }

    pub fn dtype(&self, id: NodeId) -> Result<DType> {
        Ok(self.node(id)?.dtype)
    }

    pub fn inputs(&self, id: NodeId) -> Result<&[NodeId]> {
        Ok(&self.node(id)?.inputs)
    }

    /// The op kind of a node (`"input"` / `"parameter"` for leaves).
    pub fn kind(&self, id: NodeId) -> Result<&'static str> {
        Ok(match &self.node(id)?.kind {
            NodeKind::Input => "input",
            NodeKind::Parameter => "parameter",
            NodeKind::Op(op) => op.kind(),
        })
    }

    pub fn is_leaf(&self, id: NodeId) -> Result<bool> {
        Ok(self.node(id)?.is_leaf())
    }

    pub fn requires_grad(&self, id: NodeId) -> Result<bool> {
        Ok(self.node(id)?.requires_grad)
    }

    /// The segment a node was recorded in, if any.
    pub fn segment_of(&self, id: NodeId) -> Result<Option<usize>> {
        Ok(self.node(id)?.segment)
    }

    /// Marks a node as a checkpoint (or unmarks it with `None`).
    pub fn checkpoint(&mut self, id: NodeId, options: Option<CheckpointOptions>) -> Result<()> {
        let retention = options.map_or(Retention::Keep, Retention::Recompute);
        self.set_retention(id, retention)
    }

    /// Sets what happens to a node's output between forward and backward. Leaves are always
    /// held (release them with [`Graph::release`]).
    pub fn set_retention(&mut self, id: NodeId, retention: Retention) -> Result<()> {
        let node = self.node_mut(id)?;
        if node.is_leaf() && retention != Retention::Keep {
            return Err(EngineError::Invalid(format!(
                "{} is a graph input or parameter: it cannot be recomputed",
                node.name
            )));
        }
        node.retention = retention;
        Ok(())
    }

    pub fn retention(&self, id: NodeId) -> Result<Retention> {
        Ok(self.node(id)?.retention)
    }

    /// Sets what backward does with rebuilt checkpoint values (see [`RebuildMode`]).
    pub fn set_rebuild_mode(&mut self, mode: RebuildMode) {
        self.rebuild_mode = mode;
    }

    pub fn rebuild_mode(&self) -> RebuildMode {
        self.rebuild_mode
    }

    /// Whether backward frees node `j`'s rebuilt value right after the node that read it.
    pub(crate) fn frees_after_use(&self, j: usize) -> bool {
        self.rebuild_mode == RebuildMode::FreeAfterUse
            && !self.nodes[j].is_leaf()
            && !self.retained(j)
    }

    /// Drops the graph's reference to a leaf's value (e.g. an input batch no longer
    /// needed). A later need for it is an "unrebuildable" error.
    pub fn release(&mut self, id: NodeId) -> Result<()> {
        let node = self.node_mut(id)?;
        if !node.is_leaf() {
            return Err(EngineError::Invalid(format!(
                "{} is not a graph input or parameter",
                node.name
            )));
        }
        node.value = None;
        node.released = true;
        Ok(())
    }

    /// Runs `build` so that every node it records is a checkpoint whose inputs follow their
    /// own retention, except the returned node, which is kept: in the spirit of
    /// `torch.utils.checkpoint`, only the segment's inputs and output stay in memory, and the
    /// inside is recomputed in backward (once per segment: rebuilt values are held until
    /// their last backward use).
    pub fn segment(&mut self, build: impl FnOnce(&mut Graph) -> Result<NodeId>) -> Result<NodeId> {
        let outer = self.segment.replace(self.next_segment);
        self.next_segment += 1;
        let out = build(self);
        self.segment = outer;
        let out = out?;
        self.node_mut(out)?.retention = Retention::Keep;
        Ok(out)
    }

    /// The value of a node after forward (shares storage), or why there is none.
    pub fn value(&self, id: NodeId) -> Result<Tensor> {
        let node = self.node(id)?;
        node.value.clone().ok_or_else(|| EngineError::NoValue {
            node: node.name.clone(),
            reason: if node.executed {
                "it was freed after its last use".into()
            } else {
                "forward has not run it yet".into()
            },
        })
    }

    /// The single element of a scalar-sized node, as f64.
    pub fn scalar(&self, id: NodeId) -> Result<f64> {
        let t = self.value(id)?;
        let v = t.to_f64_vec();
        match v.as_slice() {
            [x] => Ok(*x),
            _ => Err(EngineError::Invalid(format!(
                "{} has {} elements, not 1",
                self.node(id)?.name,
                v.len()
            ))),
        }
    }

    /// The accumulated gradient of a leaf (after backward).
    pub fn grad(&self, id: NodeId) -> Result<Option<Tensor>> {
        Ok(self.node(id)?.grad.clone())
    }

    /// Takes the gradient out of the graph.
    pub fn take_grad(&mut self, id: NodeId) -> Result<Option<Tensor>> {
        Ok(self.node_mut(id)?.grad.take())
    }

    /// How many times a node was recomputed.
    pub fn recompute_count(&self, id: NodeId) -> Result<u64> {
        Ok(self.node(id)?.recomputes)
    }

    /// Whether a node's value is currently held.
    pub fn is_resident(&self, id: NodeId) -> Result<bool> {
        Ok(self.node(id)?.value.is_some())
    }
}

#[cfg(test)]
mod tests;
