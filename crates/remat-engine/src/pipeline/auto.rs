//! The `auto` stage policy's decision: keep micro-batch `m`'s forward state only if the
//! stage's remaining steps still fit its budget with it kept, were every later forward state
//! dropped and recomputed (the fallback that needs the least memory). The remaining steps
//! come from the schedule; the sizes from what the stage measured: its live bytes now, the
//! forward states kept, the largest input, and the transients its passes needed
//! ([`Transients`]). Kept states are freed by their backward in schedule order, so a state
//! kept now may fit because earlier ones leave first.

use super::schedule::Step;

/// The most bytes a stage's passes were seen to need above the live bytes they started
/// from: what the `auto` stage policy keeps free.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transients {
    pub forward: usize,
    /// A backward from a kept forward state.
    pub backward: usize,
    /// A backward that first recomputed its forward state.
    pub backward_recomputed: usize,
}

impl Transients {
    /// What the stage's remaining passes need free. A backward may have to recompute: until
    /// one was measured, a plain backward plus a forward stands for it, and until any
    /// backward was measured, twice a forward (conservative: the first step learns).
    pub fn reserve(&self) -> usize {
        let backward = match (self.backward_recomputed, self.backward) {
            (0, 0) => self.forward.saturating_mul(2),
            (0, plain) => plain.saturating_add(self.forward),
            (recomputed, _) => recomputed,
        };
        backward.max(self.forward)
    }

    /// The larger of each figure, this stage's and `other`'s.
    pub(super) fn absorb(&mut self, other: &Transients) {
        self.forward = self.forward.max(other.forward);
        self.backward = self.backward.max(other.backward);
        self.backward_recomputed = self.backward_recomputed.max(other.backward_recomputed);
    }
}

/// What the decision reads.
pub struct Pressure<'a> {
    /// The stage's steps after the current forward, in order.
    pub remaining: &'a [Step],
    /// Live bytes now, the candidate's state included.
    pub live: usize,
    pub budget: usize,
    pub transients: Transients,
    /// The largest kept stage input (freed by its micro-batch's backward).
    pub input_bytes: usize,
}

/// Whether keeping `candidate`'s state (`candidate_bytes`) fits; `kept(j)` gives the bytes of
/// micro-batch `j`'s state if it is kept already.
pub fn keep_fits(
    p: &Pressure<'_>,
    candidate: usize,
    candidate_bytes: usize,
    kept: &dyn Fn(usize) -> Option<usize>,
) -> bool {
    let t = &p.transients;
    // Until a backward of each kind was measured, stand-ins as in `Transients::reserve`.
    let recompute_backward = t.reserve();
    let plain_backward = match t.backward {
        0 => recompute_backward,
        b => b,
    };
    let mut live = p.live;
    for &step in p.remaining {
        let (need, freed) = match step {
            Step::Forward(_) => (t.forward, 0),
            Step::Backward(j) => {
                let state = match j == candidate {
                    true => Some(candidate_bytes),
                    false => kept(j),
                };
                match state {
                    Some(bytes) => (plain_backward, bytes + p.input_bytes),
                    None => (recompute_backward, p.input_bytes),
                }
            }
        };
        if live.saturating_add(need) > p.budget {
            return false;
        }
        live = match step {
            Step::Forward(_) => live.saturating_add(p.input_bytes),
            Step::Backward(_) => live.saturating_sub(freed),
        };
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pressure(remaining: &[Step], live: usize, budget: usize) -> Pressure<'_> {
        Pressure {
            remaining,
            live,
            budget,
            transients: Transients {
                forward: 10,
                backward: 12,
                backward_recomputed: 20,
            },
            input_bytes: 1,
        }
    }

    #[test]
    fn a_state_fits_when_earlier_kept_states_leave_before_the_peak() {
        use Step::{Backward as B, Forward as F};
        // GPipe, 3 micro-batches, deciding micro-batch 1 with 0 kept (30 bytes each).
        let rest = [F(2), B(0), B(1), B(2)];
        let kept = |j| (j == 0).then_some(30);
        // Live 70 now (two states, inputs): F(2) peaks at 80, B(0) at 71 + 12 = 83; after it
        // 40 are left, so the later backwards (recomputing one) peak lower.
        assert!(keep_fits(&pressure(&rest, 70, 83), 1, 30, &kept));
        assert!(!keep_fits(&pressure(&rest, 70, 82), 1, 30, &kept));
        // Not keeping anything new: the recomputing backward of 2 needs 20 above what is left.
        let none = |_| None;
        assert!(keep_fits(&pressure(&[B(0)], 30, 42), 0, 30, &none));
        assert!(!keep_fits(&pressure(&[B(1)], 30, 42), 0, 30, &none));
    }
}
