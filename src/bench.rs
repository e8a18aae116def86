//! `metrale::bench` (feature `unstable`): the benchmarks of `metrale bench`
//! (`metrale_model_engine::bench`: random-weight models on the device), and [`SchemaCompiler`],
//! which compiles the serving ladder's constrained requests with the engine's own structured
//! output path (llguidance over a tokenizer's vocabulary, as `Engine` compiles a request's
//! [`Constraint::JsonSchema`]).

use metrale_model_engine::constraint::{ConstraintError, TokenConstraint};

use crate::constraint::{Constraint, MaskCompiler};
use crate::error::RequestError;

pub use metrale_model_engine::bench::*;

/// The serving ladder's [`JsonSchemaCompiler`] (`ServeOptions::schemas`): JSON schemas
/// compiled by the engine's llguidance path over one tokenizer's vocabulary. The token trie is
/// built on the first compile and serves every later one (one model's).
#[derive(Debug)]
pub struct SchemaCompiler(MaskCompiler);

impl SchemaCompiler {
    /// A compiler over the vocabulary of `tokenizer_json` (a `tokenizer.json`'s text).
    pub fn new(tokenizer_json: &str) -> Result<SchemaCompiler, RequestError> {
        MaskCompiler::new(tokenizer_json).map(SchemaCompiler)
    }
}

impl JsonSchemaCompiler for SchemaCompiler {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
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
        self.0
            .constraint(&Constraint::JsonSchema(schema), vocab, eos)
            .map_err(|e| ConstraintError {
                reason: e.to_string(),
            })
    }
}
