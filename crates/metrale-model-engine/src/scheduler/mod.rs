//! `Scheduler`: continuous batching. Requests join and leave between steps; each step is either
//! one decode step of every running sequence past its prompt (through
//! [`TransformerModel::decode`], padded to the decode ladder) or one prefill chunk of one
//! sequence (through [`TransformerModel::forward`]).
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
//! - **Steps.** While a sequence prefills and others decode, prefill chunks and decode steps
//!   alternate under the token budget `max_batch_tokens`: after a decode step, prefill chunks
//!   run until the next chunk would take the prefill tokens since that decode step past the
//!   budget, then a decode step runs. So decode waits for at most `max_batch_tokens` prefill
//!   tokens, and a long prompt still gets one chunk between any two decode steps. With nothing
//!   decoding, prefill chunks run back to back; with nothing prefilling, decode steps do.
//! - **Chunks.** A prompt is prefilled in chunks of `max_batch_tokens` from position 0, or from
//!   the end of its cached prefix (the last one shorter); on hybrid models a chunk that crosses
//!   a multiple of the SSM snapshot interval ends at the last one it crosses, and one that
//!   crosses a multiple of `ssm_snapshot_stride` at the first
//!   ([`crate::model::prefill_chunk`]). A prefill step holds that one chunk of one sequence and
//!   no decode rows. Attention rows are independent of the other rows of their step, and on
//!   hybrid models a cut is either at a multiple of the interval (where the GDN prefill, whose
//!   chunks are aligned to multiples of 64, computes what no cut computes) or at the same place
//!   in every run of the prompt (chunks restart at each multiple). So each sequence's tokens and
//!   logits are bitwise independent of the other traffic and of what the cache held (batch
//!   invariance).
//! - **Preemption by recompute.** When a decoding sequence needs a KV block and none is free,
//!   the most recently admitted running sequence (possibly itself) is preempted: its blocks and
//!   SSM slot are released and it goes back to the front of the queue with its prompt, the
//!   tokens it generated so far, its logits and its sampler. On readmission it replays the
//!   steps it had run: its prompt in chunks (from the end of its cached prefix, often its own),
//!   then its generated tokens one decode row each (their logits are not sampled again), so its
//!   state, and thus every later token and logit, is bitwise what it would have been. The oldest running sequence always makes
//!   progress: one sequence alone always fits the cache (`RequestLimits::max_context`).
//! - **Speculation** (a model built with `speculative = Mtp`, or a drafter set with
//!   [`Scheduler::set_drafter`]): decode steps verify each sequence's drafts, behind a gate that
//!   keeps speculation only while it is faster; see `speculate`.
//! - **Stopping.** A sequence finishes on a stop token (the request's, and the model's EOS unless
//!   `ignore_eos`), at `max_new_tokens`, or when its context is full (`Length`). A caller stops
//!   one from outside with [`Scheduler::finish`] between steps (cancellation, stop strings):
//!   its blocks and slot are released at once.
//!
//! Invariants:
//! - `running` is in admission order; at most one running sequence is in prefill, and it is the
//!   last one (the most recently admitted).
//! - Every SSM slot the scheduler holds belongs to exactly one running sequence (its own, and
//!   with speculation on a hybrid model one spare per draft), and every
//!   reference on a KV block to one running sequence (a shared prefix block has one per
//!   sharer); waiting sequences hold none. When the scheduler is idle it holds none (cached
//!   blocks nobody holds are the allocator's, evictable).

mod decode;
mod prefix;
mod report;
mod request;
mod sequence;
mod speculate;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;

use crate::error::ModelError;
use crate::generate::{FinishReason, Generation};
use crate::model::{ChunkCuts, StepInput, StepRow, TransformerModel};

pub use report::{SchedulerStats, SeqEvent, StepFailed, StepKind, StepReport};
pub use request::{InvalidRequest, RequestLimits, SeqRequest};
pub use sequence::SeqId;
use sequence::{Seq, release};

/// A row's next token as a step delivers it: its logits, sampled on the host, or the token the
/// device's argmax picked (when no row of the step needs host logits).
enum Picked {
    Logits(Vec<f32>),
    Token(u32),
}

