//! The target layout: world size, file format, and a placement per tensor chosen by name
//! rules, presets or the source's own placement; resolved into chunks per rank.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;

/// Kept at this path too: a target names placements as much as a checkpoint does.
pub use crate::checkpoint::Placement;
use crate::checkpoint::{Checkpoint, Format, TensorInfo};
use crate::error::{ReshardError, Result};
use crate::geometry::{Region, split_dim};

/// What a rule asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// A placement; `Whole` tensors are balanced over ranks by bytes.
    Place(Placement),
    /// The whole tensor on this rank.
    Rank(usize),
    /// The source's placement, on the target's world size.
    Source,
}

impl Rule {
    /// Parses what follows `=` in a `PATTERN=RULE` flag: a placement, `rank:R` or `source`.
    pub fn parse(s: &str) -> Option<Rule> {
        if s == "source" {
            return Some(Rule::Source);
        }
        if let Some(r) = s.strip_prefix("rank:") {
            return r.parse().ok().map(Rule::Rank);
        }
        Placement::parse(s).map(Rule::Place)
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rule::Place(p) => p.fmt(f),
            Rule::Rank(r) => write!(f, "rank:{r}"),
            Rule::Source => f.write_str("source"),
        }
    }
}

/// A rule applied to the tensors whose names match a glob (`*` any run, `?` one char).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameRule {
    pub pattern: String,
    pub rule: Rule,
}

impl NameRule {
    /// Parses `PATTERN=RULE`.
    pub fn parse(s: &str) -> Option<NameRule> {
        let (pattern, rule) = s.rsplit_once('=')?;
        Some(NameRule {
            pattern: pattern.into(),
            rule: Rule::parse(rule)?,
        })
    }
}

/// The spec's two strategies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// Whole tensors, balanced over ranks by bytes.
    Simple,
    /// Every tensor split on its first dimension (scalars replicated).
    Parallel,
}

impl Preset {
    pub fn parse(s: &str) -> Option<Preset> {
        match s {
            "simple" => Some(Preset::Simple),
            "parallel" => Some(Preset::Parallel),
            _ => None,
        }
    }

    fn rule(self) -> Rule {
        match self {
            Preset::Simple => Rule::Place(Placement::Whole),
            Preset::Parallel => Rule::Place(Placement::Shard(0)),
        }
    }
}

/// What to produce.
#[derive(Clone, Debug)]
pub struct TargetSpec {
    pub world_size: usize,
    pub format: Format,
    /// First match wins.
    pub rules: Vec<NameRule>,
    /// For tensors no rule matches: a preset, or else the source's placement.
    pub preset: Option<Preset>,
}

impl TargetSpec {
    pub fn new(world_size: usize, format: Format) -> TargetSpec {
        TargetSpec {
            world_size,
            format,
            rules: Vec::new(),
            preset: None,
        }
    }
}

/// Glob match with `*` and `?`, iterative with one backtrack point.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// A chunk of a global tensor that one target rank stores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetChunk {
    pub rank: usize,
    pub region: Region,
}

/// A tensor's resolved target placement and the chunks to write (empty chunks dropped,
/// except one for a tensor with no elements, so that it still exists).
#[derive(Clone, Debug)]
pub struct TargetTensor {
    /// Index into the source checkpoint's tensors.
    pub tensor: usize,
    pub placement: Placement,
    pub chunks: Vec<TargetChunk>,
}

fn plan_err(t: &TensorInfo, what: String) -> ReshardError {
    ReshardError::Plan {
        tensor: t.name.clone(),
        what,
    }
}

/// The most target ranks a plan may have: 2^20, far beyond any training job's world
/// size. Every rank gets a file (its name, header and copies held in memory by the plan),
/// so the bound keeps a mistyped `--world-size` an error instead of an allocation of
/// gigabytes or an abort.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// The most target chunks (over all tensors and ranks) a plan may hold: 2^25. A chunk
/// costs the plan a few hundred bytes (its box, its place in a file, its copies), so this
/// keeps a plan within a few GiB; a tensor sharded or replicated over M ranks makes up to
/// M chunks. Checked before any chunk is allocated.
pub const MAX_TARGET_CHUNKS: u64 = 1 << 25;

/// Refuses a world size that is zero or beyond [`MAX_WORLD_SIZE`], before anything is
/// allocated for its ranks.
pub fn check_world_size(m: usize) -> Result<()> {
    if m == 0 {
        return Err(ReshardError::Target(
            "the target world size must be at least 1".into(),
        ));
    }
    if m > MAX_WORLD_SIZE {
        return Err(ReshardError::Target(format!(
            "target world size {m} is more than the {MAX_WORLD_SIZE} (2^20) ranks remat plans for: every rank gets a file the plan holds in memory"
        )));
    }
    Ok(())
}

