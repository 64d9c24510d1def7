//! Pointwise activations: SiLU, SwiGLU and GELU (tanh approximation), forward and backward.

use rayon::prelude::*;

use super::{ELEMWISE_CHUNK, Float, KernelError, PARALLEL_MIN_ELEMS, check_len, vectorized};

/// Applies `f(a[i], b[i]) -> out[i]`, in parallel chunks when the buffer is large.
fn zip_map<T: Float>(a: &[T], b: &[T], out: &mut [T], f: impl Fn(T, T) -> T + Sync) {
    let run = |a: &[T], b: &[T], out: &mut [T]| {
        vectorized(|| {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                *o = f(x, y);
            }
        })
    };
    if out.len() >= PARALLEL_MIN_ELEMS {
        out.par_chunks_mut(ELEMWISE_CHUNK)
            .zip(a.par_chunks(ELEMWISE_CHUNK))
            .zip(b.par_chunks(ELEMWISE_CHUNK))
            .for_each(|((o, a), b)| run(a, b, o));
    } else {
        run(a, b, out);
    }
}

/// Applies `f(x[i]) -> out[i]`.
fn map<T: Float>(x: &[T], out: &mut [T], f: impl Fn(T) -> T + Sync) {
    zip_map(x, x, out, |a, _| f(a));
}

/// SiLU (swish): `y = x * sigmoid(x)`.
pub fn silu_forward<T: Float>(x: &[T], y: &mut [T]) -> Result<(), KernelError> {
    check_len("silu_forward", "y", y.len(), x.len())?;
    map(x, y, |x| x * x.sigmoid());
    Ok(())
}

/// `dx = dy * (s + x s (1 - s))` with `s = sigmoid(x)`.
pub fn silu_backward<T: Float>(x: &[T], dy: &[T], dx: &mut [T]) -> Result<(), KernelError> {
    check_len("silu_backward", "dy", dy.len(), x.len())?;
    check_len("silu_backward", "dx", dx.len(), x.len())?;
    zip_map(x, dy, dx, |x, g| g * silu_grad(x));
    Ok(())
}

#[inline(always)]
fn silu_grad<T: Float>(x: T) -> T {
    let s = x.sigmoid();
    s + x * s * (T::ONE - s)
}

/// SwiGLU: `y = silu(gate) * up` (the gated MLP of Llama/Qwen: `down(silu(gate(x)) * up(x))`).
pub fn swiglu_forward<T: Float>(gate: &[T], up: &[T], y: &mut [T]) -> Result<(), KernelError> {
    check_len("swiglu_forward", "up", up.len(), gate.len())?;
    check_len("swiglu_forward", "y", y.len(), gate.len())?;
    zip_map(gate, up, y, |g, u| g * g.sigmoid() * u);
    Ok(())
}

