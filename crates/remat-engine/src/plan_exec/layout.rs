//! The step layout: the engine graph of one training step unrolled into the planner's items
//! (forward ops, backward ops, op workspaces), each producing one tensor, in execution order.
//!
//! - `fwd:NAME` computes an op's output (its value plus the aux tensors its backward reads).
//! - `bwd:NAME` runs the op's backward; its tensor is the bundle of gradients it produces for
//!   its non-leaf inputs. Leaf gradients (parameters) go into their gradient buffers.
//! - `grad:NAME` is the gradient buffer of parameter NAME. It comes right before the first
//!   backward op that writes it, which reads it; as the engine's own backward does, that op's
//!   contribution *becomes* the buffer (its reserved bytes are handed to the op), later
//!   writers add to it in place, and `end:step`, the last item, reads every buffer so that
//!   each one lives from its first write to the end of the step. A buffer holds the sum of
//!   contributions already made, so it cannot be recomputed once written: the executor
//!   refuses a plan that drops a written buffer without a current host copy (see
//!   [`super::check_plan`]).
//! - `ws:NAME` stands for the transient memory an op needs beyond its output while it runs
//!   (scratch buffers, the gradient seed, the sum of several incoming gradients, parameter
//!   gradient contributions before they are added to their buffer). Measured by the
//!   profiler, it is what lets the simulator predict the pool's peak to the byte: it is
//!   "computed" (reserved) right before its op, which reads it, and freed after.

use remat_planner::{Node as IrNode, Phase as IrPhase, Step};

use super::PlanExecError;
use crate::core::graph::{Graph, NodeId};

/// What an item of the layout runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItemKind {
    /// Forward (or recompute) of engine node `node`.
    Forward { node: usize },
    /// Backward of engine node `node`.
    Backward { node: usize },
    /// The workspace of item `of` (the item right after it).
    Workspace { of: usize },
    /// The gradient buffer of leaf (parameter) `leaf`.
    Grad { leaf: usize },
    /// The end of the step: reads every gradient buffer, produces nothing.
    End,
}

/// One planner node: an engine op's forward or backward, or a workspace.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    pub kind: ItemKind,
    pub name: String,
    pub phase: IrPhase,
    /// Items whose tensors this item reads, each once.
    pub inputs: Vec<usize>,
    /// Bytes reserved for the item: its workspace (workspace items) or its gradient buffer
    /// (gradient items); zero for the others, whose bytes are measured.
    pub reserved_bytes: u64,
}

/// What the profiler learned about each engine node, needed to lay the step out exactly.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measured {
    /// Whether the node's forward produces aux tensors (its backward then reads them).
    pub has_aux: Vec<bool>,
    /// Transient bytes beyond the output while the forward runs.
    pub fwd_workspace: Vec<u64>,
    /// Transient bytes beyond the gradient bundle while the backward runs.
    pub bwd_workspace: Vec<u64>,
}

impl Measured {
    /// Before profiling: every backward reads its node's tensors, no workspace is known.
    pub fn unknown(nodes: usize) -> Self {
        Measured {
            has_aux: vec![true; nodes],
            fwd_workspace: vec![0; nodes],
            bwd_workspace: vec![0; nodes],
        }
    }
}

/// The items of one training step of one engine graph.
#[derive(Clone, Debug)]
pub struct Layout {
    pub(crate) items: Vec<Item>,
    /// The last loss (the step's only one for a single model).
    pub(crate) loss: usize,
    /// Every loss root, ascending (several when K models share the graph).
    pub(crate) losses: Vec<usize>,
    /// Engine node -> its forward item.
    pub(crate) fwd: Vec<Option<usize>>,
    /// Engine node -> its backward item.
    pub(crate) bwd: Vec<Option<usize>>,
    /// Engine node -> nodes reading it (up to the loss), ascending.
    pub(crate) users: Vec<Vec<usize>>,
    /// Leaves that receive a gradient buffer.
    pub(crate) grad_leaves: Vec<usize>,
    /// Engine node (a leaf in `grad_leaves`) -> its gradient buffer item.
    pub(crate) grad: Vec<Option<usize>>,
}

