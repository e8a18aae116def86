//! What a caller hands the scheduler: `SeqRequest` (a prompt and how to generate from it), and
//! `RequestLimits`, the checks a request must pass before it reaches the model, with the typed
//! `InvalidRequest` that names what is wrong.
//!
//! Invariants:
//! - A request that passes `RequestLimits::check` can never make a step fail: its tokens are in
//!   the vocabulary and its whole context fits both `max_seq_len` and the KV cache.

use crate::generate::GenerateParams;
use crate::model::TransformerModel;
use crate::sampling::SamplingError;

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
    /// The limits of `model`.
    pub fn of(model: &mut TransformerModel) -> RequestLimits {
        let vocab = model.config().vocab_size;
        let max_seq_len = model.max_seq_len();
        let kv = model.kv_cache();
        let cache_tokens = kv.allocator.capacity() * kv.block_size();
        RequestLimits {
            vocab,
            max_context: max_seq_len.min(cache_tokens),
        }
    }

    /// Check a request's prompt and sampling parameters.
    pub fn check(&self, req: &SeqRequest) -> Result<(), InvalidRequest> {
        self.check_prompt(&req.prompt)?;
        req.params.sampling.validate()?;
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
