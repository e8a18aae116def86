//! `ApiError`: an error as OpenAI sends it, `{"error": {"message", "type", "param", "code"}}`,
//! with its HTTP status; and how each engine error maps to one.
//!
//! Invariant: client mistakes (bad JSON, parameters out of range, a prompt too long, a token
//! outside the vocabulary, a full queue) are 4xx; only a failed engine (an aborted step, an
//! engine that has shut down) is 5xx.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use metrale::chat::ChatTemplateError;
use metrale::{EngineError, RequestError};
use serde_json::json;

/// See the module header.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// A machine-readable code, e.g. `context_length_exceeded`.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// An error of `status` and OpenAI type `kind`, without a param or code.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// A 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = param.map(str::to_string);
        e
    }

    /// Set the code.
    pub fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// A 404 for a path, or a model, that does not exist.
    pub fn not_found(message: impl Into<String>, code: &'static str) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message).code(code)
    }

    /// A 500: the server failed.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body, `{"error": {...}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.status, self.kind, self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> ApiError {
        let message = e.to_string();
        match e {
            RequestError::EmptyPrompt
            | RequestError::TokenOutOfVocab { .. }
            | RequestError::Tokenize(_) => ApiError::invalid(message, Some("prompt")),
            RequestError::NoTokenizer => ApiError::invalid(message, None),
            RequestError::PromptTooLong { .. } => {
                ApiError::invalid(message, Some("prompt")).code("context_length_exceeded")
            }
            RequestError::Sampling(s) => ApiError::invalid(message, Some(s.field)),
            RequestError::EmptyStopString { .. } => ApiError::invalid(message, Some("stop")),
            RequestError::Constraint { .. } => ApiError::invalid(message, Some("response_format")),
            RequestError::ToolChoice { .. } => ApiError::invalid(message, Some("tool_choice")),
            _ => ApiError::invalid(message, None),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        let message = e.to_string();
        match e {
            EngineError::Request(r) => r.into(),
            EngineError::ChatTemplate(t) => t.into(),
            EngineError::QueueFull { .. } => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
                    .code("queue_full")
            }
            EngineError::ShutDown => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                    .code("engine_shut_down")
            }
            other => {
                tracing::error!("engine error: {other}");
                ApiError::internal(message)
            }
        }
    }
}

impl From<ChatTemplateError> for ApiError {
    /// Rendering a chat request: a checkpoint without a template, no messages and a template
    /// that fails on the messages (its own `raise_exception` included) are the client's
    /// mistakes; anything else is the server's.
    fn from(e: ChatTemplateError) -> ApiError {
        let message = e.to_string();
        match e {
            ChatTemplateError::NoTemplate => {
                ApiError::invalid(message, Some("messages")).code("no_chat_template")
            }
            ChatTemplateError::NoMessages => {
                ApiError::invalid("`messages` is empty", Some("messages"))
            }
            ChatTemplateError::Render { .. } => ApiError::invalid(message, Some("messages")),
            _ => ApiError::internal(message),
        }
    }
}
