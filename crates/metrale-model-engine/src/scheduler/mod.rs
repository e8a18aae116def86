//! `Scheduler`: continuous batching, and the one generation loop of the engine. It owns the
//! `StepRunner` and the `CacheManager`; requests join and leave between steps, and each step is
//! one decode step of every running sequence past its prompt (through [`StepRunner::decode`],
//! padded to the decode ladder, or [`StepRunner::verify`] with drafts), one prefill chunk of one
//! sequence (through [`StepRunner::forward`]), or both in one forward (a mixed step). The
//! engine's scheduler thread steps it; `run` steps it on the caller's thread until given
//! requests finish.
//!
//! # Policy
//! - **Queue.** Requests wait in arrival order. A sequence is admitted (becomes *running*) when
//!   no running sequence is still prefilling, fewer than `max_decode_seqs` are running, an SSM
//!   slot is free (hybrid models), and the free KV blocks cover its context plus one token,
//!   plus one block of headroom per running sequence (so a new prompt does not take the blocks
//!   the running sequences are about to grow into). Admission reserves those blocks and the slot
//!   at once, so a prefill never runs out of cache. Admission is first come, first served: a
//!   head that does not fit yet holds back the requests behind it.
//! - **Prefix caching** (`ModelOptions::prefix_caching`, see `prefix`). At admission the
//!   longest cached prefix of the prompt (whole blocks, at least one prompt token left to
//!   compute; on hybrid models ending at a kept SSM snapshot) is shared instead of computed: its
//!   blocks are taken by reference, the snapshot is copied into the sequence's slot, and prefill
//!   starts after it. Shared blocks count once against the free blocks. After each prefill
//!   chunk the prompt blocks it completed are published, and on hybrid models the SSM state is
//!   kept when the chunk ends at a multiple of the snapshot interval. On models whose decode
//!   steps compute what prefill steps compute (not hybrid ones), a block that decode steps fill
//!   is published after the step of its last token, so a follow-up turn repeating the
//!   conversation shares it.
//! - **Re-prefill** (`ModelOptions::reprefill_answers`, see `reprefill`). On the other models
//!   (hybrid ones), a sequence that ends by its stop rule leaves its conversation to prefill
//!   again, up to its last multiple of the snapshot interval, as a sequence of no request: it
//!   is admitted like a prompt but only when nothing else waits or runs, gives way (released
//!   and requeued) as soon as a request waits, is dropped rather than preempt anything or wait
//!   for room, samples nothing, emits no event and never shares a mixed step. Its blocks and snapshots are what a cold prefill writes, so a follow-up turn
//!   shares the answer as well as the prompt.
//! - **Steps.** While a sequence prefills and others decode, with `ModelOptions::mixed_steps`
//!   (the default) every step is a *mixed* step: one decode row of every decoding sequence and,
//!   after them, a chunk of the prompt sized to what the token budget `max_batch_tokens` leaves
//!   (see "Chunks"), in one [`StepRunner::forward`] whose logit rows are the chunk's last row
//!   (when it ends the prompt) and the decode rows; all are picked by one sampler launch, and
//!   the decode rows then go through the decode step's bookkeeping (stop rules, preemption for
//!   their blocks, publishing) and the chunk through the prefill step's (the choices' fork,
//!   its first token, publishing). So a long prompt never stalls a decoding sequence's next
//!   token: every step holds its row. Where mixing does not apply, prefill chunks and decode
//!   steps alternate under the budget: after a decode step, prefill chunks run until the next
//!   chunk would take the prefill tokens since that decode step past the budget, then a
//!   decode step runs (decode waits for at most `max_batch_tokens` prefill tokens, and a long
//!   prompt still gets one chunk between any two decode steps). Mixing does not apply with
//!   `mixed_steps` off; to a re-prefill; when the next decode step verifies drafts (speculation: a verify step
//!   keeps each row's GDN state in a slot of its own, which a prefill chunk's rows cannot
//!   share); under circuit programs holding a fusion that rounds differently from
//!   `forward`'s launches ([`StepRunner::forward_matches_decode`]); and on hybrid models when the
//!   chunk's smallest allowed piece does not fit the step's rows beside the decode rows. With
//!   nothing decoding, prefill chunks run back to back; with nothing prefilling, decode steps
//!   do (padded up the ladder, from graphs).
//! - **Chunks.** A prompt is prefilled in chunks of `max_batch_tokens` from position 0, or from
//!   the end of its cached prefix (the last one shorter); on hybrid models a chunk that crosses
//!   a multiple of the SSM snapshot interval ends at the last one it crosses, and one that
//!   crosses a multiple of `ssm_snapshot_stride` at the first
//!   ([`crate::runner::prefill_chunk`]). A prefill step holds that one chunk of one sequence and
//!   no decode rows. A mixed step with `d` decode rows holds a chunk of `max_batch_tokens - d`
//!   rows (`mixed_step_tokens - d` where that is set and smaller; at least one; fewer where
//!   `mixed_chunk_attention` bounds the keys its rows read,
//!   [`crate::runner::rows_within_attention`], or `mixed_step_slowdown_pct` paces the step to
//!   a wall time, `pace`; a paced step whose decode width has not had two plain steps timed
//!   runs plain) cut from that one
//!   ([`crate::runner::mixed_chunk`]): on hybrid models
//!   it ends only where the chunk ends or at a multiple of the snapshot interval, so it runs
//!   over the budget when the budget left is shorter than the way to the next such cut (by
//!   less than the interval, 64 rows by default). The decode rows alone exceed the budget when
//!   there are `max_batch_tokens` or more of them; the chunk then takes its smallest piece.
//!   Attention rows are independent of the other rows of their step, and on hybrid models a
//!   cut is either at a multiple of the interval (where the GDN prefill, whose chunks are
//!   aligned to multiples of 64, computes what no cut computes) or at the same place in every
//!   run of the prompt (chunks restart at each multiple); a one-row GDN chunk (a decode row in
//!   a mixed step) is the recurrent step bit for bit. So each sequence's tokens and logits are
//!   bitwise independent of the other traffic, of mixing, and of what the cache held (batch
//!   invariance).
//! - **Preemption by recompute.** When a decoding sequence needs a KV block and none is free,
//!   the most recently admitted running sequence (possibly itself) is preempted: its blocks and
//!   SSM slot are released and it goes back to the front of the queue with its prompt, the
//!   tokens it generated so far, its logits and its sampler. On readmission it replays the
//!   steps it had run: its prompt in chunks (from the end of its cached prefix, often its own),
//!   then its generated tokens one decode row each (their logits are not sampled again), so its
//!   state, and thus every later token and logit, is bitwise what it would have been. The
//!   oldest running sequence always makes progress: one sequence alone always fits the cache
//!   (`RequestLimits::max_context`).
//! - **Speculation** (a runner built with `speculative = Mtp`, or a drafter set with
//!   [`Scheduler::set_drafter`]): decode steps verify each sequence's drafts, behind a gate that
//!   keeps speculation only while it is faster; see `speculate`.
//! - **Choices** (`SamplingParams::n`, or `best_of` when more). A request of `n` choices is admitted once room is there
//!   for all of them (sequences, SSM slots, a forked block and a block of headroom each); its
//!   prompt is prefilled once, by choice 0. After the last prompt chunk the other choices fork
//!   its cache (`CacheManager::fork`: full KV blocks shared, the partial block and the SSM
//!   state copied), take their own seeds (`sampling::choice_seed`) and draw their first tokens
//!   from the same logits; from then on each is a sequence of its own (preempted, replayed and
//!   finished alone), bitwise the solo run of its seed.
//! - **Structured output** ([`Scheduler::add_constrained`]). A constrained sequence's token mask
//!   depends on its last token, so it is computed on the host once that token is known, while
//!   the device runs the next step's forward: a decode step with a constrained row launches its
//!   forward alone ([`StepRunner::decode_forward`]), computes the masks, uploads them behind the
//!   forward on the stream and then launches the sampler ([`StepRunner::sample_decoded`]); a
//!   prefill or verify step's sampler runs after its forward anyway. A decode step without one
//!   runs its single graph, forward and sampler, as it would without structured output.
//! - **Stopping.** A sequence finishes by its `StopRule`: a stop token (the request's, and the
//!   model's EOS unless `ignore_eos`), `max_new_tokens`, or a full context (`Length`). A caller
//!   stops one from outside with [`Scheduler::finish`] between steps (cancellation, stop
//!   strings): its blocks and slot are released at once.
//!
//! Invariants:
//! - `running` is in admission order; at most one running sequence is in prefill, and it is the
//!   last one (the most recently admitted). A re-prefill in `running` is always in prefill; it
//!   leaves `running` at the end of its last chunk.
//! - Every SSM slot the cache has handed out belongs to exactly one running sequence (its own,
//!   and with speculation on a hybrid model one spare per draft), and every reference on a KV
//!   block to one running sequence (a shared prefix block has one per sharer); waiting
//!   sequences and queued re-prefills hold none. When the scheduler is idle (re-prefills done
//!   or dropped) it holds none (cached blocks nobody holds are the allocator's, evictable).

