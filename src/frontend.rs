//! `Frontend`: what a request meets before the scheduler — the checkpoint's tokenizer and the
//! scheduler's limits — and the one place a `GenerateRequest` is checked and turned into the
//! scheduler's `SeqRequest`; and `Follow`, the one reading of a request's events for a caller's
//! token callback (`Engine::generate_stream`, `generate_direct`).
//!
//! Invariants:
//! - A request that `prepare` accepts passes the scheduler's own checks: it can never make a
//!   step fail.
//! - A callback that breaks on a token sees no later token, and the output ends right after it
//!   (finish reason `cancelled`), however many tokens the step that chose it produced. With
//!   several choices the callback follows choice 0; breaking cancels every choice.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use metrale_model_engine::Scheduler;
use metrale_model_engine::constraint::TokenConstraint;
use metrale_model_engine::generate::{FinishReason, GenerateParams};
use metrale_model_engine::scheduler::{RequestLimits, SeqRequest};

use crate::constraint::Grammars;

use crate::error::{EngineError, RequestError};
use crate::request::{GenerateEvent, GenerateOutput, GenerateRequest, Prompt};

/// See the module header.
#[derive(Debug, Clone)]
pub(crate) struct Frontend {
    pub tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    pub limits: RequestLimits,
    /// The model's EOS tokens, which end a constrained output.
    eos: Vec<u32>,
    /// Structured-output constraints' compiler, shared by the engine's callers.
    grammars: Arc<Grammars>,
}

/// A request checked and ready for the scheduler.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub seq: SeqRequest,
    pub stop_strings: Vec<String>,
    /// None, or one per choice the scheduler generates.
    pub constraints: Vec<Box<dyn TokenConstraint>>,
}

/// The checkpoint's `tokenizer.json`, when it has one.
pub(crate) fn load_tokenizer(
    dir: &Path,
) -> Result<Option<Arc<tokenizers::Tokenizer>>, EngineError> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Ok(None);
    }
    let t = tokenizers::Tokenizer::from_file(&path).map_err(|e| EngineError::Tokenizer {
        path: path.clone(),
        message: e.to_string(),
    })?;
    Ok(Some(Arc::new(t)))
}

impl Frontend {
    /// The frontend of `scheduler`'s model, with `tokenizer`.
    pub fn new(tokenizer: Option<Arc<tokenizers::Tokenizer>>, scheduler: &Scheduler) -> Frontend {
        Frontend {
            tokenizer,
            limits: RequestLimits::of(scheduler.runner(), scheduler.cache()),
            eos: (scheduler.runner().model().config().tokens.eos_token_ids).clone(),
            grammars: Arc::default(),
        }
    }