impl Layout {
    /// Lays out the training step of `graph` ending in `loss`.
    pub fn build(
        graph: &Graph,
        loss: NodeId,
        measured: &Measured,
    ) -> Result<Layout, PlanExecError> {
        Self::build_multi(graph, &[loss], measured)
    }

    /// Lays out a training step with several loss roots (K models recorded into one
    /// graph, each ending in its own loss; see [`Graph::backward_many`]). Each loss seeds
    /// its own gradient; none is summed with another.
    #[allow(clippy::needless_range_loop)] // v indexes three arrays at once
    pub fn build_multi(
        graph: &Graph,
        losses: &[NodeId],
        measured: &Measured,
    ) -> Result<Layout, PlanExecError> {
        let nodes = &graph.nodes;
        let mut roots: Vec<usize> = losses.iter().map(|l| l.index()).collect();
        roots.sort_unstable();
        for pair in roots.windows(2) {
            if pair[0] == pair[1] {
                return Err(PlanExecError::BadLoss {
                    index: pair[0],
                    reason: "it is given twice",
                });
            }
        }
        let loss = *roots.last().ok_or(PlanExecError::Invalid(
            "a training step needs at least one loss".into(),
        ))?;
        for &root in &roots {
            let node = nodes.get(root).ok_or(PlanExecError::BadLoss {
                index: root,
                reason: "no such node",
            })?;
            if node.op().is_none() {
                return Err(PlanExecError::BadLoss {
                    index: root,
                    reason: "it is a leaf, not an op",
                });
            }
        }
        if measured.has_aux.len() < loss + 1 {
            return Err(PlanExecError::Invalid(format!(
                "measurements cover {} nodes, the step has {}",
                measured.has_aux.len(),
                loss + 1
            )));
        }
        let mut users = vec![Vec::new(); loss + 1];
        for (c, node) in nodes.iter().enumerate().take(loss + 1) {
            for j in &node.inputs {
                if !users[j.0].contains(&c) {
                    users[j.0].push(c);
                }
            }
        }
        let has_bwd = backward_reach(graph, &roots, &users);
        let mut layout = Layout {
            items: Vec::new(),
            loss,
            losses: roots,
            fwd: vec![None; loss + 1],
            bwd: vec![None; loss + 1],
            users,
            grad_leaves: Vec::new(),
            grad: vec![None; loss + 1],
        };
        layout.grad_leaves = (0..=loss)
            .filter(|&j| {
                nodes[j].is_leaf()
                    && nodes[j].requires_grad
                    && layout.users[j].iter().any(|&w| has_bwd[w])
            })
            .collect();
        let is_grad_leaf = {
            let mut v = vec![false; loss + 1];
            for &j in &layout.grad_leaves {
                v[j] = true;
            }
            v
        };
        for v in 0..=loss {
            if nodes[v].op().is_some() {
                layout.push_forward(graph, v, measured.fwd_workspace[v]);
            }
        }
        for c in (0..=loss).rev() {
            if has_bwd[c] {
                for j in &nodes[c].inputs {
                    if is_grad_leaf[j.0] && layout.grad[j.0].is_none() {
                        layout.push_grad(graph, j.0);
                    }
                }
                layout.push_backward(graph, c, measured, &has_bwd);
            }
        }
        layout.push_end();
        Ok(layout)
    }

    /// The gradient buffer of leaf `j`, right before the first backward op writing it.
    fn push_grad(&mut self, graph: &Graph, j: usize) {
        let node = &graph.nodes[j];
        self.grad[j] = Some(self.items.len());
        self.items.push(Item {
            kind: ItemKind::Grad { leaf: j },
            name: format!("grad:{}", node.name),
            phase: IrPhase::Backward,
            inputs: Vec::new(),
            reserved_bytes: crate::core::tensor::nbytes(&node.shape, node.dtype),
        });
    }

