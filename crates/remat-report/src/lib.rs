//! remat-report: the front ends' one table printer. The `remat` command and its benchmarks
//! (`remat-bench`) both print comparison tables; with one printer, a table looks the same
//! whichever command prints it, and a benchmark never reaches into a command for its
//! printing. Byte sizes in the cells are `remat_units`' (`human_bytes`).
//!
//! - [`table`]: one table printer, in the four layouts remat prints.

pub mod table;

pub use table::{Layout, print_table, render};
