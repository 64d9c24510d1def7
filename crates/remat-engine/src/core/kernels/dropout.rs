//! Dropout driven by a counter-based generator (Philox4x32-10): element `i` of a draw with
//! state `(seed, offset)` keeps or drops according to `philox(seed, offset + i)` alone. No
//! sequential state, so the mask can be recomputed in backward (or in a rematerialized
//! forward) for any element, on any thread, with the same result; backward never stores it.

use rayon::prelude::*;

use super::{ELEMWISE_CHUNK, Float, KernelError, PARALLEL_MIN_ELEMS, check_len};

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11)
/// with key `seed` and counter `(counter, 0)`; returns the first 64 output bits.
#[inline]
pub fn philox_hash(seed: u64, counter: u64) -> u64 {
    let c = philox4x32_10(
        [counter as u32, (counter >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    u64::from(c[0]) | (u64::from(c[1]) << 32)
}

/// The full Philox4x32-10 block: ten rounds of two 32x32->64 multiplies and a key bump.
#[inline]
fn philox4x32_10(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// 24-bit threshold: an element is kept when its top 24 random bits are `>= threshold`, so
/// the keep probability is `1 - p` to within 2^-24.
fn threshold(kernel: &'static str, p: f64) -> Result<u64, KernelError> {
    if !(0.0..1.0).contains(&p) {
        return Err(KernelError::Invalid {
            kernel,
            what: format!("dropout probability {p} is outside [0, 1)"),
        });
    }
    Ok((p * (1u64 << 24) as f64).ceil() as u64)
}

/// Whether element `index` survives a dropout with probability `p` and state `(seed, offset)`.
pub fn dropout_keep(p: f64, seed: u64, offset: u64, index: u64) -> Result<bool, KernelError> {
    let t = threshold("dropout_keep", p)?;
    Ok(philox_hash(seed, offset.wrapping_add(index)) >> 40 >= t)
}

/// `out[i] = keep(i) ? x[i] / (1 - p) : 0`, mask from `(seed, offset + i)`.
fn apply_mask<T: Float>(
    kernel: &'static str,
    x: &[T],
    p: f64,
    seed: u64,
    offset: u64,
    out: &mut [T],
) -> Result<(), KernelError> {
    check_len(kernel, "output", out.len(), x.len())?;
    let t = threshold(kernel, p)?;
    let scale = T::from_f64(1.0 / (1.0 - p));
    let run = |start: usize, x: &[T], out: &mut [T]| {
        for (i, (o, &v)) in out.iter_mut().zip(x).enumerate() {
            let ctr = offset.wrapping_add((start + i) as u64);
            *o = if philox_hash(seed, ctr) >> 40 >= t {
                v * scale
            } else {
                T::ZERO
            };
        }
    };
    if x.len() >= PARALLEL_MIN_ELEMS {
        out.par_chunks_mut(ELEMWISE_CHUNK)
            .zip(x.par_chunks(ELEMWISE_CHUNK))
            .enumerate()
            .for_each(|(c, (o, x))| run(c * ELEMWISE_CHUNK, x, o));
    } else {
        run(0, x, out);
    }
    Ok(())
}

/// Inverted dropout: kept elements are scaled by `1 / (1 - p)`. The draw consumes counters
/// `offset .. offset + x.len()`; the caller advances its offset by `x.len()`.
pub fn dropout_forward<T: Float>(
    x: &[T],
    p: f64,
    seed: u64,
    offset: u64,
    y: &mut [T],
) -> Result<(), KernelError> {
    apply_mask("dropout_forward", x, p, seed, offset, y)
}

/// `dx = dy * mask / (1 - p)`, regenerating the forward's mask from `(seed, offset)`.
pub fn dropout_backward<T: Float>(
    dy: &[T],
    p: f64,
    seed: u64,
    offset: u64,
    dx: &mut [T],
) -> Result<(), KernelError> {
    apply_mask("dropout_backward", dy, p, seed, offset, dx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_published_known_answers() {
        // Random123's kat_vectors for philox4x32-10: (counter, key) -> output.
        let kat: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            (
                [0; 4],
                [0; 2],
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (counter, key, want) in kat {
            assert_eq!(
                philox4x32_10(counter, key),
                want,
                "counter {counter:x?} key {key:x?}"
            );
        }
        // The dropout hash is the first two words with the counter's high half zero.
        assert_eq!(philox_hash(0, 0), 0xe169_c58d_6627_e8d5);
        let seed = 0x299f_31d0_a409_3822u64;
        let c = philox4x32_10([7, 1, 0, 0], [seed as u32, (seed >> 32) as u32]);
        assert_eq!(
            philox_hash(seed, (1 << 32) | 7),
            u64::from(c[0]) | (u64::from(c[1]) << 32)
        );
    }

    #[test]
    fn mask_is_reproducible_and_has_the_right_rate() {
        let n = PARALLEL_MIN_ELEMS * 2 + 7;
        let x = vec![1.0f32; n];
        let (mut a, mut b) = (vec![0.0f32; n], vec![0.0f32; n]);
        dropout_forward(&x, 0.25, 42, 1000, &mut a).unwrap();
        dropout_forward(&x, 0.25, 42, 1000, &mut b).unwrap();
        assert_eq!(a, b);
        let kept = a.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
        assert!((kept - 0.75).abs() < 0.01, "kept fraction {kept}");
        assert!(a.iter().all(|&v| v == 0.0 || v == 1.0 / 0.75));
        // Element i depends only on (seed, offset + i): a shifted draw lines up.
        let mut shifted = vec![0.0f32; 100];
        dropout_forward(&x[..100], 0.25, 42, 1500, &mut shifted).unwrap();
        assert_eq!(shifted[..], a[500..600]);
        for i in 0..100u64 {
            assert_eq!(
                dropout_keep(0.25, 42, 1000, i).unwrap(),
                a[i as usize] != 0.0
            );
        }
        dropout_forward(&x, 0.25, 43, 1000, &mut b).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn backward_applies_the_forward_mask() {
        let x: Vec<f64> = (0..500).map(|i| i as f64 + 1.0).collect();
        let mut y = vec![0.0; 500];
        dropout_forward(&x, 0.5, 7, 3, &mut y).unwrap();
        let dy = vec![1.0; 500];
        let mut dx = vec![0.0; 500];
        dropout_backward(&dy, 0.5, 7, 3, &mut dx).unwrap();
        for i in 0..500 {
            assert_eq!(dx[i] * x[i], y[i]);
        }
    }

    #[test]
    fn bad_probability_is_an_error() {
        let mut y = [0.0f32; 1];
        let err = dropout_forward(&[1.0f32], 1.0, 0, 0, &mut y).unwrap_err();
        assert!(err.to_string().contains("outside [0, 1)"), "{err}");
        let mut y0 = [0.0f32; 1];
        dropout_forward(&[2.0f32], 0.0, 0, 0, &mut y0).unwrap();
        assert_eq!(y0[0], 2.0);
    }
}
