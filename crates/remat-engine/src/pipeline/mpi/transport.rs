//! [`MpiTransport`]: activations forward and gradients backward between neighbouring ranks
//! of one pipeline communicator (rank = stage).
//!
//! Sends are non-blocking (`MPI_Isend`): the encoded message is owned by a pending-send
//! record until MPI reports it delivered, so a stage goes on computing while its previous
//! output travels. Receives take whatever the neighbour sent next (MPI keeps the order of
//! messages between two ranks) and check its tag, micro-batch and direction against what the
//! schedule expects, as [`super::super::ChannelTransport`] does.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::os::raw::c_void;
use std::time::Duration;

use mpi::datatype::Equivalence;
use mpi::ffi;
use mpi::point_to_point::{MatchedReceiveVec, Message, Source, Status};
use mpi::raw::AsRaw;
use mpi::topology::{Communicator, SimpleCommunicator};

use super::super::transport::{Direction, Transport, TransportError};
use super::super::wire::Wire;
use super::activity::{self, Activity};

/// The tag of micro-batch `micro_batch`'s message in `direction`.
pub fn tag(direction: Direction, micro_batch: usize) -> Option<i32> {
    let dir = match direction {
        Direction::Forward => 0,
        Direction::Backward => 1,
    };
    i32::try_from(micro_batch.checked_mul(2)?.checked_add(dir)?).ok()
}

fn untag(tag: i32) -> (Direction, usize) {
    let direction = match tag % 2 {
        0 => Direction::Forward,
        _ => Direction::Backward,
    };
    (direction, (tag / 2) as usize)
}

/// Bytes this transport has sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Tensor data of the activations sent forward.
    pub activation_bytes: u64,
    /// Tensor data of the gradients sent backward.
    pub gradient_bytes: u64,
    /// Everything on the wire, framing (shapes, random-stream offsets) included.
    pub wire_bytes: u64,
    pub messages: u64,
}

/// A message handed to `MPI_Isend`, kept alive until it is delivered.
struct PendingSend {
    request: ffi::MPI_Request,
    /// Read by MPI through the raw pointer given to `MPI_Isend`: must not be freed or moved
    /// (a `Vec`'s heap buffer does not move when the `Vec` does) before the request ends.
    _buffer: Vec<u8>,
}

/// One rank's wires to its pipeline neighbours.
pub struct MpiTransport<'c, T> {
    comm: &'c SimpleCommunicator,
    stage: usize,
    stages: usize,
    pending: RefCell<Vec<PendingSend>>,
    traffic: Cell<Traffic>,
    _message: PhantomData<fn(T) -> T>,
}

impl<'c, T: Wire> MpiTransport<'c, T> {
    /// The transport of this rank of `comm`, a pipeline communicator whose rank `s` runs
    /// stage `s`.
    pub fn new(comm: &'c SimpleCommunicator) -> Self {
        Self {
            comm,
            stage: comm.rank() as usize,
            stages: comm.size() as usize,
            pending: RefCell::new(Vec::new()),
            traffic: Cell::new(Traffic::default()),
            _message: PhantomData,
        }
    }

    pub fn traffic(&self) -> Traffic {
        self.traffic.get()
    }

    pub fn reset_traffic(&self) {
        self.traffic.set(Traffic::default());
    }

    /// Waits until every message sent so far has been delivered (the end of a step).
    pub fn flush(&self) {
        for mut p in self.pending.borrow_mut().drain(..) {
            // SAFETY: the request came from MPI_Isend and its buffer is alive in `p`.
            unsafe {
                ffi::MPI_Wait(&mut p.request, ffi::RSMPI_STATUS_IGNORE);
            }
        }
    }

    /// Lets MPI finish sends in the background and frees the buffers of delivered ones.
    fn progress(&self) {
        self.pending.borrow_mut().retain_mut(|p| {
            let mut done = 0;
            // SAFETY: as in `flush`; MPI_Test frees a completed request.
            unsafe {
                ffi::MPI_Test(&mut p.request, &mut done, ffi::RSMPI_STATUS_IGNORE);
            }
            done == 0
        });
    }

    fn neighbour(&self, direction: Direction, sending: bool) -> Option<usize> {
        // Activations go up the pipeline, gradients down.
        let up = matches!(
            (direction, sending),
            (Direction::Forward, true) | (Direction::Backward, false)
        );
        match up {
            true => Some(self.stage + 1).filter(|&s| s < self.stages),
            false => self.stage.checked_sub(1),
        }
    }

