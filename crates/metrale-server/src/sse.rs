//! `SseStream`: a request's events as a server-sent-event body in OpenAI's shape: for chat a
//! first chunk with the assistant's role for each choice, then a chunk per generated token (its
//! id, when asked for its logprobs, and what it adds: for a completion its text; for chat
//! `delta.reasoning_content`, `delta.content`, and for a tool call a chunk
//! `delta.tool_calls: [{index, id, type, function: {name, arguments: ""}}]` when it starts, then
//! one `[{index, function: {arguments}}]` per token that adds to its arguments (their
//! concatenation is the arguments' text); markup never reaches `content`), a last chunk per
//! choice with its finish reason (`tool_calls` when calls were made) when that choice ends, a
//! usage chunk when asked for (the prompt once, the tokens of every choice), then
//! `data: [DONE]`. Every chunk carries one choice, named by its `index`; the choices' chunks
//! interleave as the engine generates them. An engine error ends the stream with
//! `data: {"error": ...}` and `[DONE]`.
//!
//! Invariant: the stream owns the request's handle until the request has finished; hyper drops
//! the body when the client disconnects, and with it the handle, which cancels the request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Bytes;
use futures_core::Stream;
use std::sync::Arc;

use metrale::chat::{ChatEvent, ChatHandle};
use metrale::{Engine, EngineError, EventResult, GenerateEvent, RequestHandle};
use serde::Serialize;

use super::error::ApiError;
use super::logprobs;
use super::response::{
    ChatChunkChoice, ChatDelta, CompletionChoice, Envelope, FunctionOut, ResponseHead, ToolCallOut,
    Usage, chat_usage,
};

/// A submitted request's events: a completion's tokens, or a chat answer read apart.
#[derive(Debug)]
pub enum Events {
    /// `/v1/completions`.
    Generate(RequestHandle),
    /// `/v1/chat/completions` (boxed: a chat handle carries its answer's parser).
    Chat(Box<ChatHandle>),
}

impl Events {
    /// The request's id number.
    pub fn id(&self) -> u64 {
        match self {
            Events::Generate(h) => h.id().0,
            Events::Chat(h) => h.id().0,
        }
    }

    fn flavor(&self) -> Flavor {
        match self {
            Events::Generate(_) => Flavor::Completion,
            Events::Chat(_) => Flavor::Chat,
        }
    }
}

/// Which endpoint's shapes to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

impl Flavor {
    /// The response id's prefix.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Flavor::Completion => "cmpl",
            Flavor::Chat => "chatcmpl",
        }
    }

    fn chunk_object(self) -> &'static str {
        match self {
            Flavor::Completion => "text_completion",
            Flavor::Chat => "chat.completion.chunk",
        }
    }
}

/// See the module header.
#[derive(Debug)]
pub struct SseStream {
    /// `None` once the request has ended.
    handle: Option<Events>,
    flavor: Flavor,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// The engine (its tokenizer spells the tokens) when the request asked for logprobs.
    logprobs: Option<Arc<Engine>>,
    /// Entry `c`: characters of choice `c`'s text so far, in the legacy logprobs shape
    /// (`text_offset`).
    offsets: Vec<usize>,
    /// Entry `c`: choice `c` has sent its finish chunk.
    finished: Vec<bool>,
    /// Events ready to send.
    ready: VecDeque<Bytes>,
}

