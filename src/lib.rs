//! metrale: an LLM inference engine for Qwen3 dense and the hybrid Qwen3.5 / Qwen3-Next families.
//!
//! This crate is the public facade: [`Engine`] loads a Hugging Face checkpoint directory
//! (`config.json`, safetensors, optionally `tokenizer.json` and a chat template) onto a backend
//! and generates tokens for many requests at once (continuous batching on a scheduler thread of
//! its own).
//!
//! ```no_run
//! use metrale::{Engine, EngineOptions, GenerateRequest, ModelOptions, SamplingParams};
//!
//! let options = EngineOptions::default().model(ModelOptions::default().max_decode_seqs(16));
//! let engine = Engine::load("path/to/checkpoint", options)?;
//! let request = GenerateRequest::new("hello")
//!     .max_new_tokens(8)
//!     .sampling(SamplingParams::default().temperature(0.7).seed(1));
//! let out = engine.generate(&request)?;
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
//!         _ => {}
//!     }
//! }
//! println!("{:?}", engine.metrics());
//! # Ok::<(), metrale::EngineError>(())
//! ```
//!
//! Chat with tools and reasoning: [`Engine::submit_chat`] takes a [`chat::ChatRequest`]
//! (messages, function tools, a tool choice) and streams its answer read apart into reasoning,
//! content and tool calls ([`chat::ChatEvent`]). Structured output: a request's [`Constraint`]
//! (a JSON schema, a regular expression, a Lark grammar, compiled with llguidance) masks each of
//! its tokens to those the grammar allows.
//!
//! Speculative decoding (`ModelOptions::speculative = Mtp`: the checkpoint's MTP head drafts,
//! the model verifies) runs in the engine's scheduler, behind a gate that keeps it only while it
//! is faster (`EngineOptions::speculation_gate`); [`generate_direct`] runs one request with it
//! on the calling thread.
//!
//! # A surface that grows
//! The option, request, output, event and error types are `#[non_exhaustive]`: build options
//! from `Default` and requests from `GenerateRequest::new`, then change what differs with the
//! setters; matches on the enums keep a wildcard arm. New fields and variants then break no
//! caller.
//!
//! # The `unstable` feature
//! Development tooling stays out of the default surface. The cargo feature `unstable` adds it,
//! with no stability promise (it changes with the engine's internals):
//! - `metrale::bench`: the benchmarks of `metrale bench` (random-weight models on the device),
//!   and the compiler of the serving ladder's JSON-schema requests;
//! - `metrale::circuit`: circuit plans and their digests (`metrale circuit plan`);
//! - `metrale::gpu`, `make_backend` and `make_backends`: the raw device backend (and a
//!   tensor-parallel group of them);
//! - forward selection: `ForwardSelect`, `EngineOptions::forward` (the default forward, the
//!   layers' own, is the same with or without the feature), `Engine::forward_disclosure` and
//!   `ForwardDisclosure`.

#[cfg(feature = "unstable")]
pub mod bench;
pub mod chat;
mod constraint;
mod direct;
mod engine;
mod error;
mod frontend;
mod handle;
mod metrics;
mod options;
mod request;
mod text;
mod worker;

pub use constraint::Constraint;
pub use direct::generate_direct;
pub use engine::Engine;
pub use error::{EngineError, RequestError};
pub use handle::{Canceller, EventResult, RequestHandle, RequestId};
pub use metrale_config::{GenerationDefaults, ModelConfig};
pub use metrale_model_engine::generate::FinishReason;
pub use metrale_model_engine::options::{
    KvCacheDtype, MAX_DRAFT_TOKENS, ModelOptions, Quantization, Speculative,
};
pub use metrale_model_engine::sampling::{
    MAX_CHOICES, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams, choice_seed,
};
pub use metrale_model_engine::scheduler::{CacheUsage, PrefixStats, SnapshotUsage, StepCounts};
pub use metrale_model_engine::speculative::GateOptions;
pub use metrics::{EngineMetrics, RequestCounts, SpeculationMetrics};
pub use options::{Backend, EngineOptions};
pub use request::{
    GenerateEvent, GenerateOutput, GenerateRequest, Prompt, TokenEvent, TokenLogprobs,
};

#[cfg(feature = "unstable")]
pub use engine::{make_backend, make_backends};
#[cfg(feature = "unstable")]
pub use metrale_model_engine::runner::{ForwardDisclosure, ForwardSelect};

/// The circuit a checkpoint's decode step is compiled from: its plan without loading weights
/// (`metrale circuit plan`), and the fusions a [`ForwardSelect::Circuit`] lowers with. Only with
/// the `unstable` feature.
#[cfg(feature = "unstable")]
pub mod circuit {
    pub use metrale_model_engine::runner::{
        Digest, Fusions, checkpoint_plan, checkpoint_plans, plans_digest,
    };
    pub use metrale_model_layers::circuit_exec::{Plan, Step, Width};
}

/// Internals that the crate's own benchmarks (`benches/`) drive directly. Not part of the API:
/// hidden from the documentation, and free to change with any release.
#[doc(hidden)]
pub mod bench_internals {
    pub use crate::constraint::{MaskBench, MaskCompiler};
    pub use crate::text::TextStream;
}

/// The device layer, for tools built on the engine (benchmarks, tests). Only with the
/// `unstable` feature.
#[cfg(feature = "unstable")]
pub mod gpu {
    pub use metrale_gpu_runtime::{CpuBackend, GpuBackend, GpuError};
}
