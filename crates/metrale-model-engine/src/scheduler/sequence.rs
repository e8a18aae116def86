//! `Seq`: one request inside the scheduler: its tokens so far, how far the model has computed
//! them, what it holds in the cache while it runs (`SeqCache`), its sampler, and the one rule
//! that ends it (`StopRule`). A re-prefill of a finished conversation (`reprefill`) is a `Seq`
//! too, of no request: its prompt is the conversation, and it ends with its prefill.
//!
//! Invariants:
//! - `tokens` is the prompt followed by every generated token; `computed` tokens of it have
//!   their KV entries and SSM state in the sequence's cache. `computed <= tokens.len()`.
//! - `computed < prompt_len`: the sequence is in prefill. Otherwise it decodes, feeding
//!   `tokens[computed]`; while `computed + 1 < tokens.len()` it is replaying tokens it generated
//!   before a preemption, and the logits of those rows are not sampled again.
//! - The sampling state is created once, at submission, and survives preemption: the device
//!   sampler draws token `i` from the sequence's seed and `i` alone, the penalties' counts are
//!   the tokens', and the host sampler (speculative rejection sampling) keeps its generator
//!   state, so a resumed sequence's output is unchanged.
//! - A constrained sequence (`constraint`) picks each token on the device, like every other
//!   row, with its constraint's bitmask for that token in the sampler's mask input
//!   ([`Seq::prepare_mask`], computed once per token, while the device runs the step's forward;
//!   [`Seq::sample_row`] carries it). Every token it records is accepted by the constraint, and
//!   it ends (`Stop`) when the constraint is finished. It never drafts.
//! - With prefix caching, `block_hashes` are the keys of the leading full blocks of `tokens`:
//!   the prompt's (from the first admission on), then, on a model that publishes generated
//!   blocks, each block decode steps filled; the hashes only grow (a preempted sequence keeps
//!   them: they depend on its tokens alone). The first `published` blocks of `table` are in the
//!   prefix index under them, or were computed while an equal block was (shared or duplicated,
//!   never written again). `published * block_size <= computed`.

use metrale_cache::{BlockHash, BlockTable, CacheManager};

use super::request::{FinishReason, Generation};
use crate::constraint::{TokenConstraint, allow, mask_words};
use crate::error::ModelError;
use crate::runner::{ChunkCuts, prefill_chunk};
use crate::sampling::{SampleRow, SampledToken, Sampler, TokenStats};
use crate::speculative::Verdict;

/// A request's id, unique for the life of its scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seq{}", self.0)
    }
}

/// When a sequence ends: the one rule every step applies to each token it records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StopRule {
    /// Tokens that end it (included in the output): the request's, then the model's EOS unless
    /// `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// Longest context (prompt plus output).
    pub max_context: usize,
}

