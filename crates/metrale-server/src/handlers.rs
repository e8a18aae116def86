//! `POST /v1/completions` and `POST /v1/chat/completions`: an OpenAI request becomes a
//! `GenerateRequest` (completions) or a `ChatRequest` (chat: messages, tools and tool choice,
//! rendered by the engine's chat template and its answer read apart into reasoning, content and
//! tool calls by the server's parsers), submitted off the async runtime; its output comes back
//! as one JSON response or as server-sent events. `response_format` constrains either.
//!
//! `n` choices share one prefill of the prompt; the response holds them in index order (with
//! `best_of`, the `n` best by cumulative logprob, best first), and its usage counts the prompt
//! once and the tokens of every returned choice.
//!
//! A field the request leaves out takes, in order: the checkpoint's `generation_config.json`
//! (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`; with
//! `GenerationConfig::Auto`, the default), then OpenAI's defaults: `max_tokens` 16 for
//! completions and the rest of the context for chat, `temperature` 1, `top_p` 1, all tokens
//! (`top_k` 0), no penalties or bias, a fresh seed per request. A `max_tokens` past the end of
//! the context is allowed; generation then ends there with `length`. Logprobs, when asked for,
//! are the log_softmax of the model's raw logits (before penalties, bias and temperature).

use std::pin::Pin;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_core::Stream;
use metrale::chat::{ChatHandle, ChatOptions, ChatOutput, ChatRequest, ToolChoice};
use metrale::{
    Constraint, EngineError, GenerateEvent, GenerateOutput, GenerateRequest, Prompt, RequestHandle,
    SamplingParams,
};

use super::error::ApiError;
use super::messages::chat_messages;
use super::openai::{GenerationBody, PromptInput, parse_prompt};
use super::response::{self, ResponseHead};
use super::router::{AppState, unix_seconds};
use super::sse::{Events, Flavor, SseStream};

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, body, Flavor::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, body, Flavor::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn generate(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    flavor: Flavor,
) -> Result<Response, ApiError> {
    let body = GenerationBody::parse(&body_bytes(body)?)?;
    state.check_model(body.model.as_deref())?;
    let prompt = match flavor {
        Flavor::Completion => {
            if body.tools.as_ref().is_some_and(|t| !t.is_empty()) {
                return Err(ApiError::invalid(
                    "`tools` are for /v1/chat/completions",
                    Some("tools"),
                ));
            }
            Source::Prompt(parse_prompt(body.prompt.as_ref())?)
        }
        Flavor::Chat => {
            if state.engine().chat_template().is_none() {
                return Err(ApiError::invalid(
                    format!(
                        "the model `{}` has no chat template (no `chat_template` in its \
                         tokenizer_config.json, no chat_template.jinja); use /v1/completions",
                        state.model_id()
                    ),
                    Some("messages"),
                )
                .code("no_chat_template"));
            }
            let messages = body
                .messages
                .as_deref()
                .ok_or_else(|| ApiError::invalid("`messages` is required", Some("messages")))?;
            let options = ChatOptions::default()
                .kwargs(body.chat_template_kwargs.clone().unwrap_or_default());
            let tools = body.tools()?;
            let tool_choice = body.tool_choice(!tools.is_empty())?;
            let (tool_call_parser, reasoning_parser) = state.parsers_of();
            Source::Chat(Box::new(
                ChatRequest::new(chat_messages(messages)?)
                    .tools(tools)
                    .tool_choice(tool_choice)
                    .parallel_tool_calls(body.parallel_tool_calls.unwrap_or(true))
                    .options(options)
                    .tool_call_parser(tool_call_parser)
                    .reasoning_parser(reasoning_parser),
            ))
        }
    };
    let settings = Settings::of(&body, flavor, &state)?;
    let want_logprobs = settings.sampling.wants_logprobs();
    let n = settings.sampling.n;
    let engine_state = state.clone();
    let events = tokio::task::spawn_blocking(move || submit(&engine_state, prompt, settings))
        .await
        .map_err(|e| ApiError::internal(format!("the submitting task failed: {e}")))??;
    let head = ResponseHead {
        id: format!("{}-{}", flavor.id_prefix(), events.id()),
        created: unix_seconds(),
        model: state.model_id().to_string(),
        logprobs: want_logprobs,
    };
    if body.stream() {
        let stream = SseStream::new(events, head.clone(), body.include_usage(), n)
            .with_logprobs(want_logprobs.then(|| state.engine().clone()));
        return Ok((
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            Body::from_stream(stream),
        )
            .into_response());
    }
    let engine = state.engine();
    let json = match events {
        Events::Generate(handle) => {
            serde_json::to_value(response::completion(engine, head, wait(handle).await?))
        }
        Events::Chat(handle) => {
            serde_json::to_value(response::chat(engine, head, wait_chat(*handle).await?))
        }
    }
    .map_err(|e| ApiError::internal(format!("serializing the response: {e}")))?;
    Ok(axum::Json(json).into_response())
}

/// A request's body, or the 4xx axum gives a body it could not read (too large, ...).
pub(crate) fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        ApiError::new(
            rejection.status(),
            "invalid_request_error",
            rejection.body_text(),
        )
    })
}

/// What a request asks for besides its prompt.
#[derive(Debug)]
struct Settings {
    max_tokens: Option<usize>,
    sampling: SamplingParams,
    stop_strings: Vec<String>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    response_format: Option<Constraint>,
}

