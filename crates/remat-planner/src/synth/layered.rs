//! Random layered DAGs: the benchmark graphs of Moccasin (Bartan et al., ICML 2023), built by
//! the generator of "Neural Topological Ordering for Computation Graphs" (Gagrani et al.,
//! NeurIPS 2022, Appendix A). The published files are named
//! `random_layered_n{N}_w{width}_nlv{level variance}_ed{edge density}_scd{skip density}`;
//! [`LayeredParams`] takes the same five numbers, and [`LayeredParams::from_name`] reads them
//! from such a name.
//!
//! What each parameter means here (matched against the four published files, n = 100 to
//! 1,000, whose measured statistics are quoted):
//! - `n`: nodes in all, including one source (the first layer) and one sink (the last).
//! - `w`, width: the ratio of a layer's mean width to the number of layers, so the `n - 2`
//!   inner nodes form about `sqrt((n - 2) / w)` layers of `sqrt((n - 2) w)` nodes on average
//!   (published: n = 100, w = 0.27 gives 19 inner layers of 5.2 nodes).
//! - `nlv`, node level variance: each layer's width is drawn uniformly within `1 ± nlv` of
//!   the mean, then all are scaled to sum to `n - 2` (published, nlv = 0.75: the widths'
//!   coefficient of variation is 0.47 to 0.50; a uniform draw gives nlv / sqrt 3 = 0.43).
//! - `ed`, edge density: the probability of a link between a node and a node of the next
//!   layer, on top of one guaranteed input per node and one guaranteed reader per node
//!   (published, ed = 0.2: 0.25 to 0.29 of consecutive pairs linked for n = 250 to 1,000,
//!   0.41 for n = 100's narrow layers; about ed + (1 - ed) / width). The source feeds the
//!   whole first inner layer and the last inner layer feeds the sink. The published files'
//!   layers are about 16% wider than `sqrt((n - 2) w)` above n = 100, so they have 13-17%
//!   more links than graphs generated here for the same n (944 against 855 at n = 250,
//!   5,875 against 4,979 at n = 1,000).
//! - `scd`, skip connection density: the share of all links that skip at least one layer
//!   (published: 813 of 5,875 links at n = 1,000, 0.138; 0.14 in the name). A skip leaves a
//!   uniformly chosen inner node for a uniformly chosen inner node at least two layers
//!   later, so short skips are more common than long ones, as in the files.
//!
//! Costs follow the files' distributions: compute time uniform in 0..1000 (quartiles in the
//! files 241-264 / 485-519 / 724-772), source and sink free; output bytes a multiple of 10
//! drawn from a gamma distribution of shape 3/2 and mean 2,000 (the files: mean 1,988,
//! standard deviation 1,606, median 1,470, 90th percentile 4,300; the gamma's: 2,000, 1,633,
//! 1,573, 4,160), at least 10 and at most 8,200 (the files' largest is 8,180). Time is read
//! as microseconds, as the importer reads the files. Nodes are numbered layer by layer, so
//! the node order is a topological order (the files number the sink 1 and state their order
//! in `graph.order`).

use super::{SplitMix, SynthError};
use crate::ir::{Graph, Node, NodeId, Phase};

/// The generator's parameters, as the published file names spell them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayeredParams {
    /// Nodes in all (at least 3: a source, an inner node, a sink).
    pub nodes: usize,
    /// Mean layer width over the number of layers (`w`), positive.
    pub width: f64,
    /// Relative spread of layer widths (`nlv`), in `[0, 1)`.
    pub level_variance: f64,
    /// Probability of each extra link between consecutive layers (`ed`), in `[0, 1]`.
    pub edge_density: f64,
    /// Share of all links that skip a layer or more (`scd`), in `[0, 1)`.
    pub skip_density: f64,
}

/// The largest output the generator draws, bytes.
const MAX_OUTPUT_BYTES: u64 = 8_200;

