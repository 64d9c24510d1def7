//! Retention decisions: which activations a graph keeps for backward and which it drops
//! after their last forward use and rebuilds in backward.

/// Options of a checkpointed node (a node whose output is dropped after its last forward use
/// and recomputed when backward needs it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointOptions {
    /// Keep this node's inputs until backward, so rebuilding it is one step. Without it the
    /// inputs follow their own retention and may be rebuilt in turn.
    pub save_inputs: bool,
    /// Drop this node's value even when a checkpointed consumer asks to save its inputs.
    pub force: bool,
    /// Log every recompute of this node through `tracing` (INFO, target `remat::recompute`).
    pub verbose: bool,
    /// Record the RNG state of a random op so the recompute replays the same numbers. A
    /// random op recomputed without it is an error, never a different mask.
    pub save_rng: bool,
    /// The longest chain of nodes one rebuild starting at this node may recompute
    /// (1 = only the node itself, its inputs must be held).
    pub max_recompute_depth: usize,
    /// Rebuild this node only from inputs that are still held: never recompute its
    /// ancestors on its behalf (a missing input is an error naming it).
    pub detach_inputs: bool,
}

impl Default for CheckpointOptions {
    fn default() -> Self {
        Self {
            save_inputs: true,
            force: false,
            verbose: false,
            save_rng: true,
            max_recompute_depth: 1000,
            detach_inputs: false,
        }
    }
}

impl CheckpointOptions {
    /// The options the policies use: inputs follow their own retention, no depth limit.
    pub fn policy() -> Self {
        Self {
            save_inputs: false,
            max_recompute_depth: usize::MAX,
            ..Self::default()
        }
    }
}

/// What the graph does with a node's output between forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Retention {
    /// Hold it until its last backward use (freed after its last forward use when no
    /// backward reads it).
    #[default]
    Keep,
    /// A checkpoint: free it after its last forward use, rebuild it when backward needs it.
    Recompute(CheckpointOptions),
}

impl Retention {
    pub fn is_checkpoint(&self) -> bool {
        matches!(self, Retention::Recompute(_))
    }

    pub fn options(&self) -> Option<&CheckpointOptions> {
        match self {
            Retention::Recompute(o) => Some(o),
            Retention::Keep => None,
        }
    }
}

/// What backward does with the checkpointed values a rebuild recomputes (a graph-wide
/// setting, [`crate::Graph::set_rebuild_mode`]; [`crate::Policy::apply`] sets it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RebuildMode {
    /// Hold every rebuilt value until its last backward read: each dropped value is
    /// recomputed about once per backward (a segment is recomputed once), and the values
    /// rebuilt for one node stay for the later nodes that read them.
    #[default]
    HoldUntilLastUse,
    /// Free every rebuilt checkpoint value (one not held by its own retention or pinned by a
    /// consumer) right after the backward node that needed it, and everything a rebuild
    /// recomputed on the way as soon as the rebuild is done with it; a later read rebuilds
    /// it again. Between backward nodes only kept values are held: the least memory, at up
    /// to O(n^2) recomputation on an n-node chain. What [`crate::Policy::RecomputeAll`]
    /// uses.
    FreeAfterUse,
}
