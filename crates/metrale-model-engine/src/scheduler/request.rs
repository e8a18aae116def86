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
use crate::sampling::{MAX_BANNED, SampledToken, SamplingError, SamplingParams};

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Tokens that end generation (included in the output).
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
}

impl RequestLimits {
    /// The limits of a runner over `cache`.
    pub fn of(runner: &StepRunner, cache: &CacheManager) -> RequestLimits {
        let cache_tokens = cache.blocks().capacity() * cache.block_size();
        RequestLimits {
            vocab: runner.model().config().tokens.vocab_size,
            max_context: runner.sizes().max_seq_len.min(cache_tokens),
        }
    }

    /// Check a request's prompt and sampling parameters.
    pub fn check(&self, req: &SeqRequest) -> Result<(), InvalidRequest> {
        self.check_prompt(&req.prompt)?;
        let sampling = &req.params.sampling;
        sampling.validate_for_vocab(self.vocab)?;
        if sampling.min_tokens > 0 && req.params.stop_token_ids.len() > MAX_BANNED / 2 {
            return Err(InvalidRequest::Sampling(SamplingError {
                field: "stop_token_ids",
                value: format!("{} ids", req.params.stop_token_ids.len()),
                expected: "at most 128 ids with min_tokens",
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
