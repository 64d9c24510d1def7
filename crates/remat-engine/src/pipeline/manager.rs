//! The per-stage activation checkpoint manager: for each micro-batch in flight, either keep
//! its activation until the backward pass or drop it and recompute it from the stage's kept
//! input.
//!
//! Rules worth knowing:
//! - [`CheckpointManager::store`] applies the strategy: it may decline (the activation will be
//!   recomputed) and, under [`Strategy::MemoryBased`], may evict older entries.
//! - Storing an index that is already stored **replaces** the entry: the old activation is
//!   dropped and its bytes released before the new one is accounted, its metadata (bytes,
//!   shape, time stored) becomes the new one's, and it counts as the newest entry for
//!   eviction. If the strategy declines the new activation, the old entry is dropped all the
//!   same: it is stale, and serving it in backward would give wrong gradients.
//! - Kept inputs are mandatory (recompute needs them): they are counted in
//!   [`CheckpointManager::memory_estimate`] but never evicted and never weigh against the
//!   memory-based threshold, which governs stored activations only.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use super::activation::{Activation, BoxError, DeepCopy};
use super::auto::Transients;
use super::auto::{Pressure, keep_fits};
use super::schedule::Step;

/// A stage's memory as [`Strategy::Auto`] reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePressure {
    /// The stage's steps after the current one.
    pub remaining: Vec<Step>,
    pub live: usize,
    pub budget: usize,
    pub transients: Transients,
}

/// When a micro-batch's activation is kept until backward instead of being recomputed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Keep every micro-batch's activation.
    StoreAll,
    /// Keep none; recompute each in backward from the kept input.
    RecomputeAll,
    /// Keep micro-batch `i` when `i % interval == 0`, and always the first and the last;
    /// an interval of 0 keeps all.
    Selective { interval: usize },
    /// Keep while the stored bytes stay within `threshold_bytes`; when a new activation would
    /// exceed it, evict the oldest stored ones, never the first or the last micro-batch's.
    MemoryBased { threshold_bytes: usize },
    /// Decides per micro-batch from the stage's memory: keep a forward state only if the
    /// stage's remaining steps still fit its budget with it kept (later states dropped),
    /// from the live bytes and the transients its passes were measured to need (see
    /// [`super::auto`] and [`CheckpointManager::set_pressure`]); else recompute.
    /// Where every micro-batch fits this is store-all, where none does recompute-all, and in
    /// between it keeps as many as fit, so it differs by stage (1F1B holds `P - s` in flight
    /// on stage `s`) and follows the pressure as it changes. Without a budget it keeps all.
    Auto,
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::StoreAll => write!(f, "store-all"),
            Strategy::RecomputeAll => write!(f, "recompute-all"),
            Strategy::Selective { interval } => write!(f, "selective:{interval}"),
            Strategy::MemoryBased { threshold_bytes } => write!(f, "memory:{threshold_bytes}"),
            Strategy::Auto => write!(f, "auto"),
        }
    }
}

/// A strategy name that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StrategyParseError {
    #[error(
        "unknown stage policy `{0}`: expected store-all, recompute-all, selective:N, memory:BYTES or auto"
    )]
    Unknown(String),
    #[error("stage policy `{policy}`: `{value}` is not a {what}")]
    BadValue {
        policy: String,
        value: String,
        what: &'static str,
    },
    /// `memory:BYTES` whose bytes [`remat_units::parse_size`] cannot read.
    #[error("stage policy `{policy}`: {problem}")]
    Threshold {
        policy: String,
        problem: remat_units::Problem,
    },
}

impl FromStr for Strategy {
    type Err = StrategyParseError;

    /// `store-all`, `recompute-all`, `selective:N`, `memory:BYTES` (BYTES a size as
    /// [`remat_units`] reads it, e.g. `4096`, `64KiB`, `1.5GB`: the same as
    /// `--memory-budget`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |value: &str, what| StrategyParseError::BadValue {
            policy: s.to_string(),
            value: value.to_string(),
            what,
        };
        match s.split_once(':') {
            None if s == "store-all" => Ok(Strategy::StoreAll),
            None if s == "recompute-all" => Ok(Strategy::RecomputeAll),
            None if s == "auto" => Ok(Strategy::Auto),
            // Keeping every 0-th micro-batch means nothing: N must be positive.
            Some(("selective", n)) => n
                .parse()
                .ok()
                .filter(|&interval| interval > 0)
                .map(|interval| Strategy::Selective { interval })
                .ok_or_else(|| bad(n, "positive interval (keep every N-th, N >= 1)")),
            Some(("memory", b)) => {
                let threshold = |problem| StrategyParseError::Threshold {
                    policy: s.to_string(),
                    problem,
                };
                let bytes = remat_units::parse_size(b, "").map_err(|e| threshold(e.problem))?;
                let threshold_bytes = usize::try_from(bytes)
                    .map_err(|_| threshold(remat_units::Problem::TooLarge))?;
                Ok(Strategy::MemoryBased { threshold_bytes })
            }
            _ => Err(StrategyParseError::Unknown(s.to_string())),
        }
    }
}

