use super::*;

fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let bits = crate::core::kernels::philox_hash(seed, i as u64) >> 40;
            ((bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
        })
        .collect()
}

fn act(seed: u64, shape: &[usize], scale: f32) -> Act {
    Act::new(values(seed, shape.iter().product(), scale), shape.to_vec())
}

/// `sum(f(x) * w)` in f64, for finite differences.
fn dot(a: &[f32], w: &[f32]) -> f64 {
    a.iter().zip(w).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Central differences of `loss` around `x` against `grad`, on every element.
fn check(name: &str, x: &Act, grad: &[f32], loss: &dyn Fn(&Act) -> f64) {
    assert_eq!(grad.len(), x.data.len(), "{name}");
    let h = 1e-2f32;
    for (i, g) in grad.iter().enumerate() {
        let (mut hi, mut lo) = (x.clone(), x.clone());
        hi.data[i] += h;
        lo.data[i] -= h;
        let num = (loss(&hi) - loss(&lo)) / (2.0 * h as f64);
        let g = *g as f64;
        assert!(
            (num - g).abs() <= 2e-3 + 2e-2 * num.abs().max(g.abs()),
            "{name}[{i}]: numeric {num}, analytic {g}"
        );
    }
}

#[test]
fn conv1d_gradients_match_finite_differences() {
    let (b, t, di, k) = (2, 5, 3, 4);
    let xz = act(1, &[b, t, 2 * di], 1.0);
    let w = act(2, &[di, 1, k], 0.7);
    let bias = act(3, &[di], 0.5);
    let wout = values(4, b * t * di, 1.0);
    let out = causal_conv1d(&xz, &w, Some(&bias)).unwrap();
    // Causal: the first output sees only the first input and the bias.
    assert_eq!(out.data[0], bias.data[0] + w.data[k - 1] * xz.data[0]);
    let (mut dx, mut dw, mut db) = (
        vec![0.0; xz.data.len()],
        vec![0.0; w.data.len()],
        vec![0.0; di],
    );
    causal_conv1d_backward(&xz, &w, &wout, &mut dx, &mut dw, Some(&mut db)).unwrap();
    assert!(dx.chunks(2 * di).all(|r| r[di..].iter().all(|v| *v == 0.0)));
    let f =
        |x: &Act, w: &Act, bias: &Act| dot(&causal_conv1d(x, w, Some(bias)).unwrap().data, &wout);
    check("dxz", &xz, &dx, &|x| f(x, &w, &bias));
    check("dw", &w, &dw, &|w| f(&xz, w, &bias));
    check("dbias", &bias, &db, &|bv| f(&xz, &w, bv));
}

#[test]
fn elementwise_gradients_match_finite_differences() {
    let mut x = act(5, &[2, 3, 4], 3.0);
    x.data[0] = 25.0; // softplus's linear branch
    let w = values(6, x.data.len(), 1.0);
    check("silu", &x, &silu_backward(&x.data, &w), &|x| {
        dot(&silu(x).data, &w)
    });
    check("softplus", &x, &softplus_backward(&x.data, &w), &|x| {
        dot(&softplus(x).data, &w)
    });
    let y = act(7, &[2, 3, 4], 1.0);
    let xz = act(8, &[2, 3, 8], 2.0);
    let mut dxz = vec![0.0; xz.data.len()];
    let dy = gate_backward(&y, &xz, &w, &mut dxz);
    assert!(dxz.chunks(8).all(|r| r[..4].iter().all(|v| *v == 0.0)));
    check("gate dy", &y, &dy, &|y| {
        dot(&gate(y, &xz).unwrap().data, &w)
    });
    check("gate dz", &xz, &dxz, &|xz| {
        dot(&gate(&y, xz).unwrap().data, &w)
    });
}

#[test]
fn dt_proj_gradients_match_finite_differences() {
    let (b, t, r, n, di) = (2, 3, 2, 3, 4);
    let x = act(9, &[b, t, r + 2 * n], 1.0);
    let w = act(10, &[di, r], 1.0);
    let bias = act(11, &[di], 1.0);
    let wout = values(12, b * t * di, 1.0);
    let (mut dx, mut dw, mut db) = (
        vec![0.0; x.data.len()],
        vec![0.0; w.data.len()],
        vec![0.0; di],
    );
    dt_proj_backward(&x, &w, &wout, &mut dx, &mut dw, Some(&mut db)).unwrap();
    let f = |x: &Act, w: &Act, bv: &Act| dot(&dt_proj(x, w, Some(bv)).unwrap().data, &wout);
    check("dx", &x, &dx, &|x| f(x, &w, &bias));
    check("dw", &w, &dw, &|w| f(&x, w, &bias));
    check("db", &bias, &db, &|bv| f(&x, &w, bv));
}

struct ScanCase {
    u: Act,
    dt: Act,
    a_log: Act,
    x: Act,
    d: Act,
}

fn scan_case(b: usize, t: usize, di: usize, n: usize, r: usize) -> ScanCase {
    let mut dt = act(21, &[b, t, di], 0.5);
    dt.data.iter_mut().for_each(|v| *v += 0.6);
    ScanCase {
        u: act(20, &[b, t, di], 1.0),
        dt,
        a_log: act(22, &[di, n], 1.0),
        x: act(23, &[b, t, r + 2 * n], 1.0),
        d: act(24, &[di], 1.0),
    }
}

/// The recurrence written out directly, with every state kept, in f64.
fn reference_scan(c: &ScanCase) -> Vec<f64> {
    let (b, t, di) = (c.u.shape[0], c.u.shape[1], c.u.shape[2]);
    let n = c.a_log.shape[1];
    let width = c.x.shape[2];
    let r = width - 2 * n;
    let mut y = vec![0.0; b * t * di];
    for bi in 0..b {
        for dd in 0..di {
            let mut h = vec![0.0f64; n];
            for ti in 0..t {
                let i = (bi * t + ti) * di + dd;
                let row = &c.x.data[(bi * t + ti) * width..][..width];
                let (dtv, uv) = (c.dt.data[i] as f64, c.u.data[i] as f64);
                let mut acc = 0.0;
                for j in 0..n {
                    let a = -(c.a_log.data[dd * n + j] as f64).exp();
                    h[j] = (a * dtv).exp() * h[j] + dtv * row[r + j] as f64 * uv;
                    acc += h[j] * row[r + n + j] as f64;
                }
                y[i] = acc + uv * c.d.data[dd] as f64;
            }
        }
    }
    y
}

#[test]
fn scan_matches_the_plain_recurrence_for_every_chunk_length() {
    let c = scan_case(2, 7, 3, 4, 2);
    let want = reference_scan(&c);
    let first = selective_scan(&c.u, &c.dt, &c.a_log, &c.x, &c.d, 1).unwrap();
    for chunk in [1, 3, 7, 9] {
        let out = selective_scan(&c.u, &c.dt, &c.a_log, &c.x, &c.d, chunk).unwrap();
        assert_eq!(out[1].shape, vec![2, 7usize.div_ceil(chunk), 3, 4]);
        // The chunk length changes only what is kept, never y.
        assert!(out[0].bit_eq(&first[0]), "chunk {chunk}");
        for (a, b) in out[0].data.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}

#[test]
fn scan_gradients_match_finite_differences_and_agree_across_chunks() {
    let c = scan_case(2, 6, 3, 2, 2);
    let wout = values(30, c.u.data.len(), 1.0);
    let grads = |chunk: usize| {
        let out = selective_scan(&c.u, &c.dt, &c.a_log, &c.x, &c.d, chunk).unwrap();
        selective_scan_backward(&c.u, &c.dt, &c.a_log, &c.x, &c.d, &out[1], chunk, &wout).unwrap()
    };
    let g = grads(4);
    let f = |u: &Act, dt: &Act, al: &Act, x: &Act, d: &Act| {
        dot(&selective_scan(u, dt, al, x, d, 4).unwrap()[0].data, &wout)
    };
    check("du", &c.u, &g.du, &|u| f(u, &c.dt, &c.a_log, &c.x, &c.d));
    check("ddt", &c.dt, &g.ddt, &|dt| {
        f(&c.u, dt, &c.a_log, &c.x, &c.d)
    });
    check("dA_log", &c.a_log, &g.da_log, &|al| {
        f(&c.u, &c.dt, al, &c.x, &c.d)
    });
    check("dx_dbc", &c.x, &g.dx_dbc, &|x| {
        f(&c.u, &c.dt, &c.a_log, x, &c.d)
    });
    check("dD", &c.d, &g.dd, &|d| f(&c.u, &c.dt, &c.a_log, &c.x, d));
    // The dt columns of x_dbc get nothing from the scan.
    assert!(g.dx_dbc.chunks(6).all(|r| r[..2].iter().all(|v| *v == 0.0)));
    // Recomputing inside chunks rebuilds the forward's states bit for bit, so the
    // chunk length does not change a single gradient bit.
    for chunk in [1, 3, 6, 10] {
        let h = grads(chunk);
        for (a, b) in [
            (&g.du, &h.du),
            (&g.ddt, &h.ddt),
            (&g.da_log, &h.da_log),
            (&g.dx_dbc, &h.dx_dbc),
            (&g.dd, &h.dd),
        ] {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "chunk {chunk}"
            );
        }
    }
}

#[test]
fn bad_shapes_are_errors() {
    let c = scan_case(1, 4, 3, 2, 1);
    let bad_a = act(1, &[3, 5], 1.0);
    let err = selective_scan(&c.u, &c.dt, &bad_a, &c.x, &c.d, 2)
        .err()
        .unwrap();
    assert!(err.contains("x_proj output"), "{err}");
    let err = selective_scan(&c.u, &c.dt, &c.a_log, &c.x, &c.d, 0)
        .err()
        .unwrap();
    assert!(err.contains("chunk"), "{err}");
    let w = act(2, &[7, 1, 3], 1.0);
    let err = causal_conv1d(&c.u, &w, None).err().unwrap();
    assert!(err.contains("channels"), "{err}");
}
