//! The speculative benchmark's end-to-end runs: greedy generations of `output_tokens` tokens
//! after a prompt of `context` tokens, plain and drafted, each configuration cold then warm.

use std::ops::ControlFlow;
use std::time::Instant;

use super::{EndToEnd, SpecBenchOptions};
use crate::error::ModelError;
use crate::generate::{GenerateParams, SeqRequest, generate_speculative};
use crate::sampling::SamplingParams;
use crate::scheduler::Scheduler;
use crate::speculative::{Drafter, MtpDrafter, OracleDrafter};

/// Tokens and the wall time from the first to the last of one greedy run.
struct Run {
    tokens: Vec<u32>,
    seconds: f64,
    /// Decode or verify steps.
    steps: usize,
    /// Graphs captured during the run.
    captures: u64,
}

impl Run {
    fn tok_s(&self) -> f64 {
        // The first token comes from the prefill.
        self.tokens.len().saturating_sub(1) as f64 / self.seconds
    }

    /// The figure of this (warm) run, after the `cold` run of the same configuration.
    fn figure(&self, cold: &Run, name: String, drafts: usize, plain: &[u32]) -> EndToEnd {
        let n = self.tokens.len();
        EndToEnd {
            name,
            drafts,
            tokens: n,
            tokens_per_step: n.saturating_sub(1) as f64 / self.steps.max(1) as f64,
            tok_s: self.tok_s(),
            matches_plain: self.tokens == plain && cold.tokens == plain,
            captures: self.captures,
            cold_tok_s: cold.tok_s(),
            cold_captures: cold.captures,
        }
    }
}

/// One greedy run of `prompt`: plain with `drafter` `None`, else speculative (every decode
/// step a verify step).
fn timed_run(
    sched: &mut Scheduler,
    prompt: &[u32],
    params: &GenerateParams,
    drafter: Option<Box<dyn Drafter + Send>>,
) -> Result<Run, ModelError> {
    let mut times = Vec::with_capacity(params.max_new_tokens);
    let mut on_token = |_: usize, _: u32| {
        times.push(Instant::now());
        ControlFlow::Continue(())
    };
    let reqs = vec![SeqRequest {
        prompt: prompt.to_vec(),
        params: params.clone(),
        ignore_eos: true,
    }];
    let before = sched.stats().steps.decode_steps;
    let captures = sched.runner().graphs().captures();
    let mut out = match drafter {
        None => {
            sched.set_drafter(None)?;
            sched.run(reqs, &mut on_token)?
        }
        Some(d) => generate_speculative(sched, reqs, d, &mut on_token)?.0,
    };
    let steps = (sched.stats().steps.decode_steps - before) as usize;
    let captures = sched.runner().graphs().captures() - captures;
    let seconds = match (times.first(), times.last()) {
        (Some(a), Some(b)) => (*b - *a).as_secs_f64(),
        _ => 0.0,
    };
    let tokens = out
        .pop()
        .ok_or_else(|| ModelError::Step("the benchmark run generated nothing".into()))?
        .token_ids;
    Ok(Run {
        tokens,
        seconds,
        steps,
        captures,
    })
}

/// The end-to-end runs (see the module header).
pub(super) fn end_to_end(
    sched: &mut Scheduler,
    opts: &SpecBenchOptions,
    kmax: usize,
) -> Result<Vec<EndToEnd>, ModelError> {
    let vocab = sched.runner().model().config().tokens.vocab_size;
    let prompt: Vec<u32> = (0..opts.context.max(1))
        .map(|p| ((p * 31 + 7) % vocab) as u32)
        .collect();
    let params = GenerateParams {
        max_new_tokens: opts.output_tokens.max(2),
        sampling: SamplingParams::default(),
        stop_token_ids: Vec::new(),
        return_logits: false,
    };
    // Each run starts with an empty prefix cache: no prefix of an earlier run is reused. Each
    // configuration runs twice, cold then warm.
    let run = |sched: &mut Scheduler, drafter: &dyn Fn() -> Option<Box<dyn Drafter + Send>>| {
        let mut once = || {
            sched.clear_prefix_cache();
            timed_run(sched, &prompt, &params, drafter())
        };
        let cold = once()?;
        Ok::<_, ModelError>((cold, once()?))
    };
    let (cold, graphed) = run(sched, &|| None)?;
    let plain = graphed.tokens.clone();
    let mut out = vec![graphed.figure(&cold, "plain (graphed)".into(), 0, &plain)];
    sched.runner_mut().set_decode_graphs(false);
    let eager = run(sched, &|| None);
    sched.runner_mut().set_decode_graphs(true);
    let (cold, eager) = eager?;
    out.push(eager.figure(&cold, "plain (eager)".into(), 0, &plain));
    let expected: Vec<u32> = prompt.iter().chain(&plain).copied().collect();
    for k in 1..=kmax {
        sched.runner_mut().set_num_draft_tokens(k)?;
        let oracle = || -> Option<Box<dyn Drafter + Send>> {
            Some(Box::new(OracleDrafter::new(vec![expected.clone()])))
        };
        let (cold, r) = run(sched, &oracle)?;
        out.push(r.figure(&cold, format!("oracle K={k} (free drafts)"), k, &plain));
        let (cold, r) = run(sched, &|| Some(Box::new(MtpDrafter::default())))?;
        out.push(r.figure(&cold, format!("mtp K={k} (random head)"), k, &plain));
    }
    sched.runner_mut().set_num_draft_tokens(kmax)?;
    Ok(out)
}
