//! `RequestHandle`: the caller's end of a submitted request: its events as a blocking iterator
//! or as an async `futures_core::Stream`, and `cancel`.
//!
//! The events travel through `EventChannel`, a queue behind a mutex with a condition variable
//! (for the blocking iterator) and a stored `Waker` (for the stream), so the handle needs no
//! async runtime and works with any executor.
//!
//! Invariants:
//! - A request's channel receives its events in order and exactly one last event
//!   (`Finished`, or an error), then closes; the scheduler thread's `Sink` sends
//!   `EngineError::ShutDown` as the last event if it is dropped before sending one (shutdown, or
//!   a panic), so a waiting handle always wakes.
//! - Dropping a handle whose request has not finished cancels the request.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::{Condvar, Mutex};

use crate::error::EngineError;
use crate::request::{GenerateEvent, GenerateOutput};
use crate::worker::Shared;

/// A request's id, unique for the life of its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request {}", self.0)
    }
}

/// One event of a request, or the error that ended it.
pub type EventResult = Result<GenerateEvent, EngineError>;

#[derive(Debug, Default)]
struct ChannelState {
    events: VecDeque<EventResult>,
    closed: bool,
    waker: Option<Waker>,
}

/// See the module header.
#[derive(Debug, Default)]
pub(crate) struct EventChannel {
    state: Mutex<ChannelState>,
    ready: Condvar,
}

impl EventChannel {
    fn send(&self, event: EventResult, last: bool) {
        let waker = {
            let mut st = self.state.lock();
            if st.closed {
                return;
            }
            st.events.push_back(event);
            st.closed = last;
            st.waker.take()
        };
        self.ready.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }

    fn recv(&self) -> Option<EventResult> {
        let mut st = self.state.lock();
        loop {
            if let Some(e) = st.events.pop_front() {
                return Some(e);
            }
            if st.closed {
                return None;
            }
            self.ready.wait(&mut st);
        }
    }

    /// The next event if one is queued, without waiting: `Ready(None)` once closed.
    fn try_recv(&self) -> Poll<Option<EventResult>> {
        let mut st = self.state.lock();
        match st.events.pop_front() {
            Some(e) => Poll::Ready(Some(e)),
            None if st.closed => Poll::Ready(None),
            None => Poll::Pending,
        }
    }

    fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Option<EventResult>> {
        let mut st = self.state.lock();
        if let Some(e) = st.events.pop_front() {
            return Poll::Ready(Some(e));
        }
        if st.closed {
            return Poll::Ready(None);
        }
        match &mut st.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

/// The scheduler thread's end of a request's channel.
#[derive(Debug)]
pub(crate) struct Sink {
    channel: Arc<EventChannel>,
    done: bool,
}

impl Sink {
    pub(crate) fn new(channel: Arc<EventChannel>) -> Sink {
        Sink {
            channel,
            done: false,
        }
    }

    /// A token event.
    pub(crate) fn send(&self, event: GenerateEvent) {
        self.channel.send(Ok(event), false);
    }

    /// The last event.
    pub(crate) fn finish(mut self, last: EventResult) {
        self.done = true;
        self.channel.send(last, true);
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        if !self.done {
            self.channel.send(Err(EngineError::ShutDown), true);
        }
    }
}

/// Cancels a request from anywhere (another thread, a callback) without holding its handle.
#[derive(Debug, Clone)]
pub struct Canceller {
    id: RequestId,
    shared: Arc<Shared>,
}

impl Canceller {
    /// Cancel the request: at the next step boundary it stops, its KV blocks and SSM slot are
    /// released, and its handle yields `Finished` with finish reason `cancelled` (with the
    /// tokens generated until then). A no-op once it has finished.
    pub fn cancel(&self) {
        self.shared.cancel(self.id);
    }
}

/// A submitted request. Iterate it (blocking) or poll it as a `futures_core::Stream` for its
/// events: every token as it is generated (with its choice; with several choices, each
/// choice's `GenerateEvent::ChoiceFinished` after its last), then `GenerateEvent::Finished` with
/// the whole output, or an error; then the iteration ends. Dropping the handle before the request finishes cancels it
/// (every choice).
#[derive(Debug)]
pub struct RequestHandle {
    id: RequestId,
    channel: Arc<EventChannel>,
    shared: Arc<Shared>,
    /// The last event has been taken (or the channel closed).
    ended: bool,
}

impl RequestHandle {
    pub(crate) fn new(
        id: RequestId,
        channel: Arc<EventChannel>,
        shared: Arc<Shared>,
    ) -> RequestHandle {
        RequestHandle {
            id,
            channel,
            shared,
            ended: false,
        }
    }

    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Cancel the request (see [`Canceller::cancel`]); keep reading events to get its output.
    pub fn cancel(&self) {
        self.shared.cancel(self.id);
    }

    /// A `Canceller` for this request, to cancel it from elsewhere.
    pub fn canceller(&self) -> Canceller {
        Canceller {
            id: self.id,
            shared: self.shared.clone(),
        }
    }

    /// Block until the request finishes and return its output (the token events are dropped).
    pub fn wait(mut self) -> Result<GenerateOutput, EngineError> {
        for ev in &mut self {
            if let GenerateEvent::Finished { output } = ev? {
                return Ok(output);
            }
        }
        Err(EngineError::ShutDown)
    }

    /// The next event if one has come, without waiting (`Ready(None)` after the last one).
    pub(crate) fn try_next(&mut self) -> Poll<Option<EventResult>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.channel.try_recv() {
            Poll::Ready(ev) => Poll::Ready(self.note(ev)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn note(&mut self, ev: Option<EventResult>) -> Option<EventResult> {
        match &ev {
            None | Some(Err(_)) | Some(Ok(GenerateEvent::Finished { .. })) => self.ended = true,
            Some(Ok(_)) => {}
        }
        ev
    }
}

impl Iterator for RequestHandle {
    type Item = EventResult;

    /// The next event, blocking until it comes; `None` after the last one.
    fn next(&mut self) -> Option<EventResult> {
        if self.ended {
            return None;
        }
        let ev = self.channel.recv();
        self.note(ev)
    }
}

impl futures_core::Stream for RequestHandle {
    type Item = EventResult;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<EventResult>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        match this.channel.poll_recv(cx) {
            Poll::Ready(ev) => Poll::Ready(this.note(ev)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        if !self.ended {
            self.shared.cancel(self.id);
        }
    }
}
