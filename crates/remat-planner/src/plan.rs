//! The plan format: an explicit schedule plus a per-tensor summary.
//!
//! A [`Plan`] is what the engine executes (issue 5). Its [`Plan::steps`] are run in order on
//! one compute stream; swaps are queued on two copy streams, one per direction:
//!
//! - [`Step::Compute`]`{node}`: compute `node` (its first computation or a recomputation).
//!   All its inputs must be on the device; its output must not be. The output's bytes are
//!   allocated when the step starts, so the inputs and the output coexist.
//! - [`Step::Free`]`{tensor}`: release the tensor's device bytes. If a swap-out of the tensor
//!   is still copying, the compute stream first waits for it.
//! - [`Step::SwapOut`]`{tensor}`: start copying the tensor to the host on the device-to-host
//!   stream. The device bytes stay allocated until a later `Free`.
//! - [`Step::SwapIn`]`{tensor}`: allocate the tensor's device bytes now and start copying it
//!   back on the host-to-device stream; a later `Compute` reading it waits for the copy.
//!
//! Memory is exactly `static_bytes` plus the bytes of every tensor on the device; it changes
//! only at `Compute` (up), `SwapIn` (up) and `Free` (down). Nothing is freed implicitly:
//! strategies emit a `Free` after a tensor's last use.
//!
//! [`Plan::decisions`] says, per tensor, whether it is kept, swapped or recomputed; it is for
//! people and for the engine's bookkeeping, the steps are the authority.

use serde::{Deserialize, Serialize};

use crate::ir::{Graph, NodeId};

/// Version of the JSON plan format; bumped on any incompatible change.
pub const PLAN_FORMAT_VERSION: u32 = 1;

/// One schedule step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Step {
    Compute { node: NodeId },
    Free { tensor: NodeId },
    SwapOut { tensor: NodeId },
    SwapIn { tensor: NodeId },
}

/// What happens to a tensor between its last forward use and its first backward use (more
/// generally, during its idle interval: see [`crate::attrs::TensorAttrs::idle`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Decision {
    /// Stays on the device from its computation to its last use.
    Keep,
    /// Copied to the host after `swap_out_after` computes, its device bytes released, and
    /// prefetched back when `prefetch_at` starts, ready for `use_at`.
    Swap {
        swap_out_after: NodeId,
        prefetch_at: NodeId,
        use_at: NodeId,
    },
    /// Dropped after `drop_after` computes and recomputed just before `use_at` from the
    /// tensors in `from` (which are on the device then), computing the nodes in between.
    Recompute {
        from: Vec<NodeId>,
        drop_after: NodeId,
        use_at: NodeId,
    },
}

/// The order a plan was made in, which says what a runtime may expect of its steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanOrder {
    /// Any topological order (the plan may run operations in another order than the
    /// graph's). The default, for plans written before the field existed.
    #[default]
    Free,
    /// First computations in node order ([`crate::ir::Graph::with_fixed_order`]);
    /// recomputations and copies anywhere.
    Node,
    /// What PyTorch's eager autograd runs as it is ([`crate::eager`]): node order, every
    /// tensor held while its forward readers (a backward tensor: all its readers) are
    /// ahead, recomputation of forward nodes only right before a backward node that reads
    /// them, a copy to the host only right after the value is made.
    Eager,
}

impl PlanOrder {
    /// Every order, in the order `--order` lists them.
    pub const ALL: [PlanOrder; 3] = [PlanOrder::Free, PlanOrder::Node, PlanOrder::Eager];

    /// The order a graph's plans are made in, from its marks.
    pub fn of(graph: &crate::ir::Graph) -> PlanOrder {
        if graph.order_is_eager() {
            PlanOrder::Eager
        } else if graph.order_is_fixed() {
            PlanOrder::Node
        } else {
            PlanOrder::Free
        }
    }