impl LayeredParams {
    /// The parameters of Moccasin's published file of about `nodes` nodes (n = 100, 250, 500,
    /// 1,000; the width of the nearest one for other sizes, 0.31 above 1,000).
    pub fn moccasin(nodes: usize) -> LayeredParams {
        let width = match nodes {
            0..=175 => 0.27,
            176..=375 => 0.43,
            376..=750 => 0.36,
            _ => 0.31,
        };
        LayeredParams {
            nodes,
            width,
            level_variance: 0.75,
            edge_density: 0.2,
            skip_density: 0.14,
        }
    }

    /// Reads `random_layered_n{N}_w{W}_nlv{V}_ed{E}_scd{S}` (a `.json` suffix, a directory
    /// and further `_`-separated fields such as `_sd{seed}` are ignored).
    pub fn from_name(name: &str) -> Result<LayeredParams, SynthError> {
        let stem = name.rsplit('/').next().unwrap_or(name);
        let stem = stem.strip_suffix(".json").unwrap_or(stem);
        let error = |what: String| SynthError::Name {
            name: name.to_string(),
            what,
        };
        let rest = stem
            .strip_prefix("random_layered_")
            .ok_or_else(|| error("does not start with `random_layered_`".into()))?;
        let field = |prefix: &str| -> Result<f64, SynthError> {
            let text = rest
                .split('_')
                .find_map(|part| {
                    part.strip_prefix(prefix)
                        .filter(|v| v.starts_with(|c: char| c.is_ascii_digit()))
                })
                .ok_or_else(|| error(format!("has no `{prefix}` field")))?;
            text.parse()
                .map_err(|_| error(format!("`{prefix}{text}` is not a number")))
        };
        let nodes = field("n")?;
        if nodes.fract() != 0.0 || nodes < 0.0 {
            return Err(error(format!("`n{nodes}` is not a node count")));
        }
        let params = LayeredParams {
            nodes: nodes as usize,
            width: field("w")?,
            level_variance: field("nlv")?,
            edge_density: field("ed")?,
            skip_density: field("scd")?,
        };
        params.check()?;
        Ok(params)
    }

    /// The file-name form of these parameters with the seed appended
    /// (`random_layered_n250_w0.43_nlv0.75_ed0.2_scd0.14_sd7`).
    pub fn name(&self, seed: u64) -> String {
        format!(
            "random_layered_n{}_w{}_nlv{}_ed{}_scd{}_sd{seed}",
            self.nodes, self.width, self.level_variance, self.edge_density, self.skip_density
        )
    }

    fn check(&self) -> Result<(), SynthError> {
        let bad = |field: &'static str, value: String, what: &'static str| {
            Err(SynthError::Param { field, value, what })
        };
        if self.nodes < 3 {
            return bad("n", self.nodes.to_string(), "needs at least 3 nodes");
        }
        if !(self.width.is_finite() && self.width > 0.0) {
            return bad("w", self.width.to_string(), "must be positive");
        }
        if !(0.0..1.0).contains(&self.level_variance) {
            return bad("nlv", self.level_variance.to_string(), "must be in [0, 1)");
        }
        if !(0.0..=1.0).contains(&self.edge_density) {
            return bad("ed", self.edge_density.to_string(), "must be in [0, 1]");
        }
        if !(0.0..1.0).contains(&self.skip_density) {
            return bad("scd", self.skip_density.to_string(), "must be in [0, 1)");
        }
        Ok(())
    }
}

/// A random layered DAG with `params`, the same for the same seed.
pub fn random_layered(params: &LayeredParams, seed: u64) -> Result<Graph, SynthError> {
    params.check()?;
    let mut rng = SplitMix::new(seed);
    let layers = layer_widths(params, &mut rng);
    let mut inputs = consecutive_links(&layers, params.edge_density, &mut rng);
    add_skips(&layers, &mut inputs, params.skip_density, &mut rng);
    let sink = params.nodes - 1;
    let nodes = inputs
        .into_iter()
        .enumerate()
        .map(|(id, mut inputs)| {
            inputs.sort_unstable();
            let ends = id == 0 || id == sink;
            Node {
                name: id.to_string(),
                phase: Phase::Forward,
                compute_time: if ends { 0.0 } else { rng.below(1000) as f64 },
                output_bytes: output_bytes(&mut rng),
                inputs,
            }
        })
        .collect();
    Graph::new(params.name(seed), nodes, 0, 1e-6).map_err(|error| SynthError::Graph { error })
}