    fn send(
        &self,
        direction: Direction,
        micro_batch: usize,
        value: T,
    ) -> Result<(), TransportError> {
        let peer = self
            .neighbour(direction, true)
            .ok_or(TransportError::NoNeighbour {
                stage: self.stage,
                direction,
            })?;
        let corrupt = |detail: String| TransportError::Corrupt {
            stage: self.stage,
            peer,
            direction,
            micro_batch,
            detail,
        };
        let tag = tag(direction, micro_batch)
            .ok_or_else(|| corrupt(format!("micro-batch {micro_batch} has no MPI tag")))?;
        let mut buffer = Vec::new();
        value.encode(&mut buffer);
        let count = i32::try_from(buffer.len())
            .map_err(|_| corrupt(format!("{} bytes exceed one MPI message", buffer.len())))?;
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `buffer` outlives the request (it moves into `pending` with it and is only
        // dropped after MPI_Test or MPI_Wait reports the send complete).
        unsafe {
            ffi::MPI_Isend(
                buffer.as_ptr() as *const c_void,
                count,
                u8::equivalent_datatype().as_raw(),
                peer as i32,
                tag,
                self.comm.as_raw(),
                &mut request,
            );
        }
        let mut t = self.traffic.get();
        match direction {
            Direction::Forward => t.activation_bytes += value.payload_bytes() as u64,
            Direction::Backward => t.gradient_bytes += value.payload_bytes() as u64,
        }
        t.wire_bytes += buffer.len() as u64;
        t.messages += 1;
        self.traffic.set(t);
        self.pending.borrow_mut().push(PendingSend {
            request,
            _buffer: buffer,
        });
        self.progress();
        Ok(())
    }

    fn recv(&self, direction: Direction, expected: usize) -> Result<T, TransportError> {
        let peer = self
            .neighbour(direction, false)
            .ok_or(TransportError::NoNeighbour {
                stage: self.stage,
                direction,
            })?;
        activity::set(Activity::Waiting {
            stage: self.stage,
            peer,
            direction,
            micro_batch: expected,
        });
        let message = self.wait_for(peer);
        let (bytes, status) = message.matched_receive_vec::<u8>();
        let (got_direction, received) = untag(status.tag());
        let corrupt = |detail: String| TransportError::Corrupt {
            stage: self.stage,
            peer,
            direction,
            micro_batch: expected,
            detail,
        };
        if got_direction != direction {
            return Err(corrupt(format!(
                "a {got_direction} of micro-batch {received} came instead"
            )));
        }
        if received != expected {
            return Err(TransportError::OutOfOrder {
                stage: self.stage,
                direction,
                expected,
                received,
            });
        }
        T::decode(&bytes).map_err(|e| corrupt(e.to_string()))
    }

    /// Polls for the next message from `peer`, driving this rank's own sends meanwhile and
    /// backing off from spinning to short sleeps (ranks may share cores).
    fn wait_for(&self, peer: usize) -> (Message, Status) {
        let source = self.comm.process_at_rank(peer as i32);
        let mut idle = 0u32;
        loop {
            if let Some(probed) = source.immediate_matched_probe() {
                return probed;
            }
            self.progress();
            idle = idle.saturating_add(1);
            match idle {
                0..64 => std::thread::yield_now(),
                _ => std::thread::sleep(Duration::from_micros(100)),
            }
        }
    }
}

impl<T: Wire> Transport<T> for MpiTransport<'_, T> {
    fn stage(&self) -> usize {
        self.stage
    }

    fn send_activation(&self, micro_batch: usize, value: T) -> Result<(), TransportError> {
        self.send(Direction::Forward, micro_batch, value)
    }

    fn recv_activation(&self, micro_batch: usize) -> Result<T, TransportError> {
        self.recv(Direction::Forward, micro_batch)
    }

    fn send_gradient(&self, micro_batch: usize, value: T) -> Result<(), TransportError> {
        self.send(Direction::Backward, micro_batch, value)
    }

    fn recv_gradient(&self, micro_batch: usize) -> Result<T, TransportError> {
        self.recv(Direction::Backward, micro_batch)
    }
}

impl<T> Drop for MpiTransport<'_, T> {
    fn drop(&mut self) {
        for mut p in self.pending.get_mut().drain(..) {
            // SAFETY: as in `flush`: the buffer is freed only after the send completed.
            unsafe {
                ffi::MPI_Wait(&mut p.request, ffi::RSMPI_STATUS_IGNORE);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_encode_direction_and_micro_batch() {
        for m in [0, 1, 4095] {
            for d in [Direction::Forward, Direction::Backward] {
                assert_eq!(untag(tag(d, m).unwrap()), (d, m));
            }
        }
        assert_eq!(tag(Direction::Forward, usize::MAX), None);
    }
}
