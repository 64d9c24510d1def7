//! `remat bench TARGET`: each target lives in its own module `bench_TARGET.rs`.

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    target: Target,
}

#[derive(clap::Subcommand)]
enum Target {}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.target {}
}