mod admit;
mod decode;
mod pace;
mod prefix;
mod report;
mod reprefill;
mod request;
mod run;
mod sequence;
mod speculate;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;

use metrale_cache::CacheManager;

use crate::constraint::TokenConstraint;
use crate::error::ModelError;
use crate::model::Model;
use crate::options::ModelOptions;
use crate::runner::{ChunkCuts, StepRunner};
use crate::sampling::{Sampler, SamplingError, fresh_seed};
use crate::speculative::Clock;
use pace::MixedPacer;

pub use metrale_cache::SnapshotUsage;
pub use report::{
    CacheUsage, PrefixStats, SchedulerStats, SeqEvent, StepCounts, StepFailed, StepKind, StepReport,
};
pub use request::{
    FinishReason, GenerateParams, Generation, InvalidRequest, RequestLimits, SeqRequest,
};
pub use sequence::SeqId;
use sequence::{PendingChoice, Picked, Seq, StopRule};
pub use speculate::{Speculation, SpeculativeStats};

/// What the scheduler's policy reads, fixed at construction.
#[derive(Debug, Clone)]
struct Policy {
    limits: RequestLimits,
    /// Prefill chunk size and token budget (`max_batch_tokens`).
    chunk: usize,
    /// Hybrid models: where prefill chunks are cut (the SSM snapshot interval and stride).
    cuts: Option<ChunkCuts>,
    max_seqs: usize,
    eos_token_ids: Vec<u32>,
}

