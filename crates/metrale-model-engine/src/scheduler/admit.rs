//! Admission and prefill: the queue head joins the running sequences when it fits (with its
//! cached prefix taken at once), and one prefill chunk of the sequence in prefill runs.

use super::sequence::{PendingChoice, Picked, Seq};
use super::{FinishReason, Scheduler, SeqEvent, Speculation, StepKind, prefix};
use crate::error::ModelError;
use crate::runner::{StepInput, StepRow, StepRunner};
use crate::sampling::{SampleRow, SampledToken, Sampler, choice_seed};

impl Scheduler {
    /// Admit the queue head if the policy allows and it fits; with no request waiting, the next
    /// re-prefill (see `reprefill`), which gives way to a waiting request first. On failure the
    /// sequence is dropped (its resources released) and named (a re-prefill's failure is only
    /// logged: it is no request's, and the cache error shows again on the next request).
    pub(super) fn admit(&mut self) -> Result<(), (ModelError, super::SeqId)> {
        self.yield_reprefill();
        let spares = self.spec.as_ref().map_or(0, Speculation::spares);
        let (free_slots, bs) = (
            self.cache.ssm_slots().map(|(_, free)| free),
            self.cache.block_size(),
        );
        if self.running.len() >= self.policy.max_seqs
            || self.running.iter().any(Seq::in_prefill)
            || free_slots.is_some_and(|f| f < 1 + spares)
        {
            return Ok(());
        }
        let headroom = self.running.len();
        let caching = self.runner.options().prefix_caching;
        let Some(head) = self.waiting.front_mut() else {
            self.admit_reprefill();
            return Ok(());
        };
        // Choices still to fork: each will hold its own sequence, slots and partial block.
        let forks = head.choices.len();
        if self.running.len() + 1 + forks > self.policy.max_seqs
            || free_slots.is_some_and(|f| f < (1 + spares) * (1 + forks))
        {
            return Ok(());
        }
        let context = (head.tokens.len() + 1).min(self.policy.limits.max_context);
        // Each choice forks a copy of the partial last block and grows by one block of headroom.
        let need = context.div_ceil(bs) + 2 * forks;
        // Shared blocks need no fresh ones, but taking a cached block nobody holds removes it
        // from the free count.
        let hit = prefix::lookup(&self.cache, caching, head);
        let free = self.cache.blocks().num_free() - hit.unreferenced;
        if need - hit.blocks + headroom > free {
            return Ok(());
        }
        let Some(mut s) = self.waiting.pop_front() else {
            return Ok(());
        };
        let cache = &mut self.cache;
        let admitted = prefix::acquire(cache, &mut s, hit).and_then(|()| {
            for _ in 0..spares {
                s.cache.spare_slots.extend(cache.alloc_ssm_slot(None)?);
            }
            Ok(cache.ensure(&mut s.cache.table, context)?)
        });
        if let Err(e) = admitted {
            if let Err(r) = s.release(&mut self.cache) {
                tracing::warn!("admitting {}: releasing its cache failed: {r}", s.id);
            }
            return Err((e, s.id));
        }
        if caching {
            let p = &mut self.stats.prefix;
            p.queries += 1;
            p.query_tokens += s.prompt_len as u64;
            if hit.blocks > 0 {
                p.hits += 1;
                p.hit_tokens += s.computed as u64;
            }
        }
        tracing::debug!(seq = %s.id, context, blocks = need, cached = s.computed, resumed = s.generated() > 0, "admitted");
        self.running.push(s);
        Ok(())
    }

