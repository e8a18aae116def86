//! `Seq`: one request inside the scheduler: its tokens so far, how far the model has computed
//! them, its KV blocks and SSM slot while it runs, and its sampler.
//!
//! Invariants:
//! - `tokens` is the prompt followed by every generated token; `computed` tokens of it have
//!   their KV entries and SSM state in the sequence's cache. `computed <= tokens.len()`.
//! - `computed < prompt_len`: the sequence is in prefill. Otherwise it decodes, feeding
//!   `tokens[computed]`; while `computed + 1 < tokens.len()` it is replaying tokens it generated
//!   before a preemption, and the logits of those rows are not sampled again.
//! - The sampler is created once, at submission, and survives preemption: a resumed sequence
//!   samples its next token with the generator state it had, so its output is unchanged.
//! - With prefix caching, `block_hashes` are the keys of the leading full blocks of `tokens`:
//!   the prompt's (from the first admission on), then, on a model that publishes generated
//!   blocks, each block decode steps filled; the hashes only grow (a preempted sequence keeps
//!   them: they depend on its tokens alone). The first `published` blocks of `table` are in the
//!   prefix index under them, or were computed while an equal block was (shared or duplicated,
//!   never written again). `published * block_size <= computed`.

use metrale_cache::{BlockHash, BlockTable};

use crate::error::ModelError;
use crate::model::TransformerModel;

use crate::generate::{FinishReason, GenerateParams, Generation};
use crate::model::{ChunkCuts, prefill_chunk};
use crate::sampling::Sampler;

/// A request's id, unique for the life of its scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seq{}", self.0)
    }
}

/// See the module header.
#[derive(Debug)]
pub(crate) struct Seq {
    pub id: SeqId,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Stop token ids: the request's, then the model's EOS unless `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    pub params: GenerateParams,
    pub sampler: Sampler,
    pub table: BlockTable,
    pub ssm_slot: Option<u32>,
    /// Speculation on a hybrid model: one more SSM slot per draft, where a verify step keeps
    /// the state after each of the sequence's rows.
    pub spare_slots: Vec<u32>,
    /// The drafts the next decode step verifies (empty: a plain row).
    pub drafts: Vec<u32>,
    pub computed: usize,
    /// Row `i`: the logits that chose generated token `i` (when asked for).
    pub logits: Option<Vec<Vec<f32>>>,
    /// Prefix-cache keys of the leading full blocks of `tokens` (empty until first needed).
    pub block_hashes: Vec<BlockHash>,
    /// Leading blocks of `table` that are in the prefix index (see the module header).
    pub published: usize,
}

impl Seq {
    pub fn new(
        id: SeqId,
        prompt: Vec<u32>,
        params: GenerateParams,
        stop_token_ids: Vec<u32>,
    ) -> Seq {
        Seq {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            stop_token_ids,
            sampler: Sampler::new(params.sampling),
            logits: params.return_logits.then(Vec::new),
            params,
            table: BlockTable::new(),
            ssm_slot: None,
            spare_slots: Vec::new(),
            drafts: Vec::new(),
            computed: 0,
            block_hashes: Vec::new(),
            published: 0,
        }
    }

    /// Still prefilling its prompt.
    pub fn in_prefill(&self) -> bool {
        self.computed < self.prompt_len
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
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
        for b in self.block_hashes.len()..full {
            let tokens = &self.tokens[b * block_size..(b + 1) * block_size];
            let h = BlockHash::chain(self.block_hashes.last(), tokens);
            self.block_hashes.push(h);
        }
    }

    /// Record a sampled token; returns why the sequence ends, if it does.
    pub fn accept(&mut self, logits: Vec<f32>, max_context: usize) -> (u32, Option<FinishReason>) {
        let token = self.sampler.sample(&logits);
        if let Some(all) = self.logits.as_mut() {
            all.push(logits);
        }
        self.push(token, max_context)
    }

    /// Whether picking this sequence's next token needs its logits on the host: it samples, or
    /// it keeps them. Otherwise the device's argmax picks the same token (the first maximum).
    pub fn needs_logits(&self) -> bool {
        self.logits.is_some() || !self.sampler.is_greedy()
    }

    /// Record a token the device picked by argmax (only when `!needs_logits()`); returns why
    /// the sequence ends, if it does.
    pub fn accept_greedy(&mut self, token: u32, max_context: usize) -> (u32, Option<FinishReason>) {
        debug_assert!(!self.needs_logits());
        self.push(token, max_context)
    }

    /// Record a token chosen by a verify step, with the logits that chose it when the host
    /// has them; returns why the sequence ends, if it does.
    pub fn record(
        &mut self,
        token: u32,
        logits: Option<Vec<f32>>,
        max_context: usize,
    ) -> (u32, Option<FinishReason>) {
        if let (Some(all), Some(row)) = (self.logits.as_mut(), logits) {
            all.push(row);
        }
        self.push(token, max_context)
    }

    fn push(&mut self, token: u32, max_context: usize) -> (u32, Option<FinishReason>) {
        self.tokens.push(token);
        let reason = if self.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.generated() >= self.params.max_new_tokens || self.tokens.len() > max_context
        {
            // The next input would sit at position `tokens.len() - 1`, past the context.
            Some(FinishReason::Length)
        } else {
            None
        };
        (token, reason)
    }

    /// The result, with `reason`. The sequence must hold no resources any more.
    pub fn into_generation(self, reason: FinishReason) -> Generation {
        Generation {
            token_ids: self.tokens[self.prompt_len..].to_vec(),
            finish_reason: reason,
            logits: self.logits,
        }
    }
}

/// Return a sequence's KV blocks and SSM slot; it will recompute from position 0 if it runs
/// again.
pub(super) fn release(model: &mut TransformerModel, s: &mut Seq) -> Result<(), ModelError> {
    let blocks = s
        .table
        .release_all(&mut model.kv_cache().allocator)
        .map_err(ModelError::from);
    let mut slot = Ok(());
    for spare in s.ssm_slot.take().into_iter().chain(s.spare_slots.drain(..)) {
        slot = slot.and(model.free_ssm_slot(spare));
    }
    s.drafts.clear();
    s.computed = 0;
    s.published = 0;
    blocks.and(slot)
}
