//! Pointwise activations as graph ops: SiLU, GELU (tanh form) and SwiGLU.

use crate::core::error::Result;
use crate::core::graph::{Graph, NodeId};
use crate::core::kernels::{self, KernelError};
use crate::core::op::{Op, OpCtx, OpOutput, Saved};
use crate::core::tensor::Tensor;
use crate::float_dispatch;

type Unary<T> = fn(&[T], &mut [T]) -> Result<(), KernelError>;
type UnaryGrad<T> = fn(&[T], &[T], &mut [T]) -> Result<(), KernelError>;

/// Which pointwise function a [`Pointwise`] op applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)`.
    Silu,
    /// `x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, PyTorch's `approximate="tanh"`.
    Gelu,
}

impl Activation {
    fn kernels<T: kernels::Float>(self) -> (Unary<T>, UnaryGrad<T>) {
        match self {
            Activation::Silu => (kernels::silu_forward::<T>, kernels::silu_backward::<T>),
            Activation::Gelu => (kernels::gelu_forward::<T>, kernels::gelu_backward::<T>),
        }
    }
}

/// A one-input activation; backward reads the input.
#[derive(Debug, Clone, Copy)]
pub struct Pointwise(pub Activation);

impl Op for Pointwise {
    fn kind(&self) -> &'static str {
        match self.0 {
            Activation::Silu => "silu",
            Activation::Gelu => "gelu",
        }
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [x] => Ok(x.to_vec()),
            _ => Err(format!("{} takes 1 input", self.kind())),
        }
    }

    fn saves_input(&self, _slot: usize) -> bool {
        true
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let x = inputs[0];
        let out = cx.alloc_output(x.shape(), x.dtype())?;
        float_dispatch!(x.dtype(), cx.node_name(), T => {
            let (f, _) = self.0.kernels::<T>();
            f(x.read().as_slice::<T>()?, out.write().as_mut_slice::<T>()?).map_err(|e| e.at(cx.node_name()))
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
            let x = saved.input(0)?;
            let dx = cx.alloc_grad(0, x.shape(), x.dtype())?;
            float_dispatch!(x.dtype(), cx.node_name(), T => {
                let (_, df) = self.0.kernels::<T>();
                let (xr, gr) = (x.read(), g.read());
                df(xr.as_slice::<T>()?, gr.as_slice::<T>()?, dx.write().as_mut_slice::<T>()?).map_err(|e| e.at(cx.node_name()))
            })?;
            Ok(dx)
        })
    }
}

/// SwiGLU: `silu(gate) * up` (two inputs of one shape); backward reads both.
#[derive(Debug, Clone, Copy, Default)]
pub struct SwiGlu;

impl Op for SwiGlu {
    fn kind(&self) -> &'static str {
        "swiglu"
    }

    fn output_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [a, b] if a == b => Ok(a.to_vec()),
            [a, b] => Err(format!("swiglu gate {a:?} and up {b:?} differ in shape")),
            _ => Err("swiglu takes 2 inputs (gate, up)".into()),
        }
    }

    fn saves_input(&self, _slot: usize) -> bool {
        true
    }

    fn forward(&self, cx: &mut OpCtx<'_>, inputs: &[&Tensor]) -> Result<OpOutput> {
        let (gate, up) = (inputs[0], inputs[1]);
        // The kernel writes every element.
        let out = cx.alloc_output_overwritten(gate.shape(), gate.dtype())?;
        float_dispatch!(gate.dtype(), cx.node_name(), T => {
            let (gr, ur) = (gate.read(), up.read());
            kernels::swiglu_forward(gr.as_slice::<T>()?, ur.as_slice::<T>()?, out.write().as_mut_slice::<T>()?)
                .map_err(|e| e.at(cx.node_name()))
        })?;
        Ok(out.into())
    }

    fn backward(
        &self,
        cx: &mut OpCtx<'_>,
        saved: &Saved<'_>,
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let (gate, up) = (saved.input(0)?, saved.input(1)?);
        // The kernel writes every element of both.
        let (shape, dtype) = (gate.shape(), gate.dtype());
        let dgate = cx.alloc_grad_or_scratch(0, shape, dtype)?;
        let dup = cx.alloc_grad_or_scratch(1, shape, dtype)?;
        float_dispatch!(gate.dtype(), cx.node_name(), T => {
            let (gr, ur, dr) = (gate.read(), up.read(), g.read());
            let (mut dg, mut du) = (dgate.write(), dup.write());
            kernels::swiglu_backward(
                gr.as_slice::<T>()?, ur.as_slice::<T>()?, dr.as_slice::<T>()?,
                dg.as_mut_slice::<T>()?, du.as_mut_slice::<T>()?,
            )
            .map_err(|e| e.at(cx.node_name()))
        })?;
        Ok(vec![
            cx.needs_grad(0).then_some(dgate),
            cx.needs_grad(1).then_some(dup),
        ])
    }
}

impl Graph {
    /// `x * sigmoid(x)`.
    pub fn silu(&mut self, x: NodeId) -> Result<NodeId> {
        self.apply(Pointwise(Activation::Silu), &[x])
    }

    /// GELU, tanh approximation.
    pub fn gelu(&mut self, x: NodeId) -> Result<NodeId> {
        self.apply(Pointwise(Activation::Gelu), &[x])
    }

    /// `silu(gate) * up`.
    pub fn swiglu(&mut self, gate: NodeId, up: NodeId) -> Result<NodeId> {
        self.apply(SwiGlu, &[gate, up])
    }
}

#[cfg(test)]
mod tests {
    use crate::core::gradcheck::{CheckInput, Tolerance, check_op};

    #[test]
    fn silu_and_gelu_gradients() {
        let x = CheckInput::random("x", &[3, 4], 1);
        check_op(
            |g, i| g.silu(i[0]),
            std::slice::from_ref(&x),
            Tolerance::default(),
        )
        .unwrap();
        check_op(|g, i| g.gelu(i[0]), &[x], Tolerance::default()).unwrap();
    }

    #[test]
    fn swiglu_gradient() {
        let gate = CheckInput::random("gate", &[2, 5], 1);
        let up = CheckInput::random("up", &[2, 5], 2);
        check_op(
            |g, i| g.swiglu(i[0], i[1]),
            &[gate, up],
            Tolerance::default(),
        )
        .unwrap();
    }
}
