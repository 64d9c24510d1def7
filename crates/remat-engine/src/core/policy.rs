//! Checkpointing policies: each sets the retention of every op node of a recorded graph.
//! Apply one after recording and before [`Graph::forward`].

use std::fmt;
use std::str::FromStr;

use crate::core::checkpoint::{CheckpointOptions, RebuildMode, Retention};
use crate::core::error::{EngineError, Result};
use crate::core::graph::Graph;

/// A whole-graph checkpointing policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Keep every activation backward reads.
    StoreAll,
    /// Keep only graph inputs and parameters; recompute everything else, and free every
    /// rebuilt value again right after the backward node that read it
    /// ([`RebuildMode::FreeAfterUse`]): backward holds only what the running node reads and
    /// the rebuild feeding it, so the peak is the least of all policies, at the price of
    /// rebuilding each backward node's inputs from the graph inputs (O(n^2) recomputes on
    /// an n-node chain).
    RecomputeAll,
    /// Keep the output of every n-th op node (in recording order); recompute the rest.
    EveryN(usize),
    /// Keep op nodes whose depth (longest path from a leaf) is a multiple of n.
    ByDepth(usize),
    /// Segments of ceil(sqrt(op nodes)) nodes: keep each segment's last node (Chen et al.).
    Sqrt,
}

impl Policy {
    /// Sets the retention of every op node of `g` (overwriting earlier marks) and the
    /// graph's [`RebuildMode`] (free-after-use for recompute-all, hold-until-last-use for
    /// the others).
    pub fn apply(&self, g: &mut Graph) -> Result<()> {
        g.set_rebuild_mode(match self {
            Policy::RecomputeAll => RebuildMode::FreeAfterUse,
            _ => RebuildMode::HoldUntilLastUse,
        });
        let ops: Vec<_> = g
            .node_ids()
            .filter(|&id| !g.is_leaf(id).unwrap_or(true))
            .collect();
        let recompute = Retention::Recompute(CheckpointOptions::policy());
        let keep_every = |n: usize, k: usize| (k + 1).is_multiple_of(n);
        let depths = match self {
            Policy::ByDepth(_) => Some(depths(g)?),
            _ => None,
        };
        let sqrt_len = (ops.len() as f64).sqrt().ceil().max(1.0) as usize;
        for (k, &id) in ops.iter().enumerate() {
            let keep = match *self {
                Policy::StoreAll => true,
                Policy::RecomputeAll => false,
                Policy::EveryN(n) => keep_every(n.max(1), k),
                Policy::Sqrt => keep_every(sqrt_len, k),
                Policy::ByDepth(n) => depths
                    .as_ref()
                    .is_some_and(|d| d[id.index()].is_multiple_of(n.max(1))),
            };
            g.set_retention(id, if keep { Retention::Keep } else { recompute })?;
        }
        Ok(())
    }
}

/// Longest path from a leaf to each node (leaves 0), in one pass over the arena.
pub fn depths(g: &Graph) -> Result<Vec<usize>> {
    let mut d = vec![0usize; g.len()];
    for id in g.node_ids() {
        let inputs = g.inputs(id)?;
        if let Some(m) = inputs.iter().map(|i| d[i.index()]).max() {
            d[id.index()] = m + 1;
        }
    }
    Ok(d)
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::StoreAll => f.write_str("store-all"),
            Policy::RecomputeAll => f.write_str("recompute-all"),
            Policy::EveryN(n) => write!(f, "every:{n}"),
            Policy::ByDepth(n) => write!(f, "depth:{n}"),
            Policy::Sqrt => f.write_str("sqrt"),
        }
    }
}

impl FromStr for Policy {
    type Err = EngineError;

    /// `store-all`, `recompute-all`, `every:N`, `depth:N`, `sqrt`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            EngineError::Invalid(format!(
                "unknown policy {s:?} (expected store-all, recompute-all, every:N, depth:N or sqrt)"
            ))
        };
        // A known form with a bad N says what N must be (like `blocks:N`), not "unknown".
        let number = |form: &str, v: &str| {
            v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                EngineError::Invalid(format!(
                    "policy {s:?}: {form}:N needs a positive whole number N (got {v:?})"
                ))
            })
        };
        match s {
            "store-all" => Ok(Policy::StoreAll),
            "recompute-all" => Ok(Policy::RecomputeAll),
            "sqrt" => Ok(Policy::Sqrt),
            _ => match s.split_once(':') {
                Some(("every", n)) => Ok(Policy::EveryN(number("every", n)?)),
                Some(("depth", n)) => Ok(Policy::ByDepth(number("depth", n)?)),
                _ => Err(bad()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::pool::Category;
    use crate::{ExecContext, MemoryPool, Tensor};

    #[test]
    fn parses_and_prints() {
        for s in ["store-all", "recompute-all", "every:3", "depth:2", "sqrt"] {
            assert_eq!(s.parse::<Policy>().unwrap().to_string(), s);
        }
        for bad in ["every:0", "depth:0", "every:x", "depth:-1"] {
            let err = bad.parse::<Policy>().unwrap_err().to_string();
            assert!(
                err.contains("needs a positive whole number N") && !err.contains("unknown"),
                "{err}"
            );
        }
        assert!(
            "often"
                .parse::<Policy>()
                .unwrap_err()
                .to_string()
                .contains("often")
        );
    }

    #[test]
    fn hundred_thousand_node_chain_runs_without_recursion() {
        let pool = MemoryPool::unbounded();
        let ctx = ExecContext::new(pool.clone(), 1).unwrap();
        let mut g = Graph::new(&ctx);
        let x = Tensor::from_vec(
            &pool,
            "x",
            &[4],
            vec![1.0f32, 2.0, 3.0, 4.0],
            Category::Parameters,
        )
        .unwrap();
        let mut h = g.param("x", &x);
        for _ in 0..100_000 {
            h = g.scale(h, 1.0).unwrap();
        }
        let t = g.input(
            "t",
            Tensor::zeros(&pool, &[4], crate::DType::F32, Category::Activations, None).unwrap(),
        );
        let loss = g.mse(h, t).unwrap();
        // Recompute everything too: the rebuild of the whole chain must not recurse either.
        Policy::RecomputeAll.apply(&mut g).unwrap();
        g.forward().unwrap();
        assert_eq!(g.scalar(loss).unwrap(), 7.5);
        g.backward(loss).unwrap();
        assert_eq!(
            g.grad(g.node_ids().next().unwrap())
                .unwrap()
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            vec![0.5, 1.0, 1.5, 2.0]
        );
    }
}
