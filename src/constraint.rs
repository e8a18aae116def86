//! Structured output: a request's [`Constraint`] (a JSON schema, a regular expression or a Lark
//! grammar) compiled with llguidance into a matcher over the checkpoint's vocabulary, which the
//! scheduler asks for each token's allowed-token bitmask (`TokenConstraint`).
//!
//! The vocabulary's bytes come from the checkpoint's `tokenizer.json` (byte-level BPE, as
//! Qwen's, or byte-fallback); special tokens are marked so that no grammar text produces them,
//! and the model's EOS tokens end a grammar. Ids past the tokenizer's vocabulary (the padding
//! of the embedding matrix) are never allowed. The token trie is built once per engine, on the
//! first constrained request.
//!
//! Invariant: a constraint that does not compile is refused with the request
//! (`RequestError::Constraint`), before anything reaches the scheduler.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use metrale_model_engine::constraint::{ConstraintError, TokenConstraint};
use serde_json::Value;

use crate::error::RequestError;

/// What a request's output must follow. More kinds may come: matches keep a wildcard arm.
///
/// ```
/// use metrale::{Constraint, GenerateRequest};
///
/// let schema = serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}}});
/// let request = GenerateRequest::new("Answer in JSON: ").constraint(Constraint::JsonSchema(schema));
/// assert!(request.constraint.is_some());
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Constraint {
    /// A JSON value valid under this JSON schema (`{"type": "object"}`: any object).
    JsonSchema(Value),
    /// Text matching this regular expression (whole).
    Regex(String),
    /// Text of this Lark grammar (llguidance's dialect: `start: ...`, `%json {...}` for a
    /// JSON-schema value inside it).
    Lark(String),
}

/// The compiler of one engine's constraints: its vocabulary as llguidance sees it.
#[derive(Debug, Default)]
pub(crate) struct Grammars {
    factory: OnceLock<Result<Arc<Factory>, String>>,
}

/// `ParserFactory` is not `Debug`.
struct Factory(ParserFactory);

impl std::fmt::Debug for Factory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ParserFactory")
    }
}

impl Grammars {
    /// Compile `constraint` for a model of `vocab` ids ending at `eos` tokens, with
    /// `tokenizer`'s vocabulary.
    pub fn compile(
        &self,
        constraint: &Constraint,
        tokenizer: &Arc<tokenizers::Tokenizer>,
        vocab: usize,
        eos: &[u32],
    ) -> Result<Box<dyn TokenConstraint>, RequestError> {
        let factory = self
            .factory
            .get_or_init(|| build_factory(tokenizer, vocab, eos).map(|f| Arc::new(Factory(f))))
            .as_ref()
            .map_err(|reason| RequestError::Constraint {
                reason: reason.clone(),
            })?;
        let grammar = match constraint {
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)),
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = factory.0.create_parser(grammar);
        let matcher = Matcher::new(parser);
        if let Some(e) = matcher.get_error() {
            return Err(RequestError::Constraint { reason: e });
        }
        Ok(Box::new(GrammarConstraint { matcher }))
    }
}

/// `schema` with llguidance's compact JSON layout (no free whitespace between tokens: a model
/// cannot pad its answer with blanks forever), unless the schema sets its own.
fn compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(o) = &mut schema
        && !o.contains_key("x-guidance")
    {
        o.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// The llguidance factory over `tokenizer`'s vocabulary, padded to `vocab` ids.
fn build_factory(
    tokenizer: &Arc<tokenizers::Tokenizer>,
    vocab: usize,
    eos: &[u32],
) -> Result<ParserFactory, String> {
    let json = serde_json::to_value(&**tokenizer)
        .map_err(|e| format!("reading the tokenizer's vocabulary: {e}"))?;
    let decoder = json["decoder"]["type"].as_str().unwrap_or("");
    if !matches!(decoder, "ByteLevel" | "Sequence") {
        return Err(format!(
            "structured output needs a byte-level or byte-fallback tokenizer; this one's \
             decoder is `{decoder}`"
        ));
    }
    // The vocabulary reader panics on a tokenizer it does not know; that is an error here.
    let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
        .map_err(|_| "the tokenizer's vocabulary cannot be read as bytes".to_string())?
        .map_err(|e| format!("the tokenizer's vocabulary cannot be read as bytes: {e}"))?;
    if words.len() > vocab {
        return Err(format!(
            "the tokenizer has {} tokens, more than the model's {vocab}",
            words.len()
        ));
    }
    let mut words = words;
    words.resize(vocab, Vec::new());
    let first_eos = *eos
        .first()
        .ok_or("structured output needs the model's EOS token (config.json `eos_token_id`)")?;
    let info = TokRxInfo::new(vocab as u32, first_eos as TokenId);
    let trie = TokTrie::from(&info, &words)
        .with_eos_tokens(&eos.iter().map(|&t| t as TokenId).collect::<Vec<TokenId>>());
    let env: TokEnv = Arc::new(HfEnv {
        trie,
        tokenizer: tokenizer.clone(),
    });
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.set_stderr_log_level(0);
    Ok(factory)
}

/// llguidance's view of the tokenizer: the trie, and the tokenizer's own encoding of text it
/// forces.
struct HfEnv {
    trie: TokTrie,
    tokenizer: Arc<tokenizers::Tokenizer>,
}

impl TokenizerEnv for HfEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(s);
        match self.tokenizer.encode(text.as_ref(), false) {
            Ok(enc) if text.as_bytes() == s => enc.get_ids().to_vec(),
            // Not valid UTF-8 (or the tokenizer failed): the trie's greedy tokenization.
            _ => self.trie.greedy_tokenize(s),
        }
    }
}

