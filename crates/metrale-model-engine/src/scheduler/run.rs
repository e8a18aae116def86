//! `Scheduler::run`: the scheduler driven on the caller's thread until the given requests have
//! finished, with a token callback that may stop a request. `generate`, `generate_direct` and
//! the benchmarks run this way; the engine's scheduler thread steps the same scheduler itself.

use std::collections::HashMap;
use std::ops::ControlFlow;

use super::{FinishReason, Generation, Scheduler, SeqEvent, SeqId, SeqRequest};
use crate::error::ModelError;

/// A request of a run, as its caller has seen it.
#[derive(Debug, Default)]
struct Delivered {
    /// Tokens handed to the callback.
    tokens: usize,
    /// The callback stopped it: tokens a verify step chose past the last delivered one are
    /// dropped, and it ends as `Cancelled`.
    stopped: bool,
    result: Option<Generation>,
}

impl Delivered {
    /// Keep `g` as the result, cut to what the caller saw when it stopped the request.
    fn finish(&mut self, mut g: Generation) {
        if self.stopped {
            g.token_ids.truncate(self.tokens);
            if let Some(l) = g.logits.as_mut() {
                l.truncate(self.tokens);
            }
            g.finish_reason = FinishReason::Cancelled;
        }
        self.result = Some(g);
    }
}

impl Scheduler {
    /// Run `requests` to their end on this thread; the scheduler must be idle. `on_token(i,
    /// token)` sees request `i`'s tokens as they are chosen; `ControlFlow::Break` stops that
    /// request right after the token (finish reason `Cancelled`). Returns each request's
    /// generation, in order: what it would get run alone (batch invariance). Re-prefills of
    /// finished requests run while others still do and are dropped once all are done (see
    /// `reprefill`), so the scheduler is idle when it returns. A refused request refuses the
    /// whole run; a failed step aborts it, releasing everything.
    pub fn run(
        &mut self,
        requests: Vec<SeqRequest>,
        on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
    ) -> Result<Vec<Generation>, ModelError> {
        if !self.is_idle() {
            return Err(ModelError::Step(
                "a run needs an idle scheduler (requests are in flight)".into(),
            ));
        }
        let mut index: HashMap<SeqId, usize> = HashMap::with_capacity(requests.len());
        for (i, r) in requests.into_iter().enumerate() {
            match self.add(r) {
                Ok(id) => index.insert(id, i),
                Err(e) => {
                    self.abort_all();
                    return Err(e.into());
                }
            };
        }
        let mut seen: Vec<Delivered> = (0..index.len()).map(|_| Delivered::default()).collect();
        while !self.is_idle() {
            if seen.iter().all(|d| d.result.is_some()) {
                // Its requests are done: the caller does not wait for re-prefills.
                self.drop_reprefills()?;
                break;
            }
            let report = match self.step() {
                Ok(r) => r,
                Err(failed) => {
                    self.abort_all();
                    return Err(*failed.error);
                }
            };
            let mut stop = Vec::new();
            for event in report.events {
                match event {
                    SeqEvent::Token { id, token, .. } => {
                        let d = &mut seen[index[&id]];
                        if d.stopped {
                            continue;
                        }
                        d.tokens += 1;
                        if on_token(index[&id], token).is_break() {
                            d.stopped = true;
                            stop.push(id);
                        }
                    }
                    SeqEvent::Finished { id, generation } => seen[index[&id]].finish(generation),
                }
            }
            for id in stop {
                if let Some(g) = self.finish(id, FinishReason::Cancelled)? {
                    seen[index[&id]].finish(g);
                }
            }
        }
        (seen.into_iter().enumerate())
            .map(|(i, d)| {
                d.result
                    .ok_or_else(|| ModelError::Step(format!("request {i} never finished")))
            })
            .collect()
    }
}
