//! `ChatHandle`: a submitted chat request's events, its tokens read apart into reasoning, content
//! and tool calls as they come ([`ChatEvent`]), blocking (`Iterator`) or async (`Stream`).
//!
//! Each choice of a request of several (`SamplingParams::n`) is read apart by a reader of its
//! own; its deltas name it, and it ends with its `ChoiceFinished`.
//!
//! Invariant: every token's delta comes before its choice's `ChoiceFinished` (with several
//! choices), and every event before `Finished`; the text a choice's parser held back at its end
//! comes in one last delta without a token, before its `ChoiceFinished` or `Finished`. With `best_of` above `n` nothing streams: the kept choices are read apart
//! whole, into `Finished`.

use std::collections::{BTreeMap, VecDeque};
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
    /// A reader as the request starts it, copied for each choice (boxed: the handle stays
    /// small beside a `RequestHandle`).
    fresh: Box<AnswerReader>,
    /// Each choice's reader, from its first event on, and whether its answer has ended.
    readers: BTreeMap<usize, (AnswerReader, bool)>,
    /// The answer is finished (or failed).
    done: bool,
    ready: VecDeque<Result<ChatEvent, EngineError>>,
}

impl ChatHandle {
    pub(crate) fn new(handle: RequestHandle, reader: AnswerReader) -> ChatHandle {
        ChatHandle {
            handle,
            fresh: Box::new(reader),
            readers: BTreeMap::new(),
            done: false,
            ready: VecDeque::new(),
        }
    }

    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.handle.id()
    }

    /// Cancel the request (every choice); keep reading events to get its output.
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

    fn reader(&mut self, choice: usize) -> &mut (AnswerReader, bool) {
        let fresh = &self.fresh;
        (self.readers)
            .entry(choice)
            .or_insert_with(|| (fresh.for_choice(choice), false))
    }

    /// End choice `choice`'s answer: the delta of what its parser held back, if any (once).
    fn end_choice(&mut self, choice: usize) {
        let (reader, ended) = self.reader(choice);
        if std::mem::replace(ended, true) {
            return;
        }
        let last = reader.read(None, "");
        if !(last.content.is_empty() && last.reasoning.is_empty() && last.tool_calls.is_empty()) {
            self.ready.push_back(Ok(ChatEvent::Delta(last)));
        }
    }

    /// Turn the generation's event into chat events, queued.
    fn on_event(&mut self, ev: Option<Result<GenerateEvent, EngineError>>) {
        if self.done {
            return;
        }
        match ev {
            Some(Ok(GenerateEvent::Token(t))) => {
                let text = t.text_delta.unwrap_or_default();
                let mut delta = self.reader(t.choice).0.read(Some(t.token_id), &text);
                delta.logprobs = t.logprobs;
                self.ready.push_back(Ok(ChatEvent::Delta(delta)));
            }
            Some(Ok(GenerateEvent::ChoiceFinished {
                choice,
                finish_reason,
            })) => {
                self.end_choice(choice);
                let finish_reason = self.reader(choice).0.finish_reason(finish_reason);
                self.ready.push_back(Ok(ChatEvent::ChoiceFinished {
                    choice,
                    finish_reason,
                }));
            }
            Some(Ok(GenerateEvent::Finished { output })) => {
                self.done = true;
                let outputs = output.into_choices();
                let streamed = !self.readers.is_empty();
                for o in &outputs {
                    if streamed {
                        self.end_choice(o.index);
                    }
                }
                let mut choices = outputs.into_iter().map(|o| {
                    match self.readers.remove(&o.index) {
                        Some((reader, _)) => reader.output(o),
                        // Not streamed (`best_of`, or no token): read the whole text at once.
                        None => {
                            let mut reader = self.fresh.for_choice(o.index);
                            let text = o.text.clone().unwrap_or_default();
                            reader.read(o.token_ids.first().copied(), &text);
                            reader.read(None, "");
                            reader.output(o)
                        }
                    }
                });
                if let Some(mut output) = choices.next() {
                    output.other_choices = choices.collect();
                    self.ready.push_back(Ok(ChatEvent::Finished { output }));
                }
            }
            Some(Err(e)) => {
                self.done = true;
                self.ready.push_back(Err(e));
            }
            None => self.done = true,
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
            if self.done {
                return None;
            }
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
            if this.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.handle).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(ev) => this.on_event(ev),
            }
        }
    }
}
