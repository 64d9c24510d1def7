//! A bad flag or value: what the command cannot use as given (a zero budget, an unknown
//! order, two flags that exclude each other). `remat` exits with status 2 for it, as clap
//! does for its own usage errors, and 1 for a command that failed while it worked (a file
//! that cannot be read, a budget no plan fits), so scripts can tell "fix the command line"
//! from "the run failed". Every command checks its flags before it prints anything.
//!
//! Value errors read `{flag} {value}: {what is wrong}` from every front end (clap's value
//! parsers' errors are reworded to it in `main`); a [`remat_units::UnitError`] anywhere in
//! an error's chain is a usage error too.

use std::fmt;

/// A usage error with its message (naming the flag or flags).
#[derive(Debug)]
pub struct Usage(pub String);

impl fmt::Display for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// What `--help` says of the exit status, for `remat` and every command.
pub const EXIT_STATUS: &str = "Exit status: 0 done; 1 the command failed while it worked (a file it cannot read or write, a budget no plan fits, a run out of memory); 2 a bad flag or value, told before anything runs, as `{flag} {value}: {what is wrong}`.";

/// The line after every usage error, as clap ends its own.
pub const HINT: &str = "For more information, try '--help'.";

/// The process status for bad flags and values.
pub const EXIT_USAGE: u8 = 2;

/// `anyhow::bail!` for a usage error: `return Err(usage!("--order {x}: unknown"))`.
#[macro_export]
macro_rules! usage {
    ($($arg:tt)*) => {
        anyhow::Error::new($crate::usage::Usage(format!($($arg)*)))
    };
}

/// `anyhow::ensure!` for a usage error.
pub fn ensure(ok: bool, message: &str) -> anyhow::Result<()> {
    if ok {
        Ok(())
    } else {
        Err(anyhow::Error::new(Usage(message.to_string())))
    }
}

/// `error` as a usage error, its chain's words kept (for checks whose every failure is
/// about the flags).
pub fn of(error: anyhow::Error) -> anyhow::Error {
    anyhow::Error::new(Usage(format!("{error:#}")))
}

/// Whether `error` is about the command line (status 2) rather than the run (status 1).
pub fn is_usage(error: &anyhow::Error) -> bool {
    error
        .chain()
        .any(|e| e.is::<Usage>() || e.is::<remat_units::UnitError>())
}

/// clap's error for a value its parser refused, in remat's words: `{flag} {value}:
/// {problem}` (the parser's error is the problem); `None` for clap's other errors.
pub fn reworded(error: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if error.kind() != ErrorKind::ValueValidation {
        return None;
    }
    let text = |kind| match error.get(kind) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        _ => None,
    };
    // `--max-buffer <MAX_BUFFER>`: the flag is what comes before the value's name.
    let arg = text(ContextKind::InvalidArg)?;
    let flag = arg.split_whitespace().next().unwrap_or(&arg).to_string();
    let value = text(ContextKind::InvalidValue)?;
    let problem = std::error::Error::source(error)?.to_string();
    let what: Vec<&str> = [flag.as_str(), value.trim()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    Some(format!("{}: {problem}", what.join(" ")))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[arg(long, value_parser = crate::units::buffer_arg, allow_hyphen_values = true)]
        max_buffer: Option<u64>,
        #[arg(long)]
        n: Option<u8>,
    }

    #[test]
    fn a_refused_value_reads_flag_value_problem() {
        let err = Cli::try_parse_from(["x", "--max-buffer", "0"]).expect_err("zero");
        assert_eq!(
            reworded(&err).as_deref(),
            Some(
                "--max-buffer 0: comes to 0 bytes, which holds nothing; give at least 1 byte, e.g. 256MiB"
            )
        );
        let err = Cli::try_parse_from(["x", "--max-buffer", "-1GB"]).expect_err("negative");
        assert!(
            reworded(&err)
                .expect("a value error")
                .starts_with("--max-buffer -1GB: the value is negative")
        );
        let err = Cli::try_parse_from(["x", "--bogus"]).expect_err("unknown flag");
        assert_eq!(reworded(&err), None);
    }

    #[test]
    fn usage_errors_are_told_apart_from_run_errors() {
        assert!(is_usage(&usage!("--order x: unknown")));
        let unit = remat_units::parse_size("x", "--size").expect_err("bad");
        assert!(is_usage(&anyhow::Error::new(unit).context("reading")));
        assert!(!is_usage(&anyhow::anyhow!("file.json: cannot read")));
    }
}
