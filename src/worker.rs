//! The worker: owns the `Scheduler` (and through it the model and its cache), takes new requests
//! and cancellations from the `Shared` inbox between steps, runs steps while there is work, and
//! turns the scheduler's events into each request's events: text deltas, stop strings, the final
//! output. The engine runs it on a scheduler thread of its own (`run`, which sleeps on a
//! condition variable when there is no work); `generate_direct` drives it on the caller's
//! thread (`serve`).
//!
//! Invariants:
//! - Only the worker touches the model; callers reach it through the inbox, so a request is
//!   added, cancelled or stopped only between steps.
//! - Stop strings are checked here, on the token that completes them, and the sequence is
//!   stopped before the next step: where a request stops depends on its own tokens alone. A
//!   verify step may have produced tokens past that one; they are neither sent nor kept in the
//!   output, which ends exactly where plain decoding would have stopped it.
//! - Every accepted request gets exactly one last event: `Finished`, or an error
//!   (`Aborted` when a step it was in failed, `ShutDown` when the engine goes away).
//! - A request of several choices is one scheduler request whose choices are sequences of
//!   their own (`SeqId`s `id..id + choices`): each has its own text stream and stop strings,
//!   and (with `n` > 1) ends with its own `ChoiceFinished`; the request finishes once every choice has, with
//!   `best_of` keeping the `n` of highest cumulative logprob. Cancelling stops every choice;
//!   a failed choice fails the request and stops the others.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};

use metrale_model_engine::Scheduler;
use metrale_model_engine::constraint::TokenConstraint;
use metrale_model_engine::generate::{FinishReason, Generation};
use metrale_model_engine::scheduler::{SeqEvent, SeqId, SeqRequest};

use crate::error::EngineError;
use crate::handle::{RequestId, Sink};
use crate::metrics::{EngineMetrics, MetricsState};
use crate::request::{GenerateEvent, GenerateOutput, TokenEvent};
use crate::text::TextStream;

/// A validated request on its way to the scheduler thread.
#[derive(Debug)]
pub(crate) struct Submission {
    pub id: RequestId,
    pub req: SeqRequest,
    pub stop_strings: Vec<String>,
    /// Structured output: the grammar the tokens follow, one matcher per choice (or none).
    pub constraints: Vec<Box<dyn TokenConstraint>>,
    pub sink: Sink,
}

#[derive(Debug, Default)]
struct Inbox {
    submits: Vec<Submission>,
    cancels: Vec<RequestId>,
    shutdown: bool,
    /// The scheduler thread is running (false before it starts and after it stops).
    alive: bool,
}

/// What the engine's callers and its scheduler thread share.
#[derive(Debug)]
pub(crate) struct Shared {
    inbox: Mutex<Inbox>,
    wake: Condvar,
    metrics: Mutex<MetricsState>,
    /// Sequences waiting in the scheduler after its last step.
    waiting: AtomicUsize,
}

impl Shared {
    pub(crate) fn new(metrics: MetricsState) -> Shared {
        Shared {
            inbox: Mutex::new(Inbox {
                alive: true,
                ..Inbox::default()
            }),
            wake: Condvar::new(),
            metrics: Mutex::new(metrics),
            waiting: AtomicUsize::new(0),
        }
    }

    /// Hand a request to the scheduler thread, unless `max_queued` requests already wait.
    pub(crate) fn submit(&self, sub: Submission, max_queued: usize) -> Result<(), EngineError> {
        let mut inbox = self.inbox.lock();
        if !inbox.alive || inbox.shutdown {
            return Err(EngineError::ShutDown);
        }
        if inbox.submits.len() + self.waiting.load(Ordering::Relaxed) >= max_queued {
            return Err(EngineError::QueueFull { max: max_queued });
        }
        inbox.submits.push(sub);
        drop(inbox);
        self.wake.notify_all();
        Ok(())
    }

    /// Ask the scheduler thread to cancel a request at the next step boundary.
    pub(crate) fn cancel(&self, id: RequestId) {
        let mut inbox = self.inbox.lock();
        if inbox.alive {
            inbox.cancels.push(id);
            drop(inbox);
            self.wake.notify_all();
        }
    }

    /// Ask the scheduler thread to stop.
    pub(crate) fn shutdown(&self) {
        self.inbox.lock().shutdown = true;
        self.wake.notify_all();
    }

    pub(crate) fn metrics(&self) -> EngineMetrics {
        let inbox = self.inbox.lock().submits.len();
        self.metrics.lock().snapshot(inbox)
    }
}

/// A request the scheduler thread is serving.
#[derive(Debug)]
struct Request {
    prompt_ids: Vec<u32>,
    sink: Sink,
    /// Choices returned (`n`); the scheduler generates `outputs.len()` (`best_of` when more).
    n: usize,
    /// Its choices' sequences still running.
    seqs: Vec<SeqId>,
    /// Entry `c`: choice `c`'s output once it has finished.
    outputs: Vec<Option<GenerateOutput>>,
}

impl Request {
    /// Whether choices are ranked at the end (`best_of` above `n`): nothing is streamed.
    fn ranks(&self) -> bool {
        self.outputs.len() > self.n
    }
}

