//! Cross-entropy over class logits, mean over the counted tokens, computed through the
//! log-sum-exp so no probability is ever materialized in forward.

use rayon::prelude::*;

use super::{Float, KernelError, PARALLEL_MIN_ELEMS, check_len, lane_max};

/// A target equal to this is ignored: no loss, no gradient, not counted in the mean
/// (PyTorch's `ignore_index`, used to train only on the answer part of a sequence).
pub const IGNORE_INDEX: u32 = u32::MAX;

fn counted(kernel: &'static str, targets: &[u32], vocab: usize) -> Result<usize, KernelError> {
    let mut n = 0;
    for (position, &t) in targets.iter().enumerate() {
        if t == IGNORE_INDEX {
            continue;
        }
        if t as usize >= vocab {
            return Err(KernelError::TokenOutOfRange {
                kernel,
                position,
                token: t,
                vocab,
            });
        }
        n += 1;
    }
    if n == 0 {
        return Err(KernelError::Invalid {
            kernel,
            what: "every target is ignored; the mean loss is undefined".into(),
        });
    }
    Ok(n)
}

fn row_lse<T: Float>(x: &[T]) -> T {
    let m = lane_max(x);
    let mut sum = T::ZERO;
    for &v in x {
        sum += (v - m).exp();
    }
    m + sum.ln()
}

/// Mean cross-entropy of `logits [n, vocab]` against `targets [n]`; writes each row's
/// log-sum-exp into `lse [n]` for backward. Rows are summed in order for a fixed result.
pub fn cross_entropy_forward<T: Float>(
    logits: &[T],
    targets: &[u32],
    vocab: usize,
    lse: &mut [T],
) -> Result<T, KernelError> {
    let n = targets.len();
    check_len("cross_entropy_forward", "logits", logits.len(), n * vocab)?;
    check_len("cross_entropy_forward", "lse", lse.len(), n)?;
    let count = counted("cross_entropy_forward", targets, vocab)?;
    if logits.len() >= PARALLEL_MIN_ELEMS {
        lse.par_iter_mut()
            .zip(logits.par_chunks(vocab))
            .for_each(|(l, x)| *l = row_lse(x));
    } else {
        lse.iter_mut()
            .zip(logits.chunks(vocab))
            .for_each(|(l, x)| *l = row_lse(x));
    }
    let mut total = T::ZERO;
    for (i, &t) in targets.iter().enumerate() {
        if t != IGNORE_INDEX {
            total += lse[i] - logits[i * vocab + t as usize];
        }
    }
    Ok(total / T::from_usize(count))
}

/// One row of the backward: `((dlogits, logits), target), lse`.
type RowArgs<'a, T> = (((&'a mut [T], &'a [T]), &'a u32), &'a T);

/// `dlogits = dloss / count * (softmax(logits) - onehot(target))`; ignored rows get zeros.
pub fn cross_entropy_backward<T: Float>(
    logits: &[T],
    targets: &[u32],
    vocab: usize,
    lse: &[T],
    dloss: T,
    dlogits: &mut [T],
) -> Result<(), KernelError> {
    let n = targets.len();
    check_len("cross_entropy_backward", "logits", logits.len(), n * vocab)?;
    check_len("cross_entropy_backward", "lse", lse.len(), n)?;
    check_len(
        "cross_entropy_backward",
        "dlogits",
        dlogits.len(),
        n * vocab,
    )?;
    let count = counted("cross_entropy_backward", targets, vocab)?;
    let g = dloss / T::from_usize(count);
    let row = |(((d, x), &t), &l): RowArgs<'_, T>| {
        if t == IGNORE_INDEX {
            d.fill(T::ZERO);
            return;
        }
        for (o, &v) in d.iter_mut().zip(x) {
            *o = (v - l).exp() * g;
        }
        d[t as usize] -= g;
    };
    if logits.len() >= PARALLEL_MIN_ELEMS {
        dlogits
            .par_chunks_mut(vocab)
            .zip(logits.par_chunks(vocab))
            .zip(targets.par_iter())
            .zip(lse.par_iter())
            .for_each(row);
    } else {
        dlogits
            .chunks_mut(vocab)
            .zip(logits.chunks(vocab))
            .zip(targets.iter())
            .zip(lse.iter())
            .for_each(row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::gradcheck::{assert_close, finite_diff, rand_vec};
    use super::*;

    #[test]
    fn loss_and_gradient() {
        let (n, vocab) = (6, 5);
        let x = rand_vec(n * vocab, 1, 3.0);
        let targets = [0u32, 4, IGNORE_INDEX, 2, 2, 1];
        let mut lse = vec![0.0; n];
        let loss = cross_entropy_forward(&x, &targets, vocab, &mut lse).unwrap();
        // Reference: -mean log softmax at the target, over the 5 counted rows.
        let mut want = 0.0;
        for (i, &t) in targets.iter().enumerate() {
            if t == IGNORE_INDEX {
                continue;
            }
            let row = &x[i * vocab..(i + 1) * vocab];
            let z: f64 = row.iter().map(|v| v.exp()).sum();
            want -= (row[t as usize].exp() / z).ln();
        }
        assert!((loss - want / 5.0).abs() < 1e-12);
        let mut dx = vec![0.0; n * vocab];
        cross_entropy_backward(&x, &targets, vocab, &lse, 2.0, &mut dx).unwrap();
        let numeric = finite_diff(&x, |x| {
            let mut l = vec![0.0; n];
            2.0 * cross_entropy_forward(x, &targets, vocab, &mut l).unwrap()
        });
        assert_close("cross-entropy dlogits", &dx, &numeric);
        assert!(dx[2 * vocab..3 * vocab].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn bad_targets_are_errors() {
        let mut lse = [0.0f32; 2];
        let err = cross_entropy_forward(&[0.0f32; 6], &[1, 3], 3, &mut lse).unwrap_err();
        assert!(err.to_string().contains("token 3 at position 1"), "{err}");
        let err = cross_entropy_forward(&[0.0f32; 6], &[IGNORE_INDEX; 2], 3, &mut lse).unwrap_err();
        assert!(err.to_string().contains("every target is ignored"), "{err}");
    }
}
