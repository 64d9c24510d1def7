//! Each fused op equals the unfused op slice by slice, bit for bit, forward and backward
//! (on 1 and 2 threads, with a random upstream gradient), and passes a gradient check.
#![allow(clippy::needless_range_loop)] // slice k of the fused op against model k alone

use std::sync::Arc;

use crate::core::gradcheck::{CheckInput, Tolerance, check_op};
use crate::core::graph::{Graph, NodeId};
use crate::core::ops::attention::Attention;
use crate::core::pool::{Category, MemoryPool};
use crate::core::rng::RngState;
use crate::{ExecContext, Result, Tensor};

/// Output and input gradients of one run.
#[derive(Debug, PartialEq)]
struct Run {
    out: Vec<u32>,
    grads: Vec<Vec<u32>>,
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let s = RngState { seed, offset: 0 };
    (0..n).map(|i| 2.0 * s.uniform(i as u64) - 1.0).collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_f64_vec()
        .iter()
        .map(|&v| (v as f32).to_bits())
        .collect()
}

/// Runs `build` on inputs (shape, data), seeding streams `seeds[s]`, backward from
/// `upstream` (or ones of the output's shape when empty).
fn run(
    threads: usize,
    inputs: &[(Vec<usize>, Vec<f32>)],
    seeds: &[u64],
    upstream: &[f32],
    build: impl FnOnce(&mut Graph, &[NodeId]) -> Result<NodeId>,
) -> Run {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), threads).unwrap();
    let mut g = Graph::new(&ctx);
    for (s, &seed) in seeds.iter().enumerate() {
        g.set_stream_seed(s, seed);
    }
    let ids: Vec<NodeId> = inputs
        .iter()
        .enumerate()
        .map(|(i, (shape, data))| {
            let t =
                Tensor::from_vec(&pool, "x", shape, data.clone(), Category::Activations).unwrap();
            g.input_with_grad(&format!("in{i}"), t)
        })
        .collect();
    let y = build(&mut g, &ids).unwrap();
    g.forward().unwrap();
    let out = bits(&g.value(y).unwrap());
    let shape = g.shape(y).unwrap().to_vec();
    let up = if upstream.is_empty() {
        vec![1.0; out.len()]
    } else {
        upstream.to_vec()
    };
    let seed = Tensor::from_vec(&pool, "up", &shape, up, Category::Temporaries).unwrap();
    g.backward_with(y, seed).unwrap();
    let grads = ids
        .iter()
        .map(|&i| g.grad(i).unwrap().map_or(Vec::new(), |t| bits(&t)))
        .collect();
    Run { out, grads }
}

/// Slice `k` of `K` equal slices.
fn slice<T: Clone>(v: &[T], k: usize, groups: usize) -> Vec<T> {
    let per = v.len() / groups;
    v[k * per..(k + 1) * per].to_vec()
}

const G: usize = 3;

#[test]
fn grouped_matmul_equals_matmul_per_slice() {
    for threads in [1, 2] {
        let a = (vec![G, 4, 33, 40], values(G * 4 * 33 * 40, 1));
        let ws: Vec<_> = (0..G)
            .map(|k| (vec![40, 24], values(40 * 24, 10 + k as u64)))
            .collect();
        let up = values(G * 4 * 33 * 24, 5);
        let mut inputs = vec![a.clone()];
        inputs.extend(ws.clone());
        let fused = run(threads, &inputs, &[], &up, |g, i| {
            g.grouped_matmul(i[0], &i[1..])
        });
        for k in 0..G {
            let ak = (vec![4, 33, 40], slice(&a.1, k, G));
            let alone = run(
                threads,
                &[ak, ws[k].clone()],
                &[],
                &slice(&up, k, G),
                |g, i| g.matmul(i[0], i[1]),
            );
            assert_eq!(slice(&fused.out, k, G), alone.out, "output slice {k}");
            assert_eq!(slice(&fused.grads[0], k, G), alone.grads[0], "dA slice {k}");
            assert_eq!(fused.grads[k + 1], alone.grads[1], "dB {k}");
        }
    }
}

#[test]
fn fused_rmsnorm_equals_rmsnorm_per_slice() {
    for threads in [1, 2] {
        let x = (vec![G, 2, 7, 16], values(G * 2 * 7 * 16, 2));
        let ws: Vec<_> = (0..G)
            .map(|k| (vec![16], values(16, 20 + k as u64)))
            .collect();
        let up = values(G * 2 * 7 * 16, 6);
        let mut inputs = vec![x.clone()];
        inputs.extend(ws.clone());
        let fused = run(threads, &inputs, &[], &up, |g, i| {
            g.fused_rmsnorm(i[0], &i[1..], 1e-5)
        });
        for k in 0..G {
            let xk = (vec![2, 7, 16], slice(&x.1, k, G));
            let alone = run(
                threads,
                &[xk, ws[k].clone()],
                &[],
                &slice(&up, k, G),
                |g, i| g.rmsnorm(i[0], i[1], 1e-5),
            );
            assert_eq!(slice(&fused.out, k, G), alone.out, "output slice {k}");
            assert_eq!(slice(&fused.grads[0], k, G), alone.grads[0], "dx slice {k}");
            assert_eq!(fused.grads[k + 1], alone.grads[1], "dw {k}");
        }
    }
}