/// One choice of a request the scheduler thread is serving.
#[derive(Debug)]
struct Active {
    request: RequestId,
    choice: usize,
    text: Option<TextStream>,
    /// Tokens sent to the caller so far.
    sent: usize,
}

/// See the module header.
pub(crate) struct Worker {
    pub shared: Arc<Shared>,
    pub scheduler: Scheduler,
    pub tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    actives: HashMap<SeqId, Active>,
    requests: HashMap<RequestId, Request>,
    /// Requests finished or failed since metrics were last recorded.
    finished: u64,
    failed: u64,
}

/// Marks the engine dead when the scheduler thread ends, however it ends (a panic included),
/// and fails the submissions it never took.
struct AliveGuard(Arc<Shared>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        let orphans = {
            let mut inbox = self.0.inbox.lock();
            inbox.alive = false;
            inbox.cancels.clear();
            std::mem::take(&mut inbox.submits)
        };
        // Each dropped sink tells its handle the engine has shut down.
        drop(orphans);
    }
}

impl Worker {
    pub(crate) fn new(
        shared: Arc<Shared>,
        scheduler: Scheduler,
        tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    ) -> Worker {
        Worker {
            shared,
            scheduler,
            tokenizer,
            actives: HashMap::new(),
            requests: HashMap::new(),
            finished: 0,
            failed: 0,
        }
    }

    /// The scheduler thread's body: serve until shutdown, sleeping while there is no work.
    pub(crate) fn run(mut self) {
        let _alive = AliveGuard(self.shared.clone());
        loop {
            let shutdown = {
                let mut inbox = self.shared.inbox.lock();
                while inbox.submits.is_empty()
                    && inbox.cancels.is_empty()
                    && !inbox.shutdown
                    && self.scheduler.is_idle()
                {
                    self.shared.wake.wait(&mut inbox);
                }
                inbox.shutdown
            };
            if shutdown {
                break;
            }
            self.serve();
        }
        self.shut_down();
    }

    /// One round: take the inbox's submissions and cancellations, run one step if there is
    /// work, and record the metrics. Returns whether work is left.
    pub(crate) fn serve(&mut self) -> bool {
        let (submits, cancels) = {
            let mut inbox = self.shared.inbox.lock();
            (
                std::mem::take(&mut inbox.submits),
                std::mem::take(&mut inbox.cancels),
            )
        };
        for sub in submits {
            self.accept(sub);
        }
        for id in cancels {
            let seqs = (self.requests.get(&id)).map_or_else(Vec::new, |r| r.seqs.clone());
            for seq in seqs {
                self.stop(seq, FinishReason::Cancelled);
            }
        }
        if !self.scheduler.is_idle() {
            self.step();
        }
        self.record_metrics();
        !self.scheduler.is_idle()
    }

    /// Abort whatever runs; the actives' sinks, dropped, tell their handles the engine has
    /// shut down.
    pub(crate) fn shut_down(&mut self) {
        let ids = self.scheduler.abort_all();
        tracing::debug!(aborted = ids.len(), "engine shutting down");
        self.actives.clear();
        self.requests.clear();
    }

    fn record_metrics(&mut self) {
        let stats = self.scheduler.stats();
        self.shared.waiting.store(stats.waiting, Ordering::Relaxed);
        self.shared
            .metrics
            .lock()
            .record(stats, self.finished, self.failed);
        (self.finished, self.failed) = (0, 0);
    }

    fn accept(&mut self, sub: Submission) {
        let prompt_ids = sub.req.prompt.clone();
        let sampling = &sub.req.params.sampling;
        let (n, generated) = (sampling.n, sampling.choices_generated());
        match self.scheduler.add_constrained(sub.req, sub.constraints) {
            Ok(first) => {
                let seqs: Vec<SeqId> = (0..generated as u64).map(|c| SeqId(first.0 + c)).collect();
                for (choice, &seq) in seqs.iter().enumerate() {
                    let text = (self.tokenizer.as_ref())
                        .map(|_| TextStream::new(sub.stop_strings.clone()));
                    let active = Active {
                        request: sub.id,
                        choice,
                        text,
                        sent: 0,
                    };
                    self.actives.insert(seq, active);
                }
                let request = Request {
                    prompt_ids,
                    sink: sub.sink,
                    n,
                    seqs,
                    outputs: vec![None; generated],
                };
                self.requests.insert(sub.id, request);
            }
            // `Engine::submit` checked the same limits; this is a second line of defence.
            Err(e) => sub.sink.finish(Err(EngineError::Request(e.into()))),
        }
    }

    /// Stop a sequence between steps and send its output.
    fn stop(&mut self, seq: SeqId, reason: FinishReason) {
        match self.scheduler.finish(seq, reason) {
            Ok(Some(g)) => self.complete(seq, g),
            Ok(None) => {}
            Err(e) => self.fail(seq, Arc::new(e)),
        }
    }

