//! The runtime's tensor ([`Act`]) and the one projection on it ([`linear`]) that the op
//! table ([`super::ops`]) and the Mamba ops ([`super::ssm`]) both run; its own module so
//! that the op table, which dispatches to the MoE and SSM ops, is not imported back by them.

use super::linalg;

/// A runtime tensor: contiguous row-major f32 (integer slots, the expert indices, hold
/// exact small integers).
#[derive(Debug, Clone, PartialEq)]
pub struct Act {
    pub data: Vec<f32>,
    pub shape: Vec<usize>,
}

impl Act {
    pub fn new(data: Vec<f32>, shape: Vec<usize>) -> Self {
        debug_assert_eq!(data.len(), shape.iter().product::<usize>());
        Self { data, shape }
    }

    pub fn bytes(&self) -> u64 {
        self.data.len() as u64 * 4
    }

    pub(super) fn last(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    pub(super) fn rows(&self) -> usize {
        self.data.len() / self.last().max(1)
    }

    pub fn bit_eq(&self, other: &Act) -> bool {
        self.shape == other.shape
            && self
                .data
                .iter()
                .zip(&other.data)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

/// `x @ w^T (+ bias)` over the last axis of `x` (`w` is `[out, in]`): the projection the
/// op table and the SSM ops share.
pub fn linear(x: &Act, w: &Act, bias: Option<&Act>) -> Result<Act, String> {
    let (n, k) = match w.shape.as_slice() {
        [n, k] => (*n, *k),
        s => return Err(format!("weight of shape {s:?} is not 2-D")),
    };
    if x.last() != k {
        return Err(format!(
            "input of shape {:?} does not match weight [{n}, {k}]",
            x.shape
        ));
    }
    let m = x.rows();
    let mut y = vec![0.0; m * n];
    linalg::linear(&x.data, &w.data, m, k, n, &mut y, false, 1.0);
    if let Some(b) = bias {
        if b.data.len() != n {
            return Err(format!("bias of {} elements for {n} outputs", b.data.len()));
        }
        for row in y.chunks_mut(n) {
            for (o, &bv) in row.iter_mut().zip(&b.data) {
                *o += bv;
            }
        }
    }
    let mut shape = x.shape.clone();
    *shape.last_mut().unwrap_or(&mut 0) = n;
    Ok(Act::new(y, shape))
}