/// The first `n` logit rows of the last step, as host logits when `need_logits`, else as the
/// device's argmax (4 bytes a row instead of the vocabulary's logits).
fn pick(model: &TransformerModel, n: usize, need_logits: bool) -> Result<Vec<Picked>, ModelError> {
    Ok(if need_logits {
        model.logits(n)?.into_iter().map(Picked::Logits).collect()
    } else {
        model.greedy(n)?.into_iter().map(Picked::Token).collect()
    })
}

/// See the module header.
#[derive(Debug)]
pub struct Scheduler {
    limits: RequestLimits,
    /// Prefill chunk size and token budget (`max_batch_tokens`).
    chunk: usize,
    /// Hybrid models: where prefill chunks are cut (the SSM snapshot interval and stride).
    cuts: Option<ChunkCuts>,
    max_seqs: usize,
    block_size: usize,
    eos_token_ids: Vec<u32>,
    next_id: u64,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Events of requests that finish without running (`max_new_tokens` 0), for the next step.
    pending: Vec<SeqEvent>,
    /// Prefill tokens run since the last decode step.
    prefill_since_decode: usize,
    stats: SchedulerStats,
    /// Speculative decoding, when the model is built for it.
    spec: Option<speculate::Speculation>,
}

impl Scheduler {
    /// A scheduler for `model`, which it then drives through `step`. The model's KV blocks and
    /// SSM slots must not be used by anyone else while the scheduler runs. A model that runs its
    /// MTP head (`speculative = Mtp`) decodes speculatively, behind the default gate.
    pub fn new(model: &mut TransformerModel) -> Scheduler {
        Scheduler {
            limits: RequestLimits::of(model),
            chunk: model.options().max_batch_tokens.min(model.max_rows()),
            cuts: model.prefill_cuts(),
            max_seqs: model.max_seqs(),
            block_size: model.kv_cache().block_size(),
            eos_token_ids: model.config().eos_token_ids.clone(),
            next_id: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending: Vec::new(),
            prefill_since_decode: 0,
            stats: SchedulerStats::default(),
            spec: speculate::Speculation::for_model(model),
        }
    }

    /// The limits requests are checked against.
    pub fn limits(&self) -> RequestLimits {
        self.limits
    }

