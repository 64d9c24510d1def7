//! Mixed per-model plans: for every layer and slot, keep, recompute or offload, chosen under
//! a memory budget at the least predicted step time.
//!
//! [`profile()`] measures a model by running it ([`units`] lists what may be chosen per
//! layer): the pool's peak in every phase of the step (each layer's forward and backward,
//! the LM head, the tail), for the layer's backward under every subset of its recompute
//! units, and the time of every recompute op and host transfer (medians over runs).
//! [`solve()`] then picks, exactly, the mix of least predicted time whose predicted peak
//! fits the budget (a dynamic program over the layers whose states are the bytes the
//! earlier layers keep; see [`mod@solve`]). [`tune()`] runs the exact mixes of a ladder of
//! budgets under the given one and keeps the fastest measured, since the time model does
//! not see what a smaller footprint saves (see [`mod@tune`]).
//!
//! Why the peak is predictable to the byte: a layer's backward frees its rebuilt slots when
//! it ends, so what a layer's backward adds to the pool depends on its own choice only, and
//! every phase's peak is the bytes the earlier layers keep plus a term of its own layer.

pub mod error;
pub mod profile;
pub mod solve;
pub mod tune;
pub mod units;

pub use error::MixError;
pub use profile::{BlockOf, MixModel, Profile, profile};
pub use solve::{LayerMix, Mix, floor, solve};
pub use tune::{Tried, Tuned, ladder, tune};
pub use units::{Candidate, ClassUnits, MAX_UNITS, Target};