impl StopRule {
    /// Why a sequence of `len` tokens, `generated` of them generated and `last` the newest,
    /// ends, if it does: a stop token, `max_new_tokens`, or a full context (the next input
    /// would sit at position `len - 1`, past it).
    pub fn reason(&self, last: u32, generated: usize, len: usize) -> Option<FinishReason> {
        if self.stop_token_ids.contains(&last) {
            Some(FinishReason::Stop)
        } else if generated >= self.max_new_tokens || len > self.max_context {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Drafts a sequence of `len` tokens, `generated` of them generated, may verify next: no
    /// more than `k`, nor than would reach `max_new_tokens` or the context.
    pub fn drafts_allowed(&self, k: usize, generated: usize, len: usize) -> usize {
        let left = self.max_new_tokens.saturating_sub(generated + 1);
        k.min(left).min(self.max_context.saturating_sub(len))
    }
}

/// What a sequence holds in the cache while it runs.
#[derive(Debug, Default)]
pub(crate) struct SeqCache {
    pub table: BlockTable,
    pub ssm_slot: Option<u32>,
    /// Speculation on a hybrid model: one more SSM slot per draft, where a verify step keeps
    /// the state after each of the sequence's rows.
    pub spare_slots: Vec<u32>,
    /// Prefix-cache keys of the leading full blocks of `tokens` (empty until first needed).
    pub block_hashes: Vec<BlockHash>,
    /// Leading blocks of `table` that are in the prefix index (see the module header).
    pub published: usize,
}

/// See the module header.
#[derive(Debug)]
pub(crate) struct Seq {
    pub id: SeqId,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub stop: StopRule,
    pub sampler: Sampler,
    /// The seed of the device sampler's draws.
    pub seed: u64,
    /// Token counts, when a penalty applies.
    pub stats: Option<TokenStats>,
    pub cache: SeqCache,
    /// The drafts the next decode step verifies (empty: a plain row).
    pub drafts: Vec<u32>,
    pub computed: usize,
    /// Row `i`: the logits that chose generated token `i` (when asked for).
    pub logits: Option<Vec<Vec<f32>>>,
    /// Entry `i`: generated token `i`'s logprobs (when asked for).
    pub logprobs: Option<Vec<SampledToken>>,
    /// The sum of the generated tokens' logprobs of the raw logits; `None` once a token came
    /// from an accepted draft (which has no sampled row).
    pub cumulative_logprob: Option<f64>,
    /// The other choices of this request, forked from it once its prompt is computed (empty
    /// once forked, and for one choice).
    pub choices: Vec<PendingChoice>,
    /// Structured output: the grammar its tokens follow.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// A re-prefill of a finished conversation, no request's (see `reprefill`): its prompt is
    /// the conversation up to where a follow-up can resume; it samples nothing, emits no event
    /// and leaves the scheduler once its prompt is computed.
    pub reprefill: bool,
    /// The constraint's bitmask for the next token, valid while `mask_ready`.
    mask: Vec<u32>,
    mask_ready: bool,
}

impl Seq {
    /// A sequence whose device draws are seeded `seed` and whose host sampler is `sampler`.
    pub fn new(
        id: SeqId,
        prompt: Vec<u32>,
        (sampler, seed): (Sampler, u64),
        stop: StopRule,
        keep_logits: bool,
    ) -> Seq {
        let p = sampler.params();
        let stats = p.has_penalties().then(|| TokenStats::of_prompt(&prompt));
        let logprobs = p.wants_logprobs().then(Vec::new);
        Seq {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            stop,
            sampler,
            seed,
            stats,
            cache: SeqCache::default(),
            drafts: Vec::new(),
            computed: 0,
            logits: keep_logits.then(Vec::new),
            logprobs,
            cumulative_logprob: Some(0.0),
            choices: Vec::new(),
            constraint: None,
            reprefill: false,
            mask: Vec::new(),
            mask_ready: false,
        }
    }

    /// Compute the constraint's bitmask for the next token over `vocab` tokens, unless it is
    /// computed already (or there is no constraint). A failing constraint allows only the stop
    /// tokens, so the sequence ends.
    pub fn prepare_mask(&mut self, vocab: usize) {
        let Some(c) = self.constraint.as_mut() else {
            return;
        };
        if self.mask_ready {
            return;
        }
        self.mask.clear();
        self.mask.resize(mask_words(vocab), 0);
        let failed = match c.fill_mask(&mut self.mask) {
            Ok(()) => self
                .mask
                .iter()
                .all(|&w| w == 0)
                .then(|| "it allows no token".to_string()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(reason) = failed {
            tracing::warn!(seq = %self.id, %reason, "output constraint failed; ending the sequence");
            self.mask.fill(0);
            for &t in &self.stop.stop_token_ids {
                allow(&mut self.mask, t);
            }
        }
        self.mask_ready = true;
    }

    /// Whether this sequence's next row picks a token under its constraint (it is constrained
    /// and that row is the one of its last token).
    pub fn samples_masked(&self) -> bool {
        self.constraint.is_some() && self.computed + 1 >= self.tokens.len()
    }

    /// The device sampler's row for this sequence's next token: with the constraint's bitmask
    /// when it is prepared ([`Seq::prepare_mask`] comes first for a row that
    /// [`Seq::samples_masked`]).
    pub fn sample_row(&self) -> SampleRow {
        let p = self.sampler.params();
        let generated = self.generated();
        let banned: &[u32] = if generated < p.min_tokens {
            &self.stop.stop_token_ids
        } else {
            &[]
        };
        let entries = match &self.stats {
            Some(stats) => stats.entries(p, banned),
            None if !p.logit_bias.is_empty() || !banned.is_empty() => {
                TokenStats::default().entries(p, banned)
            }
            None => Vec::new(),
        };
        debug_assert!(
            self.mask_ready || !self.samples_masked(),
            "a constrained row is sampled before its mask is prepared"
        );
        let mask = (self.constraint.is_some() && self.mask_ready).then(|| self.mask.clone());
        SampleRow {
            words: p.sample_row(self.seed, generated as u64, mask.is_some()),
            entries,
            mask,
        }
    }

    /// Whether this sequence may draft: its sampling is what speculative acceptance knows
    /// (greedy, or temperature, top-k and top-p), no constraint picks its tokens, and it is no
    /// re-prefill (which never decodes).
    pub fn may_draft(&self) -> bool {
        !self.sampler.params().needs_device_sampler()
            && self.constraint.is_none()
            && !self.reprefill
    }

    /// Still prefilling its prompt.
    pub fn in_prefill(&self) -> bool {
        self.computed < self.prompt_len
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Caught up: past its prompt and not replaying generated tokens; its next row samples.
    pub fn caught_up(&self) -> bool {
        self.computed + 1 == self.tokens.len() && !self.in_prefill()
    }

    /// The prompt positions of the next prefill chunk: chunks of `chunk` tokens from position 0
    /// (or from the end of a cached prefix), cut by `cuts` on hybrid models (see
    /// [`prefill_chunk`]), so the boundaries depend on the prompt alone.
    pub fn next_chunk(&self, chunk: usize, cuts: Option<ChunkCuts>) -> std::ops::Range<usize> {
        prefill_chunk(self.computed, self.prompt_len, chunk, cuts)
    }

    /// Extend `block_hashes` over every full block of `tokens[..upto]`, continuing the chain.
    pub fn hash_blocks(&mut self, upto: usize, block_size: usize) {
        if block_size == 0 {
            return;
        }
        let full = upto.min(self.tokens.len()) / block_size;
        let hashes = &mut self.cache.block_hashes;
        for b in hashes.len()..full {
            let tokens = &self.tokens[b * block_size..(b + 1) * block_size];
            let h = BlockHash::chain(hashes.last(), tokens);
            hashes.push(h);
        }
    }

    /// Whether the host needs this sequence's logits: it keeps them (`return_logits`).
    pub fn keeps_logits(&self) -> bool {
        self.logits.is_some()
    }

    /// Whether a verify step needs this sequence's logits on the host: it keeps them, or it
    /// has drafts and samples (rejection sampling).
    pub fn needs_verify_logits(&self) -> bool {
        self.keeps_logits() || (!self.drafts.is_empty() && !self.sampler.is_greedy())
    }

    /// Record the next token, picked by the device sampler, or a token a verify step chose,
    /// with the logits that chose it when the host has them; returns the token, its logprobs
    /// (when asked for) and why the sequence ends, if it does.
    pub fn record(&mut self, picked: Picked) -> (u32, Option<SampledToken>, Option<FinishReason>) {
        let (token, sampled, logits, logprob) = match picked {
            Picked::Sampled(s, logits) => {
                let logprob = Some(f64::from(s.logprob));
                (s.token, Some(s), logits, logprob)
            }
            Picked::Chosen(token, logits) => (token, None, logits, None),
        };
        self.cumulative_logprob = self.cumulative_logprob.zip(logprob).map(|(a, b)| a + b);
        if let (Some(all), Some(row)) = (self.logits.as_mut(), logits) {
            all.push(row);
        }
        let logprobs = self.logprobs.as_mut().map(|all| {
            // A drafted token has no device row; drafting sequences never ask for logprobs.
            let s = sampled.unwrap_or(SampledToken {
                token,
                logprob: f32::NAN,
                top: Vec::new(),
            });
            all.push(s.clone());
            s
        });
        if let Some(stats) = self.stats.as_mut() {
            stats.push(token);
        }
        self.tokens.push(token);
        let mut reason = self.stop.reason(token, self.generated(), self.tokens.len());
        if let Some(c) = self.constraint.as_mut() {
            self.mask_ready = false;
            let finished = match c.accept(token) {
                Ok(()) => c.is_finished(),
                Err(e) => {
                    tracing::warn!(seq = %self.id, reason = %e, "output constraint refused a token");
                    true
                }
            };
            if finished && reason.is_none() {
                reason = Some(FinishReason::Stop);
            }
        }
        (token, logprobs, reason)
    }

    /// Keep what a verify step accepted of this sequence's drafts: roll its SSM state back to
    /// the last kept row (its slot exchanged with that row's spare) and record the verdict's
    /// tokens (with `logits`, the rows that chose them, when the host has them) under the stop
    /// rule, which may end the run early. Returns the tokens recorded and why the sequence
    /// ends, if it does; the caller releases the KV blocks past `computed`.
    pub fn keep(
        &mut self,
        verdict: &Verdict,
        mut logits: Vec<Vec<f32>>,
    ) -> (Vec<u32>, Option<FinishReason>) {
        let (j, k) = (verdict.accepted, self.drafts.len());
        let c = &mut self.cache;
        if let Some(own) = c.ssm_slot.as_mut()
            && j < k
        {
            // Row j's slot holds the state after the last kept token.
            std::mem::swap(own, &mut c.spare_slots[j]);
        }
        self.drafts.clear();
        let mut tokens = Vec::with_capacity(verdict.tokens.len());
        for (t, &token) in verdict.tokens.iter().enumerate() {
            self.computed += 1;
            let row = logits.get_mut(t).map(std::mem::take);
            let (token, _, reason) = self.record(Picked::Chosen(token, row));
            tokens.push(token);
            if reason.is_some() {
                return (tokens, reason);
            }
        }
        (tokens, None)
    }

    /// The result, with `reason`. The sequence must hold no resources any more.
    pub fn into_generation(self, reason: FinishReason) -> Generation {
        Generation {
            token_ids: self.tokens[self.prompt_len..].to_vec(),
            finish_reason: reason,
            logits: self.logits,
            logprobs: self.logprobs,
            cumulative_logprob: self.cumulative_logprob,
        }
    }

    /// Return the sequence's KV blocks and SSM slots; it recomputes from position 0 if it runs
    /// again. Everything is returned even when one release fails; the first error is reported.
    pub fn release(&mut self, cache: &mut CacheManager) -> Result<(), ModelError> {
        let c = &mut self.cache;
        let mut result = cache.release(&mut c.table).map_err(ModelError::from);
        for slot in c.ssm_slot.take().into_iter().chain(c.spare_slots.drain(..)) {
            result = result.and(cache.free_ssm_slot(slot).map_err(ModelError::from));
        }
        self.drafts.clear();
        self.computed = 0;
        c.published = 0;
        result
    }
}

/// A choice still to fork from its request's first sequence: its id and its own constraint.
#[derive(Debug)]
pub(crate) struct PendingChoice {
    pub id: SeqId,
    pub constraint: Option<Box<dyn TokenConstraint>>,
}

/// A row's next token as a step delivers it.
#[derive(Debug)]
pub(crate) enum Picked {
    /// What the device sampler picked, with the row's logits when the host has them.
    Sampled(SampledToken, Option<Vec<f32>>),
    /// A token a verify step accepted, with the logits that chose it when the host has them.
    Chosen(u32, Option<Vec<f32>>),
}
