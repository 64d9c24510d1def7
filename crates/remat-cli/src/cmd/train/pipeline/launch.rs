//! Whether `remat train --stages` was started by an MPI launcher (`mpirun`, `mpiexec`,
//! `srun`), read from the environment the launcher gives each rank, before MPI itself is
//! initialised: a plain `remat train --stages P` never touches MPI.

/// This rank's place as the launcher announced it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub rank: usize,
    pub size: usize,
}

/// (size, rank) variables: Open MPI's, then the PMI ones of MPICH's Hydra and Slurm.
const LAUNCHER_VARS: [(&str, &str); 2] = [
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("PMI_SIZE", "PMI_RANK"),
];

pub const NOT_BUILT: &str = "remat was started by an MPI launcher but built without MPI support: \
    rebuild with `cargo build --release -p remat-cli --features mpi` (needs libopenmpi-dev), or run \
    `remat train --stages P` without mpirun to run the stages as threads";

fn from_env() -> Option<Launch> {
    LAUNCHER_VARS.iter().find_map(|(size, rank)| {
        let read = |name: &str| std::env::var(name).ok()?.trim().parse::<usize>().ok();
        Some(Launch {
            size: read(size)?,
            rank: read(rank)?,
        })
    })
}

/// The launch, if an MPI launcher started this process. Without the `mpi` feature a launch
/// of more than one rank is an error (each rank would train the whole pipeline alone).
pub fn detect() -> anyhow::Result<Option<Launch>> {
    let launch = from_env();
    if cfg!(feature = "mpi") {
        return Ok(launch);
    }
    match launch {
        Some(l) if l.size > 1 => anyhow::bail!(NOT_BUILT),
        _ => Ok(None),
    }
}
