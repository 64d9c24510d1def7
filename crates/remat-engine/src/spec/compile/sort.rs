//! Topological order of a layer's recompute steps (Kahn's algorithm, ties broken by
//! declaration order), and cycle extraction when there is none.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// `edges[p]` lists the steps that consume an output of step `p`. Returns the order, or the
/// steps of one cycle (each consuming an output of the next one's predecessor, in order).
pub fn topo_order(edges: &[Vec<usize>]) -> Result<Vec<usize>, Vec<usize>> {
    let n = edges.len();
    let mut indegree = vec![0usize; n];
    for targets in edges {
        for &t in targets {
            indegree[t] += 1;
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> =
        (0..n).filter(|&i| indegree[i] == 0).map(Reverse).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(Reverse(i)) = ready.pop() {
        order.push(i);
        for &t in &edges[i] {
            indegree[t] -= 1;
            if indegree[t] == 0 {
                ready.push(Reverse(t));
            }
        }
    }
    if order.len() == n {
        return Ok(order);
    }
    Err(find_cycle(edges, &indegree))
}

/// Every step left with a positive in-degree has a predecessor also left; walking
/// predecessors must therefore revisit a step, and the walk from there is a cycle.
fn find_cycle(edges: &[Vec<usize>], indegree: &[usize]) -> Vec<usize> {
    let n = edges.len();
    let mut predecessor = vec![usize::MAX; n];
    for (p, targets) in edges.iter().enumerate() {
        for &t in targets {
            if indegree[p] > 0 && indegree[t] > 0 {
                predecessor[t] = p;
            }
        }
    }
    let Some(start) = (0..n).find(|&i| indegree[i] > 0) else {
        return Vec::new();
    };
    let mut seen = vec![false; n];
    let mut at = start;
    while !seen[at] {
        seen[at] = true;
        at = predecessor[at];
    }
    let mut cycle = vec![at];
    let mut walk = predecessor[at];
    while walk != at {
        cycle.push(walk);
        walk = predecessor[walk];
    }
    cycle.reverse();
    cycle
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_by_dependencies_then_declaration() {
        // 2 -> 0 -> 1; 3 free.
        let edges = vec![vec![1], vec![], vec![0], vec![]];
        assert_eq!(topo_order(&edges), Ok(vec![2, 0, 1, 3]));
    }

    #[test]
    fn reports_the_cycle() {
        // 0 -> 1 -> 2 -> 1, and 3 depends on 2.
        let edges = vec![vec![1], vec![2], vec![1, 3], vec![]];
        let cycle = topo_order(&edges).unwrap_err();
        let mut sorted = cycle.clone();
        sorted.sort();
        assert_eq!(sorted, vec![1, 2]);
    }

    #[test]
    fn self_loop_is_a_cycle() {
        assert_eq!(topo_order(&[vec![0]]), Err(vec![0]));
    }
}