    /// The name `--order` and the JSON plan use.
    pub fn name(self) -> &'static str {
        match self {
            PlanOrder::Free => "free",
            PlanOrder::Node => "node",
            PlanOrder::Eager => "eager",
        }
    }

    /// The order named `text`, or `None`.
    pub fn from_name(text: &str) -> Option<PlanOrder> {
        PlanOrder::ALL.into_iter().find(|o| o.name() == text)
    }
}

/// A plan for one graph under one budget.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// [`PLAN_FORMAT_VERSION`] of the writer.
    pub version: u32,
    /// [`crate::ir::Graph::name`] of the graph planned.
    pub graph: String,
    /// Number of nodes of the graph planned, so a plan is not applied to another graph.
    pub node_count: usize,
    /// Registry name of the strategy that produced it.
    pub strategy: String,
    /// Device budget in bytes (static memory included) the plan was made for.
    pub budget_bytes: u64,
    /// Host-device bandwidth (bytes per second) the swaps were planned with.
    pub bandwidth_bytes_per_s: f64,
    /// The order the plan was made in; [`crate::sim::simulate`] checks an eager plan's
    /// steps against the eager rules. Absent in plans written before it existed: free.
    #[serde(default)]
    pub order: PlanOrder,
    pub steps: Vec<Step>,
    /// One entry per tensor, indexed by node id.
    pub decisions: Vec<Decision>,
}

impl Plan {
    /// Serializes as pretty JSON; a plan that cannot be written says so, rather than
    /// writing an error into the plan's text or a number [`Plan::from_json`] cannot read
    /// back (JSON has no NaN or infinity: serde_json would write `null`).
    pub fn to_json(&self) -> Result<String, PlanFormatError> {
        if !self.bandwidth_bytes_per_s.is_finite() {
            return Err(PlanFormatError::NotFinite {
                field: "bandwidth_bytes_per_s",
                value: self.bandwidth_bytes_per_s,
            });
        }
        serde_json::to_string_pretty(self).map_err(PlanFormatError::Write)
    }

    /// Whether the plan runs the operations in another order than the graph's (a node is
    /// computed for the first time before one with a lower id). The format is unchanged:
    /// the steps always said the order; this reads it off them.
    pub fn reorders(&self) -> bool {
        let mut last_first: Option<NodeId> = None;
        let mut seen = std::collections::HashSet::new();
        for step in &self.steps {
            if let Step::Compute { node } = *step
                && seen.insert(node)
            {
                if last_first.is_some_and(|l| node < l) {
                    return true;
                }
                last_first = Some(node);
            }
        }
        false
    }

    /// Parses a plan, refusing other format versions.
    pub fn from_json(text: &str) -> Result<Plan, PlanFormatError> {
        let plan: Plan = serde_json::from_str(text).map_err(PlanFormatError::Json)?;
        if plan.version != PLAN_FORMAT_VERSION {
            return Err(PlanFormatError::Version {
                found: plan.version,
                expected: PLAN_FORMAT_VERSION,
            });
        }
        Ok(plan)
    }
}

/// A plan that cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum PlanFormatError {
    #[error("plan is not valid JSON: {0}")]
    Json(serde_json::Error),
    #[error("plan cannot be written as JSON: {0}")]
    Write(serde_json::Error),
    #[error("plan cannot be written as JSON: its {field} is {value}, which JSON cannot hold")]
    NotFinite { field: &'static str, value: f64 },
    #[error("plan has format version {found}, this build reads version {expected}")]
    Version { found: u32, expected: u32 },
}

/// Device bytes, static bytes excluded, once each of `steps` has run on `graph`: a
/// computation and a swap-in add their tensor, a free removes it, a swap-out leaves them
/// (the accounting of [`crate::sim`], for passes that move steps against a budget).
pub(crate) fn live_bytes_after(graph: &Graph, steps: &[Step]) -> Vec<u64> {
    let mut now: u64 = 0;
    steps
        .iter()
        .map(|step| {
            match *step {
                Step::Compute { node } => now += graph.node(node).output_bytes,
                Step::SwapIn { tensor } => now += graph.node(tensor).output_bytes,
                Step::Free { tensor } => {
                    now = now.saturating_sub(graph.node(tensor).output_bytes);
                }
                Step::SwapOut { .. } => {}
            }
            now
        })
        .collect()
}

