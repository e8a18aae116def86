//! What a caller hands the scheduler and gets back: `SeqRequest` (a prompt and how to generate
//! from it, `GenerateParams`), `Generation` (the tokens, with a `FinishReason`), and
//! `RequestLimits`, the one set of checks a request must pass before it reaches the model, with
//! the typed `InvalidRequest` that names what is wrong.
//!
//! Invariants:
//! - A request that passes `RequestLimits::check` can never make a step fail: its tokens are in
//!   the vocabulary and its whole context fits both `max_seq_len` and the KV cache.

use metrale_cache::CacheManager;

use crate::runner::StepRunner;
use crate::sampling::{MAX_BANNED, SampledToken, SamplingError, SamplingParams, ids_in_vocab};

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Tokens that end generation (included in the output), inside the vocabulary.
    pub stop_token_ids: Vec<u32>,
    /// Keep each step's logits in the output.
    pub return_logits: bool,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FinishReason {
    /// `max_new_tokens`, or the model's context, was reached.
    Length,
    /// A stop token was generated.
    Stop,
    /// The caller stopped it (a cancellation, a stop string, a token callback).
    Cancelled,
}

impl FinishReason {
    /// "length", "stop" or "cancelled".
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// What generation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated tokens.
    pub token_ids: Vec<u32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Row `i`: the logits that chose `token_ids[i]` (when asked for).
    pub logits: Option<Vec<Vec<f32>>>,
    /// Entry `i`: `token_ids[i]`'s logprob and the top logprobs (when the sampling parameters
    /// ask for logprobs).
    pub logprobs: Option<Vec<SampledToken>>,
    /// The sum of the tokens' logprobs of the raw logits (what `best_of` ranks by); `None`
    /// when a token came from an accepted speculative draft.
    pub cumulative_logprob: Option<f64>,
}

/// One generation request for the scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRequest {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// How many tokens, how to pick them, extra stop token ids, whether to keep logits.
    pub params: GenerateParams,
    /// Do not stop at the model's EOS tokens (`ModelConfig::eos_token_ids`, from config.json and
    /// generation_config.json).
    pub ignore_eos: bool,
}

/// Why a request is refused. The engine is unaffected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidRequest {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt does not fit the model's context (the smaller of `max_seq_len` and what the KV
    /// cache holds).
    #[error("the prompt has {len} tokens, more than the {max} the model's context holds")]
    PromptTooLong {
        /// Prompt tokens.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A prompt token id outside the vocabulary.
    #[error("prompt token {index} is id {id}, outside the vocabulary of {vocab}")]
    TokenOutOfVocab {
        /// Position in the prompt.
        index: usize,
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A sampling parameter out of range.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
}

/// The limits a request is checked against, read from a loaded model. Cheap to copy, so a caller
/// can check requests on its own thread while the model runs on another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest context (prompt plus output): the smaller of the model's `max_seq_len` and the
    /// tokens the KV cache holds, so one sequence alone always fits the cache.
    pub max_context: usize,
    /// Most choices one request may generate: the sequences that run at once
    /// (`max_decode_seqs`), and on hybrid models the SSM slots they hold.
    pub max_choices: usize,
    /// KV blocks of the cache, and tokens per block: a request's prompt and the block each
    /// choice forks and grows into must fit the whole cache.
    pub kv_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

impl RequestLimits {
    /// The limits of a runner over `cache`.
    pub fn of(runner: &StepRunner, cache: &CacheManager) -> RequestLimits {
        let (kv_blocks, block_size) = (cache.blocks().capacity(), cache.block_size());
        let max_seqs = runner.sizes().max_seqs;
        let max_choices = match cache.ssm_slots() {
            Some((slots, _)) => {
                let hybrid_spares = if runner.has_mtp() {
                    runner.options().draft_tokens()
                } else {
                    0
                };
                max_seqs.min(slots / (1 + hybrid_spares))
            }
            None => max_seqs,
        };
        RequestLimits {
            vocab: runner.model().config().tokens.vocab_size,
            max_context: runner.sizes().max_seq_len.min(kv_blocks * block_size),
            max_choices,
            kv_blocks,
            block_size,
        }
    }

    /// Check a request's prompt and sampling parameters.
    pub fn check(&self, req: &SeqRequest) -> Result<(), InvalidRequest> {
        self.check_prompt(&req.prompt)?;
        let sampling = &req.params.sampling;
        sampling.validate_for_vocab(self.vocab)?;
        // `min_tokens` hands the stop ids to the device sampler, which fails the step (and
        // every sequence in it) on an id past the vocabulary; such an id could never stop
        // anything either.
        let stop_ids = req.params.stop_token_ids.iter().copied();
        ids_in_vocab("stop_token_ids", stop_ids, self.vocab).map_err(InvalidRequest::Sampling)?;
        if sampling.min_tokens > 0 && req.params.stop_token_ids.len() > MAX_BANNED / 2 {
            return Err(InvalidRequest::Sampling(SamplingError {
                field: "stop_token_ids",
                value: format!("{} ids", req.params.stop_token_ids.len()),
                expected: "at most 128 ids with min_tokens",
            }));
        }
        // Admission takes every choice at once: the request must fit an idle engine.
        let choices = sampling.choices_generated();
        let context = (req.prompt.len() + 1).min(self.max_context);
        let blocks = context.div_ceil(self.block_size.max(1)) + 2 * (choices - 1);
        if choices > self.max_choices || blocks > self.kv_blocks {
            let field = if sampling.ranks_choices() {
                "best_of"
            } else {
                "n"
            };
            return Err(InvalidRequest::Sampling(SamplingError {
                field,
                value: choices.to_string(),
                expected: "no more choices than the engine runs at once (`max_decode_seqs`) \
                           and its KV cache holds beside the prompt",
            }));
        }
        Ok(())
    }

    /// Check a prompt alone.
    pub fn check_prompt(&self, prompt: &[u32]) -> Result<(), InvalidRequest> {
        if prompt.is_empty() {
            return Err(InvalidRequest::EmptyPrompt);
        }
        if let Some((index, &id)) = prompt
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= self.vocab)
        {
            return Err(InvalidRequest::TokenOutOfVocab {
                index,
                id,
                vocab: self.vocab,
            });
        }
        if prompt.len() > self.max_context {
            return Err(InvalidRequest::PromptTooLong {
                len: prompt.len(),
                max: self.max_context,
            });
        }
        Ok(())
    }
}
