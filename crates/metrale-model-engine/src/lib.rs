//! The model engine: `TransformerModel` (one step of rows through every layer), `model_circuit`
//! (which forward runs its decode steps: the legacy layer walk or the circuit executor), `factory`
//! (a checkpoint directory to a model on a backend), `generate` (one sequence from prompt to
//! finish, plainly or with `speculative` decoding), `scheduler` (continuous batching of many
//! requests) and host-side `sampling`.

pub mod bench;
pub mod error;
pub mod factory;
pub mod generate;
pub mod model;
pub mod model_circuit;
pub mod options;
pub mod sampling;
pub mod scheduler;
pub mod speculative;

pub use error::ModelError;
pub use model::TransformerModel;
pub use model_circuit::{ForwardDisclosure, ForwardSelect, ModelCircuit};
pub use options::ModelOptions;
