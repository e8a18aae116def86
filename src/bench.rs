//! `metrale::bench` (feature `unstable`): the benchmarks of `metrale bench`
//! (`metrale_model_engine::bench`: random-weight models on the device), and [`SchemaCompiler`],
//! which compiles the serving ladder's constrained requests with the engine's own structured
//! output path (llguidance over a tokenizer's vocabulary, as `Engine` compiles a request's
//! [`Constraint::JsonSchema`]).

use std::sync::Arc;

use metrale_model_engine::constraint::{ConstraintError, TokenConstraint};

use crate::constraint::{Constraint, Grammars};
use crate::error::RequestError;

pub use metrale_model_engine::bench::*;

/// The serving ladder's [`JsonSchemaCompiler`] (`ServeOptions::schemas`): JSON schemas
/// compiled by the engine's llguidance path over one tokenizer's vocabulary. The token trie is
/// built on the first compile and serves every later one (one model's).
#[derive(Debug)]
pub struct SchemaCompiler {
    tokenizer: Arc<tokenizers::Tokenizer>,
    grammars: Grammars,
}

impl SchemaCompiler {
    /// A compiler over the vocabulary of `tokenizer_json` (a `tokenizer.json`'s text).
    pub fn new(tokenizer_json: &str) -> Result<SchemaCompiler, RequestError> {
        let tokenizer: tokenizers::Tokenizer = tokenizer_json
            .parse()
            .map_err(|e: tokenizers::Error| RequestError::Tokenize(e.to_string()))?;
        Ok(SchemaCompiler {
            tokenizer: Arc::new(tokenizer),
            grammars: Grammars::default(),
        })
    }
}

impl JsonSchemaCompiler for SchemaCompiler {
    fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    fn compile(
        &self,
        schema: &str,
        vocab: usize,
        eos: &[u32],
    ) -> Result<Box<dyn TokenConstraint>, ConstraintError> {
        let schema = serde_json::from_str(schema).map_err(|e| ConstraintError {
            reason: format!("the schema is not JSON: {e}"),
        })?;
        self.grammars
            .compile(&Constraint::JsonSchema(schema), &self.tokenizer, vocab, eos)
            .map_err(|e| ConstraintError {
                reason: e.to_string(),
            })
    }
}