    /// One prefill chunk of running sequence `i`, alone in its step.
    pub(super) fn prefill(
        &mut self,
        i: usize,
        events: &mut Vec<SeqEvent>,
    ) -> Result<StepKind, ModelError> {
        let s = &mut self.running[i];
        let range = s.next_chunk(self.policy.chunk, self.policy.cuts);
        let _span = tracing::debug_span!("step", kind = "prefill", seq = %s.id, start = range.start, rows = range.len()).entered();
        self.cache.ensure(&mut s.cache.table, range.end)?;
        let rows = chunk_rows(s, range.clone(), 0);
        // Logits only when the chunk ends at the last known token (a resumed sequence knows the
        // tokens after its prompt already); a re-prefill samples nothing.
        let sample = range.end == s.tokens.len() && !s.reprefill;
        let last = [(rows.len() - 1) as u32];
        let logit_rows: &[u32] = if sample { &last } else { &[] };
        let slots: Vec<u32> = s.cache.ssm_slot.into_iter().collect();
        self.runner.forward(
            &self.cache,
            &StepInput {
                rows: &rows,
                tables: &[&s.cache.table],
                logit_rows,
                ssm_slots: &slots,
                prompt_until: &[s.prompt_len as u32],
            },
        )?;
        s.computed = range.end;
        let (id, reprefill) = (s.id, s.reprefill);
        let picked = if sample {
            self.prepare_masks([i]);
            let s = &self.running[i];
            let picked = pick(&self.runner, &[s.sample_row()], s.keeps_logits())?.pop();
            Some(
                picked
                    .ok_or_else(|| ModelError::Step("a prefill step returned no logits".into()))?,
            )
        } else {
            None
        };
        self.prefill_since_decode += range.len();
        self.stats.steps += 1;
        let done = if reprefill {
            self.stats.reprefill_steps += 1;
            self.stats.reprefill_tokens += range.len() as u64;
            None
        } else {
            self.stats.prefill_steps += 1;
            self.chunk_ran(i, range.len(), picked, events)?
        };
        if done.is_none() {
            // A re-prefill leaves the batch after its last chunk.
            let ends = reprefill && range.end == self.running[i].prompt_len;
            let leaving: &[usize] = if ends { &[i] } else { &[] };
            self.take_in(&[(i, 0..range.len() as u32, range.start)], leaving)?;
        }
        self.publish_chunk(i, range.end)?;
        if let Some(reason) = done {
            self.retire(i, reason, events)?;
        }
        if reprefill {
            if range.end == self.running[i].prompt_len {
                self.end_reprefill(i, true)?;
            }
            return Ok(StepKind::Reprefill {
                start: range.start,
                rows: range.len(),
            });
        }
        Ok(StepKind::Prefill {
            seq: id,
            start: range.start,
            rows: range.len(),
        })
    }

    /// After a step that ran a prefill chunk of `rows` rows of running sequence `i` (its
    /// `computed` already past the chunk): when the chunk ends the sequence's known tokens, the
    /// step's logit row 0 is the chunk's last row and `picked` what the sequence's sampler drew
    /// from it; the other choices then fork the sequence's cache and draw their first tokens
    /// from the same row, and the pick is recorded. Returns why the sequence ends, if it does;
    /// the caller runs the take-in, publishes the chunk's blocks (`publish_chunk`) and retires
    /// the sequence.
    pub(super) fn chunk_ran(
        &mut self,
        i: usize,
        rows: usize,
        picked: Option<Picked>,
        events: &mut Vec<SeqEvent>,
    ) -> Result<Option<FinishReason>, ModelError> {
        self.stats.prefill_tokens += rows as u64;
        let Some(picked) = picked else {
            return Ok(None);
        };
        // The other choices fork this sequence's cache now, its prompt computed.
        for (c, choice) in std::mem::take(&mut self.running[i].choices)
            .into_iter()
            .enumerate()
        {
            self.fork_choice(i, choice, c + 1, events)?;
        }
        Ok(self.record(i, picked, events))
    }

