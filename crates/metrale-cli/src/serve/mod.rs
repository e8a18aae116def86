//! `metrale serve`: an OpenAI-compatible HTTP server over one [`metrale::Engine`].
//!
//! Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (chat
//! template from the checkpoint's `tokenizer_config.json`), server-sent events when a request
//! asks to `stream`, `GET /metrics` (Prometheus text) and `GET /health`.
//!
//! This is a library (`metrale_serve`) so that its integration tests run the server in-process;
//! the `metrale` binary's `serve` subcommand calls [`run`]. Code map:
//! - `router`: the routes, the shared [`AppState`], `/v1/models`, `/metrics`, `/health`;
//! - `handlers`: the two generation endpoints, from OpenAI request to `GenerateRequest` and back;
//! - `openai`: the OpenAI wire types;
//! - `sse`: a request's events as a server-sent-event body;
//! - `chat`: the chat template (minijinja);
//! - `prometheus`: `EngineMetrics` as Prometheus text;
//! - `error`: `ApiError`, OpenAI's error JSON with its HTTP status.
//!
//! Invariants:
//! - The async runtime never blocks: tokenizing and submitting run in `spawn_blocking`, and a
//!   request's events are awaited through the handle's `Stream`.
//! - Every request owns its `RequestHandle` until it has finished; when the client goes away
//!   (its connection closes, so the handler future or the SSE body is dropped), the handle is
//!   dropped with it and the engine cancels the request.
//! - Client mistakes get 4xx with OpenAI's error JSON; 5xx means the engine itself failed.

mod chat;
mod error;
mod handlers;
mod openai;
mod prometheus;
mod router;
mod sse;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use metrale::{Backend, Engine, EngineOptions, GateOptions, ModelOptions, Speculative};

pub use chat::ChatTemplate;
pub use error::ApiError;
pub use prometheus::render as prometheus_text;
pub use router::{AppState, router};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The CPU reference backend.
    Cpu,
    /// An NVIDIA GPU (a build with the `cuda` feature).
    Cuda,
}

/// Speculative decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpeculativeArg {
    /// Plain decode.
    Off,
    /// The checkpoint's MTP head drafts (Qwen3.5 / Qwen3-Next).
    Mtp,
}

/// `metrale serve`'s flags.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Checkpoint directory (config.json + safetensors, tokenizer.json for text). Default: the
    /// bundled tiny checkpoint.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The model's name in the API (`/v1/models`, the requests' `model`). Default: the
    /// checkpoint directory's name.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Where the model runs.
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    pub backend: BackendArg,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Most tokens per step (prefill chunk size and token budget).
    #[arg(long, default_value_t = ModelOptions::default().max_batch_tokens)]
    pub max_batch_tokens: usize,
    /// Most requests running at once (the widest decode step).
    #[arg(long, default_value_t = ModelOptions::default().max_decode_seqs)]
    pub max_decode_seqs: usize,
    /// Longest sequence, prompt plus output. Default: the model's, capped at 4096.
    #[arg(long)]
    pub max_seq_len: Option<usize>,
    /// KV-cache blocks. Default: enough for `max_decode_seqs` sequences of `max_seq_len`.
    #[arg(long)]
    pub num_kv_blocks: Option<usize>,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = ModelOptions::default().block_size)]
    pub block_size: usize,
    /// Most requests waiting for admission; more get 429.
    #[arg(long, default_value_t = EngineOptions::default().max_queued_requests)]
    pub max_queued_requests: usize,
    /// Turn prefix caching off: every prompt is computed from its first token, and no KV block
    /// or SSM snapshot is kept for later requests.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// SSM state snapshots kept for prefix caching on hybrid models. Default: twice
    /// `--max-decode-seqs`.
    #[arg(long)]
    pub ssm_snapshot_slots: Option<usize>,
    /// Hybrid models: also end prefill chunks (and keep an SSM snapshot) at every multiple of
    /// this many tokens, a multiple of 64 with the default blocks. Default: only every
    /// `--max-batch-tokens`.
    #[arg(long)]
    pub ssm_snapshot_stride: Option<usize>,
    /// Speculative decoding: with `mtp` the checkpoint's MTP head drafts and decode steps verify
    /// the drafts, while the engine measures it faster than plain decode.
    #[arg(long, value_enum, default_value_t = SpeculativeArg::Off)]
    pub speculative: SpeculativeArg,
    /// Tokens drafted per sequence and verify step with `--speculative mtp` (1 to 8).
    #[arg(long, default_value_t = ModelOptions::default().num_draft_tokens)]
    pub num_draft_tokens: usize,
    /// With `--speculative mtp`: always speculate, instead of turning speculation off while it
    /// measures slower than plain decode.
    #[arg(long)]
    pub no_speculation_gate: bool,
    /// The gate switches modes when the other is faster by more than this many percent.
    #[arg(long, default_value_t = GateOptions::default().margin_percent)]
    pub speculation_margin_percent: u32,
}