    /// The end of the step, reading every gradient buffer (none: no end item).
    fn push_end(&mut self) {
        let mut inputs: Vec<usize> = self
            .grad_leaves
            .iter()
            .filter_map(|&j| self.grad[j])
            .collect();
        inputs.sort_unstable();
        if inputs.is_empty() {
            return;
        }
        self.items.push(Item {
            kind: ItemKind::End,
            name: "end:step".into(),
            phase: IrPhase::Backward,
            inputs,
            reserved_bytes: 0,
        });
    }

    fn push_workspace(&mut self, name: &str, phase: IrPhase, bytes: u64) -> Option<usize> {
        if bytes == 0 {
            return None;
        }
        let id = self.items.len();
        self.items.push(Item {
            kind: ItemKind::Workspace { of: id + 1 },
            name: format!("ws:{name}"),
            phase,
            inputs: Vec::new(),
            reserved_bytes: bytes,
        });
        Some(id)
    }

    fn push_forward(&mut self, graph: &Graph, v: usize, workspace: u64) {
        let node = &graph.nodes[v];
        // The loss is the first op that exists only for training: the planner counts it
        // with the backward pass, as Checkmate's graphs do. With several losses only the
        // last does, so the forward pass stays one contiguous run of items.
        let phase = if v == self.loss {
            IrPhase::Backward
        } else {
            IrPhase::Forward
        };
        let ws = self.push_workspace(&node.name, phase, workspace);
        let mut inputs = Vec::new();
        for j in &node.inputs {
            push_once(&mut inputs, self.fwd[j.0]);
        }
        push_once(&mut inputs, ws);
        self.fwd[v] = Some(self.items.len());
        self.items.push(Item {
            kind: ItemKind::Forward { node: v },
            name: format!("fwd:{}", node.name),
            phase,
            inputs,
            reserved_bytes: 0,
        });
    }

    fn push_backward(&mut self, graph: &Graph, c: usize, measured: &Measured, has_bwd: &[bool]) {
        let node = &graph.nodes[c];
        let Some(op) = node.op() else { return };
        let ws = self.push_workspace(
            &format!("bwd:{}", node.name),
            IrPhase::Backward,
            measured.bwd_workspace[c],
        );
        let mut inputs = Vec::new();
        // Gradient sources, in the order the engine accumulates them: latest user first.
        for &w in self.users[c].iter().rev() {
            if has_bwd[w] {
                push_once(&mut inputs, self.bwd[w]);
            }
        }
        for (slot, j) in node.inputs.iter().enumerate() {
            if op.saves_input(slot) {
                push_once(&mut inputs, self.fwd[j.0]);
            }
        }
        if op.saves_output() || measured.has_aux[c] {
            push_once(&mut inputs, self.fwd[c]);
        }
        for j in &node.inputs {
            push_once(&mut inputs, self.grad[j.0]);
        }
        push_once(&mut inputs, ws);
        self.bwd[c] = Some(self.items.len());
        self.items.push(Item {
            kind: ItemKind::Backward { node: c },
            name: format!("bwd:{}", node.name),
            phase: IrPhase::Backward,
            inputs,
            reserved_bytes: 0,
        });
    }