impl Settings {
    fn of(body: &GenerationBody, flavor: Flavor, state: &AppState) -> Result<Settings, ApiError> {
        let mut sampling = state.sampling_base();
        match body.top_k {
            None => {}
            Some(-1) => sampling = sampling.top_k(0),
            Some(k) => {
                sampling = sampling.top_k(usize::try_from(k).map_err(|_| {
                    ApiError::invalid(
                        format!("`top_k` = {k}: must be >= 0 (0 or -1: all tokens)"),
                        Some("top_k"),
                    )
                })?)
            }
        }
        if let Some(t) = body.temperature {
            sampling = sampling.temperature(t);
        }
        if let Some(p) = body.top_p {
            sampling = sampling.top_p(p);
        }
        // A negative seed is a seed too: its bits are taken as they are. Without one the engine
        // draws a fresh seed for the request.
        if let Some(seed) = body.seed {
            sampling = sampling.seed(seed as u64);
        }
        if let Some(p) = body.presence_penalty {
            sampling = sampling.presence_penalty(p);
        }
        if let Some(p) = body.frequency_penalty {
            sampling = sampling.frequency_penalty(p);
        }
        if let Some(r) = body.repetition_penalty {
            sampling = sampling.repetition_penalty(r);
        }
        if let Some(p) = body.min_p {
            sampling = sampling.min_p(p);
        }
        if let Some(n) = body.min_tokens {
            sampling = sampling.min_tokens(n);
        }
        let (n, best_of) = body.choices(flavor == Flavor::Chat)?;
        sampling = sampling.n(n);
        if let Some(b) = best_of {
            sampling = sampling.best_of(b);
        }
        sampling = sampling.logit_bias(body.logit_bias()?);
        if let Some(top) = body.logprobs(flavor == Flavor::Chat)? {
            sampling = sampling.logprobs(true).top_logprobs(top);
        }
        sampling.validate().map_err(|e| {
            let field = e.field;
            ApiError::invalid(e.to_string(), Some(field))
        })?;
        Ok(Settings {
            max_tokens: body.max_tokens.or(body.max_completion_tokens),
            sampling,
            stop_strings: body.stop_strings()?,
            stop_token_ids: body.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: body.ignore_eos.unwrap_or(false),
            response_format: body.response_format()?,
        })
    }
}

/// Where a request's prompt comes from.
#[derive(Debug)]
enum Source {
    /// `/v1/completions`' `prompt`.
    Prompt(PromptInput),
    /// `/v1/chat/completions`' messages and tools (its generation settings still to set).
    Chat(Box<ChatRequest>),
}

/// Render the chat template (the engine's), tokenize and submit (blocking: run it off the async runtime).
fn submit(state: &AppState, source: Source, s: Settings) -> Result<Events, ApiError> {
    let engine = state.engine();
    let generation = |prompt: Prompt, max_new_tokens: usize| {
        GenerateRequest::new(prompt)
            .max_new_tokens(max_new_tokens)
            .sampling(s.sampling)
            .ignore_eos(s.ignore_eos)
            .stop_token_ids(s.stop_token_ids.clone())
            .stop_strings(s.stop_strings.clone())
            .constraint(s.response_format.clone())
    };
    match source {
        Source::Prompt(p) => {
            let ids = match p {
                PromptInput::Text(text) => engine.encode(&text)?,
                PromptInput::TokenIds(ids) => ids,
            };
            let max_new_tokens = s.max_tokens.unwrap_or(16);
            let request = generation(Prompt::TokenIds(ids), max_new_tokens);
            Ok(Events::Generate(engine.submit(request)?))
        }
        Source::Chat(chat) => {
            // Without `max_tokens`, the rest of the context: the library clips it to the
            // context once the prompt is rendered.
            let max_new_tokens = s.max_tokens.unwrap_or(engine.max_context());
            let forced = matches!(
                chat.tool_choice,
                ToolChoice::Required | ToolChoice::Function(_)
            );
            let chat = chat.generation(generation(Prompt::TokenIds(Vec::new()), max_new_tokens));
            engine
                .submit_chat(chat)
                .map(|h| Events::Chat(Box::new(h)))
                .map_err(|e| {
                    let mut api = ApiError::from(e);
                    // A forced call's grammar comes from the tools' schemas.
                    if forced && api.param.as_deref() == Some("response_format") {
                        api.param = Some("tools".into());
                    }
                    api
                })
        }
    }
}

/// A chat request's answer, awaited through the handle's `Stream`; dropping the future cancels
/// the request.
async fn wait_chat(mut handle: ChatHandle) -> Result<ChatOutput, EngineError> {
    loop {
        match std::future::poll_fn(|cx| Pin::new(&mut handle).poll_next(cx)).await {
            Some(Ok(metrale::chat::ChatEvent::Finished { output })) => return Ok(output),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e),
            None => return Err(EngineError::ShutDown),
        }
    }
}

/// The request's output, awaited through the handle's `Stream`. Dropping this future (the
/// client went away) drops the handle, which cancels the request.
async fn wait(mut handle: RequestHandle) -> Result<GenerateOutput, EngineError> {
    loop {
        match std::future::poll_fn(|cx| Pin::new(&mut handle).poll_next(cx)).await {
            Some(Ok(GenerateEvent::Finished { output })) => return Ok(output),
            // Tokens (and any event this server does not know) until the output.
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e),
            None => return Err(EngineError::ShutDown),
        }
    }
}
