//! Exact peak memory of the MLP chain, computed from the shapes by hand.
//!
//! The chain: `L` layers of width `d` on a batch of `B` rows (f32). A hidden layer records
//! `M = matmul(A_prev, W)`, `Z = bias(M, b)`, `A = relu(Z)`; the last records `M`, `Z`;
//! then `mse(Z_L, t)`. Backward reads: matmul its two inputs, relu its output, mse its
//! inputs; bias reads nothing. Let `s = 4*B*d` (one activation) and `p = 4*(d*d + d)` (one
//! layer's parameter gradients). With `s > 2p` and `p > 8` (B = 256, d = 32), the peaks
//! below are measured above the memory live before the step (inputs and parameters).

use remat_engine::models::mlp::{Mlp, MlpConfig};
use remat_engine::{Category, DType, ExecContext, Graph, MemoryPool, Policy, Tensor};

const B: usize = 256;
const D: usize = 32;
const S: u64 = 4 * (B * D) as u64;
const P: u64 = 4 * (D * D + D) as u64;

fn measured_peak(layers: usize, policy: Policy) -> (u64, u64) {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let mlp = Mlp::new(
        &pool,
        MlpConfig {
            dims: vec![D; layers + 1],
            dropout: 0.0,
            seed: 1,
        },
    )
    .unwrap();
    let x = Tensor::zeros(&pool, &[B, D], DType::F32, Category::Activations, None).unwrap();
    x.write()
        .as_mut_slice::<f32>()
        .unwrap()
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = (i % 7) as f32 - 3.0);
    let t = Tensor::zeros(&pool, &[B, D], DType::F32, Category::Activations, None).unwrap();
    let mut g = Graph::new(&ctx);
    let (xn, tn) = (g.input("x", x), g.input("t", t));
    let nodes = mlp.build(&mut g, xn, tn).unwrap();
    policy.apply(&mut g).unwrap();
    let base = pool.live();
    pool.reset_peak();
    g.forward().unwrap();
    g.backward(nodes.loss).unwrap();
    let peak = pool.peak() - base;
    // After the step only the parameter gradients remain.
    assert_eq!(pool.live() - base, layers as u64 * P);
    (peak, pool.stats().category(Category::Gradients).peak)
}

#[test]
fn store_all_peak() {
    // Forward holds A_1..A_{L-1} and Z_L. The peak comes in backward at layer L's matmul:
    // A_1..A_{L-1}, dZ_L, dA_{L-1} and layer L's gradients: (L + 1) s + p.
    for layers in [5, 11] {
        let (peak, grads) = measured_peak(layers, Policy::StoreAll);
        assert_eq!(peak, (layers as u64 + 1) * S + P, "L = {layers}");
        assert_eq!(grads, layers as u64 * P);
    }
}

#[test]
fn every_6_nodes_peak() {
    // Every 6th op is the relu of an even layer: only A_2, A_4, ..., A_{2m} are kept
    // (L = 2m + 1). Forward peaks at (m + 2) s (kept A's, M_L, Z_L). In backward, layer
    // 2m's matmul rebuilds A_{2m-1} from A_{2m-2}; at its gradient allocation it holds
    // A_2..A_{2m-2}, A_{2m-1}, dZ_{2m}, dA_{2m-1} and two layers of gradients:
    // (m - 1 + 3) s + 2p = (m + 2) s + 2p. Lower pairs hold one activation less and two
    // gradients more, which is less since s > 2p.
    let layers = 5;
    let m = 2;
    let (peak, _) = measured_peak(layers, Policy::EveryN(6));
    assert_eq!(peak, (m + 2) * S + 2 * P);
}

#[test]
fn sqrt_peak() {
    // L = 11 has 3L = 33 op nodes; ceil(sqrt(33)) = 6, so sqrt keeps the same nodes as
    // every-6: A_2, ..., A_10 (m = 5), and its peak is (m + 2) s + 2p.
    let layers = 11;
    let m = 5;
    let (peak, _) = measured_peak(layers, Policy::Sqrt);
    assert_eq!(peak, (m + 2) * S + 2 * P);
    let (store_all, _) = measured_peak(layers, Policy::StoreAll);
    assert!(peak < store_all);
}

#[test]
fn recompute_all_peak() {
    // Nothing but x, t and the parameters is held between nodes, and every rebuilt value is
    // freed right after the backward node that read it (free-after-use). A rebuild walks
    // the chain from x holding two activations at a time (an op's input and output). Bias
    // backward passes its gradient through, so dM_l is dZ_l. Backward then peaks at layer
    // 2's matmul (A_1 rebuilt, dZ_2, dA_1) or, equally, at layer 1's relu (A_1 rebuilt,
    // dA_1, dZ_1), holding the gradients of layers 2..L: 3s + (L - 1) p. Every other
    // moment holds less: mse's backward 2s, a rebuild under a held gradient 3s with fewer
    // parameter gradients, layer 1's matmul s + Lp (x needs no gradient; 2s > p).
    for layers in [5, 11] {
        let (peak, grads) = measured_peak(layers, Policy::RecomputeAll);
        assert_eq!(peak, 3 * S + (layers as u64 - 1) * P, "L = {layers}");
        assert_eq!(grads, layers as u64 * P);
        let (store_all, _) = measured_peak(layers, Policy::StoreAll);
        assert!(peak < store_all);
    }
}
