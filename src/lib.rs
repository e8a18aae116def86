//! metrale: an LLM inference engine for Qwen3 dense and the hybrid Qwen3.5 / Qwen3-Next families.
//!
//! This crate is the public facade: [`Engine`] loads a Hugging Face checkpoint directory
//! (`config.json`, safetensors, optionally `tokenizer.json`) onto a backend and generates tokens
//! for many requests at once (continuous batching on a scheduler thread of its own).
//!
//! ```no_run
//! use metrale::{Engine, EngineOptions, GenerateRequest, Prompt};
//!
//! let engine = Engine::load("path/to/checkpoint", EngineOptions::default())?;
//! let out = engine.generate(&GenerateRequest::new(Prompt::Text("hello".into())).max_new_tokens(8))?;
//! println!("{:?} {:?}", out.token_ids, out.text);
//! # Ok::<(), metrale::EngineError>(())
//! ```
//!
//! Many requests, from any threads, each streaming its tokens:
//!
//! ```no_run
//! use metrale::{Engine, EngineOptions, GenerateEvent, GenerateRequest, Prompt};
//!
//! let engine = Engine::load("path/to/checkpoint", EngineOptions::default())?;
//! let handle = engine.submit(GenerateRequest::new(Prompt::TokenIds(vec![1, 2, 3])).max_new_tokens(8))?;
//! for event in handle {
//!     match event? {
//!         GenerateEvent::Token(t) => print!("{}", t.text_delta.unwrap_or_default()),
//!         GenerateEvent::Finished { output } => println!(" [{}]", output.finish_reason.as_str()),
//!     }
//! }
//! println!("{:?}", engine.metrics());
//! # Ok::<(), metrale::EngineError>(())
//! ```
//!
//! Speculative decoding (`ModelOptions::speculative = Mtp`: the checkpoint's MTP head drafts,
//! the model verifies) runs in the engine's scheduler, behind a gate that keeps it only while it
//! is faster (`EngineOptions::speculation_gate`); [`generate_direct`] runs one request with it
//! on the calling thread.

mod direct;
mod engine;
mod error;
mod frontend;
mod handle;
mod metrics;
mod request;
mod text;
mod worker;

pub use direct::generate_direct;
pub use engine::{Backend, Engine, EngineOptions, make_backend};
pub use metrale_model_engine::bench;

/// The circuit a checkpoint's decode step is compiled from: its plan without loading weights
/// (`metrale circuit plan`), and the fusions a [`ForwardSelect::Circuit`] lowers with.
pub mod circuit {
    pub use metrale_model_engine::runner::{
        Digest, Fusions, checkpoint_plan, checkpoint_plans, plans_digest,
    };
    pub use metrale_model_layers::circuit_exec::{Plan, Step};
}

/// Internals that the crate's own benchmarks (`benches/`) drive directly. Not part of the API:
/// hidden from the documentation, and free to change with any release.
#[doc(hidden)]
pub mod bench_internals {
    pub use crate::text::TextStream;
}

/// The device layer, for tools built on the engine (benchmarks, tests).
pub mod gpu {
    pub use metrale_gpu_runtime::{CpuBackend, GpuBackend, GpuError};
}
pub use error::{EngineError, RequestError};
pub use handle::{Canceller, EventResult, RequestHandle, RequestId};
pub use metrale_config::ModelConfig;
pub use metrale_model_engine::generate::FinishReason;
pub use metrale_model_engine::options::{MAX_DRAFT_TOKENS, ModelOptions, Speculative};
pub use metrale_model_engine::runner::{ForwardDisclosure, ForwardSelect};
pub use metrale_model_engine::sampling::SamplingParams;
pub use metrale_model_engine::scheduler::{CacheUsage, PrefixStats, SnapshotUsage, StepCounts};
pub use metrale_model_engine::speculative::GateOptions;
pub use metrics::{EngineMetrics, RequestCounts, SpeculationMetrics};
pub use request::{GenerateEvent, GenerateOutput, GenerateRequest, Prompt, TokenEvent};

/// The bundled tiny checkpoint (a random Qwen3 with a small tokenizer), for trying the engine
/// without downloading anything.
pub fn bundled_checkpoint() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tiny")
}
