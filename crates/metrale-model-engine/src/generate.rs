//! Generation on the caller's thread: thin entry points over [`Scheduler::run`], the one
//! generation loop (chunked prefill, decode or verify steps, the stop rule, the cache released
//! however a request ends).

use std::ops::ControlFlow;

use crate::error::ModelError;
use crate::scheduler::Scheduler;
use crate::speculative::{Drafter, GateOptions, SpeculativeStats};

pub use crate::scheduler::{FinishReason, GenerateParams, Generation, SeqRequest};

/// Generate for one request on this thread. `on_token` sees each token as it is chosen and may
/// stop generation.
pub fn generate(
    scheduler: &mut Scheduler,
    request: SeqRequest,
    on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation, ModelError> {
    let mut out = scheduler.run(vec![request], &mut |_, t| on_token(t))?;
    out.pop()
        .ok_or_else(|| ModelError::Step("no generation".into()))
}

/// Generate with speculative decoding by `drafter`, speculating at every decode step (the
/// gate disabled); the scheduler keeps the drafter afterwards. The runner must be built for
/// drafts (`ModelOptions::speculative` not `Off`); `num_draft_tokens` bounds each sequence's
/// drafts. Returns the generations and the acceptance counts of this run.
pub fn generate_speculative(
    scheduler: &mut Scheduler,
    requests: Vec<SeqRequest>,
    drafter: Box<dyn Drafter + Send>,
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) -> Result<(Vec<Generation>, SpeculativeStats), ModelError> {
    scheduler.set_drafter(Some(drafter))?;
    if let Some(spec) = scheduler.speculation() {
        spec.set_gate(GateOptions::default().enabled(false));
    }
    let out = scheduler.run(requests, on_token)?;
    let stats = (scheduler.speculation())
        .map(|s| s.stats())
        .unwrap_or_default();
    Ok((out, stats))
}
