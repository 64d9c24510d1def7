//! Moving activations forward and gradients backward between neighbouring stages.
//!
//! The trait is the seam for a network transport; [`ChannelTransport`] connects stages that
//! are threads of one process. Messages carry their micro-batch index and the receiver names
//! the one it expects, so a schedule bug surfaces as a typed error instead of a silently
//! wrong gradient. When a stage fails and drops its endpoints, its neighbours' receives end
//! with [`TransportError::Disconnected`] instead of waiting forever, and so on down the line.

use std::fmt;
use std::sync::mpsc::{Receiver, Sender, channel};

/// Which way a value travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Activations, from stage `s` to `s + 1`.
    Forward,
    /// Gradients of those activations, from stage `s + 1` back to `s`.
    Backward,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::Forward => "activation",
            Direction::Backward => "gradient",
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TransportError {
    #[error(
        "stage {stage} has no neighbour to exchange a {direction} with (it is an end of the pipeline)"
    )]
    NoNeighbour { stage: usize, direction: Direction },
    #[error(
        "stage {stage}: stage {peer} hung up before the {direction} of micro-batch {micro_batch} was exchanged"
    )]
    Disconnected {
        stage: usize,
        peer: usize,
        direction: Direction,
        micro_batch: usize,
    },
    #[error(
        "stage {stage}: the {direction} of micro-batch {micro_batch} from stage {peer} is unusable: {detail}"
    )]
    Corrupt {
        stage: usize,
        peer: usize,
        direction: Direction,
        micro_batch: usize,
        detail: String,
    },
    #[error(
        "stage {stage}: expected the {direction} of micro-batch {expected} but received micro-batch {received}'s"
    )]
    OutOfOrder {
        stage: usize,
        direction: Direction,
        expected: usize,
        received: usize,
    },
}

/// One stage's view of the wires to its neighbours. (Not `Send` itself: an MPI transport
/// belongs to its process's main thread; the threaded runner's channels are `Send`.)
pub trait Transport<T> {
    /// This stage's index.
    fn stage(&self) -> usize;
    /// Sends micro-batch `micro_batch`'s output activation to the next stage.
    fn send_activation(&self, micro_batch: usize, value: T) -> Result<(), TransportError>;
    /// Receives micro-batch `micro_batch`'s input activation from the previous stage.
    fn recv_activation(&self, micro_batch: usize) -> Result<T, TransportError>;
    /// Sends the gradient of micro-batch `micro_batch`'s input activation to the previous stage.
    fn send_gradient(&self, micro_batch: usize, value: T) -> Result<(), TransportError>;
    /// Receives the gradient of micro-batch `micro_batch`'s output from the next stage.
    fn recv_gradient(&self, micro_batch: usize) -> Result<T, TransportError>;
}

struct Message<T> {
    micro_batch: usize,
    value: T,
}

/// In-process channels between stage threads (unbounded, so a send never blocks).
pub struct ChannelTransport<T> {
    stage: usize,
    to_next: Option<Sender<Message<T>>>,
    from_prev: Option<Receiver<Message<T>>>,
    to_prev: Option<Sender<Message<T>>>,
    from_next: Option<Receiver<Message<T>>>,
}

impl<T: Send> ChannelTransport<T> {
    /// Endpoints for a pipeline of `stages` stages, stage 0 first.
    pub fn pipeline(stages: usize) -> Vec<Self> {
        let mut ends: Vec<Self> = (0..stages)
            .map(|stage| Self {
                stage,
                to_next: None,
                from_prev: None,
                to_prev: None,
                from_next: None,
            })
            .collect();
        for s in 1..stages {
            let (act_tx, act_rx) = channel();
            let (grad_tx, grad_rx) = channel();
            ends[s - 1].to_next = Some(act_tx);
            ends[s].from_prev = Some(act_rx);
            ends[s].to_prev = Some(grad_tx);
            ends[s - 1].from_next = Some(grad_rx);
        }
        ends
    }

    fn send(
        &self,
        wire: &Option<Sender<Message<T>>>,
        peer: Option<usize>,
        direction: Direction,
        micro_batch: usize,
        value: T,
    ) -> Result<(), TransportError> {
        let (Some(tx), Some(peer)) = (wire, peer) else {
            return Err(self.no_neighbour(direction));
        };
        tx.send(Message { micro_batch, value })
            .map_err(|_| TransportError::Disconnected {
                stage: self.stage,
                peer,
                direction,
                micro_batch,
            })
    }