/// A compiled constraint as the scheduler drives it.
struct GrammarConstraint {
    matcher: Matcher,
}

impl std::fmt::Debug for GrammarConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarConstraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

fn failed(e: impl std::fmt::Display) -> ConstraintError {
    ConstraintError {
        reason: e.to_string(),
    }
}

impl TokenConstraint for GrammarConstraint {
    fn fill_mask(&mut self, mask: &mut [u32]) -> Result<(), ConstraintError> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(failed)?;
        for (w, &bits) in mask.iter_mut().zip(allowed.as_slice()) {
            *w = bits;
        }
        Ok(())
    }

    fn accept(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.matcher.consume_token(token as TokenId).map_err(failed)
    }

    fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// Compiles constraints over one tokenizer's vocabulary as the engine does: the token trie is
/// built by the first compile and serves every later one, so a later compile costs what a
/// request's does. For the benchmarks (the serving ladder's schemas, the mask benchmark) and the
/// tests' reference.
#[doc(hidden)]
#[derive(Debug)]
pub struct MaskCompiler {
    tokenizer: Arc<tokenizers::Tokenizer>,
    grammars: Grammars,
}

impl MaskCompiler {
    /// A compiler over the vocabulary of `tokenizer_json` (a `tokenizer.json`'s text).
    pub fn new(tokenizer_json: &str) -> Result<MaskCompiler, RequestError> {
        let tokenizer: tokenizers::Tokenizer = tokenizer_json
            .parse()
            .map_err(|e: tokenizers::Error| RequestError::Tokenize(e.to_string()))?;
        Ok(MaskCompiler {
            tokenizer: Arc::new(tokenizer),
            grammars: Grammars::default(),
        })
    }

    /// Tokens of the tokenizer's vocabulary, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// `constraint` compiled for a model of `vocab` ids (the tokenizer's padded) ending at
    /// `eos`, as the engine compiles a request's.
    pub fn constraint(
        &self,
        constraint: &Constraint,
        vocab: usize,
        eos: &[u32],
    ) -> Result<Box<dyn TokenConstraint>, RequestError> {
        self.grammars
            .compile(constraint, &self.tokenizer, vocab, eos)
    }

    /// Compile `constraint` for a model of `vocab` ids ending at `eos`, for stepping by hand.
    pub fn compile(
        &self,
        constraint: &Constraint,
        vocab: usize,
        eos: u32,
    ) -> Result<MaskBench, RequestError> {
        Ok(MaskBench {
            constraint: self.constraint(constraint, vocab, &[eos])?,
            mask: vec![0; vocab.div_ceil(32)],
        })
    }
}

/// The mask computation of a constraint alone, for the benchmarks and the tests' reference:
/// compile `constraint`, then per call compute one mask and take a token.
#[doc(hidden)]
#[derive(Debug)]
pub struct MaskBench {
    constraint: Box<dyn TokenConstraint>,
    mask: Vec<u32>,
}

impl MaskBench {
    /// Compile `constraint` over the vocabulary of `tokenizer_json` (a `tokenizer.json`'s text)
    /// padded to `vocab` ids, ending at `eos`.
    pub fn new(
        constraint: &Constraint,
        tokenizer_json: &str,
        vocab: usize,
        eos: u32,
    ) -> Result<MaskBench, RequestError> {
        MaskCompiler::new(tokenizer_json)?.compile(constraint, vocab, eos)
    }

    /// One token: its mask, then the last allowed token (so strings grow until they must
    /// close); `None` once the grammar allows nothing more.
    pub fn step(&mut self) -> Option<u32> {
        let (w, bits) = (self.mask()?.iter().enumerate()).rfind(|(_, b)| **b != 0)?;
        let token = (w * 32) as u32 + (31 - bits.leading_zeros());
        self.accept(token).then_some(())?;
        (!self.constraint.is_finished()).then_some(token)
    }

    /// The allowed-token bitmask of the next token, as the scheduler computes it (`None` when
    /// the grammar fails): the tests' reference of what a constrained row may pick.
    pub fn mask(&mut self) -> Option<&[u32]> {
        self.mask.fill(0);
        self.constraint.fill_mask(&mut self.mask).ok()?;
        Some(&self.mask)
    }

    /// Take `token`; false when the grammar refuses it.
    pub fn accept(&mut self, token: u32) -> bool {
        self.constraint.accept(token).is_ok()
    }
}