/// Decides every tensor's target chunks.
pub fn resolve(ckpt: &Checkpoint, spec: &TargetSpec) -> Result<Vec<TargetTensor>> {
    let m = spec.world_size;
    check_world_size(m)?;
    // A rule that names no tensor is most likely a typo: it would change nothing.
    if let Some(r) = spec
        .rules
        .iter()
        .find(|r| !ckpt.tensors.iter().any(|t| glob_match(&r.pattern, &t.name)))
    {
        return Err(ReshardError::Target(format!(
            "the placement rule `{}={}` (--place) matches no tensor of the checkpoint (its {} tensors are named like `{}`)",
            r.pattern,
            r.rule,
            ckpt.tensors.len(),
            ckpt.tensors.first().map_or("", |t| t.name.as_str())
        )));
    }
    // Placements first, so that the size of the plan is known before it is allocated.
    let mut placed = Vec::with_capacity(ckpt.tensors.len());
    let mut chunk_count = 0u64;
    for t in &ckpt.tensors {
        let matched = spec.rules.iter().find(|r| glob_match(&r.pattern, &t.name));
        let explicit = matched.is_some();
        let rule = match (matched, spec.preset) {
            (Some(r), _) => r.rule,
            (None, Some(p)) => p.rule(),
            (None, None) => Rule::Source,
        };
        let (placement, rank) = effective(t, rule, explicit, spec)?;
        chunk_count = chunk_count.saturating_add(chunks_needed(t, placement, spec));
        placed.push((placement, rank));
    }
    if chunk_count > MAX_TARGET_CHUNKS {
        return Err(ReshardError::Target(format!(
            "the target would hold {chunk_count} chunks (tensors sharded or replicated over {m} ranks), more than the {MAX_TARGET_CHUNKS} (2^25) a plan can hold in memory: use fewer ranks or replicate fewer tensors"
        )));
    }
    let mut load = vec![0u64; m];
    let mut out = Vec::with_capacity(ckpt.tensors.len());
    let mut balanced = Vec::new();
    for ((i, t), (placement, rank)) in ckpt.tensors.iter().enumerate().zip(placed) {
        let chunks = match (placement, rank) {
            (Placement::Shard(d), _) => shard_chunks(&t.shape, d, m),
            (Placement::Replicate, _) if spec.format == Format::Remat => (0..m)
                .map(|rank| TargetChunk {
                    rank,
                    region: Region::whole(&t.shape),
                })
                .collect(),
            (_, Some(rank)) => vec![TargetChunk {
                rank,
                region: Region::whole(&t.shape),
            }],
            // Balanced later; DCP and HF store a replicated tensor once.
            (_, None) => {
                balanced.push(out.len());
                Vec::new()
            }
        };
        let bits = t.dtype.bits();
        for c in &chunks {
            load[c.rank] += c.region.volume() * bits / 8;
        }
        out.push(TargetTensor {
            tensor: i,
            placement,
            chunks,
        });
    }
    balance(ckpt, &mut out, &balanced, &mut load);
    for tt in &mut out {
        drop_empty_chunks(tt, &ckpt.tensors[tt.tensor].shape);
    }
    Ok(out)
}

/// The placement a rule means for this tensor on this target, and a fixed rank if any.
fn effective(
    t: &TensorInfo,
    rule: Rule,
    explicit: bool,
    spec: &TargetSpec,
) -> Result<(Placement, Option<usize>)> {
    let ndim = t.shape.len();
    let (placement, rank) = match rule {
        Rule::Rank(r) if r >= spec.world_size => {
            return Err(plan_err(
                t,
                format!(
                    "rule asks for rank {r} but the target has {} ranks",
                    spec.world_size
                ),
            ));
        }
        Rule::Rank(r) => (Placement::Whole, Some(r)),
        Rule::Place(p) => (p, None),
        Rule::Source => (t.placement.unwrap_or(Placement::Whole), None),
    };
    let placement = match placement {
        Placement::Shard(d) if d >= ndim && explicit => {
            return Err(plan_err(
                t,
                format!(
                    "placement shard({d}) but the tensor has {ndim} dimensions (shape {:?})",
                    t.shape
                ),
            ));
        }
        // A preset or inherited shard of a tensor too small to shard: keep it whole.
        Placement::Shard(d) if d >= ndim => Placement::Replicate,
        Placement::Shard(_) if spec.world_size == 1 => Placement::Whole,
        // The hf layout stores whole tensors: a shard inherited from the source (no rule
        // or preset asked for it) becomes a whole tensor, balanced by bytes.
        Placement::Shard(_) if spec.format == Format::Hf && matches!(rule, Rule::Source) => {
            Placement::Whole
        }
        p => p,
    };
    if spec.format == Format::Hf
        && let Placement::Shard(d) = placement
    {
        return Err(plan_err(
            t,
            format!(
                "the hf layout stores whole tensors but this one is placed shard({d}); write --format remat or dcp, or place it whole"
            ),
        ));
    }
    Ok((placement, rank))
}

