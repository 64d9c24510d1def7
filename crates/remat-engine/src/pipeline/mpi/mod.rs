//! Pipeline stages as MPI processes (cargo feature `mpi`, rsmpi on the system's MPI).
//!
//! `mpirun -n S*R` starts `S * R` ranks: rank `r` runs stage `r % S` of pipeline replica
//! `r / S`. Each rank joins two communicators split from the world: its replica's pipeline
//! (rank = stage), over which [`MpiTransport`] moves activations and gradients, and its
//! stage's replicas (rank = replica), over which gradients are all-reduced in replica order
//! so that every replica ends with the same bits whatever the timing.

pub mod activity;
pub mod transport;

use mpi::environment::Universe;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;

pub use transport::{MpiTransport, Traffic};

use super::wire::{Wire, WireError};
use crate::core::error::EngineError;
use crate::core::tensor::Tensor;

/// Where this rank sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub rank: usize,
    pub world: usize,
    pub stages: usize,
    pub replicas: usize,
    pub stage: usize,
    pub replica: usize,
}

impl Layout {
    /// Rank `rank` of a world of `world` ranks running `stages`-stage pipelines.
    pub fn new(world: usize, rank: usize, stages: usize) -> Result<Self, MpiError> {
        if stages == 0 || !world.is_multiple_of(stages) || rank >= world {
            return Err(MpiError::WorldSize { world, stages });
        }
        Ok(Self {
            rank,
            world,
            stages,
            replicas: world / stages,
            stage: rank % stages,
            replica: rank / stages,
        })
    }

    /// The world rank of stage `stage` of replica `replica`.
    pub fn rank_of(&self, stage: usize, replica: usize) -> usize {
        replica * self.stages + stage
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MpiError {
    #[error("MPI could not be initialised (it was initialised already in this process)")]
    Init,
    #[error(
        "{world} MPI ranks cannot run {stages}-stage pipelines: the number of ranks (mpirun -n) \
         must be the stages times the data-parallel replicas"
    )]
    WorldSize { world: usize, stages: usize },
    #[error("rank {rank} sent an unreadable {what}: {error}")]
    Wire {
        rank: usize,
        what: &'static str,
        error: WireError,
    },
    #[error(
        "stage {stage}: replica {replica} holds {got} gradient values where this replica holds {expected}"
    )]
    GradientSize {
        stage: usize,
        replica: usize,
        got: usize,
        expected: usize,
    },
    #[error("stage {stage}: {error}")]
    Engine { stage: usize, error: EngineError },
}

/// Tag of the point-to-point gathers on the world communicator (pipeline messages travel on
/// their own communicator, so the tags cannot meet).
const GATHER_TAG: i32 = 1;

/// This process's place in an MPI run and its communicators.
pub struct MpiWorld {
    // Declared before the universe: dropped (freed) before MPI is finalised.
    pipeline: SimpleCommunicator,
    replicas: SimpleCommunicator,
    world: SimpleCommunicator,
    layout: Layout,
    _universe: Universe,
}

impl MpiWorld {
    /// Initialises MPI (only the main thread calls it; the stage's kernel threads never do)
    /// and splits the world into pipelines of `stages` ranks.
    pub fn init(stages: usize) -> Result<Self, MpiError> {
        let (universe, _) =
            mpi::initialize_with_threading(mpi::Threading::Funneled).ok_or(MpiError::Init)?;
        let world = universe.world();
        let layout = Layout::new(world.size() as usize, world.rank() as usize, stages)?;
        let split = |color: usize, key: usize| {
            world
                .split_by_color_with_key(Color::with_value(color as i32), key as i32)
                .ok_or(MpiError::Init)
        };
        let pipeline = split(layout.replica, layout.stage)?;
        let replicas = split(layout.stage, layout.replica)?;
        Ok(Self {
            pipeline,
            replicas,
            world,
            layout,
            _universe: universe,
        })
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn is_root(&self) -> bool {
        self.layout.rank == 0
    }

    /// This rank's wires to its pipeline neighbours.
    pub fn transport<T: Wire>(&self) -> MpiTransport<'_, T> {
        MpiTransport::new(&self.pipeline)
    }

    /// Waits for every rank (so that the ranks start a step together and its timings compare).
    pub fn barrier(&self) {
        self.world.barrier();
    }

    /// Ends every rank of the run with exit code `code` (after this rank reported why).
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    /// Sums `grads` over this stage's replicas, in replica order 0, 1, ..., on every replica:
    /// each rank gathers all replicas' values and adds them in the same order, so all end
    /// with the same bits, whichever replica finished first.
    pub fn all_reduce_grads(&self, grads: &[Tensor]) -> Result<(), MpiError> {
        if self.layout.replicas == 1 {
            return Ok(());
        }
        let stage = self.layout.stage;
        let engine = |error| MpiError::Engine { stage, error };
        let mut local = Vec::new();
        for g in grads {
            local.extend(g.to_vec::<f32>().map_err(engine)?);
        }
        let n = local.len();
        let mut sizes = vec![0u64; self.layout.replicas];
        self.replicas.all_gather_into(&(n as u64), &mut sizes[..]);
        if let Some((replica, &got)) = sizes.iter().enumerate().find(|&(_, &s)| s != n as u64) {
            return Err(MpiError::GradientSize {
                stage,
                replica,
                got: got as usize,
                expected: n,
            });
        }
        let mut all = vec![0f32; n * self.layout.replicas];
        self.replicas.all_gather_into(&local[..], &mut all[..]);
        let mut sum = all[..n].to_vec();
        for replica in all.chunks_exact(n.max(1)).skip(1) {
            for (acc, v) in sum.iter_mut().zip(replica) {
                *acc += *v;
            }
        }
        let mut offset = 0;
        for g in grads {
            let len = g.numel();
            let mut w = g.write();
            w.as_mut_slice::<f32>()
                .map_err(engine)?
                .copy_from_slice(&sum[offset..offset + len]);
            offset += len;
        }
        Ok(())
    }

    /// Gathers one value from every rank to rank 0, in rank order (`None` on other ranks).
    pub fn gather<T: Wire>(
        &self,
        value: &T,
        what: &'static str,
    ) -> Result<Option<Vec<T>>, MpiError> {
        let mut bytes = Vec::new();
        value.encode(&mut bytes);
        if !self.is_root() {
            self.world
                .process_at_rank(0)
                .send_with_tag(&bytes[..], GATHER_TAG);
            return Ok(None);
        }
        let decode = |rank, bytes: &[u8]| {
            T::decode(bytes).map_err(|error| MpiError::Wire { rank, what, error })
        };
        let mut out = vec![decode(0, &bytes)?];
        for rank in 1..self.layout.world {
            let (bytes, _) = self
                .world
                .process_at_rank(rank as i32)
                .receive_vec_with_tag::<u8>(GATHER_TAG);
            out.push(decode(rank, &bytes)?);
        }
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_map_to_stage_and_replica() {
        let l = Layout::new(6, 4, 2).unwrap();
        assert_eq!((l.stage, l.replica, l.replicas), (0, 2, 3));
        assert_eq!(l.rank_of(1, 2), 5);
        let err = Layout::new(5, 0, 2).unwrap_err();
        assert_eq!(
            err.to_string(),
            "5 MPI ranks cannot run 2-stage pipelines: the number of ranks (mpirun -n) must be \
             the stages times the data-parallel replicas"
        );
    }
}