/// Manager errors; every one names the micro-batch.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(
        "micro-batch {index} is out of range: this stage's checkpoint manager was built for {micro_batches} micro-batches"
    )]
    IndexOutOfRange { index: usize, micro_batches: usize },
    #[error("micro-batch {index}: no input was kept, so its activation cannot be recomputed")]
    MissingInput { index: usize },
    #[error("micro-batch {index}: copying the activation to store it failed: {error}")]
    Copy { index: usize, error: BoxError },
}

/// What is known about one stored activation.
#[derive(Clone, Debug, PartialEq)]
pub struct EntryMeta {
    pub micro_batch: usize,
    pub bytes: usize,
    pub shape: Vec<usize>,
    pub stored_at: Instant,
}

/// What [`CheckpointManager::store`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreOutcome {
    /// Stored; `evicted` lists the micro-batches dropped to make room, oldest first.
    Stored { evicted: Vec<usize> },
    /// The strategy keeps nothing for this micro-batch: it will be recomputed.
    Declined,
}

/// Running totals, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ManagerStats {
    pub stores: usize,
    pub replacements: usize,
    pub declines: usize,
    pub evictions: usize,
    pub recomputes: usize,
    /// The most stored-activation bytes held at once.
    pub peak_stored_bytes: usize,
}

/// An activation fetched for backward: the kept one, or one recomputed just now.
#[derive(Debug)]
pub enum Fetched<'a, A> {
    Stored(&'a A),
    Recomputed(A),
}

impl<A> Fetched<'_, A> {
    pub fn was_recomputed(&self) -> bool {
        matches!(self, Fetched::Recomputed(_))
    }
}

impl<A> std::ops::Deref for Fetched<'_, A> {
    type Target = A;
    fn deref(&self) -> &A {
        match self {
            Fetched::Stored(a) => a,
            Fetched::Recomputed(a) => a,
        }
    }
}

struct Entry<A> {
    value: A,
    meta: EntryMeta,
}

/// One stage's checkpoint manager for `micro_batches` micro-batches, storing activations of
/// type `A` and keeping the stage inputs (of type `I`) that recomputation starts from.
pub struct CheckpointManager<A, I = A> {
    strategy: Strategy,
    micro_batches: usize,
    entries: BTreeMap<usize, Entry<A>>,
    /// Stored micro-batches, oldest store first: the memory-based strategy evicts from the front.
    order: VecDeque<usize>,
    inputs: BTreeMap<usize, I>,
    stored_bytes: usize,
    input_bytes: usize,
    stats: ManagerStats,
    /// [`Strategy::Auto`]: the stage's memory and remaining steps (`None`: no budget).
    pressure: Option<StagePressure>,
}

impl<A: Activation, I: Activation> CheckpointManager<A, I> {
    pub fn new(strategy: Strategy, micro_batches: usize) -> Self {
        Self {
            strategy,
            micro_batches,
            entries: BTreeMap::new(),
            order: VecDeque::new(),
            inputs: BTreeMap::new(),
            stored_bytes: 0,
            input_bytes: 0,
            stats: ManagerStats::default(),
            pressure: None,
        }
    }

    /// Tells [`Strategy::Auto`] the stage's memory now (with the activation about to be
    /// offered already allocated) and its remaining steps; `None` for no budget.
    pub fn set_pressure(&mut self, pressure: Option<StagePressure>) {
        self.pressure = pressure;
    }