/// See the module header.
#[derive(Debug)]
pub struct Scheduler {
    runner: StepRunner,
    cache: CacheManager,
    policy: Policy,
    next_id: u64,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Events of requests that finish without running (`max_new_tokens` 0), for the next step.
    pending: Vec<SeqEvent>,
    /// Re-prefills of finished conversations waiting for their turn (see `reprefill`); they
    /// hold nothing.
    reprefills: VecDeque<Seq>,
    /// Prefill tokens run since the last decode step.
    prefill_since_decode: usize,
    stats: StepCounts,
    /// Speculative decoding, when the runner is built for it.
    spec: Option<Speculation>,
    /// Mixed steps paced to a wall time, when `mixed_step_slowdown_pct` is set.
    pacer: Option<MixedPacer>,
}

impl Scheduler {
    /// A scheduler running `model` with `options`: its step runner and cache sized and
    /// allocated (`StepRunner::new`). A model built to run its MTP head (`speculative = Mtp`)
    /// decodes speculatively, behind the default gate.
    pub fn new(model: Model, options: ModelOptions) -> Result<Scheduler, ModelError> {
        Scheduler::new_ranks(vec![model], options)
    }

    /// [`Scheduler::new`] for a model sharded over tensor-parallel ranks (`models[r]` rank
    /// `r`'s shard, `factory::load_ranks`): one scheduler and one cache bookkeeping drive
    /// every rank in lockstep (`StepRunner::new_ranks`).
    pub fn new_ranks(models: Vec<Model>, options: ModelOptions) -> Result<Scheduler, ModelError> {
        let (runner, cache) = StepRunner::new_ranks(models, options)?;
        Ok(Scheduler::from_parts(runner, cache))
    }