/// The node ids of each layer: the source, the inner layers, the sink.
fn layer_widths(params: &LayeredParams, rng: &mut SplitMix) -> Vec<std::ops::Range<NodeId>> {
    let inner = params.nodes - 2;
    let count = ((inner as f64 / params.width).sqrt().round() as usize).clamp(1, inner);
    let weights: Vec<f64> = (0..count)
        .map(|_| 1.0 + params.level_variance * (2.0 * rng.unit() - 1.0))
        .collect();
    let widths = apportion(inner, &weights);
    let mut layers = Vec::with_capacity(weights.len() + 2);
    layers.push(0..1);
    let mut start = 1;
    for width in widths {
        layers.push(start..start + width);
        start += width;
    }
    layers.push(start..start + 1);
    layers
}

/// Splits `total` into positive parts proportional to `weights` (largest remainders; a
/// part rounded to zero takes one from the largest part). `total >= weights.len()`.
fn apportion(total: usize, weights: &[f64]) -> Vec<usize> {
    let sum: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights.iter().map(|w| w / sum * total as f64).collect();
    let mut parts: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
    let mut by_remainder: Vec<usize> = (0..parts.len()).collect();
    by_remainder
        .sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    let short = total - parts.iter().sum::<usize>();
    for &i in by_remainder.iter().take(short) {
        parts[i] += 1;
    }
    while let Some(empty) = parts.iter().position(|&p| p == 0) {
        let largest = (0..parts.len()).max_by_key(|&i| parts[i]).unwrap_or(0);
        parts[largest] -= 1;
        parts[empty] += 1;
    }
    parts
}

/// Links between consecutive layers, as each node's input list: every node reads one
/// uniformly chosen node of the layer before and each other one with probability `density`;
/// a node that no one in the next layer reads then gets one reader there.
fn consecutive_links(
    layers: &[std::ops::Range<NodeId>],
    density: f64,
    rng: &mut SplitMix,
) -> Vec<Vec<NodeId>> {
    let total = layers.last().map_or(0, |l| l.end);
    let mut inputs: Vec<Vec<NodeId>> = vec![Vec::new(); total];
    let last = layers.len() - 1;
    for pair in 0..last {
        let (from, to) = (layers[pair].clone(), layers[pair + 1].clone());
        // The source feeds the whole first inner layer; the whole last one feeds the sink.
        let dense = pair == 0 || pair + 1 == last;
        let mut read = vec![dense; from.len()];
        for v in to.clone() {
            let chosen = from.start + rng.below(from.len());
            for u in from.clone() {
                if dense || u == chosen || rng.unit() < density {
                    inputs[v].push(u);
                    read[u - from.start] = true;
                }
            }
        }
        for (offset, _) in read.iter().enumerate().filter(|(_, r)| !**r) {
            let v = to.start + rng.below(to.len());
            inputs[v].push(from.start + offset);
        }
    }
    inputs
}