    /// Publish the prompt blocks running sequence `i`'s chunk ending at `end` completed (and
    /// on hybrid models keep its SSM state there, see `prefix::publish`): after the drafter's
    /// take-in, which writes the MTP head's KV of the chunk, since a published block is never
    /// written again.
    pub(super) fn publish_chunk(&mut self, i: usize, end: usize) -> Result<(), ModelError> {
        let caching = self.runner.options().prefix_caching;
        let interval = self.runner.ssm_snapshot_interval();
        prefix::publish(
            &mut self.cache,
            caching,
            interval,
            &mut self.running[i],
            end,
        )
    }
}

/// The rows of `s`'s prompt positions `range`, for the step's sequence `seq`.
pub(super) fn chunk_rows(s: &Seq, range: std::ops::Range<usize>, seq: u32) -> Vec<StepRow> {
    range
        .map(|p| StepRow {
            token: s.tokens[p],
            position: p as u32,
            seq,
        })
        .collect()
}

impl Scheduler {
    /// Choice `c` of running sequence `i`, whose prompt is computed: its cache forked from
    /// `i`'s, its own seed and constraint, its first token drawn from the last step's logits
    /// (row 0).
    /// The MTP head's KV of the last chunk's partial block is not in the fork (it is written
    /// after), which can cost the choice draft acceptance, never output.
    fn fork_choice(
        &mut self,
        i: usize,
        choice: PendingChoice,
        c: usize,
        events: &mut Vec<SeqEvent>,
    ) -> Result<(), ModelError> {
        let spares = self.spec.as_ref().map_or(0, Speculation::spares);
        let p = &self.running[i];
        let (table, slot) = self
            .cache
            .fork(&p.cache.table, p.computed, p.cache.ssm_slot)?;
        let seed = choice_seed(p.seed, c);
        let sampler = Sampler::with_seed(p.sampler.params().clone(), seed);
        let prompt = p.tokens[..p.prompt_len].to_vec();
        let mut child = Seq::new(
            choice.id,
            prompt,
            (sampler, seed),
            p.stop.clone(),
            p.logits.is_some(),
        );
        child.constraint = choice.constraint;
        child.computed = p.computed;
        child.cache.table = table;
        child.cache.ssm_slot = slot;
        child.cache.block_hashes = p.cache.block_hashes.clone();
        child.cache.published = p.cache.published;
        for _ in 0..spares {
            match self.cache.alloc_ssm_slot(None) {
                Ok(s) => child.cache.spare_slots.extend(s),
                Err(e) => {
                    child.release(&mut self.cache)?;
                    return Err(e.into());
                }
            }
        }
        self.running.push(child);
        let k = self.running.len() - 1;
        self.prepare_masks([k]);
        let child = &self.running[k];
        let (keep, row) = (child.keeps_logits(), child.sample_row());
        let picked = pick(&self.runner, &[row], keep)?
            .pop()
            .ok_or_else(|| ModelError::Step("a prefill step returned no logits".into()))?;
        if let Some(reason) = self.record(k, picked, events) {
            self.retire(k, reason, events)?;
        }
        Ok(())
    }
}

/// The first `rows.len()` logit rows of `runner`'s last step through the device sampler (only
/// tokens and logprobs come back), with every row's host logits when `keep_logits`.
pub(super) fn pick(
    runner: &StepRunner,
    rows: &[SampleRow],
    keep_logits: bool,
) -> Result<Vec<Picked>, ModelError> {
    let sampled = runner.sample(rows)?;
    with_logits(runner, sampled, keep_logits)
}

/// `sampled` as picked rows, with the host logits of the last step's rows when `keep_logits`.
pub(super) fn with_logits(
    runner: &StepRunner,
    sampled: Vec<SampledToken>,
    keep_logits: bool,
) -> Result<Vec<Picked>, ModelError> {
    let mut logits = if keep_logits {
        runner
            .logits(sampled.len())?
            .into_iter()
            .map(Some)
            .collect()
    } else {
        vec![None; sampled.len()]
    };
    Ok((sampled.into_iter().zip(logits.iter_mut()))
        .map(|(s, l)| Picked::Sampled(s, l.take()))
        .collect())
}
