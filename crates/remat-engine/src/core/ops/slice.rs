//! A slice along one axis (`split` records one per piece) and its inverse, `concat`.

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

/// `[outer, axis, inner]` view of a shape.
fn split_dims(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

/// Copies band `[start, start+len)` of axis `axis` of `whole` (shape `shape`) into `part`.
fn gather_band<T: Copy>(
    part: &mut [T],
    whole: &[T],
    shape: &[usize],
    axis: usize,
    start: usize,
    len: usize,
) {
    let (outer, n, inner) = split_dims(shape, axis);
    for o in 0..outer {
        part[o * len * inner..][..len * inner]
            .copy_from_slice(&whole[(o * n + start) * inner..][..len * inner]);
    }
}

/// Copies `part` into band `[start, start+len)` of axis `axis` of `whole` (shape `shape`).
fn scatter_band<T: Copy>(
    whole: &mut [T],
    part: &[T],
    shape: &[usize],
    axis: usize,
    start: usize,
    len: usize,
) {
    let (outer, n, inner) = split_dims(shape, axis);
    for o in 0..outer {
        whole[(o * n + start) * inner..][..len * inner]
            .copy_from_slice(&part[o * len * inner..][..len * inner]);
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Slice {
    pub axis: usize,
    pub start: usize,
    pub len: usize,
}

impl Op for Slice {
    fn kind(&self) -> &'static str {
        "slice"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        let [x] = inputs else {
            return Err("slice takes 1 input".into());
        };
        if self.axis >= x.len() || self.start + self.len > x[self.axis] {
            return Err(format!(
                "slice {}..{} of axis {} is outside {x:?}",
                self.start,
                self.start + self.len,
                self.axis
            ));
        }
        let mut s = x.to_vec();
        s[self.axis] = self.len;
        Ok(s)
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let x = inputs[0];
        let shape = self
            .output_shape(&[x.shape()])
            .map_err(|m| cx.shape_error(m))?;
        let out = cx.alloc_output(&shape, x.dtype())?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let xr = x.read();
            let mut w = out.write();
            gather_band(w.as_mut_slice::<T>()?, xr.as_slice::<T>()?, x.shape(), self.axis, self.start, self.len);
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
        cx.single_grad(|cx| {
            let shape = saved.input_shapes[0];
            let dx = cx.alloc_grad(0, shape, g.dtype())?;
            float_dispatch!(g.dtype(), cx.node_name(), T => {
                let gr = g.read();
                let mut w = dx.write();
                scatter_band(w.as_mut_slice::<T>()?, gr.as_slice::<T>()?, shape, self.axis, self.start, self.len);
                Ok::<(), crate::EngineError>(())
            })?;
            Ok(dx)
        })
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Concat {
    pub axis: usize,
}

impl Op for Concat {
    fn kind(&self) -> &'static str {
        "concat"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        let Some(first) = inputs.first() else {
            return Err("concat needs at least 1 input".into());
        };
        if self.axis >= first.len() {
            return Err(format!("axis {} is outside {first:?}", self.axis));
        }
        let mut out = first.to_vec();
        out[self.axis] = 0;
        for s in inputs {
            let same_rank = s.len() == first.len();
            if !same_rank
                || s.iter()
                    .enumerate()
                    .any(|(d, &v)| d != self.axis && v != first[d])
            {
                return Err(format!(
                    "concat along axis {}: {s:?} does not match {first:?}",
                    self.axis
                ));
            }
            out[self.axis] += s[self.axis];
        }
        Ok(out)
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape()).collect();
        let shape = self.output_shape(&shapes).map_err(|m| cx.shape_error(m))?;
        let out = cx.alloc_output(&shape, inputs[0].dtype())?;
        float_dispatch!(inputs[0].dtype(), cx.node_name(), T => {
            let mut w = out.write();
            let ov = w.as_mut_slice::<T>()?;
            let mut start = 0;
            for t in inputs {
                let tr = t.read();
                let len = t.shape()[self.axis];
                scatter_band(ov, tr.as_slice::<T>()?, &shape, self.axis, start, len);
                start += len;
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
        let mut grads = Vec::with_capacity(saved.input_shapes.len());
        let mut start = 0;
        for (slot, shape) in saved.input_shapes.iter().enumerate() {
            let len = shape[self.axis];
            if cx.needs_grad(slot) {
                let d = cx.alloc_grad(slot, shape, g.dtype())?;
                float_dispatch!(g.dtype(), cx.node_name(), T => {
                    let gr = g.read();
                    let mut w = d.write();
                    gather_band(w.as_mut_slice::<T>()?, gr.as_slice::<T>()?, g.shape(), self.axis, start, len);
                    Ok::<(), crate::EngineError>(())
                })?;
                grads.push(Some(d));
            } else {
                grads.push(None);
            }
            start += len;
        }
        Ok(grads)
    }
}

impl Graph {
    /// Rows `start..start+len` of axis `axis`.
    pub fn slice(&mut self, x: NodeId, axis: usize, start: usize, len: usize) -> Result<NodeId> {
        self.apply(Slice { axis, start, len }, &[x])
    }

    /// Splits axis `axis` into consecutive pieces of the given sizes (one node each).
    pub fn split(&mut self, x: NodeId, axis: usize, sizes: &[usize]) -> Result<Vec<NodeId>> {
        let mut start = 0;
        let mut out = Vec::with_capacity(sizes.len());
        for &len in sizes {
            out.push(self.slice(x, axis, start, len)?);
            start += len;
        }
        Ok(out)
    }

    /// Joins tensors along axis `axis`.
    pub fn concat(&mut self, xs: &[NodeId], axis: usize) -> Result<NodeId> {
        self.apply(Concat { axis }, xs)
    }
}
