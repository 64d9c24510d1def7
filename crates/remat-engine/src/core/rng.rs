//! A counter-based random generator: the state is `(seed, offset)` and element `i` of a
//! draw is a pure function of `(seed, offset + i)`. A random op records the state it drew
//! with, so a recompute in backward replays exactly the same numbers, in any order and on
//! any number of threads.

/// The state a random op draws with: `count` consecutive counters starting at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RngState {
    pub seed: u64,
    pub offset: u64,
}

impl RngState {
    /// The `i`-th 64-bit random value of this draw.
    #[inline]
    pub fn bits(&self, i: u64) -> u64 {
        mix64(self.seed, self.offset.wrapping_add(i))
    }

    /// The `i`-th uniform value in `[0, 1)` (24 bits of mantissa, exact in f32).
    #[inline]
    pub fn uniform(&self, i: u64) -> f32 {
        (self.bits(i) >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
}

/// A stateless hash of `(seed, counter)`: two rounds of the SplitMix64 finaliser over the
/// counter keyed by the seed. Every bit of the output depends on every bit of both inputs.
#[inline]
pub fn mix64(seed: u64, counter: u64) -> u64 {
    let mut z = counter
        .wrapping_add(0x9E37_79B9_7F4A_7C15)
        .wrapping_mul(0xD1B5_4A32_D192_ED03)
        ^ seed.rotate_left(29).wrapping_mul(0x94D0_49BB_1331_11EB);
    for _ in 0..2 {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
    }
    z
}

/// The generator a graph hands states out of: advancing it reserves counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterRng {
    state: RngState,
}

impl CounterRng {
    pub fn new(seed: u64) -> Self {
        Self {
            state: RngState { seed, offset: 0 },
        }
    }

    /// Reserves `count` counters and returns the state that addresses them.
    pub fn draw(&mut self, count: u64) -> RngState {
        let s = self.state;
        self.state.offset = self.state.offset.wrapping_add(count);
        s
    }

    pub fn state(&self) -> RngState {
        self.state
    }
}

/// One generator per stream. A graph recording several models (issue 22) gives each model
/// its own stream, so model `k`'s random ops draw exactly what they draw when `k` is
/// recorded alone, whatever the other models drew before.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RngStreams {
    streams: Vec<CounterRng>,
}

impl RngStreams {
    /// Stream 0 seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            streams: vec![CounterRng::new(seed)],
        }
    }

    /// Reseeds stream `stream` (creating the streams up to it, seeded 0).
    pub fn set_seed(&mut self, stream: usize, seed: u64) {
        if stream >= self.streams.len() {
            self.streams.resize(stream + 1, CounterRng::new(0));
        }
        self.streams[stream] = CounterRng::new(seed);
    }

    /// The generator of `stream` (created seeded 0 if it was never set).
    pub fn stream(&mut self, stream: usize) -> &mut CounterRng {
        if stream >= self.streams.len() {
            self.streams.resize(stream + 1, CounterRng::new(0));
        }
        &mut self.streams[stream]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_reproducible_and_disjoint() {
        let mut g = CounterRng::new(7);
        let a = g.draw(10);
        let b = g.draw(10);
        assert_eq!(a.offset, 0);
        assert_eq!(b.offset, 10);
        assert_eq!(a.bits(10), b.bits(0));
        assert_ne!(a.bits(0), b.bits(0));
        let again = RngState { seed: 7, offset: 0 };
        assert_eq!(again.uniform(3), a.uniform(3));
    }

    #[test]
    fn streams_draw_independently() {
        let mut s = RngStreams::new(3);
        s.set_seed(2, 9);
        let a = s.stream(2).draw(5);
        let b = s.stream(0).draw(5);
        // Stream 2 is where a lone generator seeded 9 would be; stream 0 untouched by it.
        assert_eq!(a, CounterRng::new(9).draw(5));
        assert_eq!(b, CounterRng::new(3).draw(5));
        assert_eq!(s.stream(1).draw(1), CounterRng::new(0).draw(1));
    }

    #[test]
    fn uniform_is_roughly_uniform() {
        let s = RngState { seed: 1, offset: 0 };
        let n = 100_000;
        let mean: f64 = (0..n).map(|i| s.uniform(i) as f64).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        assert!((0..n).all(|i| (0.0..1.0).contains(&s.uniform(i))));
    }
}
