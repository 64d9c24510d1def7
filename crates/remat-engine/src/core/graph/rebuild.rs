//! Rebuilding dropped values: collect the missing ancestors with an explicit stack (checking
//! released leaves and detached inputs), check every member's depth limit against the
//! longest chain of recomputes starting at it, then recompute them in index order, freeing
//! each rebuilt value as soon as nothing in this rebuild nor in backward needs it (under
//! [`RebuildMode::FreeAfterUse`], as soon as nothing in this rebuild and not the node it
//! serves needs it).
//!
//! [`RebuildMode::FreeAfterUse`]: crate::core::checkpoint::RebuildMode::FreeAfterUse

use std::collections::{HashMap, HashSet};

use super::Graph;
use crate::core::checkpoint::Retention;
use crate::core::error::{EngineError, Result};
use crate::core::op::Phase;

struct Visit {
    node: usize,
    parent: Option<usize>,
    depth: usize,
    /// Deepest depth this chain may reach, and the node that set the limit.
    limit: usize,
    limited_by: usize,
}

impl Graph {
    /// Makes the values of `needed` resident, and the aux tensors of `needed_aux` (a node
    /// whose own backward reads aux the forward dropped is rebuilt too).
    pub(crate) fn rebuild(&mut self, needed: &[usize], needed_aux: &[usize]) -> Result<()> {
        let set = self.collect_rebuild_set(needed, needed_aux)?;
        if set.is_empty() {
            return Ok(());
        }
        let members: HashSet<usize> = set.iter().copied().collect();
        let mut uses: HashMap<usize, usize> = HashMap::new();
        for &w in &set {
            for j in &self.nodes[w].inputs {
                *uses.entry(j.0).or_default() += 1;
            }
        }
        for &w in &set {
            self.recompute(w)?;
            let inputs = self.nodes[w].inputs.clone();
            for j in inputs {
                let left = uses.get_mut(&j.0).map(|u| {
                    *u -= 1;
                    *u
                });
                let transient = members.contains(&j.0)
                    && !needed.contains(&j.0)
                    && !needed_aux.contains(&j.0)
                    && (self.plan.bwd_remaining[j.0] == 0 || self.frees_after_use(j.0))
                    && self.plan.fwd_remaining[j.0] == 0;
                if left == Some(0) && transient {
                    self.nodes[j.0].value = None;
                    self.nodes[j.0].aux.clear();
                }
            }
        }
        Ok(())
    }

    fn is_missing(&self, i: usize, aux: bool) -> bool {
        let node = &self.nodes[i];
        // A node whose backward needs only its aux tensors (its value was released after
        // its consumers' backward) need not be rebuilt while those are still held.
        if aux {
            node.aux.is_empty() && node.aux_count > 0
        } else {
            node.value.is_none()
        }
    }

    fn collect_rebuild_set(&self, needed: &[usize], needed_aux: &[usize]) -> Result<Vec<usize>> {
        let mut visits: Vec<Visit> = Vec::new();
        let mut stack: Vec<usize> = Vec::new();
        let mut seen: HashSet<usize> = HashSet::new();
        let roots = needed
            .iter()
            .map(|&i| (i, false))
            .chain(needed_aux.iter().map(|&i| (i, true)));
        for (i, aux) in roots {
            if !self.is_missing(i, aux) || !seen.insert(i) {
                continue;
            }
            let limit = self.depth_limit(i).unwrap_or(usize::MAX);
            visits.push(Visit {
                node: i,
                parent: None,
                depth: 1,
                limit,
                limited_by: i,
            });
            stack.push(visits.len() - 1);
        }
        while let Some(vi) = stack.pop() {
            let v = visits[vi].node;
            let node = &self.nodes[v];
            if node.is_leaf() {
                let reason = format!(
                    "{} is a graph input or parameter whose value was released",
                    node.name
                );
                return Err(self.unrebuildable(&visits, vi, None, reason));
            }
            if !node.executed {
                let reason = format!("{} was never computed", node.name);
                return Err(self.unrebuildable(&visits, vi, None, reason));
            }
            let detach = node.retention.options().is_some_and(|o| o.detach_inputs);
            for j in &node.inputs {
                let u = j.0;
                if self.nodes[u].value.is_some() || seen.contains(&u) {
                    continue;
                }
                if detach {
                    let reason = format!(
                        "{} has detach_inputs set and its input {} is not held",
                        node.name, self.nodes[u].name
                    );
                    return Err(self.unrebuildable(&visits, vi, Some(u), reason));
                }
                let depth = visits[vi].depth + 1;
                if depth > visits[vi].limit {
                    let v = &visits[vi];
                    return Err(EngineError::RecomputeDepthExceeded {
                        depth,
                        limit: v.limit - self.depth_offset(&visits, vi, v.limited_by),
                        limited_by: self.nodes[v.limited_by].name.clone(),
                        chain: self.chain(&visits, vi, Some(u)),
                    });
                }
                let (mut limit, mut limited_by) = (visits[vi].limit, visits[vi].limited_by);
                if let Some(own) = self.depth_limit(u) {
                    let own_limit = (depth - 1).saturating_add(own);
                    if own_limit < limit {
                        (limit, limited_by) = (own_limit, u);
                    }
                }
                seen.insert(u);
                visits.push(Visit {
                    node: u,
                    parent: Some(vi),
                    depth,
                    limit,
                    limited_by,
                });
                stack.push(visits.len() - 1);
            }
        }
        let mut set: Vec<usize> = visits.iter().map(|v| v.node).collect();
        set.sort_unstable();
        self.check_longest_chains(&set)?;
        Ok(set)
    }

