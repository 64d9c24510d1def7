//! Grouped matrix multiply: `a[G, ..., k] x b_g[k, n]` for `g < G`, one weight per group
//! (model). Per group it is one gemm over all of the group's rows, the very call
//! [`crate::core::ops::matmul::MatMul`] makes for `a_g[..., k] x b_g[k, n]` with a shared weight,
//! and backward runs dA and dB side by side on halves of the threads as that op does.

use crate::core::dtype::Element;
use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::linalg::{MatRef, matmul_into, parallelism};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

/// Inputs: `a [G, ..., k]`, then `G` weights `[k, n]`.
#[derive(Debug, Clone, Copy, Default)]
pub struct GroupedMatMul;

/// Sizes: `groups` products of `rows x k` by `k x n`.
struct Dims {
    groups: usize,
    rows: usize,
    k: usize,
    n: usize,
}

fn dims(inputs: &[&[usize]]) -> Result<Dims, String> {
    let [a, weights @ ..] = inputs else {
        return Err("grouped matmul takes a and one weight per group".into());
    };
    let groups = weights.len();
    if a.len() < 3 || a[0] != groups || groups == 0 {
        return Err(format!(
            "grouped matmul needs a [{groups}, ..., k] for {groups} weights, got {a:?}"
        ));
    }
    let k = a[a.len() - 1];
    let rows = a[1..a.len() - 1].iter().product();
    let first = weights[0];
    let [kb, n] = *first else {
        return Err(format!(
            "grouped matmul weights must be [k, n], got {first:?}"
        ));
    };
    if kb != k {
        return Err(format!("inner dimensions differ: {a:?} x {first:?}"));
    }
    if let Some((g, w)) = weights.iter().enumerate().find(|(_, w)| **w != first) {
        return Err(format!("weight {g} is {w:?}, weight 0 is {first:?}"));
    }
    Ok(Dims { groups, rows, k, n })
}

