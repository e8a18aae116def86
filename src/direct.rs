//! `generate_direct`: one request on the calling thread. It loads the checkpoint as
//! `Engine::load` does, checks the request as `Engine::submit` does (`Frontend::prepare`), and
//! drives the same worker and scheduler on this thread instead of the engine's own (speculative
//! decoding included, without the gate: with `speculative = Mtp` every decode step verifies);
//! `metrale generate` takes this path. Events reach `on_token` as `Engine::generate_stream`
//! delivers them (`Follow`): stop strings and EOS as there, the text so far with each token.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::task::Poll;

use crate::engine::load_scheduler;
use crate::error::EngineError;
use crate::frontend::{Follow, Frontend};
use crate::handle::{EventChannel, RequestHandle, RequestId, Sink};
use crate::metrics::MetricsState;
use crate::options::EngineOptions;
use crate::request::{GenerateOutput, GenerateRequest};
use crate::worker::{Shared, Submission, Worker};

/// Load the checkpoint in `dir` and generate for `req` on this thread, calling
/// `on_token(token_id, text_so_far)` as each token is chosen (`ControlFlow::Break` stops after
/// it, finish reason `cancelled`). See the module header.
pub fn generate_direct(
    dir: impl AsRef<Path>,
    options: EngineOptions,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32, Option<&str>) -> ControlFlow<()>,
) -> Result<GenerateOutput, EngineError> {
    let gate = options.speculation_gate.enabled(false);
    let options = options.speculation_gate(gate);
    let (scheduler, tokenizer) = load_scheduler(dir.as_ref(), &options)?;
    let front = Frontend::new(tokenizer.clone(), &scheduler);
    let prepared = front.prepare(req.clone())?;
    let shared = Arc::new(Shared::new(MetricsState::new(
        options.metrics_window,
        scheduler.stats(),
    )));
    let mut worker = Worker::new(shared.clone(), scheduler, tokenizer);
    let id = RequestId(0);
    let channel = Arc::new(EventChannel::default());
    let sub = Submission {
        id,
        req: prepared.seq,
        stop_strings: prepared.stop_strings,
        constraints: prepared.constraints,
        sink: Sink::new(channel.clone()),
    };
    shared.submit(sub, 1)?;
    let mut handle = RequestHandle::new(id, channel, shared);
    let mut follow = Follow::new(front.tokenizer.is_some());
    let canceller = handle.canceller();
    loop {
        let working = worker.serve();
        while let Poll::Ready(ev) = handle.try_next() {
            let Some(ev) = ev else {
                return Err(EngineError::ShutDown);
            };
            if let Some(out) = follow.event(ev?, &front, &mut on_token, &|| canceller.cancel()) {
                worker.shut_down();
                return Ok(out);
            }
        }
        if !working {
            // Idle with the request unfinished: it cannot come back.
            worker.shut_down();
            return Err(EngineError::ShutDown);
        }
    }
}
