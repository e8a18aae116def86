//! Re-prefill of finished conversations (`ModelOptions::reprefill_answers`): on a model whose
//! decode steps do not compute what prefill steps compute (hybrid models; fused circuit
//! programs), the blocks decode steps fill are never published, so a follow-up turn, whose
//! prompt repeats the conversation so far, would prefill the previous answer again on its own
//! critical path. Instead, when a sequence finishes, the scheduler prefills its conversation
//! (prompt and generated tokens) again as a sequence of its own that belongs to no request, so
//! that its blocks and SSM snapshots are published exactly as a cold prefill of those tokens
//! writes them.
//!
//! Policy:
//! - **Where it ends.** A follow-up can resume at position `p` of the conversation when the
//!   cache at `p`, and the chunks the follow-up cuts after `p`, are bitwise what a cold prefill
//!   of the follow-up's prompt computes. On a hybrid model that holds exactly at the multiples
//!   of the snapshot interval `lcm(block_size, 64)` (64 with the default blocks): `p` is a block
//!   boundary, so the blocks before it are whole; the GDN chunked prefill aligns its chunks to
//!   absolute multiples of 64, so the state after `p` tokens is the same whether a prefill step
//!   ends at `p` (the re-prefill's does) or runs through it (the cold run's may); and
//!   [`crate::runner::prefill_chunk`] restarts its cuts at each multiple of the interval, so the
//!   follow-up resumed at `p` cuts the rest of its prompt as the cold run does or at further
//!   multiples only. Attention rows do not depend on cuts. A block boundary between two
//!   multiples falls inside a GDN chunk: a step ending there rounds differently from a cold
//!   prefill running through it, so no snapshot is kept there. On a dense model (fused decode
//!   programs) every block boundary is a resume point.
//! - **What it computes.** The conversation's `n` tokens (prompt and every generated token; one
//!   fewer with a drafter, whose take-in of a row reads the next token, so the blocks carry the
//!   MTP head's KV too; at most the longest context) up to `end`, the last resume point at or
//!   before `n`, from the end of its own cached prefix (usually the previous prompt's last
//!   snapshot), in the chunks any prompt of `end` tokens is cut into. Its chunks end at every
//!   multiple of the interval they cross last and at `end` itself, and each keeps a snapshot,
//!   the one at `end` included. A follow-up whose prompt repeats the conversation then shares
//!   `end` tokens and computes the conversation's last `n - end` tokens (fewer than one
//!   interval) and its new message. A conversation whose `end` is cached already (every block,
//!   and the snapshot at `end`) is not re-prefilled.
//! - **Which sequences.** Those that end by their stop rule (`Stop`, `Length`), in the step
//!   that ends them; not cancelled ones (a cancellation, a stop string: the caller's text ends
//!   before the tokens the scheduler holds), nor those a failed step aborted.
//! - **Priority.** Re-prefills wait in a queue of their own, at most `max_decode_seqs` (the
//!   oldest dropped past that). One is admitted like a queued prompt (its cached prefix taken,
//!   its blocks and one SSM slot reserved at once, a block of headroom left per running
//!   sequence), but only when the scheduler is otherwise idle: no request waits and none runs.
//!   When a request arrives while a re-prefill is in prefill, the re-prefill gives way before
//!   the next step: released, back at the front of its queue, to resume later from what it
//!   published. So a re-prefill only ever takes time the device would spend idle: a request's
//!   admission is never delayed by more than the one chunk running when it arrives, and no
//!   decoding stream ever waits for a re-prefill's chunk. A serving user wants the next
//!   request's tokens, and a re-prefill is a bet on a follow-up that may never come; under
//!   continuous load the queue only drops its oldest, and follow-ups prefill the answer
//!   themselves, as without re-prefills. A follow-up that
//!   arrives while its own conversation's re-prefill runs computes from what the cache holds
//!   then, bitwise as always; the re-prefill, resumed, finds itself covered and ends.
//! - **Room.** A re-prefill that does not fit the cache when its turn comes is dropped, and one
//!   whose blocks a decoding sequence needs is dropped (it is the most recently admitted, the
//!   preemption victim, and never requeued): it never preempts a request. It holds its blocks
//!   and slot only while it runs; what it published stays in the prefix cache, evictable.
//! - **Reporting.** Its chunks are `StepKind::Reprefill` steps, counted in
//!   `StepCounts::reprefill_steps` and `reprefill_tokens`, not in the requests' prefill
//!   counters nor in the prefix-cache lookups; it emits no event. The scheduler is idle only
//!   once the queue is empty ([`Scheduler::run`] drops what is left once its requests are done).

