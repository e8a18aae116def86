//! metrale-server: an OpenAI-compatible HTTP server over one [`metrale::Engine`].
//!
//! Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the
//! checkpoint's chat template, rendered by the engine), server-sent events when a request asks
//! to `stream`, `GET /metrics` (Prometheus text) and `GET /health`.
//!
//! ```no_run
//! use metrale::{EngineOptions, ModelOptions};
//! use metrale_server::{Server, ServerOptions};
//!
//! let options = ServerOptions::new("path/to/Qwen3-0.6B")
//!     .port(8000)
//!     .engine(EngineOptions::default().model(ModelOptions::default().max_decode_seqs(32)));
//! let server = Server::bind(options)?;
//! println!("serving `{}` on http://{}", server.model_id(), server.local_addr());
//! server.run()?; // until Ctrl-C or SIGTERM
//! # Ok::<(), metrale_server::ServerError>(())
//! ```
//!
//! [`router`] and [`AppState`] serve an engine the caller loaded, on the caller's own runtime.
//! `metrale serve` (the `metrale-cli` crate) turns its flags into [`ServerOptions`]. Code map:
//! - `options`: [`ServerOptions`], [`ServerError`];
//! - `router`: the routes, the shared [`AppState`], `/v1/models`, `/metrics`, `/health`;
//! - `handlers`: the two generation endpoints, from OpenAI request to `GenerateRequest` and back;
//! - `openai`: the OpenAI request body;
//! - `response`: the OpenAI responses and stream chunks, and whole responses built from an
//!   output's choices;
//! - `messages`: OpenAI chat messages as `metrale::chat::ChatMessage`s;
//! - `sse`: a request's events as a server-sent-event body;
//! - `prometheus`: `EngineMetrics` as Prometheus text;
//! - `error`: `ApiError`, OpenAI's error JSON with its HTTP status.
//!
//! Invariants:
//! - The async runtime never blocks: rendering, tokenizing and submitting run in
//!   `spawn_blocking`, and a request's events are awaited through the handle's `Stream`.
//! - Every request owns its `RequestHandle` until it has finished; when the client goes away
//!   (its connection closes, so the handler future or the SSE body is dropped), the handle is
//!   dropped with it and the engine cancels the request.
//! - Client mistakes get 4xx with OpenAI's error JSON; 5xx means the engine itself failed.

mod error;
mod handlers;
mod logprobs;
mod messages;
mod openai;
mod options;
mod prometheus;
mod response;
mod router;
mod sse;
mod tokenize;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use metrale::Engine;

pub use error::ApiError;
pub use options::{GenerationConfig, ServerError, ServerOptions};
pub use prometheus::render as prometheus_text;
pub use router::{AppState, router};

/// A loaded engine and a bound listener, ready to serve; see the crate docs.
#[derive(Debug)]
pub struct Server {
    runtime: tokio::runtime::Runtime,
    listener: tokio::net::TcpListener,
    local_addr: SocketAddr,
    state: Arc<AppState>,
}

impl Server {
    /// Load the checkpoint with `options.engine`, start the async runtime and bind
    /// `options.host:options.port` (port 0: any free port, see [`Server::local_addr`]).
    pub fn bind(options: ServerOptions) -> Result<Server, ServerError> {
        let model_id = options.model_id();
        let engine = Engine::load(&options.model, options.engine.clone()).map_err(|source| {
            ServerError::Load {
                path: options.model.clone(),
                source: Box::new(source),
            }
        })?;
        let state = AppState::new(Arc::new(engine), model_id)
            .generation_config(options.generation_config)
            .parsers(options.tool_call_parser, options.reasoning_parser);
        let state = Arc::new(state);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_io()
            .thread_name("metrale-serve")
            .build()
            .map_err(ServerError::Runtime)?;
        let addr = format!("{}:{}", options.host, options.port);
        let bind_error = |source| ServerError::Bind {
            addr: addr.clone(),
            source,
        };
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(&addr))
            .map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        Ok(Server {
            runtime,
            listener,
            local_addr,
            state,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The served model's name (`/v1/models`, the requests' `model`).
    pub fn model_id(&self) -> &str {
        self.state.model_id()
    }

    /// The engine requests go to.
    pub fn engine(&self) -> &Arc<Engine> {
        self.state.engine()
    }

    /// Serve until Ctrl-C (SIGINT) or SIGTERM; requests in flight finish first.
    pub fn run(self) -> Result<(), ServerError> {
        self.run_until(shutdown_signal())
    }

    /// Serve until `shutdown` resolves; requests in flight finish first.
    pub fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let Server {
            runtime,
            listener,
            state,
            ..
        } = self;
        runtime
            .block_on(async move {
                axum::serve(listener, router(state))
                    .with_graceful_shutdown(shutdown)
                    .await
            })
            .map_err(ServerError::Serve)
    }
}

/// Resolves on Ctrl-C or, on Unix, SIGTERM (what [`Server::run`] waits for). A signal that
/// cannot be listened for is logged and never fires. Await it inside the server's runtime
/// (in the future given to [`Server::run_until`]).
pub async fn shutdown_signal() {
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
}
