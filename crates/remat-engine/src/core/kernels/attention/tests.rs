use super::super::gradcheck::{assert_close, rand_vec};
use super::*;

/// Straightforward attention in f64: rotate, scores, causal softmax, weighted sum.
fn reference(
    shape: &AttentionShape,
    rope: Option<&RopeTable<f64>>,
    q: &[f64],
    k: &[f64],
    v: &[f64],
) -> Vec<f64> {
    let AttentionShape {
        batch,
        seq,
        n_heads,
        n_kv_heads,
        head_dim: d,
    } = *shape;
    let rep = n_heads / n_kv_heads;
    let rot = |x: &[f64], heads: usize, b: usize, h: usize, p: usize| -> Vec<f64> {
        let row = &x[((b * seq + p) * heads + h) * d..][..d];
        let mut out = row.to_vec();
        if let Some(t) = rope {
            rotate_row(t, p, row, &mut out, false);
        }
        out
    };
    let mut out = vec![0.0; shape.q_len()];
    for b in 0..batch {
        for h in 0..n_heads {
            for i in 0..seq {
                let qi = rot(q, n_heads, b, h, i);
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let kj = rot(k, n_kv_heads, b, h / rep, j);
                        qi.iter().zip(&kj).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    let pj = (s - m).exp() / z;
                    for c in 0..d {
                        out[((b * seq + i) * n_heads + h) * d + c] +=
                            pj * v[((b * seq + j) * n_kv_heads + h / rep) * d + c];
                    }
                }
            }
        }
    }
    out
}

fn run_forward(
    shape: &AttentionShape,
    rope: Option<&RopeTable<f64>>,
    q: &[f64],
    k: &[f64],
    v: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; shape.q_len()];
    let mut lse = vec![0.0; shape.lse_len()];
    let mut scratch = vec![0.0; attention_forward_scratch_len(shape, attention_workers(shape))];
    attention_forward(shape, rope, q, k, v, &mut out, &mut lse, &mut scratch).unwrap();
    (out, lse)
}

fn gradient_check(shape: AttentionShape, rope: bool, probes: usize) {
    let table = RopeTable::new(shape.seq, shape.head_dim, 10000.0).unwrap();
    let rope = rope.then_some(&table);
    let q = rand_vec(shape.q_len(), 1, 1.5);
    let k = rand_vec(shape.kv_len(), 2, 1.5);
    let v = rand_vec(shape.kv_len(), 3, 1.0);
    let up = rand_vec(shape.q_len(), 4, 1.0);
    let (out, lse) = run_forward(&shape, rope, &q, &k, &v);
    let want = reference(&shape, rope, &q, &k, &v);
    assert_close("attention forward", &out, &want);
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; shape.q_len()],
        vec![0.0; shape.kv_len()],
        vec![0.0; shape.kv_len()],
    );
    let mut scratch = vec![0.0; attention_backward_scratch_len(&shape, attention_workers(&shape))];
    attention_backward(
        &shape,
        rope,
        &q,
        &k,
        &v,
        &lse,
        &up,
        &mut dq,
        &mut dk,
        &mut dv,
        &mut scratch,
    )
    .unwrap();
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        run_forward(&shape, rope, q, k, v)
            .0
            .iter()
            .zip(&up)
            .map(|(a, b)| a * b)
            .sum()
    };
    // Central differences on `probes` coordinates of each input, spread over the buffer.
    let h = 1e-6;
    let probe = |x: &[f64], grad: &[f64], which: usize| {
        let stride = (x.len() / probes).max(1);
        let (mut got, mut num) = (vec![], vec![]);
        for i in (0..x.len())
            .step_by(stride)
            .map(|i| (i + which * 7) % x.len())
        {
            let mut xs = [q.clone(), k.clone(), v.clone()];
            xs[which][i] += h;
            let up_l = loss(&xs[0], &xs[1], &xs[2]);
            xs[which][i] -= 2.0 * h;
            let down_l = loss(&xs[0], &xs[1], &xs[2]);
            got.push(grad[i]);
            num.push((up_l - down_l) / (2.0 * h));
        }
        (got, num)
    };
    for (which, (x, grad, name)) in [(&q, &dq, "dq"), (&k, &dk, "dk"), (&v, &dv, "dv")]
        .into_iter()
        .enumerate()
    {
        let (got, num) = probe(x, grad, which);
        assert_close(name, &got, &num);
    }
}