    /// The walk above fixes a node's depth where it is first found, so a node shared by a
    /// short and a long path (a residual, an input read twice) may hide a longer chain.
    /// Here the longest chain starting at each member is computed exactly, in index order
    /// (inputs precede consumers), and checked against that member's own limit.
    fn check_longest_chains(&self, set: &[usize]) -> Result<()> {
        // Per member: (longest chain of members starting at it, next member on that chain).
        let mut longest: HashMap<usize, (usize, Option<usize>)> = HashMap::new();
        for &v in set {
            let mut best = (1, None);
            for j in &self.nodes[v].inputs {
                if let Some(&(len, _)) = longest.get(&j.0)
                    && len + 1 > best.0
                {
                    best = (len + 1, Some(j.0));
                }
            }
            longest.insert(v, best);
        }
        for &v in set.iter().rev() {
            let (Some(limit), Some(&(depth, _))) = (self.depth_limit(v), longest.get(&v)) else {
                continue;
            };
            if depth <= limit {
                continue;
            }
            let mut chain = Vec::with_capacity(depth);
            let mut cur = Some(v);
            while let Some(c) = cur {
                chain.push(self.nodes[c].name.clone());
                cur = longest.get(&c).and_then(|&(_, next)| next);
            }
            return Err(EngineError::RecomputeDepthExceeded {
                depth,
                limit,
                limited_by: self.nodes[v].name.clone(),
                chain,
            });
        }
        Ok(())
    }

    fn depth_limit(&self, i: usize) -> Option<usize> {
        match self.nodes[i].retention {
            Retention::Recompute(o) => Some(o.max_recompute_depth),
            Retention::Keep => None,
        }
    }

    /// Depth of `limiter` in the chain ending at visit `vi`, minus one (its limit counts
    /// from itself).
    fn depth_offset(&self, visits: &[Visit], vi: usize, limiter: usize) -> usize {
        let mut cur = Some(vi);
        while let Some(c) = cur {
            if visits[c].node == limiter {
                return visits[c].depth - 1;
            }
            cur = visits[c].parent;
        }
        0
    }

    /// Node names from the rebuild's root down to visit `vi` (and `extra`).
    fn chain(&self, visits: &[Visit], vi: usize, extra: Option<usize>) -> Vec<String> {
        let mut names = Vec::new();
        let mut cur = Some(vi);
        while let Some(c) = cur {
            names.push(self.nodes[visits[c].node].name.clone());
            cur = visits[c].parent;
        }
        names.reverse();
        if let Some(u) = extra {
            names.push(self.nodes[u].name.clone());
        }
        names
    }

    fn unrebuildable(
        &self,
        visits: &[Visit],
        vi: usize,
        extra: Option<usize>,
        reason: String,
    ) -> EngineError {
        EngineError::Unrebuildable {
            reason,
            chain: self.chain(visits, vi, extra),
        }
    }

    fn recompute(&mut self, w: usize) -> Result<()> {
        let verbose = self.nodes[w].retention.options().is_some_and(|o| o.verbose);
        if verbose {
            let node = &self.nodes[w];
            let inputs: Vec<&str> = node
                .inputs
                .iter()
                .map(|j| self.nodes[j.0].name.as_str())
                .collect();
            tracing::info!(
                target: "remat::recompute",
                node = %node.name,
                inputs = ?inputs,
                bytes = crate::core::tensor::nbytes(&node.shape, node.dtype),
                "recomputing {}",
                node.name
            );
        }
        self.execute(w, Phase::Recompute)
    }
}
