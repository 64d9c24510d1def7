//! Set-up shared by the planner's integration tests: where `../shared/graphs` is, a tiny
//! deterministic generator and a node constructor for hand-made graphs. Each test binary
//! uses a part of it, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::path::PathBuf;

use remat_planner::{Node, Phase};

/// `../shared/graphs` beside the checkout, or `$REMAT_SHARED_DIR/graphs` (for worktrees
/// that do not sit beside it); `None`, saying so, when neither exists, so that tests that
/// read the shared graphs skip rather than fail on a machine without them.
pub fn graphs_dir() -> Option<PathBuf> {
    let beside = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/graphs"
    ));
    let from_env = std::env::var_os("REMAT_SHARED_DIR").map(|d| PathBuf::from(d).join("graphs"));
    let dir = if beside.is_dir() {
        beside
    } else {
        from_env.unwrap_or(beside)
    };
    if dir.is_dir() {
        eprintln!("reading shared graphs from {}", dir.display());
        Some(dir)
    } else {
        eprintln!("skipping: {} is absent", dir.display());
        None
    }
}

/// xorshift64: reproducible random graphs without a dependency.
pub struct Rng(pub u64);

impl Rng {
    /// A value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

pub fn node(name: String, phase: Phase, time: u64, bytes: u64, inputs: Vec<usize>) -> Node {
    Node {
        name,
        phase,
        compute_time: time as f64,
        output_bytes: bytes,
        inputs,
    }
}

/// A random layered DAG in the spirit of Moccasin's generator: `n` nodes on levels of about
/// `width` nodes, each reading one to three nodes of the level before and, with a chance of
/// one in `skip_one_in`, a node of an earlier level (a skip connection). Sizes 1..=1000
/// bytes, times 1..=100. Nodes are numbered level by level, a topological order.
pub fn random_layered(n: usize, width: usize, skip_one_in: u64, seed: u64) -> remat_planner::Graph {
    let mut rng = Rng(seed.max(1));
    let mut levels: Vec<Vec<usize>> = Vec::new();
    let mut nodes = Vec::new();
    while nodes.len() < n {
        let size = (width as u64 / 2 + rng.below(width as u64 + 1)).max(1) as usize;
        let mut level = Vec::new();
        for _ in 0..size.min(n - nodes.len()) {
            let id = nodes.len();
            let mut inputs = Vec::new();
            if let Some(prev) = levels.last() {
                for _ in 0..1 + rng.below(3) {
                    let i = prev[rng.below(prev.len() as u64) as usize];
                    if !inputs.contains(&i) {
                        inputs.push(i);
                    }
                }
                if levels.len() > 1 && rng.below(skip_one_in) == 0 {
                    let l = rng.below(levels.len() as u64 - 1) as usize;
                    let i = levels[l][rng.below(levels[l].len() as u64) as usize];
                    if !inputs.contains(&i) {
                        inputs.push(i);
                    }
                }
            }
            inputs.sort_unstable();
            let time = 1 + rng.below(100);
            let bytes = 1 + rng.below(1000);
            nodes.push(node(format!("n{id}"), Phase::Forward, time, bytes, inputs));
            level.push(id);
        }
        levels.push(level);
    }
    remat_planner::Graph::new(format!("random-layered-{n}-{seed}"), nodes, 0, 1e-6)
        .expect("generated graphs are valid")
}

/// A transformer's training step with `layers` blocks (hidden `d` = 1 KiB-ish units per
/// token): per block RMS norm, q/k/v projections, scores, softmax, attention, output
/// projection, residual add, norm, MLP up/gate, activation, down, residual add; a loss;
/// then the backward of each block in reverse, the residual gradients summed at each add.
pub fn transformer(layers: usize) -> remat_planner::Graph {
    let h = 4096u64; // bytes of one hidden activation
    let s = 8192u64; // bytes of one score matrix
    let mut b = Builder::default();
    let mut x = b.op("embed", Phase::Forward, 2, h, vec![]);
    let mut saved = Vec::new();
    for l in 0..layers {
        let n1 = b.op(&format!("l{l}.norm1"), Phase::Forward, 1, h, vec![x]);
        let q = b.op(&format!("l{l}.q"), Phase::Forward, 8, h, vec![n1]);
        let k = b.op(&format!("l{l}.k"), Phase::Forward, 8, h, vec![n1]);
        let v = b.op(&format!("l{l}.v"), Phase::Forward, 8, h, vec![n1]);
        let sc = b.op(&format!("l{l}.scores"), Phase::Forward, 6, s, vec![q, k]);
        let sm = b.op(&format!("l{l}.softmax"), Phase::Forward, 2, s, vec![sc]);
        let at = b.op(&format!("l{l}.attn"), Phase::Forward, 6, h, vec![sm, v]);
        let o = b.op(&format!("l{l}.out"), Phase::Forward, 8, h, vec![at]);
        let r1 = b.op(&format!("l{l}.res1"), Phase::Forward, 1, h, vec![x, o]);
        let n2 = b.op(&format!("l{l}.norm2"), Phase::Forward, 1, h, vec![r1]);
        let up = b.op(&format!("l{l}.up"), Phase::Forward, 32, 4 * h, vec![n2]);
        let gate = b.op(&format!("l{l}.gate"), Phase::Forward, 32, 4 * h, vec![n2]);
        let act = b.op(
            &format!("l{l}.act"),
            Phase::Forward,
            4,
            4 * h,
            vec![up, gate],
        );
        let down = b.op(&format!("l{l}.down"), Phase::Forward, 32, h, vec![act]);
        let r2 = b.op(&format!("l{l}.res2"), Phase::Forward, 1, h, vec![r1, down]);
        saved.push([x, n1, q, k, v, sm, at, r1, n2, up, gate, act]);
        x = r2;
    }
    let mut g = b.op("loss", Phase::Backward, 2, 4, vec![x]);
    for (l, [x, n1, q, k, v, sm, at, r1, n2, up, gate, act]) in saved.into_iter().enumerate().rev()
    {
        let bw = |b: &mut Builder, name: &str, t: u64, bytes: u64, inputs: Vec<usize>| {
            b.op(
                &format!("l{l}.{name}.grad"),
                Phase::Backward,
                t,
                bytes,
                inputs,
            )
        };
        let d_down = bw(&mut b, "down", 64, 4 * h, vec![g, act]);
        let d_act = bw(&mut b, "act", 8, 8 * h, vec![d_down, up, gate]);
        let d_n2 = bw(&mut b, "upgate", 128, h, vec![d_act, n2]);
        let d_r1n = bw(&mut b, "norm2", 2, h, vec![d_n2, r1]);
        let g_r1 = bw(&mut b, "res1", 1, h, vec![g, d_r1n]);
        let d_at = bw(&mut b, "out", 16, h, vec![g_r1, at]);
        let d_sm = bw(&mut b, "attn", 12, s, vec![d_at, sm, v]);
        let d_v = bw(&mut b, "v_in", 6, h, vec![d_at, sm]);
        let d_sc = bw(&mut b, "softmax", 4, s, vec![d_sm, sm]);
        let d_q = bw(&mut b, "q_in", 6, h, vec![d_sc, k]);
        let d_k = bw(&mut b, "k_in", 6, h, vec![d_sc, q]);
        let d_n1 = bw(&mut b, "qkv", 48, h, vec![d_q, d_k, d_v, n1]);
        let d_xn = bw(&mut b, "norm1", 2, h, vec![d_n1, x]);
        g = bw(&mut b, "res0", 1, h, vec![g_r1, d_xn]);
    }
    remat_planner::Graph::new(format!("transformer-{layers}"), b.nodes, 1 << 20, 1e-6)
        .expect("generated graphs are valid")
}

#[derive(Default)]
struct Builder {
    nodes: Vec<Node>,
}

impl Builder {
    fn op(
        &mut self,
        name: &str,
        phase: Phase,
        time: u64,
        bytes: u64,
        mut inputs: Vec<usize>,
    ) -> usize {
        inputs.sort_unstable();
        inputs.dedup();
        self.nodes
            .push(node(name.to_string(), phase, time, bytes, inputs));
        self.nodes.len() - 1
    }
}

/// Static bytes plus `fraction` of the store-all peak's activation bytes: budget fractions
/// that mean the same on graphs with different static memory.
pub fn activation_budget(graph: &remat_planner::Graph, fraction: f64) -> u64 {
    let s = graph.static_bytes();
    s + ((graph.store_all_peak() - s) as f64 * fraction) as u64
}

/// A random training graph from `(bytes, time, seed)` per forward op: op `i` reads op `i - 1`
/// and, for one seed in three, an earlier op (a skip); then the loss and one backward op per
/// forward op in reverse (`synth::mirror_backward`). The property tests' generator.
pub fn skip_chain(layers: &[(u64, u32, u32)], static_bytes: u64) -> remat_planner::Graph {
    let mut nodes = Vec::new();
    for (i, &(bytes, time, seed)) in layers.iter().enumerate() {
        let mut inputs = Vec::new();
        if i > 0 {
            inputs.push(i - 1);
            let skip = seed as usize % i;
            if skip != i - 1 && seed % 3 == 0 {
                inputs.push(skip);
            }
        }
        inputs.sort_unstable();
        nodes.push(Node {
            name: format!("f{i}"),
            phase: Phase::Forward,
            compute_time: f64::from(time),
            output_bytes: bytes,
            inputs,
        });
    }
    let nodes = remat_planner::synth::mirror_backward(nodes, 1.0, 1, |fw| format!("b{fw}"));
    remat_planner::Graph::new("random", nodes, static_bytes, 1.0)
        .expect("generated graphs are valid")
}

/// The least recompute time of any recompute-only schedule of `graph` under `budget`, by
/// Dijkstra over (resident set, computed-once set), `None` when none fits: any order in
/// which first computations run a pinned tensor's readers in their order (as the bound's
/// precedence, `solve::order::Precedence`, asks), a pinned node computed once and left on
/// the device until its last reader has run. Graphs of at most 32 nodes; costs are whole
/// compute times, so they order exactly as u64.
pub fn least_recompute_time(graph: &remat_planner::Graph, budget: u64) -> Option<f64> {
    use std::cmp::Reverse;
    use std::collections::{BinaryHeap, HashMap};

    let n = graph.len();
    let all = (1u32 << n) - 1;
    let bytes = |mask: u32| -> u64 {
        (0..n)
            .filter(|&v| mask >> v & 1 == 1)
            .map(|v| graph.node(v).output_bytes)
            .sum()
    };
    let mut best: HashMap<(u32, u32), u64> = HashMap::new();
    let mut heap = BinaryHeap::new();
    heap.push(Reverse((0u64, 0u32, 0u32)));
    while let Some(Reverse((cost, resident, done))) = heap.pop() {
        if done == all {
            return Some(cost as f64);
        }
        if best.get(&(resident, done)).is_some_and(|&c| c < cost) {
            continue;
        }
        let mut push = |state: (u32, u32), c: u64| {
            if best.get(&state).is_none_or(|&old| c < old) {
                best.insert(state, c);
                heap.push(Reverse((c, state.0, state.1)));
            }
        };
        for v in 0..n {
            let bit = 1u32 << v;
            if resident & bit != 0 {
                // A pinned tensor leaves only when no reader is left to run.
                let readers_done = graph.users(v).iter().all(|&u| done >> u & 1 == 1);
                if !graph.is_pinned(v) || readers_done {
                    push((resident & !bit, done), cost);
                }
                continue;
            }
            if done & bit != 0 && graph.is_pinned(v) {
                continue;
            }
            let node = graph.node(v);
            let in_turn = |p: usize| {
                graph
                    .users(p)
                    .iter()
                    .take_while(|&&u| u != v)
                    .all(|&u| done >> u & 1 == 1)
            };
            if done & bit == 0
                && !node
                    .inputs
                    .iter()
                    .filter(|&&p| graph.is_pinned(p))
                    .all(|&p| in_turn(p))
            {
                continue;
            }
            let ready = node.inputs.iter().all(|&i| resident >> i & 1 == 1);
            if ready && graph.static_bytes() + bytes(resident) + node.output_bytes <= budget {
                let extra = if done & bit != 0 {
                    node.compute_time as u64
                } else {
                    0
                };
                push((resident | bit, done | bit), cost + extra);
            }
        }
    }
    None
}
