//! `ApiError`: an error as OpenAI sends it, `{"error": {"message", "type", "param", "code"}}`,
//! with its HTTP status; and how each engine error maps to one.
//!
//! Invariant: client mistakes (bad JSON, parameters out of range, a prompt too long, a token
//! outside the vocabulary, a full queue) are 4xx; only a failed engine (an aborted step, an
//! engine that has shut down) is 5xx.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use metrale::{EngineError, RequestError};
use serde_json::json;

/// See the module header.
#[derive(Debug, Clone, PartialEq)]
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
    /// A 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// Set the code.
    pub fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// A 404 for a path, or a model, that does not exist.
    pub fn not_found(message: impl Into<String>, code: &'static str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some(code),
        }
    }

    /// A 500: the server failed.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
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
            _ => ApiError::invalid(message, None),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        let message = e.to_string();
        match e {
            EngineError::Request(r) => r.into(),
            EngineError::QueueFull { .. } => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message,
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            EngineError::ShutDown => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message,
                kind: "server_error",
                param: None,
                code: Some("engine_shut_down"),
            },
            other => {
                tracing::error!("engine error: {other}");
                ApiError::internal(message)
            }
        }
    }
}