    pub fn items(&self) -> &[Item] {
        &self.items
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The engine node of the loss (the last one when the step has several).
    pub fn loss(&self) -> NodeId {
        NodeId(self.loss)
    }

    /// The engine nodes of every loss root, ascending.
    pub fn losses(&self) -> Vec<NodeId> {
        self.losses.iter().map(|&l| NodeId(l)).collect()
    }

    /// Whether engine node `node` is a loss root.
    pub(crate) fn is_loss(&self, node: usize) -> bool {
        self.losses.binary_search(&node).is_ok()
    }

    /// The owner (model or fused group, see [`Graph::set_owner`]) of each item: the owner
    /// of its engine node (a workspace: of the item it serves); `None` for shared nodes and
    /// the end of the step. Indexed like the profiled planner graph's nodes.
    pub fn item_owners(&self, graph: &Graph) -> Vec<Option<usize>> {
        let of_node = |n: usize| graph.nodes.get(n).and_then(|node| node.owner);
        let mut owners: Vec<Option<usize>> = self
            .items
            .iter()
            .map(|item| match item.kind {
                ItemKind::Forward { node } | ItemKind::Backward { node } => of_node(node),
                ItemKind::Grad { leaf } => of_node(leaf),
                ItemKind::Workspace { .. } | ItemKind::End => None,
            })
            .collect();
        for (i, item) in self.items.iter().enumerate() {
            if let ItemKind::Workspace { of } = item.kind {
                owners[i] = owners.get(of).copied().flatten();
            }
        }
        owners
    }

    /// The forward item of an engine node, if it has one.
    pub fn forward_item(&self, node: NodeId) -> Option<usize> {
        self.fwd.get(node.0).copied().flatten()
    }

    /// The gradient buffer item of a leaf, if it gets one.
    pub fn grad_item(&self, leaf: NodeId) -> Option<usize> {
        self.grad.get(leaf.0).copied().flatten()
    }

    /// The backward item of an engine node, if it has one.
    pub fn backward_item(&self, node: NodeId) -> Option<usize> {
        self.bwd.get(node.0).copied().flatten()
    }

    /// The items the planner must compute exactly once: the gradient buffers. Later
    /// backward ops add into a buffer in place, so creating it a second time would discard
    /// the gradients accumulated so far; it may be kept or swapped, never recomputed.
    pub fn pinned_items(&self) -> impl Iterator<Item = usize> + '_ {
        self.items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| matches!(item.kind, ItemKind::Grad { .. }).then_some(i))
    }

    /// The planner nodes of this layout given each item's time (seconds) and output bytes.
    pub fn ir_nodes(&self, times: &[f64], output_bytes: &[u64]) -> Vec<IrNode> {
        self.items
            .iter()
            .enumerate()
            .map(|(i, item)| IrNode {
                name: item.name.clone(),
                phase: item.phase,
                compute_time: times.get(i).copied().unwrap_or(0.0),
                output_bytes: match item.kind {
                    ItemKind::Workspace { .. } | ItemKind::Grad { .. } => item.reserved_bytes,
                    ItemKind::End => 0,
                    _ => output_bytes.get(i).copied().unwrap_or(0),
                },
                inputs: item.inputs.clone(),
            })
            .collect()
    }

    /// Keep everything: compute every item in order and free each tensor right after its
    /// last reader (a tensor nobody reads right after it is computed).
    pub fn store_all_steps(&self) -> Vec<Step> {
        let n = self.items.len();
        let mut last_use: Vec<usize> = (0..n).collect();
        for (i, item) in self.items.iter().enumerate() {
            for &j in &item.inputs {
                last_use[j] = last_use[j].max(i);
            }
        }
        let mut freed_after = vec![Vec::new(); n];
        for (t, &at) in last_use.iter().enumerate() {
            freed_after[at].push(t);
        }
        let mut steps = Vec::with_capacity(2 * n);
        for (i, freed) in freed_after.iter().enumerate() {
            steps.push(Step::Compute { node: i });
            steps.extend(freed.iter().map(|&t| Step::Free { tensor: t }));
        }
        steps
    }
}

fn push_once(list: &mut Vec<usize>, item: Option<usize>) {
    if let Some(i) = item
        && !list.contains(&i)
    {
        list.push(i);
    }
}

