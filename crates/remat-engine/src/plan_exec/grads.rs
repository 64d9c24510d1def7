//! Gradient arithmetic of the executor, in the engine's exact order and rounding.

use super::PlanExecError;
use crate::core::elementwise;
use crate::core::error::EngineError;
use crate::core::tensor::Tensor;
use crate::float_dispatch;

/// Sets every element to one (the seed of the loss gradient).
pub(crate) fn fill_ones(t: &Tensor) -> Result<(), PlanExecError> {
    float_dispatch!(t.dtype(), "backward seed", T => {
        t.write().as_mut_slice::<T>()?.fill(<T as crate::core::dtype::Element>::ONE);
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
