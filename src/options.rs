//! `EngineOptions` and `Backend`: how an engine loads and runs a model. Both grow with the
//! engine, so they are `#[non_exhaustive]`: start from `EngineOptions::default()` and change what
//! differs with the setters (or by assigning the public fields).

use std::time::Duration;

use metrale_model_engine::options::ModelOptions;
use metrale_model_engine::runner::ForwardSelect;
use metrale_model_engine::speculative::GateOptions;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Backend {
    /// The CPU reference backend. The default.
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal (needs the `cuda` feature). A model split over
    /// `ModelOptions::tensor_parallel_size` = N ranks runs rank `r` on GPU `device + r`, the
    /// ranks exchanging partial sums through NCCL.
    Cuda {
        /// Device ordinal (of rank 0).
        device: usize,
    },
}

impl Backend {
    /// The NVIDIA GPU with ordinal `device`.
    pub fn cuda(device: usize) -> Backend {
        Backend::Cuda { device }
    }
}

/// How to load and run a model. Every field has a documented default:
///
/// ```
/// use metrale::{Backend, EngineOptions, ModelOptions};
///
/// let options = EngineOptions::default()
///     .backend(Backend::Cpu)
///     .model(ModelOptions::default().max_batch_tokens(256).max_decode_seqs(16))
///     .max_queued_requests(64);
/// assert_eq!(options.model.max_decode_seqs, 16);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineOptions {
    /// Where the model runs. Default CPU.
    pub backend: Backend,
    /// Buffer and cache sizes; `max_batch_tokens` is also the scheduler's prefill chunk and
    /// token budget between decode steps, `max_decode_seqs` the most requests running at once,
    /// `prefix_caching` (default on) whether requests share the KV blocks (and, on hybrid
    /// models, SSM state snapshots) of prompt prefixes computed before, `reprefill_answers`
    /// (default on) whether a hybrid model prefills finished conversations again so that
    /// follow-up turns share the answers too. Default `ModelOptions::default()`.
    pub model: ModelOptions,
    /// Most requests waiting for admission (submitted, not yet running); `submit` refuses more
    /// with `EngineError::QueueFull`. Default 1024.
    pub max_queued_requests: usize,
    /// The window `EngineMetrics::tokens_per_second` averages over. Default 10 s.
    pub metrics_window: Duration,
    /// With `model.speculative = Mtp`: when the scheduler keeps speculating (it measures
    /// tokens/s with and without, and turns speculation off while it is slower). Default
    /// `GateOptions::default()`.
    pub speculation_gate: GateOptions,
    /// Which forward runs decode steps: the layers' own (`ForwardSelect::Legacy`, the default)
    /// or the circuit executor's compiled programs. Set it with `EngineOptions::forward`, which
    /// only the `unstable` feature has: forward selection is a development tool.
    pub(crate) forward: ForwardSelect,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            backend: Backend::default(),
            model: ModelOptions::default(),
            max_queued_requests: 1024,
            metrics_window: Duration::from_secs(10),
            speculation_gate: GateOptions::default(),
            forward: ForwardSelect::default(),
        }
    }
}

impl EngineOptions {
    /// Set `backend`.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Set `model`.
    pub fn model(mut self, model: ModelOptions) -> Self {
        self.model = model;
        self
    }

    /// Set `max_queued_requests`.
    pub fn max_queued_requests(mut self, n: usize) -> Self {
        self.max_queued_requests = n;
        self
    }

    /// Set `metrics_window`.
    pub fn metrics_window(mut self, window: Duration) -> Self {
        self.metrics_window = window;
        self
    }

    /// Set `speculation_gate`.
    pub fn speculation_gate(mut self, gate: GateOptions) -> Self {
        self.speculation_gate = gate;
        self
    }

    /// Which forward runs decode steps (default `ForwardSelect::Legacy`). A model the circuit
    /// does not model fails `Engine::load`, naming what it does not model. Development tooling:
    /// only with the `unstable` feature.
    #[cfg(feature = "unstable")]
    pub fn forward(mut self, forward: ForwardSelect) -> Self {
        self.forward = forward;
        self
    }

    /// The forward that runs decode steps. Only with the `unstable` feature.
    #[cfg(feature = "unstable")]
    pub fn forward_select(&self) -> ForwardSelect {
        self.forward
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_documented_ones_and_the_setters_change_one_field() {
        let d = EngineOptions::default();
        assert_eq!(d.backend, Backend::Cpu);
        assert_eq!(d.max_queued_requests, 1024);
        assert_eq!(d.metrics_window, Duration::from_secs(10));
        assert_eq!(d.forward, ForwardSelect::Legacy);
        let o = d
            .clone()
            .backend(Backend::cuda(1))
            .max_queued_requests(3)
            .speculation_gate(GateOptions::default().enabled(false));
        assert_eq!(o.backend, Backend::Cuda { device: 1 });
        assert_eq!(o.max_queued_requests, 3);
        assert!(!o.speculation_gate.enabled);
        assert_eq!(o.model, d.model);
        assert_eq!(o.metrics_window, d.metrics_window);
    }
}
