//! remat-report: what the front ends print, in one place. The `remat` command and its
//! benchmarks (`remat-bench`) both print comparison tables and byte sizes; with one printer
//! for each, a table looks the same whichever command prints it, and a benchmark never
//! reaches into a command for its printing.
//!
//! - [`table`]: one table printer, in the three layouts remat prints.
//! - [`bytes`]: byte sizes as the reports show them.

pub mod bytes;
pub mod table;

pub use bytes::{format_bytes, human_bytes};
pub use table::{Layout, print_table, render};