    /// Encode text with the checkpoint's tokenizer, as a text prompt is (no special tokens
    /// added: the text or the chat template writes its own).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RequestError> {
        self.tokenize(text, false)
    }

    /// Encode text, with the tokenizer's special tokens (a BOS, for some) added or not.
    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, RequestError> {
        let tok = self.tokenizer.as_ref().ok_or(RequestError::NoTokenizer)?;
        let enc = tok
            .encode(text, add_special_tokens)
            .map_err(|e| RequestError::Tokenize(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Each id's token as the tokenizer's vocabulary spells it; `None` without a tokenizer.
    pub fn token_strs(&self, ids: &[u32]) -> Option<Vec<String>> {
        let tok = self.tokenizer.as_ref()?;
        Some(
            ids.iter()
                .map(|&id| tok.id_to_token(id).unwrap_or_default())
                .collect(),
        )
    }

    /// Decode token ids to text, special tokens kept or skipped; every id must be in the
    /// tokenizer's vocabulary.
    pub fn detokenize(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, RequestError> {
        let tok = self.tokenizer.as_ref().ok_or(RequestError::NoTokenizer)?;
        let vocab = tok.get_vocab_size(true);
        if let Some(index) = ids.iter().position(|&id| id as usize >= vocab) {
            let id = ids[index];
            return Err(RequestError::TokenOutOfVocab { index, id, vocab });
        }
        tok.decode(ids, skip_special_tokens)
            .map_err(|e| RequestError::Tokenize(e.to_string()))
    }

    /// Decode token ids to text; `None` without a tokenizer.
    pub fn decode(&self, ids: &[u32]) -> Option<String> {
        (self.tokenizer.as_ref()).and_then(|t| t.decode(ids, true).ok())
    }

    /// Check a request completely and turn it into the scheduler's form, with its stop strings.
    pub fn prepare(&self, req: GenerateRequest) -> Result<Prepared, RequestError> {
        let ids = match req.prompt {
            Prompt::Text(t) => self.encode(&t)?,
            Prompt::TokenIds(ids) => ids,
        };
        if !req.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(RequestError::NoTokenizer);
        }
        if let Some(index) = req.stop_strings.iter().position(String::is_empty) {
            return Err(RequestError::EmptyStopString { index });
        }
        let seq = SeqRequest {
            prompt: ids,
            params: GenerateParams {
                max_new_tokens: req.max_new_tokens,
                sampling: req.sampling,
                stop_token_ids: req.stop_token_ids,
                return_logits: req.return_logits,
            },
            ignore_eos: req.ignore_eos,
        };
        self.limits.check(&seq)?;
        // Each choice follows the grammar on its own: one compiled matcher per choice.
        let constraints = match &req.constraint {
            None => Vec::new(),
            Some(c) => {
                let tok = self.tokenizer.as_ref().ok_or(RequestError::NoTokenizer)?;
                (0..seq.params.sampling.choices_generated())
                    .map(|_| self.grammars.compile(c, tok, self.limits.vocab, &self.eos))
                    .collect::<Result<_, _>>()?
            }
        };
        Ok(Prepared {
            seq,
            stop_strings: req.stop_strings,
            constraints,
        })
    }
}

/// A caller's token callback following one request's events: the text so far, and where the
/// callback stopped the request.
#[derive(Debug)]
pub(crate) struct Follow {
    text: Option<String>,
    seen: usize,
    broke_at: Option<usize>,
}

impl Follow {
    /// Follow a request whose events carry text deltas when `with_text`.
    pub fn new(with_text: bool) -> Follow {
        Follow {
            text: with_text.then(String::new),
            seen: 0,
            broke_at: None,
        }
    }

    /// Take one event: a token goes to `on_token(token_id, text_so_far)` (and when it breaks,
    /// `cancel` runs); the last event gives the output, cut right after the token the callback
    /// broke on.
    pub fn event(
        &mut self,
        event: GenerateEvent,
        front: &Frontend,
        on_token: &mut dyn FnMut(u32, Option<&str>) -> ControlFlow<()>,
        cancel: &dyn Fn(),
    ) -> Option<GenerateOutput> {
        match event {
            GenerateEvent::Token(t) => {
                if self.broke_at.is_none() && t.choice == 0 {
                    self.seen += 1;
                    if let (Some(text), Some(delta)) = (self.text.as_mut(), t.text_delta.as_deref())
                    {
                        text.push_str(delta);
                    }
                    if on_token(t.token_id, self.text.as_deref()).is_break() {
                        self.broke_at = Some(self.seen);
                        cancel();
                    }
                }
                None
            }
            GenerateEvent::Finished { mut output } => {
                // The cancellation lands at the next step boundary; the caller asked to stop
                // right after the token it broke on.
                if let Some(n) = self.broke_at {
                    output.token_ids.truncate(n);
                    if let Some(l) = output.logits.as_mut() {
                        l.truncate(n);
                    }
                    if let Some(l) = output.logprobs.as_mut() {
                        l.truncate(n);
                    }
                    output.cumulative_logprob = (output.logprobs.as_ref())
                        .map(|l| l.iter().map(|t| f64::from(t.logprob)).sum());
                    output.text = front.decode(&output.token_ids);
                    output.finish_reason = FinishReason::Cancelled;
                }
                Some(output)
            }
            _ => None,
        }
    }
}
