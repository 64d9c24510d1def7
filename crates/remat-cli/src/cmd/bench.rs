//! `remat bench TARGET`: the benchmarks live in their own crate, `remat-bench`; this
//! command only hands them their flags and prints their error.

pub use remat_bench::Args;

pub fn run(args: Args) -> anyhow::Result<()> {
    Ok(remat_bench::run(args)?)
}
