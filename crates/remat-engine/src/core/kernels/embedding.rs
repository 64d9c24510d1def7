//! Token embedding: a row gather in forward, a scatter-add in backward.

use rayon::prelude::*;

use super::{Float, KernelError, PARALLEL_MIN_ELEMS, check_len};

fn check_ids(kernel: &'static str, ids: &[u32], vocab: usize) -> Result<(), KernelError> {
    match ids.iter().position(|&t| t as usize >= vocab) {
        Some(position) => Err(KernelError::TokenOutOfRange {
            kernel,
            position,
            token: ids[position],
            vocab,
        }),
        None => Ok(()),
    }
}

/// `out[i, :] = weight[ids[i], :]` for a `[vocab, dim]` table.
pub fn embedding_forward<T: Float>(
    weight: &[T],
    vocab: usize,
    dim: usize,
    ids: &[u32],
    out: &mut [T],
) -> Result<(), KernelError> {
    check_len("embedding_forward", "weight", weight.len(), vocab * dim)?;
    check_len("embedding_forward", "out", out.len(), ids.len() * dim)?;
    check_ids("embedding_forward", ids, vocab)?;
    if dim == 0 {
        return Ok(());
    }
    let gather = |(row, &id): (&mut [T], &u32)| {
        let id = id as usize;
        row.copy_from_slice(&weight[id * dim..(id + 1) * dim]);
    };
    if out.len() >= PARALLEL_MIN_ELEMS {
        out.par_chunks_mut(dim).zip(ids.par_iter()).for_each(gather);
    } else {
        out.chunks_mut(dim).zip(ids.iter()).for_each(gather);
    }
    Ok(())
}

/// `dweight[ids[i], :] += dout[i, :]`, in token order. Tokens repeat, so rows are split by
/// column range across threads (never by token) to keep each sum's order fixed.
pub fn embedding_backward<T: Float>(
    ids: &[u32],
    dout: &[T],
    vocab: usize,
    dim: usize,
    dweight: &mut [T],
) -> Result<(), KernelError> {
    check_len("embedding_backward", "dweight", dweight.len(), vocab * dim)?;
    check_len("embedding_backward", "dout", dout.len(), ids.len() * dim)?;
    check_ids("embedding_backward", ids, vocab)?;
    for (i, &id) in ids.iter().enumerate() {
        let id = id as usize;
        let src = &dout[i * dim..(i + 1) * dim];
        for (d, &s) in dweight[id * dim..(id + 1) * dim].iter_mut().zip(src) {
            *d += s;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_and_scatter_add() {
        let w: Vec<f64> = (0..12).map(f64::from).collect(); // vocab 4, dim 3
        let ids = [2u32, 0, 2];
        let mut out = vec![0.0; 9];
        embedding_forward(&w, 4, 3, &ids, &mut out).unwrap();
        assert_eq!(out, [6.0, 7.0, 8.0, 0.0, 1.0, 2.0, 6.0, 7.0, 8.0]);
        let dout: Vec<f64> = (0..9).map(|i| i as f64 * 0.5).collect();
        let mut dw = vec![1.0; 12];
        embedding_backward(&ids, &dout, 4, 3, &mut dw).unwrap();
        assert_eq!(
            dw,
            [
                2.5,
                3.0,
                3.5,
                1.0,
                1.0,
                1.0,
                1.0 + 3.0,
                1.0 + 4.0,
                1.0 + 5.0,
                1.0,
                1.0,
                1.0
            ]
        );
    }

    #[test]
    fn out_of_range_token_is_named() {
        let mut out = vec![0.0f32; 6];
        let err = embedding_forward(&[0.0f32; 12], 4, 3, &[1, 9], &mut out).unwrap_err();
        assert_eq!(
            err,
            KernelError::TokenOutOfRange {
                kernel: "embedding_forward",
                position: 1,
                token: 9,
                vocab: 4
            }
        );
        assert!(err.to_string().contains("token 9 at position 1"));
    }
}