/// Adds skip links until they are a `density` share of all links: each leaves a uniform
/// inner node for a uniform inner node two or more layers later. A draw that repeats a link
/// is redrawn (a bounded number of times, so a dense tiny graph cannot loop forever).
fn add_skips(
    layers: &[std::ops::Range<NodeId>],
    inputs: &mut [Vec<NodeId>],
    density: f64,
    rng: &mut SplitMix,
) {
    let inner = &layers[1..layers.len() - 1];
    if inner.len() < 3 || density <= 0.0 {
        return;
    }
    let consecutive: usize = inputs.iter().map(Vec::len).sum();
    let wanted = (consecutive as f64 * density / (1.0 - density)).round() as usize;
    // Skips leave layers 0..inner.len() - 2 (of the inner layers) for layers two later on.
    let sources = inner[0].start..inner[inner.len() - 3].end;
    let targets_end = inner[inner.len() - 1].end;
    let layer_of = |v: NodeId| inner.partition_point(|l| l.end <= v);
    let mut added = 0;
    let mut tries = 0;
    while added < wanted && tries < wanted * 20 {
        tries += 1;
        let u = sources.start + rng.below(sources.len());
        let first = inner[layer_of(u) + 2].start;
        let v = first + rng.below(targets_end - first);
        if !inputs[v].contains(&u) {
            inputs[v].push(u);
            added += 1;
        }
    }
}