    fn recv(
        &self,
        wire: &Option<Receiver<Message<T>>>,
        peer: Option<usize>,
        direction: Direction,
        expected: usize,
    ) -> Result<T, TransportError> {
        let (Some(rx), Some(peer)) = (wire, peer) else {
            return Err(self.no_neighbour(direction));
        };
        let message = rx.recv().map_err(|_| TransportError::Disconnected {
            stage: self.stage,
            peer,
            direction,
            micro_batch: expected,
        })?;
        if message.micro_batch != expected {
            return Err(TransportError::OutOfOrder {
                stage: self.stage,
                direction,
                expected,
                received: message.micro_batch,
            });
        }
        Ok(message.value)
    }

    fn no_neighbour(&self, direction: Direction) -> TransportError {
        TransportError::NoNeighbour {
            stage: self.stage,
            direction,
        }
    }

    fn prev(&self) -> Option<usize> {
        self.stage.checked_sub(1)
    }

    fn next(&self) -> Option<usize> {
        Some(self.stage + 1)
    }
}

impl<T: Send> Transport<T> for ChannelTransport<T> {
    fn stage(&self) -> usize {
        self.stage
    }

    fn send_activation(&self, micro_batch: usize, value: T) -> Result<(), TransportError> {
        self.send(
            &self.to_next,
            self.next(),
            Direction::Forward,
            micro_batch,
            value,
        )
    }

    fn recv_activation(&self, micro_batch: usize) -> Result<T, TransportError> {
        self.recv(
            &self.from_prev,
            self.prev(),
            Direction::Forward,
            micro_batch,
        )
    }

    fn send_gradient(&self, micro_batch: usize, value: T) -> Result<(), TransportError> {
        self.send(
            &self.to_prev,
            self.prev(),
            Direction::Backward,
            micro_batch,
            value,
        )
    }

    fn recv_gradient(&self, micro_batch: usize) -> Result<T, TransportError> {
        self.recv(
            &self.from_next,
            self.next(),
            Direction::Backward,
            micro_batch,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_flow_both_ways_between_threads() {
        let mut ends = ChannelTransport::<Vec<f32>>::pipeline(3);
        let last = ends.pop().unwrap();
        let middle = ends.pop().unwrap();
        let first = ends.pop().unwrap();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                for m in 0..4 {
                    let x = middle.recv_activation(m).unwrap();
                    middle
                        .send_activation(m, x.iter().map(|v| v * 2.0).collect())
                        .unwrap();
                }
                for m in 0..4 {
                    let g = middle.recv_gradient(m).unwrap();
                    middle.send_gradient(m, g).unwrap();
                }
            });
            scope.spawn(move || {
                for m in 0..4 {
                    let y = last.recv_activation(m).unwrap();
                    last.send_gradient(m, vec![y[0] + 0.5]).unwrap();
                }
            });
            for m in 0..4 {
                first.send_activation(m, vec![m as f32]).unwrap();
            }
            for m in 0..4 {
                assert_eq!(first.recv_gradient(m).unwrap(), vec![2.0 * m as f32 + 0.5]);
            }
        });
    }

    #[test]
    fn ends_of_the_pipeline_have_no_neighbour() {
        let ends = ChannelTransport::<u8>::pipeline(2);
        assert_eq!(
            ends[0].recv_activation(0),
            Err(TransportError::NoNeighbour {
                stage: 0,
                direction: Direction::Forward
            })
        );
        assert!(ends[0].send_gradient(0, 1).is_err());
        assert!(ends[1].send_activation(0, 1).is_err());
        assert!(ends[1].recv_gradient(0).is_err());
        let single = ChannelTransport::<u8>::pipeline(1);
        assert!(single[0].send_activation(0, 1).is_err());
    }

    #[test]
    fn out_of_order_messages_are_reported() {
        let ends = ChannelTransport::<u8>::pipeline(2);
        ends[0].send_activation(1, 7).unwrap();
        let err = ends[1].recv_activation(0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "stage 1: expected the activation of micro-batch 0 but received micro-batch 1's"
        );
    }

    #[test]
    fn a_dropped_peer_is_a_disconnect_not_a_hang() {
        let mut ends = ChannelTransport::<u8>::pipeline(2);
        let second = ends.pop().unwrap();
        drop(ends);
        let err = second.recv_activation(3).unwrap_err();
        assert_eq!(
            err.to_string(),
            "stage 1: stage 0 hung up before the activation of micro-batch 3 was exchanged"
        );
        assert!(matches!(
            second.send_gradient(0, 1),
            Err(TransportError::Disconnected { peer: 0, .. })
        ));
    }
}