/// Chunks a tensor of this placement takes before empty ones are dropped.
fn chunks_needed(t: &TensorInfo, placement: Placement, spec: &TargetSpec) -> u64 {
    match placement {
        Placement::Shard(d) => sharded_ranks(t.shape[d], spec.world_size) as u64,
        Placement::Replicate if spec.format == Format::Remat => spec.world_size as u64,
        _ => 1,
    }
}

/// Ranks that get a non-empty part of a dimension of `n` split in `m` (at least one, so
/// that a tensor with no elements keeps a chunk): PyTorch's chunks of `ceil(n/m)` leave
/// the trailing ranks empty when `n < m`, and those are never materialised.
fn sharded_ranks(n: u64, m: usize) -> usize {
    let chunk = n.div_ceil(m.max(1) as u64).max(1);
    usize::try_from(n.div_ceil(chunk))
        .unwrap_or(usize::MAX)
        .clamp(1, m.max(1))
}

fn shard_chunks(shape: &[u64], d: usize, m: usize) -> Vec<TargetChunk> {
    (0..sharded_ranks(shape[d], m))
        .map(|rank| {
            let (start, len) = split_dim(shape[d], m as u64, rank as u64);
            let mut region = Region::whole(shape);
            region.offsets[d] = start;
            region.sizes[d] = len;
            TargetChunk { rank, region }
        })
        .collect()
}

/// Longest-processing-time-first: biggest tensors first, each onto the least loaded rank.
/// Deterministic, so every machine of a `--rank` run computes the same plan.
fn balance(ckpt: &Checkpoint, out: &mut [TargetTensor], which: &[usize], load: &mut [u64]) {
    let mut order: Vec<usize> = which.to_vec();
    order.sort_by_key(|&i| {
        let t = &ckpt.tensors[out[i].tensor];
        (std::cmp::Reverse(t.nbytes()), t.name.clone())
    });
    if order.is_empty() {
        return;
    }
    // The least loaded rank (lowest number among equals) by a heap, so that balancing
    // costs O(log M) per tensor rather than a scan of every rank.
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> = load
        .iter()
        .enumerate()
        .map(|(r, &l)| Reverse((l, r)))
        .collect();
    for i in order {
        let t = &ckpt.tensors[out[i].tensor];
        let Some(Reverse((_, rank))) = heap.pop() else {
            return;
        };
        load[rank] += t.nbytes();
        heap.push(Reverse((load[rank], rank)));
        out[i].chunks = vec![TargetChunk {
            rank,
            region: Region::whole(&t.shape),
        }];
    }
}

/// Drops empty chunks: PyTorch cannot load them, and they hold nothing. A tensor with no
/// elements keeps one chunk, the whole (empty) box on the first rank that had one, so
/// that it still exists and its global shape can be read back from its only piece.
fn drop_empty_chunks(tt: &mut TargetTensor, shape: &[u64]) {
    if tt.chunks.iter().all(|c| c.region.is_empty()) {
        let rank = tt.chunks.first().map_or(0, |c| c.rank);
        tt.chunks = vec![TargetChunk {
            rank,
            region: Region::whole(shape),
        }];
    } else {
        tt.chunks.retain(|c| !c.region.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_like_shells() {
        assert!(glob_match("layers.*.mlp.*", "layers.0.mlp.up.weight"));
        assert!(glob_match("*", ""));
        assert!(glob_match("*.bias", "lm_head.bias"));
        assert!(!glob_match("*.bias", "lm_head.bias2"));
        assert!(glob_match("l?_head*", "lm_head.bias"));
        assert!(!glob_match("embed", "embed.weight"));
        assert!(glob_match("a*b*c", "aXbYbZc"));
    }

    #[test]
    fn rules_and_placements_parse() {
        assert_eq!(Placement::parse("shard(2)"), Some(Placement::Shard(2)));
        assert_eq!(Placement::parse("shard:1"), Some(Placement::Shard(1)));
        assert_eq!(Placement::parse("shard(x)"), None);
        assert_eq!(
            Placement::parse(&Placement::Shard(3).to_string()),
            Some(Placement::Shard(3))
        );
        assert_eq!(
            NameRule::parse("layers.*=rank:2"),
            Some(NameRule {
                pattern: "layers.*".into(),
                rule: Rule::Rank(2)
            })
        );
        assert_eq!(
            NameRule::parse("x=source").map(|r| r.rule),
            Some(Rule::Source)
        );
        assert_eq!(NameRule::parse("x=bogus"), None);
    }
}