#[test]
fn grouped_query_attention_with_rope_matches_reference_and_finite_differences() {
    let shape = AttentionShape {
        batch: 2,
        seq: 5,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 4,
    };
    gradient_check(shape, true, 1000);
}

#[test]
fn multi_block_sequences_and_plain_multi_head() {
    let shape = AttentionShape {
        batch: 1,
        seq: BLOCK + 9,
        n_heads: 2,
        n_kv_heads: 2,
        head_dim: 4,
    };
    gradient_check(shape, false, 40);
    let shape = AttentionShape {
        batch: 3,
        seq: BLOCK + 3,
        n_heads: 3,
        n_kv_heads: 1,
        head_dim: 2,
    };
    gradient_check(shape, true, 40);
}

#[test]
fn bits_do_not_depend_on_the_thread_count() {
    let shape = AttentionShape {
        batch: 3,
        seq: 70,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
    };
    let table = RopeTable::<f32>::new(70, 8, 10000.0).unwrap();
    let f = |seed, n| {
        rand_vec(n, seed, 1.0)
            .iter()
            .map(|&x| x as f32)
            .collect::<Vec<_>>()
    };
    let (q, k, v, up) = (
        f(1, shape.q_len()),
        f(2, shape.kv_len()),
        f(3, shape.kv_len()),
        f(4, shape.q_len()),
    );
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let w = attention_workers(&shape);
            let mut out = vec![0.0f32; shape.q_len()];
            let mut lse = vec![0.0f32; shape.lse_len()];
            let mut scratch = vec![0.0f32; attention_forward_scratch_len(&shape, w)];
            attention_forward(
                &shape,
                Some(&table),
                &q,
                &k,
                &v,
                &mut out,
                &mut lse,
                &mut scratch,
            )
            .unwrap();
            let (mut dq, mut dk, mut dv) = (
                vec![0.0f32; shape.q_len()],
                vec![0.0f32; shape.kv_len()],
                vec![0.0f32; shape.kv_len()],
            );
            let mut scratch = vec![0.0f32; attention_backward_scratch_len(&shape, w)];
            attention_backward(
                &shape,
                Some(&table),
                &q,
                &k,
                &v,
                &lse,
                &up,
                &mut dq,
                &mut dk,
                &mut dv,
                &mut scratch,
            )
            .unwrap();
            (out, lse, dq, dk, dv)
        })
    };
    assert_eq!(run(1), run(2));
    assert_eq!(run(2), run(3));
}

#[test]
fn bad_shapes_are_errors() {
    let shape = AttentionShape {
        batch: 1,
        seq: 4,
        n_heads: 3,
        n_kv_heads: 2,
        head_dim: 2,
    };
    let err = shape.validate().unwrap_err();
    assert!(err.to_string().contains("does not divide"), "{err}");
    let shape = AttentionShape {
        batch: 1,
        seq: 4,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 2,
    };
    let mut out = vec![0.0f32; shape.q_len()];
    let mut lse = vec![0.0f32; shape.lse_len()];
    let err = attention_forward(
        &shape,
        None,
        &[0.0; 3],
        &[0.0; 8],
        &[0.0; 8],
        &mut out,
        &mut lse,
        &mut [0.0; 64],
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::Length {
                buffer: "q",
                expected: 16,
                got: 3,
                ..
            }
        ),
        "{err}"
    );
}