impl SseStream {
    /// The body for `handle`'s events, a request of `n` choices.
    pub fn new(handle: Events, head: ResponseHead, include_usage: bool, n: usize) -> SseStream {
        let flavor = handle.flavor();
        let mut s = SseStream {
            handle: Some(handle),
            flavor,
            id: head.id,
            created: head.created,
            model: head.model,
            include_usage,
            logprobs: None,
            offsets: vec![0; n],
            finished: vec![false; n],
            ready: VecDeque::new(),
        };
        if flavor == Flavor::Chat {
            for index in 0..n {
                let role = ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    ..ChatDelta::default()
                };
                s.push_choice(index, role, String::new(), None, Vec::new(), None);
            }
        }
        s
    }

    /// Send each token's logprobs with it (`Some(engine)`: the request asked for them).
    pub fn with_logprobs(mut self, engine: Option<Arc<Engine>>) -> SseStream {
        self.logprobs = engine;
        self
    }

    fn push_data(&mut self, json: &impl Serialize) {
        let text = serde_json::to_string(json).unwrap_or_else(|e| {
            ApiError::internal(format!("serializing a chunk: {e}"))
                .body()
                .to_string()
        });
        self.ready
            .push_back(Bytes::from(format!("data: {text}\n\n")));
    }

    /// A chunk of choice `index`. `delta` is the chat delta; `text` the completion's.
    fn push_choice(
        &mut self,
        index: usize,
        delta: ChatDelta,
        text: String,
        finish_reason: Option<&'static str>,
        token_ids: Vec<u32>,
        logprobs: Option<serde_json::Value>,
    ) {
        match self.flavor {
            Flavor::Completion => {
                let choice = CompletionChoice {
                    index,
                    text,
                    logprobs,
                    finish_reason,
                    token_ids,
                };
                let env = self.envelope(vec![choice], None);
                self.push_data(&env);
            }
            Flavor::Chat => {
                let choice = ChatChunkChoice {
                    index,
                    delta,
                    logprobs,
                    finish_reason,
                    token_ids,
                };
                let env = self.envelope(vec![choice], None);
                self.push_data(&env);
            }
        }
    }

    fn envelope<C>(&self, choices: Vec<C>, usage: Option<Usage>) -> Envelope<C> {
        Envelope {
            id: self.id.clone(),
            object: self.flavor.chunk_object(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    fn push_done(&mut self) {
        self.ready
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.handle = None;
    }

    fn on_event(&mut self, event: Option<EventResult>) {
        match event {
            Some(Ok(GenerateEvent::Token(t))) => {
                let text = t.text_delta.unwrap_or_default();
                let delta = ChatDelta {
                    content: Some(text.clone()),
                    ..ChatDelta::default()
                };
                let lps = match (&self.logprobs, &t.logprobs) {
                    (Some(engine), Some(l)) => {
                        let one = std::slice::from_ref(l);
                        Some(match self.flavor {
                            Flavor::Completion => {
                                let offset = self.offsets.get(t.choice).copied().unwrap_or(0);
                                let v = logprobs::completion(engine, one, offset);
                                if let Some(o) = self.offsets.get_mut(t.choice) {
                                    *o += logprobs::completion_chars(engine, one);
                                }
                                v
                            }
                            Flavor::Chat => logprobs::chat(engine, one),
                        })
                    }
                    _ => None,
                };
                self.push_choice(t.choice, delta, text, None, vec![t.token_id], lps);
            }
            Some(Ok(GenerateEvent::ChoiceFinished {
                choice,
                finish_reason,
            })) => self.push_choice_finish(choice, finish_reason.as_str()),
            Some(Ok(GenerateEvent::Finished { output })) => {
                let usage = Usage::new(output.prompt_ids.len(), output.completion_tokens());
                let reasons: Vec<_> = (std::iter::once(&output).chain(&output.other_choices))
                    .map(|o| (o.index, o.finish_reason.as_str()))
                    .collect();
                self.push_finish(&reasons, usage);
            }
            // An event this server does not know yet adds nothing to the stream.
            Some(Ok(_)) => {}
            Some(Err(e)) => self.push_error(e),
            None => self.push_done(),
        }
    }

    /// Choice `index`'s last chunk, with its finish reason (once).
    fn push_choice_finish(&mut self, index: usize, reason: &'static str) {
        if self.finished.get(index).copied().unwrap_or(false) {
            return;
        }
        if let Some(f) = self.finished.get_mut(index) {
            *f = true;
        }
        let delta = ChatDelta::default();
        self.push_choice(index, delta, String::new(), Some(reason), Vec::new(), None);
    }

    /// The last chunk of each choice that has not sent one (`reasons`: index and finish
    /// reason), the usage chunk when asked for, then `[DONE]`.
    fn push_finish(&mut self, reasons: &[(usize, &'static str)], usage: Usage) {
        for &(index, reason) in reasons {
            self.push_choice_finish(index, reason);
        }
        if self.include_usage {
            let env = self.envelope::<CompletionChoice>(Vec::new(), Some(usage));
            self.push_data(&env);
        }
        self.push_done();
    }

    fn push_error(&mut self, e: EngineError) {
        let body = ApiError::from(e).body();
        self.push_data(&body);
        self.push_done();
    }

    fn on_chat_event(&mut self, event: Option<Result<ChatEvent, EngineError>>) {
        match event {
            Some(Ok(ChatEvent::Delta(d))) => {
                let mut token_ids: Vec<u32> = d.token_id.into_iter().collect();
                let mut lps = match (&self.logprobs, &d.logprobs) {
                    (Some(engine), Some(l)) => {
                        Some(logprobs::chat(engine, std::slice::from_ref(l)))
                    }
                    _ => None,
                };
                let text = |s: String| (!s.is_empty()).then_some(s);
                let delta = ChatDelta {
                    content: text(d.content),
                    reasoning_content: text(d.reasoning),
                    ..ChatDelta::default()
                };
                let index = d.choice;
                if d.tool_calls.is_empty()
                    || delta.content.is_some()
                    || delta.reasoning_content.is_some()
                {
                    let (ids, lps) = (std::mem::take(&mut token_ids), lps.take());
                    self.push_choice(index, delta, String::new(), None, ids, lps);
                }
                for call in d.tool_calls {
                    // A call's first piece: its head with empty arguments, as OpenAI sends it;
                    // then each fragment of its arguments.
                    let head = (call.id.zip(call.name)).map(|(id, name)| ToolCallOut {
                        index: Some(call.index),
                        id: Some(id),
                        kind: Some("function"),
                        function: FunctionOut {
                            name: Some(name),
                            arguments: String::new(),
                        },
                    });
                    let args = (!call.arguments.is_empty()).then_some(ToolCallOut {
                        index: Some(call.index),
                        id: None,
                        kind: None,
                        function: FunctionOut {
                            name: None,
                            arguments: call.arguments,
                        },
                    });
                    for piece in head.into_iter().chain(args) {
                        let delta = ChatDelta {
                            tool_calls: Some(vec![piece]),
                            ..ChatDelta::default()
                        };
                        let (ids, lps) = (std::mem::take(&mut token_ids), lps.take());
                        self.push_choice(index, delta, String::new(), None, ids, lps);
                    }
                }
            }
            Some(Ok(ChatEvent::ChoiceFinished {
                choice,
                finish_reason,
            })) => self.push_choice_finish(choice, finish_reason),
            Some(Ok(ChatEvent::Finished { output })) => {
                let usage = chat_usage(&output);
                let reasons: Vec<_> = (std::iter::once(&output).chain(&output.other_choices))
                    .map(|o| (o.index(), o.finish_reason()))
                    .collect();
                self.push_finish(&reasons, usage);
            }
            // An event this server does not know yet adds nothing to the stream.
            Some(Ok(_)) => {}
            Some(Err(e)) => self.push_error(e),
            None => self.push_done(),
        }
    }
}

impl Stream for SseStream {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(bytes) = this.ready.pop_front() {
                return Poll::Ready(Some(Ok(bytes)));
            }
            let Some(handle) = this.handle.as_mut() else {
                return Poll::Ready(None);
            };
            match handle {
                Events::Generate(h) => match Pin::new(h).poll_next(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(event) => this.on_event(event),
                },
                Events::Chat(h) => match Pin::new(&mut **h).poll_next(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(event) => this.on_chat_event(event),
                },
            }
        }
    }
}