    /// [`Strategy::Auto`]'s rule: see [`super::auto`].
    fn auto_keeps(&self, index: usize, bytes: usize) -> bool {
        let Some(p) = &self.pressure else {
            return true;
        };
        let pressure = Pressure {
            remaining: &p.remaining,
            live: p.live,
            budget: p.budget,
            transients: p.transients,
            input_bytes: self
                .inputs
                .values()
                .map(Activation::byte_size)
                .max()
                .unwrap_or(0),
        };
        let kept = |j| self.entries.get(&j).map(|e| e.meta.bytes);
        keep_fits(&pressure, index, bytes, &kept)
    }

    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// Whether an activation of `bytes` for micro-batch `index` would be stored now.
    ///
    /// For [`Strategy::MemoryBased`] this accounts for what eviction could free: it is true
    /// when the activation fits within the threshold after evicting every evictable entry
    /// (and always for the first and last micro-batch, which are never left out).
    pub fn should_checkpoint(&self, index: usize, bytes: usize) -> Result<bool, CheckpointError> {
        self.check_index(index)?;
        let pinned = self.is_pinned(index);
        Ok(match self.strategy {
            Strategy::StoreAll => true,
            Strategy::RecomputeAll => false,
            Strategy::Selective { interval: 0 } => true,
            Strategy::Selective { interval } => pinned || index.checked_rem(interval) == Some(0),
            Strategy::MemoryBased { threshold_bytes } => {
                pinned || self.pinned_bytes_excluding(index) + bytes <= threshold_bytes
            }
            Strategy::Auto => self.auto_keeps(index, bytes),
        })
    }

    /// Like [`store`](Self::store) but takes the activation by value: nothing else can change
    /// it afterwards, so no copy is needed. A declined activation is dropped.
    pub fn store_owned(
        &mut self,
        index: usize,
        activation: A,
    ) -> Result<StoreOutcome, CheckpointError> {
        if !self.should_checkpoint(index, activation.byte_size())? {
            return Ok(self.decline(index));
        }
        Ok(self.insert(index, activation))
    }

    pub fn get(&self, index: usize) -> Option<&A> {
        self.entries.get(&index).map(|e| &e.value)
    }

    pub fn has(&self, index: usize) -> bool {
        self.entries.contains_key(&index)
    }

    /// Removes and returns a stored activation, releasing its bytes (backward consumes it).
    pub fn take(&mut self, index: usize) -> Option<A> {
        let entry = self.entries.remove(&index)?;
        self.order.retain(|&i| i != index);
        self.stored_bytes -= entry.meta.bytes;
        Some(entry.value)
    }

    /// Keeps the stage input of micro-batch `index`, the starting point of its recomputation.
    /// Keeping an index twice replaces the input.
    pub fn keep_input(&mut self, index: usize, input: I) -> Result<(), CheckpointError> {
        self.check_index(index)?;
        self.input_bytes += input.byte_size();
        if let Some(old) = self.inputs.insert(index, input) {
            self.input_bytes -= old.byte_size();
        }
        Ok(())
    }

    pub fn input(&self, index: usize) -> Option<&I> {
        self.inputs.get(&index)
    }

    /// Drops the kept input of micro-batch `index` (after its backward pass).
    pub fn release_input(&mut self, index: usize) -> Option<I> {
        let input = self.inputs.remove(&index)?;
        self.input_bytes -= input.byte_size();
        Some(input)
    }

    /// Reruns the stage's forward pass for micro-batch `index` from its kept input. The result
    /// is handed back, not stored: a recomputed activation lives only for its backward use.
    pub fn recompute<E, F>(&mut self, index: usize, forward: F) -> Result<A, E>
    where
        E: From<CheckpointError>,
        F: FnOnce(&I) -> Result<A, E>,
    {
        self.check_index(index)?;
        let input = self
            .inputs
            .get(&index)
            .ok_or(CheckpointError::MissingInput { index })?;
        let value = forward(input)?;
        self.stats.recomputes += 1;
        Ok(value)
    }

    /// The stored activation of micro-batch `index`, or a recomputation of it.
    pub fn get_or_compute<E, F>(&mut self, index: usize, forward: F) -> Result<Fetched<'_, A>, E>
    where
        E: From<CheckpointError>,
        F: FnOnce(&I) -> Result<A, E>,
    {
        if self.has(index) {
            return Ok(Fetched::Stored(&self.entries[&index].value));
        }
        self.recompute(index, forward).map(Fetched::Recomputed)
    }

    /// Like [`get_or_compute`](Self::get_or_compute) but removes a stored activation, so that
    /// backward owns it and its bytes are released.
    pub fn take_or_compute<E, F>(&mut self, index: usize, forward: F) -> Result<(A, bool), E>
    where
        E: From<CheckpointError>,
        F: FnOnce(&I) -> Result<A, E>,
    {
        match self.take(index) {
            Some(value) => Ok((value, false)),
            None => self.recompute(index, forward).map(|v| (v, true)),
        }
    }

