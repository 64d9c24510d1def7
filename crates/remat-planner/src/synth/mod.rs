//! Deterministic synthetic training graphs, for tests and benchmarks at sizes the shared
//! graphs do not reach (hundreds to ten thousand nodes). Every generator is a pure function
//! of its parameters and a seed.
//!
//! - [`training_graph`] ([`chain`]): a chain of layers with occasional skips and its mirrored
//!   backward pass ([`mirror_backward`], which also serves graphs built elsewhere).
//! - [`random_layered`] ([`layered`]): the random layered DAGs of the Moccasin benchmark
//!   (Gagrani et al., "Neural Topological Ordering for Computation Graphs", NeurIPS 2022,
//!   Appendix A), with the parameters its file names spell.
//! - [`transformer()`] ([`transformer`](mod@transformer)): the training step of a
//!   decoder-only transformer, op by op, forward and backward, with sizes and roofline
//!   times derived from the model's shape.

pub mod chain;
pub mod layered;
pub mod transformer;

pub use chain::{mirror_backward, training_graph};
pub use layered::{LayeredParams, random_layered};
pub use transformer::{TransformerParams, transformer};

/// Parameters a generator cannot build a graph from.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SynthError {
    #[error("synthetic graph parameter `{field}` is {value}: {what}")]
    Param {
        field: &'static str,
        value: String,
        what: &'static str,
    },
    #[error("synthetic graph name `{name}`: {what}")]
    Name { name: String, what: String },
    /// The generated nodes break an IR invariant (sizes past what the IR can sum).
    #[error("the generated graph is invalid: {error}")]
    Graph { error: crate::GraphError },
}

/// SplitMix64 (Steele, Lea and Flood, 2014): a tiny generator with good statistical quality,
/// so graphs are reproducible from a seed without a dependency.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix(u64);

impl SplitMix {
    pub(crate) fn new(seed: u64) -> SplitMix {
        SplitMix(seed ^ 0x5851_f42d_4c95_7f2d)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `0..n` (`n >= 1`); the modulo bias is below 2^-40 for the sizes used here.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
    /// A standard normal draw (Box-Muller).
    pub(crate) fn normal(&mut self) -> f64 {
        let u = 1.0 - self.unit();
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_draws_are_spread_and_reproducible() {
        let mut a = SplitMix::new(3);
        let draws: Vec<f64> = (0..20_000).map(|_| a.unit()).collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mut b = SplitMix::new(3);
        assert_eq!(b.unit(), draws[0]);
        let normals: Vec<f64> = (0..20_000).map(|_| a.normal()).collect();
        let var = normals.iter().map(|z| z * z).sum::<f64>() / normals.len() as f64;
        assert!((var - 1.0).abs() < 0.05, "{var}");
    }
}