/// `steps` without the ones `removed` says, with each of `inserted` (the index of the step
/// of `steps` it goes before, `steps.len()` to append, and the step) in place; steps
/// inserted before one index keep their order in `inserted`. For passes that move or add
/// steps in one rebuild.
pub(crate) fn splice(
    steps: &[Step],
    removed: impl Fn(usize) -> bool,
    mut inserted: Vec<(usize, Step)>,
) -> Vec<Step> {
    // Stable: insertions before one index keep their order.
    inserted.sort_by_key(|&(before, _)| before);
    let mut out = Vec::with_capacity(steps.len() + inserted.len());
    let mut next = inserted.into_iter().peekable();
    for (i, step) in steps.iter().enumerate() {
        while let Some((_, s)) = next.next_if(|&(before, _)| before == i) {
            out.push(s);
        }
        if !removed(i) {
            out.push(*step);
        }
    }
    out.extend(next.map(|(_, s)| s));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Removed steps go, insertions land before their index (or at the end) in the order
    /// given.
    #[test]
    fn splice_removes_and_inserts_in_order() {
        use Step::*;
        let steps = [Compute { node: 0 }, Free { tensor: 0 }, Compute { node: 1 }];
        let out = splice(
            &steps,
            |i| i == 1,
            vec![
                (2, SwapOut { tensor: 1 }),
                (1, SwapOut { tensor: 0 }),
                (1, Free { tensor: 0 }),
                (3, Free { tensor: 1 }),
            ],
        );
        assert_eq!(
            out,
            [
                Compute { node: 0 },
                SwapOut { tensor: 0 },
                Free { tensor: 0 },
                SwapOut { tensor: 1 },
                Compute { node: 1 },
                Free { tensor: 1 },
            ]
        );
    }

    #[test]
    fn json_round_trip_and_version_check() {
        let plan = Plan {
            version: PLAN_FORMAT_VERSION,
            graph: "g".into(),
            node_count: 2,
            strategy: "store-all".into(),
            budget_bytes: 10,
            bandwidth_bytes_per_s: 1e9,
            order: PlanOrder::Node,
            steps: vec![
                Step::Compute { node: 0 },
                Step::SwapOut { tensor: 0 },
                Step::Free { tensor: 0 },
                Step::SwapIn { tensor: 0 },
                Step::Compute { node: 1 },
            ],
            decisions: vec![
                Decision::Swap {
                    swap_out_after: 0,
                    prefetch_at: 1,
                    use_at: 1,
                },
                Decision::Keep,
            ],
        };
        let text = plan.to_json().expect("a plan serializes");
        assert!(text.contains("\"op\": \"swap_out\""), "{text}");
        assert_eq!(Plan::from_json(&text).unwrap(), plan);
        assert!(text.contains("\"order\": \"node\""), "{text}");
        // A plan written before the field existed reads as free order.
        let older = text.replace("\"order\": \"node\",", "");
        assert_eq!(Plan::from_json(&older).unwrap().order, PlanOrder::Free);
        assert_eq!(PlanOrder::from_name("eager"), Some(PlanOrder::Eager));
        assert_eq!(PlanOrder::from_name("zigzag"), None);
        let old = text.replace("\"version\": 1", "\"version\": 0");
        assert!(matches!(
            Plan::from_json(&old),
            Err(PlanFormatError::Version { found: 0, .. })
        ));
        // A plan JSON cannot hold is refused, not written with an error or a null inside.
        let unwritable = Plan {
            bandwidth_bytes_per_s: f64::NAN,
            ..plan
        };
        let err = unwritable.to_json().expect_err("NaN has no JSON form");
        assert!(matches!(err, PlanFormatError::NotFinite { .. }), "{err}");
        assert!(err.to_string().contains("bandwidth_bytes_per_s"), "{err}");
    }
}
