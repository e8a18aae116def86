//! `EngineError` and `RequestError`: what the facade reports, each naming what is wrong and where.

use std::sync::Arc;

use metrale_model_engine::error::ModelError;
use metrale_model_engine::sampling::SamplingError;
use metrale_model_engine::scheduler::InvalidRequest;

/// A request the engine refuses; the engine itself is unaffected. More kinds of refusal may
/// come: matches keep a wildcard arm.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt does not fit the model's context: `max_seq_len`, or the tokens the KV cache
    /// holds when that is smaller.
    #[error(
        "the prompt has {len} tokens, more than the {max} the context holds (max_seq_len, or the KV cache when smaller)"
    )]
    PromptTooLong {
        /// Prompt tokens.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A token id outside the vocabulary (of the model for a prompt, of the tokenizer for
    /// detokenizing).
    #[error("token {index} is id {id}, outside the vocabulary of {vocab}")]
    TokenOutOfVocab {
        /// Position in the list (the prompt, or the ids to decode).
        index: usize,
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A sampling parameter out of range.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// Text input or output needs a tokenizer and the checkpoint has none.
    #[error("the checkpoint has no tokenizer.json; pass token ids instead of text")]
    NoTokenizer,
    /// The tokenizer failed on the input.
    #[error("tokenizing the prompt failed: {0}")]
    Tokenize(String),
    /// The request's output constraint does not compile (a JSON schema, regular expression or
    /// grammar llguidance refuses, or a tokenizer it cannot read).
    #[error("the output constraint cannot be used: {reason}")]
    Constraint {
        /// What is wrong, in the compiler's words.
        reason: String,
    },
    /// A chat request's tools do not fit its tool choice (a named function that is not
    /// declared, a required call without tools, a forced call beside a response format).
    #[error("`tool_choice`: {reason}")]
    ToolChoice {
        /// What is wrong.
        reason: String,
    },
    /// A stop string that is empty (it would stop before the first token).
    #[error("stop string {index} is empty")]
    EmptyStopString {
        /// Its index in `stop_strings`.
        index: usize,
    },
}

impl From<InvalidRequest> for RequestError {
    fn from(e: InvalidRequest) -> RequestError {
        match e {
            InvalidRequest::EmptyPrompt => RequestError::EmptyPrompt,
            InvalidRequest::PromptTooLong { len, max } => RequestError::PromptTooLong { len, max },
            InvalidRequest::TokenOutOfVocab { index, id, vocab } => {
                RequestError::TokenOutOfVocab { index, id, vocab }
            }
            InvalidRequest::Sampling(s) => RequestError::Sampling(s),
        }
    }
}

/// An error of the engine. More kinds may come: matches keep a wildcard arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The request was refused.
    #[error("invalid request: {0}")]
    Request(#[from] RequestError),
    /// Loading or running the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The tokenizer file could not be loaded.
    #[error("{path}: cannot load the tokenizer: {message}")]
    Tokenizer {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        message: String,
    },
    /// `max_queued_requests` requests are already waiting; try again later.
    #[error("the engine is busy: {max} requests are already queued (max_queued_requests)")]
    QueueFull {
        /// The limit.
        max: usize,
    },
    /// The engine shut down (it was dropped, or its scheduler thread stopped) before the request
    /// finished.
    #[error("the engine has shut down; the request did not finish")]
    ShutDown,
    /// A step this request was part of failed on the device; the request was aborted and its
    /// resources released. Requests that were not in that step carry on.
    #[error("the request was aborted because its step failed: {0}")]
    Aborted(Arc<ModelError>),
    /// The engine's scheduler thread could not be started.
    #[error("cannot start the engine's scheduler thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The checkpoint's chat template could not be loaded.
    #[error(transparent)]
    ChatTemplate(#[from] crate::chat::ChatTemplateError),
    /// The backend asked for is not in this build or not on this machine.
    #[error("backend `{backend}` is not available: {why}")]
    BackendUnavailable {
        /// "cpu" or "cuda".
        backend: &'static str,
        /// Why.
        why: String,
    },
}
