//! What the scheduler reports: what a step ran (`StepKind`), what happened to sequences
//! (`SeqEvent`), a step's result or failure (`StepReport`, `StepFailed`), and the counters and
//! resource use for metrics (`SchedulerStats`).

use crate::sampling::SampledToken;
use metrale_cache::{CacheManager, SnapshotUsage};

use super::SeqId;
use super::request::Generation;
use super::speculate::SpeculativeStats;
use crate::error::ModelError;

/// What one step ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// Nothing to run.
    Idle,
    /// One prefill chunk of one sequence.
    Prefill {
        /// The sequence.
        seq: SeqId,
        /// Its first position in this chunk.
        start: usize,
        /// Rows (prompt tokens) in the chunk.
        rows: usize,
    },
    /// One prefill chunk of a finished conversation re-run inside the scheduler (see
    /// `ModelOptions::reprefill_answers`): no request's, it emits no event.
    Reprefill {
        /// Its first position in this chunk.
        start: usize,
        /// Rows (conversation tokens) in the chunk.
        rows: usize,
    },
    /// One decode row of each running sequence past its prompt.
    Decode {
        /// Sequences in the step.
        seqs: usize,
    },
    /// One decode row of each running sequence past its prompt and, after them, a prefill chunk
    /// of the sequence in prefill (a mixed step; `ModelOptions::mixed_steps`).
    Mixed {
        /// Decoding sequences in the step (one row each).
        seqs: usize,
        /// The sequence in prefill.
        seq: SeqId,
        /// Its first position in this chunk.
        start: usize,
        /// Rows (prompt tokens) of its chunk; the step has `seqs + rows` rows.
        rows: usize,
    },
    /// One verify step: each running sequence past its prompt with its drafts.
    Verify {
        /// Sequences in the step.
        seqs: usize,
        /// Drafts checked (the step has `seqs + drafts` rows).
        drafts: usize,
    },
}

/// Something that happened to a sequence in a step.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// A token was generated.
    Token {
        /// The sequence.
        id: SeqId,
        /// The token.
        token: u32,
        /// Its logprob and the top logprobs, when the request asked for logprobs.
        logprobs: Option<SampledToken>,
    },
    /// The sequence finished; it holds no resources any more.
    Finished {
        /// The sequence.
        id: SeqId,
        /// Its tokens, finish reason and logits.
        generation: Generation,
    },
}

/// One step's result: what ran, and the events in order (a sequence's token before its
/// `Finished`).
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// What ran.
    pub kind: StepKind,
    /// Tokens and finished sequences.
    pub events: Vec<SeqEvent>,
}

/// A step that failed. The sequences it ran are aborted (their resources released, they are
/// gone from the scheduler); the others are untouched and the scheduler keeps serving.
#[derive(Debug, thiserror::Error)]
#[error("scheduler step failed, {} sequence(s) aborted: {error}", aborted.len())]
pub struct StepFailed {
    /// What failed.
    #[source]
    pub error: Box<ModelError>,
    /// The sequences that were aborted.
    pub aborted: Vec<SeqId>,
}

/// Counters and resource use, for metrics.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct SchedulerStats {
    /// Sequences admitted and not finished (re-prefills not included).
    pub running: usize,
    /// Sequences waiting for admission (preempted ones included; re-prefills not included).
    pub waiting: usize,
    /// Re-prefills of finished conversations running or queued (see
    /// `ModelOptions::reprefill_answers`); the scheduler is idle only once they are done.
    pub reprefills: usize,
    /// What the steps so far ran and produced.
    pub steps: StepCounts,
    /// Speculative decoding's acceptance and gate (`None`: the scheduler does not speculate).
    pub speculation: Option<SpeculativeStats>,
    /// The cache in use now.
    pub cache: CacheUsage,
}

/// What the steps so far ran and produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StepCounts {
    /// Steps run (idle steps excluded; re-prefill steps included).
    pub steps: u64,
    /// Steps among them that ran a request's prefill chunk (mixed steps included, re-prefill
    /// steps not).
    pub prefill_steps: u64,
    /// Steps among them that ran decode rows (verify and mixed steps included).
    pub decode_steps: u64,
    /// Steps among them that ran decode rows and a prefill chunk together (counted in
    /// `prefill_steps` and `decode_steps` too): `steps = prefill_steps + decode_steps -
    /// mixed_steps`.
    pub mixed_steps: u64,
    /// Verify steps among those (speculative decoding).
    pub verify_steps: u64,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Tokens generated so far (replayed tokens are not counted again).
    pub tokens_generated: u64,
    /// Prompt tokens computed in prefill chunks, mixed steps' included (a preempted sequence's
    /// replay included; re-prefill tokens not).
    pub prefill_tokens: u64,
    /// Re-prefill steps run: prefill chunks of finished conversations, computed inside the
    /// scheduler so that a follow-up turn shares the answer (`ModelOptions::reprefill_answers`).
    pub reprefill_steps: u64,
    /// Conversation tokens those steps computed.
    pub reprefill_tokens: u64,
    /// Re-prefills run to their end (their blocks and SSM snapshots published).
    pub reprefills_done: u64,
    /// Re-prefills dropped: no room in the cache when their turn came, or a request needed
    /// the blocks while they ran.
    pub reprefills_skipped: u64,
    /// Prefix-cache lookups and hits.
    pub prefix: PrefixStats,
}

/// Prefix-cache lookups and hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PrefixStats {
    /// Lookups: admissions with prefix caching on (a preempted sequence's readmission
    /// included; re-prefills not included).
    pub queries: u64,
    /// Lookups that reused a cached prefix.
    pub hits: u64,
    /// Prompt tokens of the lookups.
    pub query_tokens: u64,
    /// Of those, the tokens whose KV (and SSM state) came from the cache instead of prefill.
    pub hit_tokens: u64,
}

/// The cache in use now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct CacheUsage {
    /// KV blocks referenced by running sequences (cached blocks nobody holds are free).
    pub kv_blocks_used: usize,
    /// KV blocks that can be handed out.
    pub kv_blocks_total: usize,
    /// Tokens the KV cache holds, every block that can be handed out full
    /// (`kv_blocks_total * block_size`): twice as many with an FP8 cache in the same memory.
    pub kv_tokens_capacity: usize,
    /// KV blocks in the prefix index, referenced or not.
    pub kv_blocks_cached: usize,
    /// SSM state slots in use (0 for models without GDN layers).
    pub ssm_slots_used: usize,
    /// SSM state slots (0 for models without GDN layers).
    pub ssm_slots_total: usize,
    /// SSM snapshots kept for prefix caching (hybrid models), and the entries there are.
    pub snapshots: SnapshotUsage,
}

impl CacheUsage {
    /// What `cache` holds now.
    pub fn of(cache: &CacheManager) -> CacheUsage {
        let blocks = cache.blocks();
        let (ssm_total, ssm_free) = cache.ssm_slots().unwrap_or((0, 0));
        CacheUsage {
            kv_blocks_used: blocks.capacity() - blocks.num_free(),
            kv_blocks_total: blocks.capacity(),
            kv_tokens_capacity: blocks.capacity() * cache.block_size(),
            kv_blocks_cached: blocks.num_cached(),
            ssm_slots_used: ssm_total.saturating_sub(ssm_free),
            ssm_slots_total: ssm_total,
            snapshots: cache.snapshot_usage(),
        }
    }
}
