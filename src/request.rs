//! `GenerateRequest` and `GenerateOutput`: one generation's input and result; `GenerateEvent`
//! and `TokenEvent`: what a request's handle yields as it runs.
//!
//! A request of several choices (`SamplingParams::n`) has one output per choice: the
//! `GenerateOutput` it finishes with is choice 0, holding choices 1.. in `other_choices`
//! (`GenerateOutput::into_choices` lists them all), and each token event names its choice. A
//! request of one choice reads as it always has.
//!
//! All of them grow with the engine, so they are `#[non_exhaustive]`: a request is built with
//! `GenerateRequest::new` and its setters; outputs and events are read, and matches on the enums
//! keep a wildcard arm.

use metrale_model_engine::generate::FinishReason;
use metrale_model_engine::sampling::SamplingParams;

use crate::constraint::Constraint;
/// A generated token's logprob (log_softmax of the model's raw logits, before penalties, bias
/// and temperature) and the most likely tokens with theirs, best first.
pub use metrale_model_engine::sampling::SampledToken as TokenLogprobs;

/// The prompt: text (needs a tokenizer) or token ids (always works).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Prompt {
    /// Text, encoded with the checkpoint's tokenizer.
    Text(String),
    /// Token ids.
    TokenIds(Vec<u32>),
}

impl From<String> for Prompt {
    fn from(text: String) -> Prompt {
        Prompt::Text(text)
    }
}

impl From<&str> for Prompt {
    fn from(text: &str) -> Prompt {
        Prompt::Text(text.to_string())
    }
}

impl From<Vec<u32>> for Prompt {
    fn from(ids: Vec<u32>) -> Prompt {
        Prompt::TokenIds(ids)
    }
}

/// One generation request. Build with [`GenerateRequest::new`] and the setters:
///
/// ```
/// use metrale::{GenerateRequest, SamplingParams};
///
/// let request = GenerateRequest::new("The capital of France is")
///     .max_new_tokens(32)
///     .sampling(SamplingParams::default().temperature(0.7).top_p(0.9).seed(42))
///     .stop_strings(vec!["\n".into()]);
/// assert_eq!(request.max_new_tokens, 32);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct GenerateRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Most tokens to generate. Default 16.
    pub max_new_tokens: usize,
    /// Sampling. Default greedy.
    pub sampling: SamplingParams,
    /// Do not stop at the model's EOS tokens. Default false.
    pub ignore_eos: bool,
    /// Extra token ids that end generation (the token is part of the output), inside the
    /// vocabulary. Default none.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation once the decoded output contains one (needs a tokenizer).
    /// The token that completes the string is part of `token_ids`; the output text stops right
    /// before the string, and no text delta shows it. Default none.
    pub stop_strings: Vec<String>,
    /// Return the logits of every step. Default false.
    pub return_logits: bool,
    /// Structured output: the text must follow this constraint (a JSON schema, a regular
    /// expression, a Lark grammar; needs a tokenizer); generation stops when it is complete.
    /// Default none.
    pub constraint: Option<Constraint>,
}

impl GenerateRequest {
    /// A request for `prompt` (a [`Prompt`], text or token ids) with every other field at its
    /// default.
    pub fn new(prompt: impl Into<Prompt>) -> GenerateRequest {
        GenerateRequest {
            prompt: prompt.into(),
            max_new_tokens: 16,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            return_logits: false,
            constraint: None,
        }
    }

    /// Set `max_new_tokens`.
    pub fn max_new_tokens(mut self, n: usize) -> Self {
        self.max_new_tokens = n;
        self
    }

    /// Set the sampling parameters.
    pub fn sampling(mut self, s: SamplingParams) -> Self {
        self.sampling = s;
        self
    }

    /// Set `ignore_eos`.
    pub fn ignore_eos(mut self, v: bool) -> Self {
        self.ignore_eos = v;
        self
    }

    /// Set `stop_token_ids`.
    pub fn stop_token_ids(mut self, ids: Vec<u32>) -> Self {
        self.stop_token_ids = ids;
        self
    }

    /// Set `stop_strings`.
    pub fn stop_strings(mut self, strings: Vec<String>) -> Self {
        self.stop_strings = strings;
        self
    }

    /// Set `constraint`.
    pub fn constraint(mut self, c: impl Into<Option<Constraint>>) -> Self {
        self.constraint = c.into();
        self
    }

    /// Set `return_logits`.
    pub fn return_logits(mut self, v: bool) -> Self {
        self.return_logits = v;
        self
    }
}

/// What a generation produced: one choice of it, and for a request of several choices the
/// others in `other_choices`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct GenerateOutput {
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// Which choice this is: 0 for the output a request finishes with; with `best_of`, the
    /// rank (0 the highest cumulative logprob).
    pub index: usize,
    /// Generated token ids.
    pub token_ids: Vec<u32>,
    /// The generated text, when the checkpoint has a tokenizer.
    pub text: Option<String>,
    /// Why generation ended.
    pub finish_reason: FinishReason,
    /// Row `i`: the logits that chose `token_ids[i]`, when asked for.
    pub logits: Option<Vec<Vec<f32>>>,
    /// Entry `i`: `token_ids[i]`'s logprob and the top logprobs, when the sampling parameters
    /// ask for logprobs (`logprobs` or `top_logprobs`).
    pub logprobs: Option<Vec<TokenLogprobs>>,
    /// The sum of the tokens' logprobs of the raw logits (what `best_of` ranks by); `None`
    /// when a token came from an accepted speculative draft, which has no logprob.
    pub cumulative_logprob: Option<f64>,
    /// Choices `1..n` of a request of `n` choices, in index order (each with no
    /// `other_choices` of its own); empty for one choice.
    pub other_choices: Vec<GenerateOutput>,
}

impl GenerateOutput {
    /// Every choice in index order: this one, then `other_choices`.
    pub fn into_choices(mut self) -> Vec<GenerateOutput> {
        let others = std::mem::take(&mut self.other_choices);
        std::iter::once(self).chain(others).collect()
    }

    /// The tokens generated over every choice.
    pub fn completion_tokens(&self) -> usize {
        self.token_ids.len()
            + (self.other_choices.iter())
                .map(|c| c.token_ids.len())
                .sum::<usize>()
    }
}

/// One generated token, as it is chosen.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TokenEvent {
    /// The choice it belongs to (0 for a request of one choice).
    pub choice: usize,
    /// The token.
    pub token_id: u32,
    /// Its logprob and the top logprobs, when the sampling parameters ask for logprobs.
    pub logprobs: Option<TokenLogprobs>,
    /// The text this token adds to the output; `None` without a tokenizer. It can be empty: text
    /// is held back while it may be the start of a stop string or of an incomplete character,
    /// and comes with a later token (or the last one).
    pub text_delta: Option<String>,
}

/// What a request's handle yields: its tokens in order, then `Finished` once, last. With
/// several choices (`n` > 1) the choices' tokens interleave as the steps produce them, and each
/// choice's last token is followed by its `ChoiceFinished`. With `best_of` above `n` the kept
/// choices are known only at the end, so such a request yields `Finished` alone.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum GenerateEvent {
    /// A token was generated.
    Token(TokenEvent),
    /// A choice of a request of several ended (its tokens have all been sent).
    ChoiceFinished {
        /// The choice.
        choice: usize,
        /// Why it ended.
        finish_reason: FinishReason,
    },
    /// The request finished (its last event).
    Finished {
        /// Everything it generated: choice 0, with the others in `other_choices`.
        output: GenerateOutput,
    },
}