    /// Queue a request; it joins at a later step. A request that fails the checks is refused
    /// and nothing changes.
    pub fn add(&mut self, req: SeqRequest) -> Result<SeqId, InvalidRequest> {
        self.limits.check(&req)?;
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let mut stop = req.params.stop_token_ids.clone();
        if !req.ignore_eos {
            stop.extend(&self.eos_token_ids);
        }
        let seq = Seq::new(id, req.prompt, req.params, stop);
        if seq.params.max_new_tokens == 0 {
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
    /// already, or was never added).
    pub fn finish(
        &mut self,
        model: &mut TransformerModel,
        id: SeqId,
        reason: FinishReason,
    ) -> Result<Option<Generation>, ModelError> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut s = self.running.remove(i);
            release(model, &mut s)?;
            return Ok(Some(s.into_generation(reason)));
        }
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            return Ok(self.waiting.remove(i).map(|s| s.into_generation(reason)));
        }
        Ok(None)
    }

    /// Nothing queued, running or left to report.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.pending.is_empty()
    }

    /// Sequences waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences admitted and not finished.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Counters and the resources in use now.
    pub fn stats(&self, model: &mut TransformerModel) -> SchedulerStats {
        let kv = model.kv_allocator();
        let (kv_total, kv_free, kv_cached) = (kv.capacity(), kv.num_free(), kv.num_cached());
        let ssm_total = model.num_ssm_slots().unwrap_or(0);
        let ssm_free = model.free_ssm_slots().unwrap_or(0);
        let (snapshots_used, snapshots_total) = model.ssm_snapshot_usage();
        SchedulerStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_blocks_used: kv_total - kv_free,
            kv_blocks_total: kv_total,
            kv_blocks_cached: kv_cached,
            ssm_slots_used: ssm_total.saturating_sub(ssm_free),
            ssm_slots_total: ssm_total,
            ssm_snapshots_used: snapshots_used,
            ssm_snapshots_total: snapshots_total,
            speculation_on: self.spec.as_ref().map(|s| s.gate.is_on()),
            speculation_switches: self.spec.as_ref().map_or(0, |s| s.gate.switches()),
            plain_tok_s: self.spec.as_ref().and_then(|s| s.gate.rates().0),
            speculative_tok_s: self.spec.as_ref().and_then(|s| s.gate.rates().1),
            ..self.stats
        }
    }

    /// Run one step (see the policy in the module header): admit the queue head if it fits,
    /// then run a prefill chunk or a decode step.
    pub fn step(&mut self, model: &mut TransformerModel) -> Result<StepReport, StepFailed> {
        let mut events = std::mem::take(&mut self.pending);
        if let Err((error, id)) = self.admit(model) {
            self.pending = events;
            return Err(StepFailed {
                error: Box::new(error),
                aborted: vec![id],
            });
        }
        let prefill = self.running.iter().position(Seq::in_prefill);
        let decoders = self.running.iter().any(|s| !s.in_prefill());
        let kind = match prefill {
            Some(i)
                if !decoders
                    || self.prefill_since_decode
                        + self.running[i].next_chunk(self.chunk, self.cuts).len()
                        <= self.chunk =>
            {
                let id = self.running[i].id;
                self.prefill(model, i, &mut events)
                    .map_err(|e| (e, vec![id]))
            }
            _ if decoders => {
                let ids: Vec<SeqId> = self
                    .running
                    .iter()
                    .filter(|s| !s.in_prefill())
                    .map(|s| s.id)
                    .collect();
                self.decode(model, &mut events).map_err(|e| (e, ids))
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
                let aborted = self.abort(model, &ids);
                Err(StepFailed {
                    error: Box::new(error),
                    aborted,
                })
            }
        }
    }

    /// Drop every sequence, queued or running, releasing their resources; returns their ids.
    pub fn abort_all(&mut self, model: &mut TransformerModel) -> Vec<SeqId> {
        let mut ids: Vec<SeqId> = self
            .running
            .iter()
            .chain(&self.waiting)
            .map(|s| s.id)
            .collect();
        ids.extend(self.pending.iter().filter_map(|e| match e {
            SeqEvent::Finished { id, .. } => Some(*id),
            SeqEvent::Token { .. } => None,
        }));
        self.pending.clear();
        self.abort(model, &ids)
    }

    /// Remove the sequences `ids` (running or waiting) and release what they hold. A release
    /// that fails is logged: the sequence is gone either way.
    fn abort(&mut self, model: &mut TransformerModel, ids: &[SeqId]) -> Vec<SeqId> {
        let mut out = Vec::new();
        for &id in ids {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let mut s = self.running.remove(i);
                if let Err(e) = release(model, &mut s) {
                    tracing::warn!("aborting {id}: releasing its cache failed: {e}");
                }
            } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
                self.waiting.remove(i);
            }
            out.push(id);
        }
        out
    }

    /// Admit the queue head if the policy allows and it fits. On failure the head is dropped
    /// (its resources released) and named.
    fn admit(&mut self, model: &mut TransformerModel) -> Result<(), (ModelError, SeqId)> {
        let spares = self.spec.as_ref().map_or(0, |s| s.spares);
        if self.running.len() >= self.max_seqs
            || self.running.iter().any(Seq::in_prefill)
            || model.free_ssm_slots().is_some_and(|f| f < 1 + spares)
        {
            return Ok(());
        }
        let headroom = self.running.len();
        let Some(head) = self.waiting.front_mut() else {
            return Ok(());
        };
        let context = (head.tokens.len() + 1).min(self.limits.max_context);
        let need = context.div_ceil(self.block_size);
        // Shared blocks need no fresh ones, but taking a cached block nobody holds removes it
        // from the free count.
        let hit = prefix::lookup(model, head);
        let free = model.kv_allocator().num_free() - hit.unreferenced;
        if need - hit.blocks + headroom > free {
            return Ok(());
        }
        let Some(mut s) = self.waiting.pop_front() else {
            return Ok(());
        };
        let admitted = prefix::acquire(model, &mut s, hit).and_then(|()| {
            for _ in 0..spares {
                s.spare_slots.extend(model.alloc_ssm_slot()?);
            }
            Ok(s.table
                .ensure(context, self.block_size, &mut model.kv_cache().allocator)?)
        });
        if let Err(e) = admitted {
            if let Err(r) = release(model, &mut s) {
                tracing::warn!("admitting {}: releasing its cache failed: {r}", s.id);
            }
            return Err((e, s.id));
        }
        if model.options().prefix_caching {
            self.stats.prefix_queries += 1;
            self.stats.prefix_query_tokens += s.prompt_len as u64;
            if hit.blocks > 0 {
                self.stats.prefix_hits += 1;
                self.stats.prefix_hit_tokens += s.computed as u64;
            }
        }
        tracing::debug!(seq = %s.id, context, blocks = need, cached = s.computed, resumed = s.generated() > 0, "admitted");
        self.running.push(s);
        Ok(())
    }

    /// One prefill chunk of running sequence `i`.
    fn prefill(
        &mut self,
        model: &mut TransformerModel,
        i: usize,
        events: &mut Vec<SeqEvent>,
    ) -> Result<StepKind, ModelError> {
        let (chunk, bs) = (self.chunk, self.block_size);
        let s = &mut self.running[i];
        let range = s.next_chunk(chunk, self.cuts);
        let _span = tracing::debug_span!("step", kind = "prefill", seq = %s.id, start = range.start, rows = range.len()).entered();
        s.table
            .ensure(range.end, bs, &mut model.kv_cache().allocator)?;
        let rows: Vec<StepRow> = range
            .clone()
            .map(|p| StepRow {
                token: s.tokens[p],
                position: p as u32,
                seq: 0,
            })
            .collect();
        // Logits only when the chunk ends at the last known token (a resumed sequence knows the
        // tokens after its prompt already).
        let sample = range.end == s.tokens.len();
        let last = [(rows.len() - 1) as u32];
        let logit_rows: &[u32] = if sample { &last } else { &[] };
        let slots: Vec<u32> = s.ssm_slot.into_iter().collect();
        model.forward(&StepInput {
            rows: &rows,
            tables: &[&s.table],
            logit_rows,
            ssm_slots: &slots,
        })?;
        s.computed = range.end;
        let id = s.id;
        self.prefill_since_decode += range.len();
        self.stats.steps += 1;
        self.stats.prefill_steps += 1;
        self.stats.prefill_tokens += range.len() as u64;
        let mut done = None;
        if sample {
            let need = self.running[i].needs_logits();
            let picked = pick(model, 1, need)?
                .pop()
                .ok_or_else(|| ModelError::Step("a prefill step returned no logits".into()))?;
            done = self.accept(i, picked, events);
        }
        if done.is_none() {
            self.take_in(model, &[(i, 0..range.len() as u32, range.start)])?;
        }
        // Published after the drafter's take-in, which writes the MTP head's KV of the chunk:
        // a published block is never written again.
        prefix::publish(model, &mut self.running[i], range.end)?;
        if let Some(reason) = done {
            self.retire(model, i, reason, events)?;
        }
        Ok(StepKind::Prefill {
            seq: id,
            start: range.start,
            rows: range.len(),
        })
    }

    /// Sample running sequence `i`'s next token; returns why it ends, if it does.
    fn accept(
        &mut self,
        i: usize,
        picked: Picked,
        events: &mut Vec<SeqEvent>,
    ) -> Option<FinishReason> {
        let s = &mut self.running[i];
        let max = self.limits.max_context;
        let (token, reason) = match picked {
            Picked::Logits(logits) => s.accept(logits, max),
            Picked::Token(token) => s.accept_greedy(token, max),
        };
        self.stats.tokens_generated += 1;
        events.push(SeqEvent::Token { id: s.id, token });
        reason
    }

    /// Finish running sequence `i` with `reason`.
    fn retire(
        &mut self,
        model: &mut TransformerModel,
        i: usize,
        reason: FinishReason,
        events: &mut Vec<SeqEvent>,
    ) -> Result<(), ModelError> {
        let mut s = self.running.remove(i);
        let id = s.id;
        let released = release(model, &mut s);
        events.push(SeqEvent::Finished {
            id,
            generation: s.into_generation(reason),
        });
        released
    }
}
