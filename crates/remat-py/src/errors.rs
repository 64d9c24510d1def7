//! Raising the `remat.errors` exception classes from Rust errors. The classes are Python's
//! (so that `BudgetError` can be both a `RematError` and a `ValueError`); each is called
//! with the library's message and keyword attributes naming what was at fault.

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// An exception of class `class` (a name in `remat.errors`) with `message`, and `details`
/// set as attributes. Should the package itself be broken, the import error is raised.
pub fn raise(
    py: Python<'_>,
    class: &str,
    message: String,
    details: impl FnOnce(&Bound<'_, PyDict>) -> PyResult<()>,
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let cls = py.import("remat.errors")?.getattr(class)?;
        let kwargs = PyDict::new(py);
        details(&kwargs)?;
        let instance = cls.call((message,), Some(&kwargs))?;
        Ok(PyErr::from_value(instance))
    };
    build().unwrap_or_else(|e| e)
}

/// [`raise`] with no attributes.
pub fn plain(py: Python<'_>, class: &str, message: impl ToString) -> PyErr {
    raise(py, class, message.to_string(), |_| Ok(()))
}

/// `remat.ArgumentError` for a value the one reader (`remat_units`) refused: the message
/// the command prints after its flag, here after the argument's name, with `argument` and
/// `value` (the text as given) as attributes.
pub fn unit_error(py: Python<'_>, error: remat_units::UnitError) -> PyErr {
    argument_error(py, &error.field, &error.text, error.to_string())
}

/// `remat.ArgumentError` with `message`, naming the argument and the value at fault as
/// the attributes `argument` and `value`.
pub fn argument_error(py: Python<'_>, argument: &str, value: &str, message: String) -> PyErr {
    raise(py, "ArgumentError", message, |d| {
        d.set_item("argument", argument)?;
        d.set_item("value", value)
    })
}