use metrale_cache::CacheManager;

use super::request::FinishReason;
use super::sequence::Seq;
use super::{Scheduler, SeqId, prefix};
use crate::error::ModelError;
use crate::sampling::{Sampler, SamplingParams};

impl Scheduler {
    /// Whether finished sequences are re-prefilled: the option, with prefix caching on, on a
    /// model whose decode-filled blocks are not published and whose hits can be served (a
    /// hybrid model keeps snapshots).
    fn reprefills_on(&self) -> bool {
        let o = self.runner.options();
        o.prefix_caching
            && o.reprefill_answers
            && !self.runner.decode_matches_prefill()
            && (self.cache.ssm_slots().is_none() || self.cache.keeps_snapshots())
    }

    /// `s` has finished with `reason` (and released its cache): queue the re-prefill of its
    /// conversation, when there is one to run.
    pub(super) fn queue_reprefill(&mut self, s: &Seq, reason: FinishReason) {
        if !matches!(reason, FinishReason::Stop | FinishReason::Length) || !self.reprefills_on() {
            return;
        }
        let Some(r) = self.reprefill_of(s) else {
            return;
        };
        if self.reprefills.len() >= self.policy.max_seqs {
            self.reprefills.pop_front();
            self.stats.reprefills_skipped += 1;
        }
        tracing::debug!(seq = %r.id, of = %s.id, end = r.prompt_len, "re-prefill queued");
        self.reprefills.push_back(r);
    }

    /// The re-prefill of `s`'s conversation (see the module header), unless it would compute
    /// nothing new.
    fn reprefill_of(&mut self, s: &Seq) -> Option<Seq> {
        let bs = self.cache.block_size();
        let unit = self.policy.cuts.map_or(bs, |c| c.interval);
        let n = (s.tokens.len().min(self.policy.limits.max_context))
            .saturating_sub(usize::from(self.spec.is_some()));
        let end = n / unit * unit;
        if end == 0 {
            return None;
        }
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let sampler = Sampler::with_seed(SamplingParams::default(), 0);
        let mut r = Seq::new(
            id,
            s.tokens[..end].to_vec(),
            (sampler, 0),
            s.stop.clone(),
            false,
        );
        // The token after `end`, for a drafter's take-in of the last row.
        r.tokens.extend(s.tokens.get(end).copied());
        r.reprefill = true;
        let hashes = &s.cache.block_hashes;
        r.cache.block_hashes = hashes[..hashes.len().min(end / bs)].to_vec();
        (!covered(&self.cache, &mut r)).then_some(r)
    }

    /// No request waits and none is in prefill: admit the next queued re-prefill that still
    /// computes something, if it fits; one that does not fit, or fails to take its cache
    /// (logged), is dropped.
    pub(super) fn admit_reprefill(&mut self) {
        if !self.running.is_empty() {
            return; // only on an otherwise idle scheduler (see "Priority")
        }
        let bs = self.cache.block_size();
        while let Some(mut r) = self.reprefills.pop_front() {
            if covered(&self.cache, &mut r) {
                self.stats.reprefills_done += 1;
                continue;
            }
            let hit = prefix::lookup(&self.cache, true, &mut r);
            let free = self.cache.blocks().num_free() - hit.unreferenced;
            if r.prompt_len.div_ceil(bs) - hit.blocks + self.running.len() > free {
                tracing::debug!(seq = %r.id, "re-prefill skipped: no room in the cache");
                self.stats.reprefills_skipped += 1;
                continue;
            }
            let cache = &mut self.cache;
            let admitted = prefix::acquire(cache, &mut r, hit)
                .and_then(|()| Ok(cache.ensure(&mut r.cache.table, r.prompt_len)?));
            if let Err(e) = admitted {
                tracing::warn!("admitting re-prefill {}: {e}", r.id);
                if let Err(x) = r.release(&mut self.cache) {
                    tracing::warn!("admitting {}: releasing its cache failed: {x}", r.id);
                }
                self.stats.reprefills_skipped += 1;
                continue;
            }
            tracing::debug!(seq = %r.id, end = r.prompt_len, cached = r.computed, "re-prefill admitted");
            self.running.push(r);
            return;
        }
    }