/// A gamma(3/2) draw of mean 2,000 bytes (half the sum of three squared normals, scaled),
/// rounded to a multiple of 10, within 10..=8,200 (larger draws are redrawn).
fn output_bytes(rng: &mut SplitMix) -> u64 {
    const SCALE: f64 = 2000.0 / 1.5;
    loop {
        let chi3: f64 = (0..3).map(|_| rng.normal().powi(2)).sum();
        let bytes = ((SCALE * chi3 / 2.0 / 10.0).round() as u64 * 10).max(10);
        if bytes <= MAX_OUTPUT_BYTES {
            return bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(graph: &Graph, params: &LayeredParams, seed: u64) -> Vec<usize> {
        let mut rng = SplitMix::new(seed);
        let layers = layer_widths(params, &mut rng);
        let layer_of = |v: NodeId| layers.partition_point(|l| l.end <= v);
        graph
            .nodes()
            .iter()
            .enumerate()
            .flat_map(|(v, n)| n.inputs.iter().map(move |&u| (u, v)))
            .map(|(u, v)| layer_of(v) - layer_of(u))
            .collect()
    }

    #[test]
    fn sizes_links_and_costs_match_the_published_files() {
        for (n, links) in [(250, 944), (500, 2461), (1000, 5875)] {
            let params = LayeredParams::moccasin(n);
            let graph = random_layered(&params, 1).unwrap();
            assert_eq!(graph.len(), n);
            let spans = spans(&graph, &params, 1);
            assert!(spans.iter().all(|&s| s >= 1), "a link goes backwards");
            let skips = spans.iter().filter(|&&s| s >= 2).count() as f64;
            let share = skips / spans.len() as f64;
            assert!((share - 0.14).abs() < 0.01, "n={n}: skip share {share}");
            // Within a third of the published file's link count.
            let ratio = spans.len() as f64 / links as f64;
            assert!((0.67..1.5).contains(&ratio), "n={n}: {} links", spans.len());
            let bytes: Vec<u64> = graph.nodes().iter().map(|n| n.output_bytes).collect();
            let mean = bytes.iter().sum::<u64>() as f64 / n as f64;
            assert!((1700.0..2300.0).contains(&mean), "n={n}: mean bytes {mean}");
            assert!(
                bytes
                    .iter()
                    .all(|&b| (10..=MAX_OUTPUT_BYTES).contains(&b) && b % 10 == 0)
            );
            let time = graph.base_time() / n as f64;
            assert!((430.0..570.0).contains(&time), "n={n}: mean time {time}");
            assert_eq!(graph.node(0).compute_time, 0.0);
            assert!(graph.node(0).inputs.is_empty() && graph.users(n - 1).is_empty());
            // One source and one sink: every other node reads and is read.
            for v in 1..n - 1 {
                assert!(!graph.node(v).inputs.is_empty() && !graph.users(v).is_empty());
            }
        }
    }

    #[test]
    fn deterministic_from_the_seed() {
        let params = LayeredParams::moccasin(500);
        let a = random_layered(&params, 9).unwrap();
        assert_eq!(a, random_layered(&params, 9).unwrap());
        assert_ne!(a, random_layered(&params, 10).unwrap());
        assert_eq!(
            a.name(),
            "random_layered_n500_w0.36_nlv0.75_ed0.2_scd0.14_sd9"
        );
    }

    #[test]
    fn each_parameter_does_what_it_says() {
        let base = LayeredParams::moccasin(1000);
        let layers_of = |p: &LayeredParams| layer_widths(p, &mut SplitMix::new(4)).len();
        let links = |p: &LayeredParams| -> Vec<usize> {
            let g = random_layered(p, 4).unwrap();
            spans(&g, p, 4)
        };
        // Wider layers: fewer of them.
        let wide = LayeredParams { width: 1.2, ..base };
        assert!(layers_of(&wide) * 3 / 2 < layers_of(&base));
        // More skip density: more links that skip, and some long ones.
        let none = LayeredParams {
            skip_density: 0.0,
            ..base
        };
        let many = LayeredParams {
            skip_density: 0.4,
            ..base
        };
        let long = |s: &[usize]| s.iter().filter(|&&x| x >= 10).count();
        assert_eq!(long(&links(&none)), 0);
        assert!(long(&links(&many)) > 3 * long(&links(&base)));
        assert!(long(&links(&base)) > 50);
        // More edge density: more links between consecutive layers.
        let dense = LayeredParams {
            edge_density: 0.5,
            ..base
        };
        let near = |s: &[usize]| s.iter().filter(|&&x| x == 1).count();
        assert!(near(&links(&dense)) > 3 * near(&links(&base)) / 2);
        // Level variance spreads the widths.
        let widths = |v: f64| -> f64 {
            let p = LayeredParams {
                level_variance: v,
                ..base
            };
            let w: Vec<f64> = layer_widths(&p, &mut SplitMix::new(4))
                .iter()
                .map(|l| l.len() as f64)
                .collect();
            let inner = &w[1..w.len() - 1];
            let mean = inner.iter().sum::<f64>() / inner.len() as f64;
            let var = inner.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / inner.len() as f64;
            var.sqrt() / mean
        };
        assert!(
            widths(0.0) < 0.05 && widths(0.75) > 0.3,
            "{} {}",
            widths(0.0),
            widths(0.75)
        );
    }

    #[test]
    fn names_round_trip_and_bad_parameters_are_named() {
        let p =
            LayeredParams::from_name("data/random_layered_n1000_w0.31_nlv0.75_ed0.2_scd0.14.json")
                .unwrap();
        assert_eq!(p, LayeredParams::moccasin(1000));
        let named = LayeredParams::from_name(&p.name(3)).unwrap();
        assert_eq!(named, p);
        let err = LayeredParams::from_name("random_layered_n100_w0.3_nlv0.75_ed0.2").unwrap_err();
        assert!(err.to_string().contains("`scd`"), "{err}");
        let err = LayeredParams::from_name("vgg16.json").unwrap_err();
        assert!(err.to_string().contains("random_layered_"), "{err}");
        let bad = LayeredParams {
            level_variance: 1.5,
            ..p
        };
        let err = random_layered(&bad, 1).unwrap_err().to_string();
        assert!(err.contains("`nlv`") && err.contains("1.5"), "{err}");
        let tiny = LayeredParams { nodes: 2, ..p };
        assert!(
            random_layered(&tiny, 1)
                .unwrap_err()
                .to_string()
                .contains("`n`")
        );
        // The smallest graphs still build.
        for n in 3..12 {
            let g = random_layered(&LayeredParams { nodes: n, ..p }, 5).unwrap();
            assert_eq!(g.len(), n);
        }
    }

    #[test]
    fn five_thousand_nodes() {
        let g = random_layered(&LayeredParams::moccasin(5000), 2).unwrap();
        assert_eq!(g.len(), 5000);
        assert!(g.memory_floor() < g.store_all_peak());
    }
}