impl Op for GroupedMatMul {
    fn kind(&self) -> &'static str {
        "grouped_matmul"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        let d = dims(inputs)?;
        let a = inputs[0];
        let mut out = a[..a.len() - 1].to_vec();
        out.push(d.n);
        Ok(out)
    }

    fn saves_input(&self, _slot: usize) -> bool {
        true
    }

    fn flops(&self, inputs: &[&[usize]]) -> u64 {
        dims(inputs).map_or(0, |d| 2 * (d.groups * d.rows * d.k * d.n) as u64)
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape()).collect();
        let d = dims(&shapes).map_err(|m| cx.shape_error(m))?;
        let shape = self.output_shape(&shapes).map_err(|m| cx.shape_error(m))?;
        let out = cx.alloc_output_overwritten(&shape, inputs[0].dtype())?;
        let par = cx.gemm_parallelism();
        float_dispatch!(inputs[0].dtype(), cx.node_name(), T => {
            let ar = inputs[0].read();
            let av = ar.as_slice::<T>()?;
            let mut w = out.write();
            let ov = w.as_mut_slice::<T>()?;
            let (a_len, o_len) = (d.rows * d.k, d.rows * d.n);
            for (g, b) in inputs[1..].iter().enumerate() {
                let br = b.read();
                let am = MatRef::new(&av[g * a_len..][..a_len], d.rows, d.k);
                let bm = MatRef::new(br.as_slice::<T>()?, d.k, d.n);
                matmul_into(&mut ov[g * o_len..][..o_len], am, bm, false, par)?;
            }
            Ok::<(), crate::EngineError>(())
        })?;
        Ok(out.into())
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let d = dims(&saved.input_shapes).map_err(|m| cx.shape_error(m))?;
        let a = saved.input(0)?;
        let weights = (1..=d.groups)
            .map(|slot| saved.input(slot))
            .collect::<Result<Vec<_>>>()?;
        let da = cx
            .needs_grad(0)
            .then(|| cx.alloc_grad_overwritten(0, a.shape(), a.dtype()))
            .transpose()?;
        let mut dbs = Vec::with_capacity(d.groups);
        for (g, b) in weights.iter().enumerate() {
            dbs.push(
                cx.needs_grad(g + 1)
                    .then(|| cx.alloc_grad_overwritten(g + 1, b.shape(), b.dtype()))
                    .transpose()?,
            );
        }
        // As MatMul: dA and dB side by side on halves of the threads when both are needed
        // (each gemm's result does not depend on the split, this only keeps cores busy).
        let threads = cx.threads();
        let side_by_side = da.is_some() && dbs.iter().any(Option::is_some) && threads >= 2;
        let (par_a, par_b) = if side_by_side {
            (parallelism(threads / 2), parallelism(threads - threads / 2))
        } else {
            (cx.gemm_parallelism(), cx.gemm_parallelism())
        };
        float_dispatch!(a.dtype(), cx.node_name(), T => {
            let (ar, gr) = (a.read(), g.read());
            let (av, gv) = (ar.as_slice::<T>()?, gr.as_slice::<T>()?);
            let brs: Vec<_> = weights.iter().map(|b| b.read()).collect();
            let bvs = brs.iter().map(|b| b.as_slice::<T>()).collect::<Result<Vec<_>>>()?;
            let mut wa = da.as_ref().map(Tensor::write);
            let dav = match wa.as_mut() { Some(w) => Some(w.as_mut_slice::<T>()?), None => None };
            let mut wbs: Vec<_> = dbs.iter().map(|t| t.as_ref().map(Tensor::write)).collect();
            let mut dbvs = Vec::with_capacity(wbs.len());
            for w in wbs.iter_mut() {
                dbvs.push(match w.as_mut() { Some(w) => Some(w.as_mut_slice::<T>()?), None => None });
            }
            let run_a = || dav.map_or(Ok(()), |dav| grad_a(&d, dav, gv, &bvs, par_a));
            let run_b = || grad_b(&d, dbvs, av, gv, par_b);
            if side_by_side {
                let (ra, rb) = rayon::join(run_a, run_b);
                ra.and(rb)
            } else {
                run_a().and_then(|()| run_b())
            }
        })?;
        let mut grads = vec![da];
        grads.extend(dbs);
        Ok(grads)
    }
}

/// `dA_g = dY_g * B_g^T`, one gemm per group.
fn grad_a<T: Element>(
    d: &Dims,
    dav: &mut [T],
    gv: &[T],
    bvs: &[&[T]],
    par: gemm::Parallelism,
) -> Result<()> {
    let (a_len, g_len) = (d.rows * d.k, d.rows * d.n);
    for (g, bv) in bvs.iter().enumerate() {
        let gm = MatRef::new(&gv[g * g_len..][..g_len], d.rows, d.n);
        let bt = MatRef::transposed(bv, d.n, d.k);
        matmul_into(&mut dav[g * a_len..][..a_len], gm, bt, false, par)?;
    }
    Ok(())
}

/// `dB_g = A_g^T * dY_g`: one gemm over all of the group's rows.
fn grad_b<T: Element>(
    d: &Dims,
    dbvs: Vec<Option<&mut [T]>>,
    av: &[T],
    gv: &[T],
    par: gemm::Parallelism,
) -> Result<()> {
    let (a_len, g_len) = (d.rows * d.k, d.rows * d.n);
    for (g, dbv) in dbvs.into_iter().enumerate() {
        let Some(dbv) = dbv else { continue };
        let at = MatRef::transposed(&av[g * a_len..][..a_len], d.k, d.rows);
        let gm = MatRef::new(&gv[g * g_len..][..g_len], d.rows, d.n);
        matmul_into(dbv, at, gm, false, par)?;
    }
    Ok(())
}

impl Graph {
    /// `a[G, ..., k] x weights[g] [k, n]` per group `g`: output `[G, ..., n]`.
    pub fn grouped_matmul(&mut self, a: NodeId, weights: &[NodeId]) -> Result<NodeId> {
        let mut inputs = vec![a];
        inputs.extend_from_slice(weights);
        self.apply(GroupedMatMul, &inputs)
    }
}