    /// Drops every stored activation and kept input (statistics survive).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
        self.inputs.clear();
        self.stored_bytes = 0;
        self.input_bytes = 0;
    }

    /// Exact bytes held: stored activations plus kept inputs.
    pub fn memory_estimate(&self) -> usize {
        self.stored_bytes + self.input_bytes
    }

    pub fn stored_bytes(&self) -> usize {
        self.stored_bytes
    }

    pub fn input_bytes(&self) -> usize {
        self.input_bytes
    }

    /// Number of stored activations.
    pub fn count(&self) -> usize {
        self.entries.len()
    }

    pub fn metadata(&self, index: usize) -> Option<&EntryMeta> {
        self.entries.get(&index).map(|e| &e.meta)
    }

    /// Metadata of every stored activation, by micro-batch index.
    pub fn entries(&self) -> impl Iterator<Item = &EntryMeta> {
        self.entries.values().map(|e| &e.meta)
    }

    pub fn stats(&self) -> ManagerStats {
        self.stats
    }

    fn check_index(&self, index: usize) -> Result<(), CheckpointError> {
        if index >= self.micro_batches {
            return Err(CheckpointError::IndexOutOfRange {
                index,
                micro_batches: self.micro_batches,
            });
        }
        Ok(())
    }

    /// The first and last micro-batch are never left out by the selective and memory rules.
    fn is_pinned(&self, index: usize) -> bool {
        index == 0 || index + 1 == self.micro_batches
    }

    /// Bytes that eviction cannot free, not counting micro-batch `index` (being replaced).
    fn pinned_bytes_excluding(&self, index: usize) -> usize {
        self.entries
            .iter()
            .filter(|&(&i, _)| i != index && self.is_pinned(i))
            .map(|(_, e)| e.meta.bytes)
            .sum()
    }

    /// Records a declined store; an older entry for the same index is stale now, so it goes.
    fn decline(&mut self, index: usize) -> StoreOutcome {
        if self.take(index).is_some() {
            self.stats.replacements += 1;
        }
        self.stats.declines += 1;
        StoreOutcome::Declined
    }

    /// Accounts and stores an activation the strategy accepted, evicting if it must.
    fn insert(&mut self, index: usize, value: A) -> StoreOutcome {
        if self.take(index).is_some() {
            self.stats.replacements += 1;
        }
        let bytes = value.byte_size();
        let evicted = match self.strategy {
            Strategy::MemoryBased { threshold_bytes } => self.evict_for(bytes, threshold_bytes),
            _ => Vec::new(),
        };
        let meta = EntryMeta {
            micro_batch: index,
            bytes,
            shape: value.shape(),
            stored_at: Instant::now(),
        };
        self.entries.insert(index, Entry { value, meta });
        self.order.push_back(index);
        self.stored_bytes += bytes;
        self.stats.stores += 1;
        self.stats.peak_stored_bytes = self.stats.peak_stored_bytes.max(self.stored_bytes);
        StoreOutcome::Stored { evicted }
    }

    /// Evicts the oldest unpinned entries until `incoming` more bytes fit within `threshold`
    /// or nothing evictable is left (only a pinned newcomer can then exceed the threshold).
    fn evict_for(&mut self, incoming: usize, threshold: usize) -> Vec<usize> {
        let mut evicted = Vec::new();
        let mut cursor = 0;
        while self.stored_bytes + incoming > threshold && cursor < self.order.len() {
            let index = self.order[cursor];
            if self.is_pinned(index) {
                cursor += 1;
                continue;
            }
            self.take(index);
            self.stats.evictions += 1;
            evicted.push(index);
        }
        evicted
    }
}

impl<A: DeepCopy, I: Activation> CheckpointManager<A, I> {
    /// Stores a deep copy of `activation` for micro-batch `index` if the strategy says so.
    pub fn store(&mut self, index: usize, activation: &A) -> Result<StoreOutcome, CheckpointError> {
        if !self.should_checkpoint(index, activation.byte_size())? {
            return Ok(self.decline(index));
        }
        let copy = activation.deep_copy().map_err(|e| CheckpointError::Copy {
            index,
            error: Box::new(e),
        })?;
        Ok(self.insert(index, copy))
    }
}

impl<A, I> fmt::Debug for CheckpointManager<A, I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckpointManager")
            .field("strategy", &self.strategy)
            .field("micro_batches", &self.micro_batches)
            .field("stored", &self.entries.keys().collect::<Vec<_>>())
            .field("stored_bytes", &self.stored_bytes)
            .field("input_bytes", &self.input_bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests;