impl ServeArgs {
    /// The engine options these flags give.
    pub fn engine_options(&self) -> EngineOptions {
        let backend = match self.backend {
            BackendArg::Cpu => Backend::Cpu,
            BackendArg::Cuda => Backend::cuda(self.device),
        };
        let speculative = match self.speculative {
            SpeculativeArg::Off => Speculative::Off,
            SpeculativeArg::Mtp => Speculative::Mtp,
        };
        let model = ModelOptions::default()
            .max_batch_tokens(self.max_batch_tokens)
            .max_decode_seqs(self.max_decode_seqs)
            .max_seq_len(self.max_seq_len)
            .num_kv_blocks(self.num_kv_blocks)
            .block_size(self.block_size)
            .prefix_caching(!self.no_prefix_caching)
            .ssm_snapshot_slots(self.ssm_snapshot_slots)
            .ssm_snapshot_stride(self.ssm_snapshot_stride)
            .speculative(speculative)
            .num_draft_tokens(self.num_draft_tokens);
        let gate = GateOptions::default()
            .enabled(!self.no_speculation_gate)
            .margin_percent(self.speculation_margin_percent);
        EngineOptions::default()
            .backend(backend)
            .model(model)
            .max_queued_requests(self.max_queued_requests)
            .speculation_gate(gate)
    }
}

/// Load the checkpoint, listen, and serve until Ctrl-C (SIGINT) or SIGTERM; requests in flight
/// finish first.
pub fn run(args: ServeArgs) -> Result<()> {
    let dir = args
        .model
        .clone()
        .unwrap_or_else(metrale::bundled_checkpoint);
    let engine = Engine::load(&dir, args.engine_options())
        .with_context(|| format!("loading {}", dir.display()))?;
    let state = AppState::new(Arc::new(engine), &dir, args.served_model_name.clone())?;
    let model_id = state.model_id().to_string();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_io()
        .thread_name("metrale-serve")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let local: SocketAddr = listener.local_addr().context("reading the bound address")?;
        println!("metrale serve: model `{model_id}` on http://{local}");
        axum::serve(listener, router(Arc::new(state)))
            .with_graceful_shutdown(shutdown_signal())
            .await
            .context("serving")
    })
}

/// Resolves on Ctrl-C or, on Unix, SIGTERM. A signal that cannot be listened for is logged and
/// never fires.
async fn shutdown_signal() {
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    let mut ctrl_c_live = true;
    #[cfg(unix)]
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!("cannot listen for SIGTERM: {e}");
            None
        }
    };
    std::future::poll_fn(|cx| {
        if ctrl_c_live {
            match ctrl_c.as_mut().poll(cx) {
                std::task::Poll::Ready(Ok(())) => return std::task::Poll::Ready(()),
                std::task::Poll::Ready(Err(e)) => {
                    tracing::error!("cannot listen for Ctrl-C: {e}");
                    ctrl_c_live = false;
                }
                std::task::Poll::Pending => {}
            }
        }
        #[cfg(unix)]
        if let Some(t) = term.as_mut()
            && t.poll_recv(cx).is_ready()
        {
            return std::task::Poll::Ready(());
        }
        std::task::Poll::Pending
    })
    .await;
    eprintln!("metrale serve: shutting down");
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn prefix_caching_is_on_by_default_and_the_flags_reach_the_options() {
        let parse = |args: &[&str]| {
            let mut argv = vec!["metrale-serve"];
            argv.extend(args);
            Cli::try_parse_from(argv).map(|c| c.serve.engine_options().model)
        };
        let default = parse(&[]).unwrap();
        assert!(default.prefix_caching);
        assert_eq!(default.ssm_snapshot_slots, None);
        assert_eq!(default.ssm_snapshot_stride, None);
        let off = parse(&["--no-prefix-caching", "--ssm-snapshot-slots", "3"]).unwrap();
        assert!(!off.prefix_caching);
        assert_eq!(off.ssm_snapshot_slots, Some(3));
        let strided = parse(&["--ssm-snapshot-stride", "128"]).unwrap();
        assert_eq!(strided.ssm_snapshot_stride, Some(128));
        assert!(parse(&["--ssm-snapshot-slots", "many"]).is_err());
    }

    #[test]
    fn speculation_is_off_by_default_and_its_flags_reach_the_options() {
        let parse = |args: &[&str]| {
            let mut argv = vec!["metrale-serve"];
            argv.extend(args);
            Cli::try_parse_from(argv).map(|c| c.serve.engine_options())
        };
        let default = parse(&[]).unwrap();
        assert_eq!(default.model.speculative, Speculative::Off);
        assert!(default.speculation_gate.enabled);
        let on = parse(&[
            "--speculative",
            "mtp",
            "--num-draft-tokens",
            "3",
            "--no-speculation-gate",
            "--speculation-margin-percent",
            "9",
        ])
        .unwrap();
        assert_eq!(on.model.speculative, Speculative::Mtp);
        assert_eq!(on.model.num_draft_tokens, 3);
        assert!(!on.speculation_gate.enabled);
        assert_eq!(on.speculation_gate.margin_percent, 9);
        assert!(parse(&["--speculative", "eagle"]).is_err());
    }
}
