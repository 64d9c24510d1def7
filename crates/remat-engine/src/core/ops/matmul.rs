//! Batched matrix multiply: `a[..., m, k] x b[k, n]` (one weight shared by the batch, done as
//! a single gemm) or `a[..., m, k] x b[..., k, n]` (same batch dims).

use crate::core::dtype::Element;
use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::linalg::{MatRef, matmul_into, parallelism};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::{Tensor, numel};
use crate::float_dispatch;

#[derive(Debug, Clone, Copy, Default)]
pub struct MatMul;

struct Dims {
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    shared_b: bool,
}

fn dims(a: &[usize], b: &[usize]) -> Result<Dims, String> {
    if a.len() < 2 || b.len() < 2 {
        return Err(format!("matmul needs matrices, got shapes {a:?} and {b:?}"));
    }
    let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
    let (kb, n) = (b[b.len() - 2], b[b.len() - 1]);
    if k != kb {
        return Err(format!("inner dimensions differ: {a:?} x {b:?}"));
    }
    let batch = numel(&a[..a.len() - 2]);
    let shared_b = b.len() == 2;
    if !shared_b && a[..a.len() - 2] != b[..b.len() - 2] {
        return Err(format!("batch dimensions differ: {a:?} x {b:?}"));
    }
    Ok(Dims {
        batch,
        m,
        k,
        n,
        shared_b,
    })
}

impl Op for MatMul {
    fn kind(&self) -> &'static str {
        "matmul"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        let [a, b] = inputs else {
            return Err("matmul takes 2 inputs".into());
        };
        let d = dims(a, b)?;
        let mut out = a[..a.len() - 2].to_vec();
        out.extend([d.m, d.n]);
        Ok(out)
    }

    fn saves_input(&self, _slot: usize) -> bool {
        true
    }

    fn flops(&self, inputs: &[&[usize]]) -> u64 {
        match inputs {
            [a, b] => dims(a, b).map_or(0, |d| 2 * (d.batch * d.m * d.k * d.n) as u64),
            _ => 0,
        }
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let (a, b) = (inputs[0], inputs[1]);
        let d = dims(a.shape(), b.shape()).map_err(|m| cx.shape_error(m))?;
        let shape = self
            .output_shape(&[a.shape(), b.shape()])
            .map_err(|m| cx.shape_error(m))?;
        // Every element is written by the product (or zero-filled when k == 0).
        let out = cx.alloc_output_overwritten(&shape, a.dtype())?;
        let par = cx.gemm_parallelism();
        float_dispatch!(a.dtype(), cx.node_name(), T => {
            let (ar, br) = (a.read(), b.read());
            let (av, bv) = (ar.as_slice::<T>()?, br.as_slice::<T>()?);
            let mut w = out.write();
            let ov = w.as_mut_slice::<T>()?;
            if d.shared_b {
                let am = MatRef { data: av, rows: d.batch * d.m, cols: d.k, trans: false };
                let bm = MatRef { data: bv, rows: d.k, cols: d.n, trans: false };
                matmul_into(ov, am, bm, false, par)
            } else {
                for i in 0..d.batch {
                    let am = MatRef { data: &av[i * d.m * d.k..][..d.m * d.k], rows: d.m, cols: d.k, trans: false };
                    let bm = MatRef { data: &bv[i * d.k * d.n..][..d.k * d.n], rows: d.k, cols: d.n, trans: false };
                    matmul_into(&mut ov[i * d.m * d.n..][..d.m * d.n], am, bm, false, par)?;
                }
                Ok(())
            }
        })?;
        Ok(out.into())
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let (a, b) = (saved.input(0)?, saved.input(1)?);
        let d = dims(a.shape(), b.shape()).map_err(|m| cx.shape_error(m))?;
        let da = cx
            .needs_grad(0)
            .then(|| cx.alloc_grad_overwritten(0, a.shape(), a.dtype()))
            .transpose()?;
        let db = cx
            .needs_grad(1)
            .then(|| cx.alloc_grad_overwritten(1, b.shape(), b.dtype()))
            .transpose()?;
        // dA and dB are independent products of about the same size: with both needed and
        // two or more threads, they run side by side on halves of the threads, which keeps
        // both cores busier than splitting each product in turn (each result does not
        // depend on how its rows are split, so this changes no bit).
        let threads = cx.threads();
        let side_by_side = da.is_some() && db.is_some() && threads >= 2;
        let (par_a, par_b) = if side_by_side {
            (parallelism(threads / 2), parallelism(threads - threads / 2))
        } else {
            (cx.gemm_parallelism(), cx.gemm_parallelism())
        };
        float_dispatch!(a.dtype(), cx.node_name(), T => {
            let (ar, br, gr) = (a.read(), b.read(), g.read());
            let (av, bv, gv) = (ar.as_slice::<T>()?, br.as_slice::<T>()?, gr.as_slice::<T>()?);
            let mut wa = da.as_ref().map(Tensor::write);
            let mut wb = db.as_ref().map(Tensor::write);
            let dav = match wa.as_mut() { Some(w) => Some(w.as_mut_slice::<T>()?), None => None };
            let dbv = match wb.as_mut() { Some(w) => Some(w.as_mut_slice::<T>()?), None => None };
            let run_a = || dav.map_or(Ok(()), |dav| grad_a(&d, dav, gv, bv, par_a));
            let run_b = || dbv.map_or(Ok(()), |dbv| grad_b(&d, dbv, av, gv, par_b));
            if side_by_side {
                let (ra, rb) = rayon::join(run_a, run_b);
                ra.and(rb)
            } else {
                run_a().and_then(|()| run_b())
            }
        })?;
        Ok(vec![da, db])
    }
}