fn ids(k: usize, n: usize, vocab: u32) -> Arc<[u32]> {
    (0..n)
        .map(|i| ((i * 7 + k * 5 + 3) as u32) % vocab)
        .collect()
}

#[test]
fn fused_embedding_equals_embedding_per_slice() {
    let tables: Vec<_> = (0..G)
        .map(|k| (vec![11, 8], values(88, 30 + k as u64)))
        .collect();
    let lists: Vec<Arc<[u32]>> = (0..G).map(|k| ids(k, 10, 11)).collect();
    let up = values(G * 10 * 8, 7);
    let l = lists.clone();
    let fused = run(1, &tables, &[], &up, move |g, i| {
        g.fused_embedding(i, l, &[2, 5])
    });
    for k in 0..G {
        let list = lists[k].clone();
        let alone = run(
            1,
            &[tables[k].clone()],
            &[],
            &slice(&up, k, G),
            move |g, i| g.embedding(i[0], list, &[2, 5]),
        );
        assert_eq!(slice(&fused.out, k, G), alone.out, "output slice {k}");
        assert_eq!(fused.grads[k], alone.grads[0], "table gradient {k}");
    }
}

#[test]
fn fused_cross_entropy_equals_cross_entropy_per_slice() {
    for threads in [1, 2] {
        let x = (vec![G, 2, 5, 11], values(G * 110, 3));
        let mut lists: Vec<Arc<[u32]>> = (0..G).map(|k| ids(k, 10, 11)).collect();
        let mut with_ignored = lists[1].to_vec();
        with_ignored[3] = crate::core::kernels::IGNORE_INDEX;
        lists[1] = Arc::from(with_ignored);
        // Element k of the upstream gradient scales slice k.
        let up = [1.0f32, 0.75, -2.5];
        let l = lists.clone();
        let fused = run(threads, std::slice::from_ref(&x), &[], &up, move |g, i| {
            g.fused_cross_entropy(i[0], l)
        });
        for k in 0..G {
            let list = lists[k].clone();
            let xk = (vec![2, 5, 11], slice(&x.1, k, G));
            let alone = run(threads, &[xk], &[], &[up[k]], move |g, i| {
                g.cross_entropy(i[0], list)
            });
            assert_eq!(fused.out[k], alone.out[0], "loss {k}");
            assert_eq!(
                slice(&fused.grads[0], k, G),
                alone.grads[0],
                "dlogits slice {k}"
            );
        }
    }
}