/// `dgate = dy * up * silu'(gate)`, `dup = dy * silu(gate)`.
pub fn swiglu_backward<T: Float>(
    gate: &[T],
    up: &[T],
    dy: &[T],
    dgate: &mut [T],
    dup: &mut [T],
) -> Result<(), KernelError> {
    let n = gate.len();
    check_len("swiglu_backward", "up", up.len(), n)?;
    check_len("swiglu_backward", "dy", dy.len(), n)?;
    check_len("swiglu_backward", "dgate", dgate.len(), n)?;
    check_len("swiglu_backward", "dup", dup.len(), n)?;
    let run = |gate: &[T], up: &[T], dy: &[T], dgate: &mut [T], dup: &mut [T]| {
        vectorized(|| {
            let outs = dgate.iter_mut().zip(dup.iter_mut());
            for ((dg, du), ((&g, &u), &d)) in outs.zip(gate.iter().zip(up).zip(dy)) {
                let s = g.sigmoid();
                *du = d * g * s;
                *dg = d * u * (s + g * s * (T::ONE - s));
            }
        })
    };
    if n >= PARALLEL_MIN_ELEMS {
        let c = ELEMWISE_CHUNK;
        dgate
            .par_chunks_mut(c)
            .zip(dup.par_chunks_mut(c))
            .zip(
                gate.par_chunks(c)
                    .zip(up.par_chunks(c))
                    .zip(dy.par_chunks(c)),
            )
            .for_each(|((dg, du), ((g, u), d))| run(g, u, d, dg, du));
    } else {
        run(gate, up, dy, dgate, dup);
    }
    Ok(())
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_A: f64 = 0.044_715;

/// GELU, tanh approximation (PyTorch's `gelu(approximate="tanh")`, GPT-2's form):
/// `y = x/2 (1 + tanh(c (x + a x^3)))`, `c = sqrt(2/pi)`, `a = 0.044715`.
pub fn gelu_forward<T: Float>(x: &[T], y: &mut [T]) -> Result<(), KernelError> {
    check_len("gelu_forward", "y", y.len(), x.len())?;
    let (c, a, half) = (T::from_f64(GELU_C), T::from_f64(GELU_A), T::from_f64(0.5));
    map(x, y, |x| {
        half * x * (T::ONE + (c * (x + a * x * x * x)).tanh())
    });
    Ok(())
}

/// Derivative of the tanh-form GELU:
/// `1/2 (1 + t) + x/2 (1 - t^2) c (1 + 3 a x^2)` with `t = tanh(c (x + a x^3))`.
pub fn gelu_backward<T: Float>(x: &[T], dy: &[T], dx: &mut [T]) -> Result<(), KernelError> {
    check_len("gelu_backward", "dy", dy.len(), x.len())?;
    check_len("gelu_backward", "dx", dx.len(), x.len())?;
    let (c, a, half) = (T::from_f64(GELU_C), T::from_f64(GELU_A), T::from_f64(0.5));
    let three = T::from_f64(3.0);
    zip_map(x, dy, dx, |x, g| {
        let t = (c * (x + a * x * x * x)).tanh();
        let d =
            half * (T::ONE + t) + half * x * (T::ONE - t * t) * c * (T::ONE + three * a * x * x);
        g * d
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::gradcheck::{check_unary, rand_vec};
    use super::*;

    #[test]
    fn silu_gradient_matches_finite_differences() {
        check_unary(
            "silu",
            300,
            3.0,
            |x, y| silu_forward(x, y).unwrap(),
            |x, dy, dx| silu_backward(x, dy, dx).unwrap(),
        );
    }

    #[test]
    fn gelu_gradient_matches_finite_differences() {
        check_unary(
            "gelu",
            300,
            3.0,
            |x, y| gelu_forward(x, y).unwrap(),
            |x, dy, dx| gelu_backward(x, dy, dx).unwrap(),
        );
    }

    #[test]
    fn gelu_matches_reference_values() {
        // torch.nn.functional.gelu(torch.tensor([-2., -0.5, 0., 1., 3.]), approximate="tanh")
        let x = [-2.0f64, -0.5, 0.0, 1.0, 3.0];
        let want = [-0.045_402_3, -0.154_285_8, 0.0, 0.841_192, 2.996_362_7];
        let mut y = [0.0; 5];
        gelu_forward(&x, &mut y).unwrap();
        for (g, w) in y.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
    }

    #[test]
    fn swiglu_gradient_matches_finite_differences() {
        let n = 257;
        let gate = rand_vec(n, 1, 3.0);
        let up = rand_vec(n, 2, 2.0);
        let w = rand_vec(n, 3, 1.0);
        let loss = |g: &[f64], u: &[f64]| {
            let mut y = vec![0.0; n];
            swiglu_forward(g, u, &mut y).unwrap();
            y.iter().zip(&w).map(|(a, b)| a * b).sum::<f64>()
        };
        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
        swiglu_backward(&gate, &up, &w, &mut dg, &mut du).unwrap();
        let fd_g = super::super::gradcheck::finite_diff(&gate, |g| loss(g, &up));
        let fd_u = super::super::gradcheck::finite_diff(&up, |u| loss(&gate, u));
        super::super::gradcheck::assert_close("swiglu dgate", &dg, &fd_g);
        super::super::gradcheck::assert_close("swiglu dup", &du, &fd_u);
    }

    #[test]
    fn large_inputs_take_the_parallel_path_with_identical_bits() {
        let n = PARALLEL_MIN_ELEMS + 123;
        let x: Vec<f32> = rand_vec(n, 9, 4.0).iter().map(|&v| v as f32).collect();
        let mut y_par = vec![0.0f32; n];
        silu_forward(&x, &mut y_par).unwrap();
        let mut y_seq = vec![0.0f32; 100];
        silu_forward(&x[..100], &mut y_seq).unwrap();
        assert_eq!(y_par[..100], y_seq[..]);
        assert!(matches!(
            silu_forward(&x, &mut y_seq),
            Err(KernelError::Length { buffer: "y", .. })
        ));
    }
}