    /// A scheduler over `runner` and its `cache`, which it owns from now on (no sequence may
    /// hold any of the cache's blocks or slots).
    pub fn from_parts(runner: StepRunner, cache: CacheManager) -> Scheduler {
        let limits = RequestLimits::of(&runner, &cache);
        let policy = Policy {
            limits,
            chunk: runner
                .options()
                .max_batch_tokens
                .min(runner.sizes().max_rows),
            cuts: runner.prefill_cuts(),
            max_seqs: runner.sizes().max_seqs,
            eos_token_ids: runner.model().config().tokens.eos_token_ids.clone(),
        };
        let spec = Speculation::for_runner(&runner);
        let pacer = runner
            .options()
            .mixed_step_slowdown_pct
            .map(MixedPacer::new);
        Scheduler {
            runner,
            cache,
            policy,
            next_id: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending: Vec::new(),
            reprefills: VecDeque::new(),
            prefill_since_decode: 0,
            stats: StepCounts::default(),
            spec,
            pacer,
        }
    }

    /// Read the time that paces mixed steps (`mixed_step_slowdown_pct`) from `clock` (tests
    /// inject one); without pacing, nothing reads it.
    pub fn set_mixed_step_clock(&mut self, clock: Box<dyn Clock>) {
        if let Some(p) = &mut self.pacer {
            p.set_clock(clock);
        }
    }

    /// The step runner (the model, its buffers, graphs and forward choice).
    pub fn runner(&self) -> &StepRunner {
        &self.runner
    }

    /// The step runner, to change its forward or settings.
    pub fn runner_mut(&mut self) -> &mut StepRunner {
        &mut self.runner
    }

    /// The cache (KV blocks, prefix index, SSM slots and snapshots).
    pub fn cache(&self) -> &CacheManager {
        &self.cache
    }

    /// Drop every cached prefix nobody holds (see [`CacheManager::clear_prefix_cache`]);
    /// returns the KV blocks evicted.
    pub fn clear_prefix_cache(&mut self) -> usize {
        self.cache.clear_prefix_cache()
    }

    /// Queue a request; it joins at a later step. A request that fails the checks is refused
    /// and nothing changes. A request of several choices (`SamplingParams::n`, or `best_of`
    /// when more) takes the ids `id..id + choices` (choice `c` is `id + c`); its prompt is
    /// computed once, by choice 0, whose cache the others fork when it is done
    /// (`CacheManager::fork`).
    pub fn add(&mut self, req: SeqRequest) -> Result<SeqId, InvalidRequest> {
        self.add_constrained(req, Vec::new())
    }

    /// Queue a request whose tokens follow `constraints` (structured output; see
    /// [`crate::constraint`]): none, or one per choice it generates (choice `c` follows
    /// `constraints[c]`). Each constrained token is picked by the device sampler under the
    /// constraint's mask, and a choice stops when its constraint is finished.
    pub fn add_constrained(
        &mut self,
        req: SeqRequest,
        constraints: Vec<Box<dyn TokenConstraint>>,
    ) -> Result<SeqId, InvalidRequest> {
        self.policy.limits.check(&req)?;
        let n = req.params.sampling.choices_generated().max(1);
        if !constraints.is_empty() && constraints.len() != n {
            return Err(InvalidRequest::Sampling(SamplingError {
                field: "n",
                value: format!("{n} choices and {} constraints", constraints.len()),
                expected: "one constraint per choice, or none",
            }));
        }
        let mut constraints = constraints.into_iter().map(Some);
        let id = SeqId(self.next_id);
        self.next_id += n as u64;
        let mut stop_token_ids = req.params.stop_token_ids.clone();
        if !req.ignore_eos {
            stop_token_ids.extend(&self.policy.eos_token_ids);
        }
        let stop = StopRule {
            stop_token_ids,
            max_new_tokens: req.params.max_new_tokens,
            max_context: self.policy.limits.max_context,
        };
        let seed = req.params.sampling.seed.unwrap_or_else(fresh_seed);
        let sampler = Sampler::with_seed(req.params.sampling, seed);
        let mut seq = Seq::new(
            id,
            req.prompt,
            (sampler, seed),
            stop,
            req.params.return_logits,
        );
        seq.constraint = constraints.next().flatten();
        seq.choices = (1..n as u64)
            .map(|c| PendingChoice {
                id: SeqId(id.0 + c),
                constraint: constraints.next().flatten(),
            })
            .collect();
        if req.params.max_new_tokens == 0 {
            for c in &seq.choices {
                let generation = Generation {
                    token_ids: Vec::new(),
                    finish_reason: FinishReason::Length,
                    logits: seq.logits.clone(),
                    logprobs: seq.logprobs.clone(),
                    cumulative_logprob: Some(0.0),
                };
                self.pending.push(SeqEvent::Finished {
                    id: c.id,
                    generation,
                });
            }
            self.pending.push(SeqEvent::Finished {
                id,
                generation: seq.into_generation(FinishReason::Length),
            });
        } else {
            self.waiting.push_back(seq);
        }
        Ok(id)
    }