#[test]
fn fused_dropout_draws_each_slice_from_its_stream() {
    let per = 4 * 3000;
    let x = (vec![G, 4, 3000], values(G * per, 4));
    let up = values(G * per, 8);
    let (p, seeds) = ([0.1f32, 0.0, 0.3], [41u64, 42, 43]);
    for threads in [1, 2] {
        let fused = run(threads, std::slice::from_ref(&x), &seeds, &up, |g, i| {
            g.fused_dropout(i[0], &p, &[0, 1, 2])
        });
        for k in 0..G {
            let xk = (vec![4, 3000], slice(&x.1, k, G));
            // Alone, model k draws from stream 0 seeded with its seed; p = 0 is no node.
            let alone = run(
                threads,
                std::slice::from_ref(&xk),
                &[seeds[k]],
                &slice(&up, k, G),
                |g, i| {
                    if p[k] > 0.0 {
                        g.dropout(i[0], p[k])
                    } else {
                        g.scale(i[0], 1.0)
                    }
                },
            );
            assert_eq!(slice(&fused.out, k, G), alone.out, "output slice {k}");
            assert_eq!(slice(&fused.grads[0], k, G), alone.grads[0], "dx slice {k}");
        }
        assert_eq!(
            slice(&fused.out, 1, G),
            slice(&x.1, 1, G)
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn attention_folds_leading_dims_into_the_batch() {
    let op = Attention {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        rope_theta: Some(10000.0),
    };
    let (b, s) = (2, 70);
    let q = (vec![G, b, s, 32], values(G * b * s * 32, 11));
    let k = (vec![G, b, s, 16], values(G * b * s * 16, 12));
    let v = (vec![G, b, s, 16], values(G * b * s * 16, 13));
    let up = values(G * b * s * 32, 14);
    for threads in [1, 2] {
        let fused = run(
            threads,
            &[q.clone(), k.clone(), v.clone()],
            &[],
            &up,
            |g, i| g.attention(i[0], i[1], i[2], op),
        );
        for m in 0..G {
            let part = |t: &(Vec<usize>, Vec<f32>)| (t.0[1..].to_vec(), slice(&t.1, m, G));
            let alone = run(
                threads,
                &[part(&q), part(&k), part(&v)],
                &[],
                &slice(&up, m, G),
                |g, i| g.attention(i[0], i[1], i[2], op),
            );
            assert_eq!(slice(&fused.out, m, G), alone.out, "output slice {m}");
            for slot in 0..3 {
                assert_eq!(
                    slice(&fused.grads[slot], m, G),
                    alone.grads[slot],
                    "grad {slot} slice {m}"
                );
            }
        }
    }
}

#[test]
fn fused_ops_pass_gradient_checks() {
    let tol = Tolerance::default();
    let a = CheckInput::random("a", &[2, 3, 4], 1);
    let ws = [
        CheckInput::random("w0", &[4, 5], 2),
        CheckInput::random("w1", &[4, 5], 3),
    ];
    check_op(
        |g, i| g.grouped_matmul(i[0], &i[1..]),
        &[a, ws[0].clone(), ws[1].clone()],
        tol,
    )
    .unwrap();
    let x = CheckInput::random("x", &[2, 3, 5], 4);
    let (n0, n1) = (
        CheckInput::random("n0", &[5], 5),
        CheckInput::random("n1", &[5], 6),
    );
    check_op(
        |g, i| g.fused_rmsnorm(i[0], &i[1..], 1e-5),
        &[x, n0, n1],
        tol,
    )
    .unwrap();
    let tables = [
        CheckInput::random("t0", &[5, 4], 7),
        CheckInput::random("t1", &[5, 4], 8),
    ];
    let lists: Vec<Arc<[u32]>> = vec![Arc::from(vec![3u32, 1, 3]), Arc::from(vec![0u32, 4, 4])];
    check_op(
        |g, i| g.fused_embedding(i, lists.clone(), &[3]),
        &tables,
        tol,
    )
    .unwrap();
    let logits = CheckInput::random("logits", &[2, 3, 5], 9);
    let targets: Vec<Arc<[u32]>> = vec![Arc::from(vec![2u32, 0, 4]), Arc::from(vec![1u32, 1, 3])];
    check_op(
        |g, i| g.fused_cross_entropy(i[0], targets.clone()),
        &[logits],
        tol,
    )
    .unwrap();
    let x = CheckInput::random("x", &[2, 4, 6], 10);
    check_op(
        |g, i| g.fused_dropout(i[0], &[0.3, 0.0], &[0, 1]),
        &[x],
        tol,
    )
    .unwrap();
    // Attention over [G, B, S, ...]: the leading dims fold into the batch.
    let op = Attention {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 4,
        rope_theta: Some(10000.0),
    };
    let q = CheckInput::random("q", &[2, 1, 3, 8], 11);
    let k = CheckInput::random("k", &[2, 1, 3, 4], 12);
    let v = CheckInput::random("v", &[2, 1, 3, 4], 13);
    check_op(|g, i| g.attention(i[0], i[1], i[2], op), &[q, k, v], tol).unwrap();
}

#[test]
fn fused_ops_name_the_bad_input() {
    let ctx = ExecContext::single_threaded().unwrap();
    let mut g = Graph::new(&ctx);
    let t = |shape: &[usize]| {
        let n = shape.iter().product();
        Tensor::from_vec(ctx.pool(), "t", shape, vec![0f32; n], Category::Parameters).unwrap()
    };
    let a = g.param("a", &t(&[2, 3, 4]));
    let (w0, w1) = (g.param("w0", &t(&[4, 5])), g.param("w1", &t(&[4, 6])));
    let err = g.grouped_matmul(a, &[w0, w1]).unwrap_err().to_string();
    assert!(err.contains("weight 1 is [4, 6]"), "{err}");
    let err = g.grouped_matmul(a, &[w0]).unwrap_err().to_string();
    assert!(err.contains("needs a [1, ..., k]"), "{err}");
    let err = g
        .fused_dropout(a, &[0.1, 1.5], &[0, 1])
        .unwrap_err()
        .to_string();
    assert!(err.contains("outside [0, 1)"), "{err}");
    let err = g
        .fused_cross_entropy(
            a,
            vec![Arc::from(vec![0u32, 9, 0]), Arc::from(vec![0u32; 3])],
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("target 9 at position 1 of list 0"), "{err}");
}
