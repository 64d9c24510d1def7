//! Gradient arithmetic of the executor, in the engine's exact order and rounding.

use super::PlanExecError;
use crate::elementwise;
use crate::error::EngineError;
use crate::float_dispatch;
use crate::tensor::Tensor;

/// Sets every element to one (the seed of the loss gradient).
pub(crate) fn fill_ones(t: &Tensor) -> Result<(), PlanExecError> {
    float_dispatch!(t.dtype(), "backward seed", T => {
        t.write().as_mut_slice::<T>()?.fill(<T as crate::dtype::Element>::ONE);
        Ok::<(), EngineError>(())
    })?;
    Ok(())
}

/// `acc = acc + g`, element by element (`acc` first, as the engine's accumulation does).
pub(crate) fn add_in_place(acc: &Tensor, g: &Tensor, name: &str) -> Result<(), PlanExecError> {
    check_same(acc, g, name)?;
    float_dispatch!(acc.dtype(), "gradient accumulation", T => {
        let src = g.read();
        let src = src.as_slice::<T>()?;
        let mut dst = acc.write();
        elementwise::update(dst.as_mut_slice::<T>()?, src, |a: T, b: T| a + b);
        Ok::<(), EngineError>(())
    })?;
    Ok(())
}

/// Adds a contribution to a leaf's gradient buffer; the first contribution is copied bit
/// for bit (adding it to zeros would turn -0.0 into +0.0).
pub(crate) fn accumulate_into(
    buf: &Tensor,
    g: &Tensor,
    first: bool,
    name: &str,
) -> Result<(), PlanExecError> {
    if !first {
        return add_in_place(buf, g, name);
    }
    check_same(buf, g, name)?;
    float_dispatch!(buf.dtype(), "gradient copy", T => {
        let src = g.read();
        let src = src.as_slice::<T>()?;
        buf.write().as_mut_slice::<T>()?.copy_from_slice(src);
        Ok::<(), EngineError>(())
    })?;
    Ok(())
}

fn check_same(a: &Tensor, b: &Tensor, name: &str) -> Result<(), PlanExecError> {
    if a.shape() != b.shape() || a.dtype() != b.dtype() {
        return Err(EngineError::Backward {
            node: name.to_string(),
            message: format!(
                "gradient contribution {:?} {} does not match {:?} {}",
                b.shape(),
                b.dtype(),
                a.shape(),
                a.dtype()
            ),
        }
        .into());
    }
    Ok(())
}
