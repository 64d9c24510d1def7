//! Load-time checks that a compiled plan is one the runtime can run, made before a model is
//! built so a wrong spec fails in milliseconds rather than after allocating the model.

use crate::spec::compile::{Disposition, Plan};
use crate::spec::types::Dtype;

use super::error::{RunError, RunResult};

/// Element types the runtime runs: it computes in f32, and holds integer index slots
/// (the chosen experts) as exact small integers in f32, the same four bytes as i32.
fn runnable(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::I32)
}

/// Every present slot, every block input and every parameter of `plan` has a dtype the
/// runtime can run; otherwise the error names the first one that has not.
pub fn check_dtypes(plan: &Plan) -> RunResult<()> {
    let spec = plan.spec();
    let bad = |owner: String, dtype: Dtype| RunError::UnsupportedDtype {
        block: spec.name.clone(),
        owner,
        dtype: dtype.name(),
    };
    if let Some(x) = spec.inputs.iter().find(|x| !runnable(x.dtype)) {
        return Err(bad(format!("block input `{}`", x.name), x.dtype));
    }
    if let Some(p) = spec.params.iter().find(|p| !runnable(p.dtype)) {
        return Err(bad(format!("parameter `{}`", p.name), p.dtype));
    }
    for (i, s) in spec.slots.iter().enumerate() {
        let present = plan
            .layers
            .iter()
            .any(|l| l.slots[i].disposition != Disposition::Absent);
        if present && !runnable(s.dtype) {
            return Err(bad(format!("slot `{}`", s.name), s.dtype));
        }
    }
    Ok(())
}
