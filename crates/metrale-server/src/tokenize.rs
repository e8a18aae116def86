//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: the token ids a prompt or a chat
//! conversation becomes (with their count and the model's context), and the text ids decode
//! to.
//!
//! `/tokenize` takes either `prompt` (text) or `messages` (rendered through the chat template,
//! `add_generation_prompt` true unless set, `chat_template_kwargs` passed on). Its
//! `add_special_tokens` defaults to false, which gives exactly the ids `/v1/completions` and
//! `/v1/chat/completions` feed for the same prompt or messages (the text or the template writes
//! its special tokens); true adds the tokenizer's own (a BOS, for some). `return_token_strs`
//! adds each id's vocabulary piece. `/detokenize` keeps special tokens, so the chat template's
//! markers come back as written.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use metrale::RequestError;
use metrale::chat::ChatOptions;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::handlers::body_bytes;
use super::messages::chat_messages;
use super::openai::parse_object;
use super::router::AppState;

/// `/tokenize`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeBody {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Value>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    return_token_strs: Option<bool>,
}

/// `/detokenize`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeBody {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// `POST /tokenize`.
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = || -> Result<Value, ApiError> {
        let body: TokenizeBody = parse(body)?;
        state.check_model(body.model.as_deref())?;
        let engine = state.engine();
        let text = match (&body.prompt, &body.messages) {
            (Some(prompt), None) => prompt.clone(),
            (None, Some(messages)) => {
                let options = ChatOptions::default()
                    .add_generation_prompt(body.add_generation_prompt.unwrap_or(true))
                    .kwargs(body.chat_template_kwargs.clone().unwrap_or_default());
                let messages = chat_messages(messages)?;
                engine.apply_chat_template(&messages, &options)?
            }
            _ => {
                return Err(ApiError::invalid(
                    "give exactly one of `prompt` and `messages`",
                    Some("prompt"),
                ));
            }
        };
        let add_special = body.add_special_tokens.unwrap_or(false);
        let tokens = engine
            .tokenize(&text, add_special)
            .map_err(|e| request_error(e, "prompt"))?;
        let token_strs = match body.return_token_strs {
            Some(true) => engine.token_strs(&tokens),
            _ => None,
        };
        Ok(json!({
            "count": tokens.len(),
            "max_model_len": engine.max_context(),
            "tokens": tokens,
            "token_strs": token_strs,
        }))
    };
    respond(answer())
}

/// `POST /detokenize`.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = || -> Result<Value, ApiError> {
        let body: DetokenizeBody = parse(body)?;
        state.check_model(body.model.as_deref())?;
        let prompt = (state.engine())
            .detokenize(&body.tokens, false)
            .map_err(|e| request_error(e, "tokens"))?;
        Ok(json!({ "prompt": prompt }))
    };
    respond(answer())
}

/// A JSON body as `T`; a malformed one gets a 400 naming the field.
fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    parse_object(&body_bytes(body)?)
}

/// A tokenizer error as a 400 naming `field` (a server without a tokenizer names none).
fn request_error(e: RequestError, field: &str) -> ApiError {
    match e {
        RequestError::NoTokenizer => ApiError::invalid(e.to_string(), None),
        other => ApiError::invalid(other.to_string(), Some(field)),
    }
}

fn respond(answer: Result<Value, ApiError>) -> Response {
    match answer {
        Ok(value) => axum::Json(value).into_response(),
        Err(e) => e.into_response(),
    }
}
