//! `ChatHandle`: a submitted chat request's events, its tokens read apart into reasoning, content
//! and tool calls as they come ([`ChatEvent`]), blocking (`Iterator`) or async (`Stream`).
//!
//! Invariant: every token's delta comes before `Finished`; the text the parser held back at the
//! end comes in one last delta without a token.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::request::{AnswerReader, ChatEvent};
use crate::error::EngineError;
use crate::handle::{RequestHandle, RequestId};
use crate::request::GenerateEvent;

/// See the module header. Dropping it cancels the request.
#[derive(Debug)]
pub struct ChatHandle {
    handle: RequestHandle,
    /// `None` once the answer is finished.
    reader: Option<AnswerReader>,
    ready: VecDeque<Result<ChatEvent, EngineError>>,
}

impl ChatHandle {
    pub(crate) fn new(handle: RequestHandle, reader: AnswerReader) -> ChatHandle {
        ChatHandle {
            handle,
            reader: Some(reader),
            ready: VecDeque::new(),
        }
    }

    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.handle.id()
    }

    /// Cancel the request; keep reading events to get its output.
    pub fn cancel(&self) {
        self.handle.cancel();
    }

    /// Block until the answer is complete and return it.
    pub fn wait(mut self) -> Result<super::ChatOutput, EngineError> {
        for ev in &mut self {
            if let ChatEvent::Finished { output } = ev? {
                return Ok(output);
            }
        }
        Err(EngineError::ShutDown)
    }

    /// Turn the generation's event into chat events, queued.
    fn on_event(&mut self, ev: Option<Result<GenerateEvent, EngineError>>) {
        let Some(reader) = self.reader.as_mut() else {
            return;
        };
        match ev {
            Some(Ok(GenerateEvent::Token(t))) => {
                let text = t.text_delta.unwrap_or_default();
                let mut delta = reader.read(Some(t.token_id), &text);
                delta.logprobs = t.logprobs;
                self.ready.push_back(Ok(ChatEvent::Delta(delta)));
            }
            Some(Ok(GenerateEvent::Finished { output })) => {
                let last = reader.read(None, "");
                if !(last.content.is_empty()
                    && last.reasoning.is_empty()
                    && last.tool_calls.is_empty())
                {
                    self.ready.push_back(Ok(ChatEvent::Delta(last)));
                }
                if let Some(reader) = self.reader.take() {
                    let output = reader.output(output);
                    self.ready.push_back(Ok(ChatEvent::Finished { output }));
                }
            }
            Some(Err(e)) => {
                self.reader = None;
                self.ready.push_back(Err(e));
            }
            None => self.reader = None,
        }
    }
}

impl Iterator for ChatHandle {
    type Item = Result<ChatEvent, EngineError>;

    /// The next event, blocking until it comes; `None` after the last one.
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(ev) = self.ready.pop_front() {
                return Some(ev);
            }
            self.reader.as_ref()?;
            let ev = self.handle.next();
            self.on_event(ev);
        }
    }
}

impl futures_core::Stream for ChatHandle {
    type Item = Result<ChatEvent, EngineError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(ev) = this.ready.pop_front() {
                return Poll::Ready(Some(ev));
            }
            if this.reader.is_none() {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.handle).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(ev) => this.on_event(ev),
            }
        }
    }
}
