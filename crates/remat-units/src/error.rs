//! The one error of this crate: which field, which text, and what is wrong with it.

use std::fmt;

use thiserror::Error;

use crate::print::human_bytes;

/// The least budget in bytes a front end takes where it budgets a training step: no step
/// of any model fits in less, so a smaller count is a slip (`memory_budget=1` meant `1.0`
/// or `1GiB`). See [`crate::Budget::check_step`].
pub const MIN_STEP_BUDGET: u64 = 1 << 10;

/// [`MIN_STEP_BUDGET`] as messages say it.
pub const MIN_STEP_BUDGET_TEXT: &str = "1 KiB";

/// `{n} {one}` or `{n} {many}`: `1 byte`, `2 bytes`, `0 files`.
pub fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The units a size may carry, as error messages list them.
pub const UNITS: &str = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB";

/// What kind of value a field takes: it decides what an empty value is told to give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Size,
    Budget,
    Bandwidth,
    Count,
    Seconds,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Size => "bytes, e.g. 256MiB or 1e9",
            Kind::Budget => "bytes (8GiB) or a fraction of the reference peak (0.7)",
            Kind::Bandwidth => "bytes per second, e.g. 32GB/s",
            Kind::Count => "a whole number, e.g. 4",
            Kind::Seconds => "a number of seconds, e.g. 0.5",
        })
    }
}

/// What is wrong with a text, without naming where it came from (see [`UnitError`]).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Problem {
    #[error("an empty value; give {0}")]
    Empty(Kind),
    #[error(
        "not a number (expected digits with an optional decimal point and exponent, e.g. 0.7, 1234, 1e9)"
    )]
    NotANumber,
    #[error("not a size: give a number with an optional unit ({UNITS}), e.g. 8GiB or 1e9")]
    NotASize,
    #[error("the value is negative; give a number of bytes")]
    Negative,
    #[error("the value is negative; give {0}")]
    NegativeOf(Kind),
    #[error("not a whole number; give {0}")]
    NotAWholeNumber(Kind),
    #[error("must be at least {0}")]
    TooFew(u64),
    #[error("out of range: more than 2^64 - 1")]
    OutOfRange,
    #[error("must be more than 0 seconds and at most {0}")]
    SecondsRange(u64),
    #[error("too many digits")]
    TooManyDigits,
    #[error("unknown unit `{0}` (use {UNITS}, in any case)")]
    UnknownUnit(String),
    #[error("out of range: more than 2^64 - 1 bytes")]
    TooLarge,
    #[error("comes to 0 bytes, which holds nothing; give a size (8GiB) or a fraction (0.5)")]
    ZeroBudget,
    #[error(
        "{} cannot hold a training step (a budget in bytes is at least {MIN_STEP_BUDGET_TEXT}); did you mean a fraction (1.0) or a size (1GiB)?",
        plural(*.0, "byte", "bytes")
    )]
    TinyBudget(u64),
    #[error("comes to 0 bytes, which holds nothing; give at least 1 byte, e.g. 256MiB")]
    ZeroSize,
    #[error("a fraction must be in (0, 1]; give bytes with a unit (8GiB) or an integer")]
    FractionRange,
    #[error("a fraction has at most 19 digits after the point")]
    FractionDigits,
    #[error(
        "{fraction} of {reference} ({}) is less than one byte",
        human_bytes(*reference_bytes)
    )]
    BelowOneByte {
        fraction: String,
        reference: String,
        reference_bytes: u64,
    },
    #[error("a fraction needs a reference peak, and {0}; give bytes with a unit, e.g. 256MiB")]
    NoReference(String),
    #[error(
        "comes to 0 bytes per second; the bandwidth is in bytes per second (32GB/s, 16GiB/s, 1e9) and must be at least 1 B/s"
    )]
    ZeroBandwidth,
}

/// A size, budget or bandwidth that cannot be used: `{field} {text}: {problem}`, e.g.
/// `--budget 7x: unknown unit `x` (...)` (the text left out when it is empty, the field
/// when none is given).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("{}", located(.field, .text, .problem))]
pub struct UnitError {
    /// The flag, argument or field the text came from (`--budget`, `max_buffer`).
    pub field: String,
    /// The text as given, trimmed.
    pub text: String,
    pub problem: Problem,
}

impl UnitError {
    pub(crate) fn new(field: &str, text: &str, problem: Problem) -> UnitError {
        UnitError {
            field: field.to_string(),
            text: text.trim().to_string(),
            problem,
        }
    }
}

/// `{field} {text}: {problem}`, leaving out what is empty.
fn located(field: &str, text: &str, problem: &Problem) -> String {
    let what = [field, text]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    if what.is_empty() {
        problem.to_string()
    } else {
        format!("{what}: {problem}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_field_and_the_text_and_skip_what_is_empty() {
        let e = |field, text| UnitError::new(field, text, Problem::Negative).to_string();
        assert_eq!(
            e("--budget", " -3 "),
            "--budget -3: the value is negative; give a number of bytes"
        );
        assert_eq!(
            UnitError::new("budget", "", Problem::Empty(Kind::Budget)).to_string(),
            "budget: an empty value; give bytes (8GiB) or a fraction of the reference peak (0.7)"
        );
        assert_eq!(
            e("", "-3"),
            "-3: the value is negative; give a number of bytes"
        );
    }
}
