//! `remat bench reshard`.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`remat bench reshard` is not built yet")
}