    /// A request waits: the re-prefill in prefill, if any, gives way (released, requeued first,
    /// to resume from what it published). A release that fails is logged.
    pub(super) fn yield_reprefill(&mut self) {
        if self.waiting.is_empty() || !self.running.last().is_some_and(|s| s.reprefill) {
            return;
        }
        let Some(mut r) = self.running.pop() else {
            return;
        };
        tracing::debug!(seq = %r.id, computed = r.computed, "re-prefill gives way to a request");
        if let Err(e) = r.release(&mut self.cache) {
            tracing::warn!("re-prefill {}: releasing its cache failed: {e}", r.id);
        }
        self.reprefills.push_front(r);
    }

    /// Remove running re-prefill `i` and release its cache (what it published stays cached):
    /// `done`, or dropped.
    pub(super) fn end_reprefill(&mut self, i: usize, done: bool) -> Result<(), ModelError> {
        let mut r = self.running.remove(i);
        if done {
            self.stats.reprefills_done += 1;
        } else {
            tracing::debug!(seq = %r.id, "re-prefill dropped");
            self.stats.reprefills_skipped += 1;
        }
        r.release(&mut self.cache)
    }

    /// Drop every re-prefill, running or queued.
    pub(super) fn drop_reprefills(&mut self) -> Result<(), ModelError> {
        let mut result = Ok(());
        while let Some(i) = self.running.iter().position(|s| s.reprefill) {
            result = result.and(self.end_reprefill(i, false));
        }
        self.stats.reprefills_skipped += self.reprefills.len() as u64;
        self.reprefills.clear();
        result
    }

    /// Re-prefills running or queued.
    pub(super) fn reprefills_pending(&self) -> usize {
        self.reprefills.len() + self.running.iter().filter(|s| s.reprefill).count()
    }
}

