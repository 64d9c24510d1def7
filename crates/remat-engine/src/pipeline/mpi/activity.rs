//! What this process's stage is doing right now, readable from a signal handler or a panic
//! hook: when a run ends abnormally, each rank can still say which stage and micro-batch it
//! was on. Lock-free atomics only (a signal handler may not take locks or allocate).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use super::super::schedule::Step;
use super::super::transport::Direction;

/// One rank's current activity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activity {
    Computing {
        stage: usize,
        step: Step,
    },
    Waiting {
        stage: usize,
        peer: usize,
        direction: Direction,
        micro_batch: usize,
    },
}

const NONE: u64 = 0;
const FORWARD: u64 = 1;
const BACKWARD: u64 = 2;
const WAIT_ACTIVATION: u64 = 3;
const WAIT_GRADIENT: u64 = 4;

static KIND: AtomicU64 = AtomicU64::new(NONE);
static STAGE: AtomicU64 = AtomicU64::new(0);
static PEER: AtomicU64 = AtomicU64::new(0);
static MICRO_BATCH: AtomicU64 = AtomicU64::new(0);

/// Records the current activity (the kind last, so a reader never sees a new kind with
/// stale fields... at worst old fields with the old kind).
pub fn set(activity: Activity) {
    let (kind, stage, peer, m) = match activity {
        Activity::Computing { stage, step } => match step {
            Step::Forward(m) => (FORWARD, stage, 0, m),
            Step::Backward(m) => (BACKWARD, stage, 0, m),
        },
        Activity::Waiting {
            stage,
            peer,
            direction,
            micro_batch,
        } => match direction {
            Direction::Forward => (WAIT_ACTIVATION, stage, peer, micro_batch),
            Direction::Backward => (WAIT_GRADIENT, stage, peer, micro_batch),
        },
    };
    KIND.store(NONE, Ordering::SeqCst);
    STAGE.store(stage as u64, Ordering::SeqCst);
    PEER.store(peer as u64, Ordering::SeqCst);
    MICRO_BATCH.store(m as u64, Ordering::SeqCst);
    KIND.store(kind, Ordering::SeqCst);
}

/// The activity last recorded, if any.
pub fn get() -> Option<Activity> {
    let kind = KIND.load(Ordering::SeqCst);
    let stage = STAGE.load(Ordering::SeqCst) as usize;
    let peer = PEER.load(Ordering::SeqCst) as usize;
    let m = MICRO_BATCH.load(Ordering::SeqCst) as usize;
    let waiting = |direction| Activity::Waiting {
        stage,
        peer,
        direction,
        micro_batch: m,
    };
    match kind {
        FORWARD => Some(Activity::Computing {
            stage,
            step: Step::Forward(m),
        }),
        BACKWARD => Some(Activity::Computing {
            stage,
            step: Step::Backward(m),
        }),
        WAIT_ACTIVATION => Some(waiting(Direction::Forward)),
        WAIT_GRADIENT => Some(waiting(Direction::Backward)),
        _ => None,
    }
}

/// A fixed-size text buffer, filled without allocating.
pub struct Line {
    bytes: [u8; 256],
    len: usize,
}

impl Line {
    fn new() -> Self {
        Self {
            bytes: [0; 256],
            len: 0,
        }
    }

    fn push(&mut self, s: &str) {
        for &b in s.as_bytes() {
            if self.len < self.bytes.len() {
                self.bytes[self.len] = b;
                self.len += 1;
            }
        }
    }

    fn number(&mut self, mut n: usize) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        for &d in &digits[i..] {
            if self.len < self.bytes.len() {
                self.bytes[self.len] = d;
                self.len += 1;
            }
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// "stage S, micro-batch M: what it was doing", built without allocating (safe in a
/// signal handler).
pub fn describe(activity: Option<Activity>) -> Line {
    let mut line = Line::new();
    match activity {
        None => line.push("before its first micro-batch"),
        Some(Activity::Computing { stage, step }) => {
            line.push("stage ");
            line.number(stage);
            line.push(", micro-batch ");
            line.number(step.micro_batch());
            line.push(match step {
                Step::Forward(_) => ": during its forward pass",
                Step::Backward(_) => ": during its backward pass",
            });
        }
        Some(Activity::Waiting {
            stage,
            peer,
            direction,
            micro_batch,
        }) => {
            line.push("stage ");
            line.number(stage);
            line.push(", micro-batch ");
            line.number(micro_batch);
            line.push(match direction {
                Direction::Forward => ": waiting for its activation from stage ",
                Direction::Backward => ": waiting for its gradient from stage ",
            });
            line.number(peer);
        }
    }
    line
}

static ENDED_PREFIX: OnceLock<Vec<u8>> = OnceLock::new();

/// On SIGTERM (what `mpirun` sends the other ranks when one fails or is killed), writes
/// `prefix` and this rank's activity to stderr and exits with 143, so that every rank says
/// where it stood instead of vanishing silently.
pub fn report_when_ended(prefix: &str) {
    let _ = ENDED_PREFIX.set(prefix.as_bytes().to_vec());
    let handler: extern "C" fn(libc::c_int) = on_terminate;
    // SAFETY: the handler only reads atomics and an initialised OnceLock, formats into a
    // stack buffer, and calls write(2) and _exit(2), which are async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, handler as libc::sighandler_t);
    }
}

extern "C" fn on_terminate(_signal: libc::c_int) {
    let line = describe(get());
    let write = |bytes: &[u8]| {
        // SAFETY: writes a valid buffer to stderr.
        unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
    };
    if let Some(prefix) = ENDED_PREFIX.get() {
        write(prefix);
    }
    write(line.as_bytes());
    write(b"\n");
    // SAFETY: ends the process without running destructors (not safe in a handler).
    unsafe { libc::_exit(128 + libc::SIGTERM) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activity_round_trips_and_describes_itself() {
        let text = |a| String::from_utf8(describe(a).as_bytes().to_vec()).unwrap();
        assert_eq!(text(None), "before its first micro-batch");
        let waiting = Activity::Waiting {
            stage: 2,
            peer: 3,
            direction: Direction::Backward,
            micro_batch: 117,
        };
        set(waiting);
        assert_eq!(get(), Some(waiting));
        assert_eq!(
            text(get()),
            "stage 2, micro-batch 117: waiting for its gradient from stage 3"
        );
        let computing = Activity::Computing {
            stage: 0,
            step: Step::Forward(0),
        };
        set(computing);
        assert_eq!(get(), Some(computing));
        assert_eq!(
            text(get()),
            "stage 0, micro-batch 0: during its forward pass"
        );
    }
}
