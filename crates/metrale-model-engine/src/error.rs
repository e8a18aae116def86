//! `ModelError`: what loading a checkpoint or running a step can fail with.

use metrale_cache::CacheError;
use metrale_config::ConfigError;
use metrale_gpu_runtime::GpuError;
use metrale_model_layers::circuit_exec::CircuitExecError;
use metrale_model_layers::weight_map::WeightError;

/// An error of the model engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The checkpoint's config.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The checkpoint's weights.
    #[error(transparent)]
    Weights(#[from] WeightError),
    /// The device.
    #[error("device: {0}")]
    Gpu(#[from] GpuError),
    /// The KV cache.
    #[error("KV cache: {0}")]
    Cache(#[from] CacheError),
    /// Options that cannot work together or with this model.
    #[error("invalid option `{option}`: {problem}")]
    Options {
        /// The option's name.
        option: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// A step that does not fit the buffers or the model (a caller bug or a bad request that
    /// slipped past validation).
    #[error("invalid step: {0}")]
    Step(String),
    /// The circuit executor refused the model or failed to compile it.
    #[error(transparent)]
    Circuit(#[from] CircuitExecError),
    /// A request the scheduler refused.
    #[error(transparent)]
    Request(#[from] crate::scheduler::InvalidRequest),
    /// A model feature this engine does not run.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// Speculative decoding generated other tokens than plain greedy decoding of the same
    /// request, which it must reproduce exactly (found by the benchmarks that compare them).
    #[error(
        "speculative decoding with the {drafter} drafter at concurrency {concurrency} diverged \
         from plain greedy decoding: request {request}, output token {position}: {speculative:?} \
         where plain decoding has {plain:?}"
    )]
    SpeculativeMismatch {
        /// The drafter (`oracle`, `mtp`).
        drafter: &'static str,
        /// Requests in flight together.
        concurrency: usize,
        /// The request, in submission order.
        request: usize,
        /// The first output position where the tokens differ.
        position: usize,
        /// Plain decoding's token there (`None`: its output ended before).
        plain: Option<u32>,
        /// Speculative decoding's token there (`None`: its output ended before).
        speculative: Option<u32>,
    },
    /// A tokenizer whose vocabulary does not fit the model's: it has ids the embedding has no
    /// row for.
    #[error("the tokenizer has {tokenizer} tokens, more than the model's vocabulary of {model}")]
    TokenizerVocab {
        /// Tokens of the tokenizer (special tokens included).
        tokenizer: usize,
        /// The model's vocabulary (`vocab_size`: the embedding's rows).
        model: usize,
    },
}