/// Whether the cache serves all of re-prefill `r` already: every block of its prompt, and on a
/// hybrid model the snapshot at its end.
fn covered(cache: &CacheManager, r: &mut Seq) -> bool {
    r.hash_blocks(r.prompt_len, cache.block_size());
    let hashes = &r.cache.block_hashes;
    hashes.iter().all(|h| cache.blocks().lookup(h).is_some())
        && (cache.ssm_slots().is_none() || hashes.last().is_some_and(|h| cache.has_snapshot(h)))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{fixture_scheduler, greedy_request};
    use super::super::{SeqRequest, StepKind};
    use super::*;
    use crate::options::ModelOptions;

    fn hybrid(num_kv_blocks: usize) -> Scheduler {
        let options = ModelOptions::default()
            .max_batch_tokens(16)
            .max_decode_seqs(4)
            .num_kv_blocks(num_kv_blocks);
        fixture_scheduler("qwen3_5-tiny", options)
    }

    fn request(salt: usize, prompt_len: usize, max_new_tokens: usize) -> SeqRequest {
        let prompt = (0..prompt_len).map(|t| ((t + salt) * 7 % 250) as u32 + 1);
        greedy_request(prompt.collect(), max_new_tokens)
    }

    /// Run `requests` (salt, prompt length, new tokens) together to the end; returns each
    /// one's tokens, in order.
    fn run_all(s: &mut Scheduler, requests: &[(usize, usize, usize)]) -> Vec<Vec<u32>> {
        let ids: Vec<SeqId> = (requests.iter())
            .map(|&(salt, p, n)| s.add(request(salt, p, n)).expect("a valid request"))
            .collect();
        let mut out = vec![Vec::new(); ids.len()];
        while !s.is_idle() {
            for e in s.step().expect("step").events {
                if let super::super::SeqEvent::Finished { id, generation } = e {
                    out[ids.iter().position(|&i| i == id).expect("a request")] =
                        generation.token_ids;
                }
            }
        }
        out
    }

    /// Nothing is held: every block can be handed out, every SSM slot is free.
    fn assert_nothing_held(s: &Scheduler) {
        let a = s.cache().blocks();
        assert_eq!(a.num_free(), a.capacity(), "a KV block is still referenced");
        let (total, free) = s.cache().ssm_slots().expect("a hybrid model");
        assert_eq!(free, total, "an SSM slot is held");
    }

    /// Three requests together on 24 blocks: the first to finish (130 tokens) leaves its
    /// re-prefill queued while the other two decode; only once all three are done do the three
    /// re-prefills run, one after another. Nobody is preempted, the tokens are those of a roomy
    /// cache, and nothing is held once idle.
    #[test]
    fn reprefills_wait_until_the_scheduler_is_idle() {
        let requests = [(0, 70, 60), (100, 56, 100), (200, 56, 100)];
        let mut tight = hybrid(24);
        let ids: Vec<SeqId> = (requests.iter())
            .map(|&(salt, p, n)| tight.add(request(salt, p, n)).expect("a valid request"))
            .collect();
        let mut got = vec![Vec::new(); ids.len()];
        let (mut finished, mut beside_requests) = (0, 0);
        while !tight.is_idle() {
            let report = tight.step().expect("step");
            if matches!(report.kind, StepKind::Reprefill { .. }) && finished < ids.len() {
                beside_requests += 1;
            }
            for e in report.events {
                if let super::super::SeqEvent::Finished { id, generation } = e {
                    finished += 1;
                    got[ids.iter().position(|&i| i == id).expect("a request")] =
                        generation.token_ids;
                }
            }
        }
        assert_eq!(beside_requests, 0, "a re-prefill ran while a request ran");
        assert_eq!(got, run_all(&mut hybrid(40), &requests));
        let t = tight.stats().steps;
        assert_eq!(
            (t.preemptions, t.reprefills_skipped, t.reprefills_done),
            (0, 0, 3)
        );
        assert_nothing_held(&tight);
    }

    /// A re-prefill waits while a request is queued or runs: the request's prefill and decode
    /// steps run first, the re-prefill only once the request is done.
    #[test]
    fn a_reprefill_waits_behind_a_queued_request() {
        let mut s = hybrid(40);
        let a = s.add(request(0, 70, 60)).expect("a valid request");
        let mut finished = false;
        while !finished {
            let events = s.step().expect("step").events;
            finished = (events.iter())
                .any(|e| matches!(e, super::super::SeqEvent::Finished { id, .. } if *id == a));
        }
        assert_eq!(s.stats().reprefills, 1);
        let b = s.add(request(100, 40, 4)).expect("a valid request");
        let mut kinds = Vec::new();
        while !s.is_idle() {
            kinds.push(s.step().expect("step").kind);
        }
        let prefill = |start, rows| StepKind::Prefill {
            seq: b,
            start,
            rows,
        };
        assert_eq!(
            kinds[..3],
            [prefill(0, 16), prefill(16, 16), prefill(32, 8)]
        );
        let first = kinds
            .iter()
            .position(|k| matches!(k, StepKind::Reprefill { .. }));
        assert_eq!(
            first.map(|i| kinds[i]),
            Some(StepKind::Reprefill {
                start: 64,
                rows: 16
            }),
            "{kinds:?}"
        );
        // Prefill, then one decode step per token after the first.
        assert_eq!(first, Some(3 + 3), "{kinds:?}");
        assert_eq!(s.stats().steps.reprefill_tokens, 64);
        assert_nothing_held(&s);
    }
}
