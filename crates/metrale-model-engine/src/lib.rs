//! The model engine: `Model` (a checkpoint's weights and the launches of one step through them),
//! `runner` (`StepRunner`: a step's buffers, graphs and forward choice — the legacy layer walk or
//! the circuit executor, `ModelCircuit`), the `CacheManager` it steps over (from
//! `metrale-cache`), `factory` (a checkpoint directory to a model on a backend), `scheduler`
//! (continuous batching and the one generation loop, speculative decoding included), `generate`
//! (that loop on the caller's thread), `speculative` (drafters, acceptance, the gate) and
//! host-side `sampling`; `constraint` (`TokenConstraint`: a structured-output grammar's
//! allowed-token bitmask per step).

pub mod bench;
pub mod constraint;
pub mod error;
pub mod factory;
pub mod generate;
pub mod model;
pub mod options;
pub mod runner;
pub mod sampling;
pub mod scheduler;
pub mod speculative;

pub use error::ModelError;
pub use metrale_cache::CacheManager;
pub use model::Model;
pub use options::{KvCacheDtype, ModelOptions, Quantization};
pub use runner::{ForwardDisclosure, ForwardSelect, ModelCircuit, StepRunner};
pub use scheduler::Scheduler;
