//! Wider vectors for hot elementwise loops without giving up portability: the crate is
//! built for baseline x86-64 (SSE2, 4 f32 lanes), so a loop run through [`vectorized`] is
//! compiled a second time with AVX2 enabled (8 lanes) and that copy is used when the CPU
//! has AVX2. Results are identical bit for bit: enabling AVX2 only widens the same IEEE
//! operations (Rust never contracts `a * b + c` into a fused multiply-add, and no kernel
//! reorders a reduction by lane count), so the choice never changes a gradient.

/// Runs `body`, compiled for AVX2 when the CPU supports it. `body` (and everything it
/// calls that is inlined into it) must be `#[inline]`-able for the wider copy to help.
#[inline(always)]
pub(crate) fn vectorized<R>(body: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the running CPU supports AVX2, checked just above.
            return unsafe { with_avx2(body) };
        }
    }
    body()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn with_avx2<R>(body: impl FnOnce() -> R) -> R {
    body()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_avx2_copy_computes_the_same_bits() {
        let x: Vec<f32> = (0..4099).map(|i| (i as f32 * 0.37).sin() * 40.0).collect();
        let f = |v: &[f32], out: &mut [f32]| {
            for (o, &x) in out.iter_mut().zip(v) {
                *o = x * <f32 as super::super::Float>::sigmoid(x) + x / 3.0;
            }
        };
        let (mut a, mut b) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
        f(&x, &mut a);
        vectorized(|| f(&x, &mut b));
        assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
    }
}
