//! The routes and what they share: [`AppState`] (the engine and the served model's name) and
//! [`router`]; the small endpoints (`/v1/models`, `/metrics`, `/health`) and the
//! JSON 404 and 405 answers live here, the generation endpoints in `handlers`, `/tokenize` and
//! `/detokenize` in `tokenize`.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metrale::chat::{ReasoningParser, ToolCallParser};
use metrale::{Engine, SamplingParams};
use serde_json::json;

use super::error::ApiError;
use super::options::GenerationConfig;
use super::{handlers, prometheus, tokenize};

/// Largest request body accepted (a long prompt as a token-id array fits many times over).
const MAX_BODY_BYTES: usize = 16 << 20;

/// What every handler shares.
#[derive(Debug)]
pub struct AppState {
    engine: Arc<Engine>,
    model_id: String,
    /// Unix seconds when the server started (`created` of the model).
    started: u64,
    /// The sampling of a request that sets no sampling field (`GenerationConfig`).
    sampling_base: SamplingParams,
    tool_call_parser: ToolCallParser,
    reasoning_parser: ReasoningParser,
}

impl AppState {
    /// Serve `engine` as `model_id` (`ServerOptions::model_id` names a checkpoint by its
    /// directory), with [`GenerationConfig::Auto`].
    pub fn new(engine: Arc<Engine>, model_id: impl Into<String>) -> AppState {
        let started = unix_seconds();
        AppState {
            engine,
            model_id: model_id.into(),
            started,
            sampling_base: SamplingParams::default(),
            tool_call_parser: ToolCallParser::Auto,
            reasoning_parser: ReasoningParser::Auto,
        }
        .generation_config(GenerationConfig::Auto)
    }

    /// Read chat answers' tool calls and reasoning with these parsers (default both `Auto`).
    pub fn parsers(mut self, tool_calls: ToolCallParser, reasoning: ReasoningParser) -> AppState {
        self.tool_call_parser = tool_calls;
        self.reasoning_parser = reasoning;
        self
    }

    /// The chat answers' parsers.
    pub(crate) fn parsers_of(&self) -> (ToolCallParser, ReasoningParser) {
        (self.tool_call_parser, self.reasoning_parser)
    }

    /// Take the sampling defaults from `source`: with `Auto`, the checkpoint's
    /// `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` where its
    /// `generation_config.json` sets them, then OpenAI's; with `Ignore`, OpenAI's alone. A
    /// field the request sets wins over both.
    pub fn generation_config(mut self, source: GenerationConfig) -> AppState {
        // OpenAI's defaults: temperature 1, top-p 1, every token, no penalty.
        let openai = SamplingParams::default().temperature(1.0);
        self.sampling_base = match source {
            GenerationConfig::Ignore => openai,
            _ => openai.with_checkpoint_defaults(&self.engine.config().checkpoint.generation),
        };
        self
    }

    /// The sampling of a request that sets no sampling field.
    pub(crate) fn sampling_base(&self) -> SamplingParams {
        self.sampling_base.clone()
    }

    /// The served model's name.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// A 404 unless `model` is absent or the served one.
    pub(crate) fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_id => Err(ApiError::not_found(
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    self.model_id
                ),
                "model_not_found",
            )),
            _ => Ok(()),
        }
    }
}

/// Unix seconds now.
pub(crate) fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The server's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/chat/completions", post(handlers::chat_completions))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok" }))
        .fallback(|| async { ApiError::not_found("no such endpoint", "not_found").into_response() })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "this endpoint does not take that method",
            )
            .code("method_not_allowed")
            .into_response()
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

fn model_json(state: &AppState) -> serde_json::Value {
    json!({
        "id": state.model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "metrale",
        "max_model_len": state.engine.max_context(),
    })
}

async fn list_models(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_json(&state)]})).into_response()
}

async fn get_model(State(state): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> Response {
    match state.check_model(Some(&id)) {
        Ok(()) => axum::Json(model_json(&state)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = prometheus::render(&state.engine.metrics());
    ([(header::CONTENT_TYPE, prometheus::CONTENT_TYPE)], text).into_response()
}