/// `dA = dY * B^T` (per batch element when B is batched).
fn grad_a<T: Element>(
    d: &Dims,
    dav: &mut [T],
    gv: &[T],
    bv: &[T],
    par: gemm::Parallelism,
) -> Result<()> {
    if d.shared_b {
        let gm = MatRef::new(gv, d.batch * d.m, d.n);
        return matmul_into(dav, gm, MatRef::transposed(bv, d.n, d.k), false, par);
    }
    let (g_len, b_len, a_len) = (d.m * d.n, d.k * d.n, d.m * d.k);
    for i in 0..d.batch {
        let gm = MatRef::new(&gv[i * g_len..][..g_len], d.m, d.n);
        let bt = MatRef::transposed(&bv[i * b_len..][..b_len], d.n, d.k);
        matmul_into(&mut dav[i * a_len..][..a_len], gm, bt, false, par)?;
    }
    Ok(())
}

/// `dB = A^T * dY`, summed over the batch when B is shared (one gemm over all rows).
fn grad_b<T: Element>(
    d: &Dims,
    dbv: &mut [T],
    av: &[T],
    gv: &[T],
    par: gemm::Parallelism,
) -> Result<()> {
    if d.shared_b {
        let at = MatRef::transposed(av, d.k, d.batch * d.m);
        return matmul_into(dbv, at, MatRef::new(gv, d.batch * d.m, d.n), false, par);
    }
    let (a_len, g_len, b_len) = (d.m * d.k, d.m * d.n, d.k * d.n);
    for i in 0..d.batch {
        let at = MatRef::transposed(&av[i * a_len..][..a_len], d.k, d.m);
        let gm = MatRef::new(&gv[i * g_len..][..g_len], d.m, d.n);
        matmul_into(&mut dbv[i * b_len..][..b_len], at, gm, false, par)?;
    }
    Ok(())
}

impl Graph {
    /// `a[..., m, k] x b[k, n]` or batched `a[..., m, k] x b[..., k, n]`.
    pub fn matmul(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.apply(MatMul, &[a, b])
    }
}