    /// Stop a sequence now, between steps: release its blocks and slot and return what it
    /// generated, with `reason`. `None` when no such sequence is queued or running (it finished
    /// already, or was never added). Choices it has not forked yet end with it, empty and with
    /// the same reason: their `Finished` events come with the next step.
    pub fn finish(
        &mut self,
        id: SeqId,
        reason: FinishReason,
    ) -> Result<Option<Generation>, ModelError> {
        let (mut s, released) = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut s = self.running.remove(i);
            let released = s.release(&mut self.cache);
            (s, released)
        } else if let Some(s) =
            (self.waiting.iter().position(|s| s.id == id)).and_then(|i| self.waiting.remove(i))
        {
            (s, Ok(()))
        } else {
            return Ok(None);
        };
        self.end_unforked(&mut s, reason);
        released?;
        Ok(Some(s.into_generation(reason)))
    }

    /// End the choices `s` has not forked, empty, with `reason` (their events for the next
    /// step).
    fn end_unforked(&mut self, s: &mut Seq, reason: FinishReason) {
        for c in std::mem::take(&mut s.choices) {
            let generation = Generation {
                token_ids: Vec::new(),
                finish_reason: reason,
                logits: s.logits.is_some().then(Vec::new),
                logprobs: s.logprobs.is_some().then(Vec::new),
                cumulative_logprob: Some(0.0),
            };
            self.pending.push(SeqEvent::Finished {
                id: c.id,
                generation,
            });
        }
    }

    /// Nothing queued, running or left to report, re-prefills included.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty()
            && self.running.is_empty()
            && self.pending.is_empty()
            && self.reprefills.is_empty()
    }

    /// Counters and the resources in use now.
    pub fn stats(&self) -> SchedulerStats {
        let reprefills = self.reprefills_pending();
        SchedulerStats {
            running: self.running.len() - (reprefills - self.reprefills.len()),
            waiting: self.waiting.len(),
            reprefills,
            steps: self.stats,
            speculation: self.spec.as_ref().map(Speculation::stats),
            cache: CacheUsage::of(&self.cache),
        }
    }

    /// Run one step (see the policy in the module header): admit the queue head if it fits,
    /// then run a prefill chunk, a decode step, or a decode step with a prefill chunk (mixed).
    pub fn step(&mut self) -> Result<StepReport, StepFailed> {
        let mut events = std::mem::take(&mut self.pending);
        if let Err((error, id)) = self.admit() {
            self.pending = events;
            return Err(StepFailed {
                error: Box::new(error),
                aborted: vec![id],
            });
        }
        let prefill = self.running.iter().position(Seq::in_prefill);
        let decoders = self.running.iter().any(|s| !s.in_prefill());
        let (chunk, cuts) = (self.policy.chunk, self.policy.cuts);
        let kind = match prefill {
            Some(i)
                if !decoders
                    || (!self.may_mix(i)
                        && self.prefill_since_decode
                            + self.running[i].next_chunk(chunk, cuts).len()
                            <= chunk) =>
            {
                let id = self.running[i].id;
                self.prefill(i, &mut events).map_err(|e| (e, vec![id]))
            }
            _ if decoders => {
                // A mixed step's failure aborts the sequence in prefill too.
                let mixes = prefill.is_some_and(|i| self.mixes(i));
                let ids: Vec<SeqId> = (self.running.iter())
                    .filter(|s| mixes || !s.in_prefill())
                    .map(|s| s.id)
                    .collect();
                self.decode(&mut events).map_err(|e| (e, ids))
            }
            _ => Ok(StepKind::Idle),
        };
        match kind {
            Ok(kind) => Ok(StepReport { kind, events }),
            Err((error, ids)) => {
                events.retain(|e| match e {
                    SeqEvent::Token { id, .. } | SeqEvent::Finished { id, .. } => !ids.contains(id),
                });
                self.pending = events;
                let aborted = self.abort(&ids);
                Err(StepFailed {
                    error: Box::new(error),
                    aborted,
                })
            }
        }
    }

    /// Drop every sequence, queued or running, releasing their resources (re-prefills
    /// included); returns the requests' ids.
    pub fn abort_all(&mut self) -> Vec<SeqId> {
        if let Err(e) = self.drop_reprefills() {
            tracing::warn!("dropping the re-prefills: releasing their cache failed: {e}");
        }
        let mut ids: Vec<SeqId> = (self.running.iter().chain(&self.waiting))
            .map(|s| s.id)
            .collect();
        ids.extend(self.pending.iter().filter_map(|e| match e {
            SeqEvent::Finished { id, .. } => Some(*id),
            SeqEvent::Token { .. } => None,
        }));
        self.pending.clear();
        self.abort(&ids)
    }

    /// Remove the sequences `ids` (running or waiting) and release what they hold; returns
    /// the requests' ids among them (a re-prefill is dropped, no request's). A release that
    /// fails is logged: the sequence is gone either way.
    fn abort(&mut self, ids: &[SeqId]) -> Vec<SeqId> {
        let mut out = Vec::new();
        for &id in ids {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let mut s = self.running.remove(i);
                if let Err(e) = s.release(&mut self.cache) {
                    tracing::warn!("aborting {id}: releasing its cache failed: {e}");
                }
                if s.reprefill {
                    self.stats.reprefills_skipped += 1;
                    continue;
                }
            } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
                self.waiting.remove(i);
            }
            out.push(id);
        }
        out
    }

    /// Compute the bitmasks of the constrained sequences among running `idx` whose next row
    /// picks a token: called once a step's forward is launched and before its sampler, so the
    /// grammar's work overlaps the device's.
    fn prepare_masks(&mut self, idx: impl IntoIterator<Item = usize>) {
        let vocab = self.policy.limits.vocab;
        for i in idx {
            let s = &mut self.running[i];
            if s.samples_masked() {
                s.prepare_mask(vocab);
            }
        }
    }

    /// Record running sequence `i`'s next token; returns why it ends, if it does.
    fn record(
        &mut self,
        i: usize,
        picked: Picked,
        events: &mut Vec<SeqEvent>,
    ) -> Option<FinishReason> {
        let s = &mut self.running[i];
        let (token, logprobs, reason) = s.record(picked);
        self.stats.tokens_generated += 1;
        events.push(SeqEvent::Token {
            id: s.id,
            token,
            logprobs,
        });
        reason
    }

    /// Finish running sequence `i` with `reason`.
    fn retire(
        &mut self,
        i: usize,
        reason: FinishReason,
        events: &mut Vec<SeqEvent>,
    ) -> Result<(), ModelError> {
        let mut s = self.running.remove(i);
        let id = s.id;
        let released = s.release(&mut self.cache);
        self.queue_reprefill(&s, reason);
        events.push(SeqEvent::Finished {
            id,
            generation: s.into_generation(reason),
        });
        released
    }
}