    fn step(&mut self) {
        match self.scheduler.step() {
            Ok(report) => self.dispatch(report.events),
            Err(failed) => {
                tracing::error!("{failed}");
                let cause: Arc<metrale_model_engine::ModelError> = Arc::from(failed.error);
                for seq in failed.aborted {
                    self.fail(seq, cause.clone());
                }
            }
        }
    }

    fn dispatch(&mut self, events: Vec<SeqEvent>) {
        let finishing: HashSet<SeqId> = events
            .iter()
            .filter_map(|e| match e {
                SeqEvent::Finished { id, .. } => Some(*id),
                SeqEvent::Token { .. } => None,
            })
            .collect();
        let mut stopped = Vec::new();
        for e in events {
            match e {
                SeqEvent::Token {
                    id,
                    token,
                    logprobs,
                } => {
                    let Some(a) = self.actives.get_mut(&id) else {
                        continue;
                    };
                    let Some(r) = self.requests.get(&a.request) else {
                        continue;
                    };
                    if a.text.as_ref().is_some_and(TextStream::stopped) {
                        // Past the token that completed a stop string (a verify step's run).
                        continue;
                    }
                    a.sent += 1;
                    let last = finishing.contains(&id);
                    let text_delta = match (&mut a.text, &self.tokenizer) {
                        (Some(t), Some(tok)) => {
                            let delta = t
                                .push(token, last, |ids| tok.decode(ids, true).unwrap_or_default());
                            if t.stopped() && !last {
                                stopped.push(id);
                            }
                            Some(delta)
                        }
                        _ => None,
                    };
                    if !r.ranks() {
                        r.sink.send(GenerateEvent::Token(TokenEvent {
                            choice: a.choice,
                            token_id: token,
                            logprobs,
                            text_delta,
                        }));
                    }
                }
                SeqEvent::Finished { id, generation } => self.complete(id, generation),
            }
        }
        for id in stopped {
            self.stop(id, FinishReason::Stop);
        }
    }

    /// Keep a finished choice's output; send the request's once every choice has finished.
    fn complete(&mut self, seq: SeqId, mut g: Generation) {
        let Some(a) = self.actives.remove(&seq) else {
            return;
        };
        let Some(r) = self.requests.get_mut(&a.request) else {
            return;
        };
        let stopped_by_string = a.text.as_ref().is_some_and(TextStream::stopped);
        if stopped_by_string {
            g.token_ids.truncate(a.sent);
            if let Some(l) = g.logits.as_mut() {
                l.truncate(a.sent);
            }
            if let Some(l) = g.logprobs.as_mut() {
                l.truncate(a.sent);
            }
        }
        let text = a.text.as_ref().and_then(|t| {
            let full = self
                .tokenizer
                .as_ref()
                .and_then(|tok| tok.decode(&g.token_ids, true).ok());
            t.final_text(full)
        });
        let finish_reason = if stopped_by_string {
            FinishReason::Stop
        } else {
            g.finish_reason
        };
        if r.n > 1 && !r.ranks() {
            r.sink.send(GenerateEvent::ChoiceFinished {
                choice: a.choice,
                finish_reason,
            });
        }
        r.seqs.retain(|&s| s != seq);
        r.outputs[a.choice] = Some(GenerateOutput {
            prompt_ids: r.prompt_ids.clone(),
            index: a.choice,
            token_ids: g.token_ids,
            text,
            finish_reason,
            logits: g.logits,
            logprobs: g.logprobs,
            cumulative_logprob: g.cumulative_logprob,
            other_choices: Vec::new(),
        });
        if !r.seqs.is_empty() {
            return;
        }
        let Some(r) = self.requests.remove(&a.request) else {
            return;
        };
        let mut choices: Vec<GenerateOutput> = r.outputs.into_iter().flatten().collect();
        if choices.len() > r.n {
            // vLLM's `best_of`: the highest cumulative logprobs, best first (ties in index
            // order); a choice without a score ranks last.
            let score = |o: &GenerateOutput| o.cumulative_logprob.unwrap_or(f64::NEG_INFINITY);
            choices.sort_by(|a, b| score(b).total_cmp(&score(a)));
            choices.truncate(r.n);
            for (i, c) in choices.iter_mut().enumerate() {
                c.index = i;
            }
        }
        let mut choices = choices.into_iter();
        let Some(mut output) = choices.next() else {
            return;
        };
        output.other_choices = choices.collect();
        r.sink.finish(Ok(GenerateEvent::Finished { output }));
        self.finished += 1;
    }

    /// End a request with an error: the sequence that failed, and the request's other choices.
    fn fail(&mut self, seq: SeqId, cause: Arc<metrale_model_engine::ModelError>) {
        let Some(a) = self.actives.remove(&seq) else {
            return;
        };
        let Some(r) = self.requests.remove(&a.request) else {
            return;
        };
        for other in r.seqs.iter().filter(|&&s| s != seq) {
            self.actives.remove(other);
            if let Err(e) = self.scheduler.finish(*other, FinishReason::Cancelled) {
                tracing::warn!("stopping {other} after its request failed: {e}");
            }
        }
        r.sink.finish(Err(EngineError::Aborted(cause)));
        self.failed += 1;
    }
}

#[cfg(test)]
mod tests;