/// Which op nodes receive a gradient from the loss: the loss itself, and every op that
/// requires a gradient and feeds one that does. One reverse sweep (users come later).
fn backward_reach(graph: &Graph, losses: &[usize], users: &[Vec<usize>]) -> Vec<bool> {
    let loss = losses.iter().copied().max().unwrap_or(0);
    let mut reach = vec![false; loss + 1];
    for c in (0..=loss).rev() {
        let node = &graph.nodes[c];
        if node.op().is_none() || !node.requires_grad {
            continue;
        }
        reach[c] = losses.contains(&c) || users[c].iter().any(|&w| reach[w]);
    }
    reach
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::context::ExecContext;
    use crate::core::pool::{Category, MemoryPool};
    use crate::core::tensor::Tensor;

    /// x -> h = x W -> r = relu(h) -> s = h + r -> loss = mse(s, y)
    fn residual() -> (Graph, NodeId) {
        let pool = MemoryPool::unbounded();
        let ctx = ExecContext::new(pool.clone(), 1).unwrap();
        let t = |shape: &[usize], cat| {
            Tensor::from_vec(&pool, "t", shape, vec![0.5f32; shape.iter().product()], cat).unwrap()
        };
        let mut g = Graph::new(&ctx);
        let x = g.input("x", t(&[2, 3], Category::Activations));
        let y = g.input("y", t(&[2, 3], Category::Activations));
        let w = g.param("w", &t(&[3, 3], Category::Parameters));
        let h = g.matmul(x, w).unwrap();
        let r = g.relu(h).unwrap();
        let s = g.add(h, r).unwrap();
        let loss = g.mse(s, y).unwrap();
        (g, loss)
    }

    #[test]
    fn items_follow_the_step_and_gradients_flow_latest_user_first() {
        let (g, loss) = residual();
        let layout = Layout::build(&g, loss, &Measured::unknown(g.nodes.len())).unwrap();
        let names: Vec<&str> = layout.items().iter().map(|i| i.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "fwd:matmul#3",
                "fwd:relu#4",
                "fwd:add#5",
                "fwd:mse#6",
                "bwd:mse#6",
                "bwd:add#5",
                "bwd:relu#4",
                "grad:w",
                "bwd:matmul#3",
                "end:step"
            ]
        );
        // The loss counts as backward; everything before it as forward.
        assert_eq!(layout.items()[3].phase, IrPhase::Backward);
        assert_eq!(layout.items()[2].phase, IrPhase::Forward);
        // bwd:matmul reads the gradient bundles of add (node 5, later) then relu (node 4),
        // then its own forward value (unknown aux is assumed), then w's gradient buffer.
        assert_eq!(layout.items()[8].inputs, [5, 6, 0, 7]);
        assert_eq!(layout.grad_leaves, vec![2]);
        assert_eq!(layout.grad_item(NodeId(2)), Some(7));
        // w's buffer: 3 x 3 f32, read by its writer and by the end of the step.
        assert_eq!(layout.items()[7].reserved_bytes, 36);
        assert_eq!(layout.items()[9].inputs, [7]);
        // Store-all computes everything once and frees every tensor.
        let steps = layout.store_all_steps();
        let computes = steps
            .iter()
            .filter(|s| matches!(s, Step::Compute { .. }))
            .count();
        let frees = steps
            .iter()
            .filter(|s| matches!(s, Step::Free { .. }))
            .count();
        assert_eq!((computes, frees), (10, 10));
        // The buffer is freed only after the end of the step.
        let freed_at = steps
            .iter()
            .position(|s| *s == Step::Free { tensor: 7 })
            .unwrap();
        let end_at = steps
            .iter()
            .position(|s| *s == Step::Compute { node: 9 })
            .unwrap();
        assert!(freed_at > end_at);
    }

    #[test]
    fn a_leaf_cannot_be_the_loss() {
        let (g, _) = residual();
        let err = Layout::build(&g, NodeId(0), &Measured::unknown(g.nodes.len())).unwrap_err();
        assert!(
            err.to_string().contains("#0") && err.to_string().contains("leaf"),
            "{err}"
        );
    }

    #[test]
    fn workspaces_come_right_before_their_op() {
        let (g, loss) = residual();
        let mut m = Measured::unknown(g.nodes.len());
        m.bwd_workspace[loss.index()] = 24;
        let layout = Layout::build(&g, loss, &m).unwrap();
        let ws = layout
            .items()
            .iter()
            .position(|i| i.name == "ws:bwd:mse#6")
            .unwrap();
        assert_eq!(layout.items()[ws].reserved_bytes, 24);
        assert_eq!(layout.items()[ws + 1].name, "bwd:mse#6");
        assert!(layout.items()[ws + 1].inputs.contains(&ws));
    }
}
