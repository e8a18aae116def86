//! Admission and prefill: the queue head joins the running sequences when it fits (with its
//! cached prefix taken at once), and one prefill chunk of the sequence in prefill runs.

use super::sequence::{Picked, Seq};
use super::{Scheduler, SeqEvent, Speculation, StepKind, prefix};
use crate::error::ModelError;
use crate::runner::{StepInput, StepRow, StepRunner};

impl Scheduler {
    /// Admit the queue head if the policy allows and it fits. On failure the head is dropped
    /// (its resources released) and named.
    pub(super) fn admit(&mut self) -> Result<(), (ModelError, super::SeqId)> {
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
            return Ok(());
        };
        let context = (head.tokens.len() + 1).min(self.policy.limits.max_context);
        let need = context.div_ceil(bs);
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

    /// One prefill chunk of running sequence `i`.
    pub(super) fn prefill(
        &mut self,
        i: usize,
        events: &mut Vec<SeqEvent>,
    ) -> Result<StepKind, ModelError> {
        let s = &mut self.running[i];
        let range = s.next_chunk(self.policy.chunk, self.policy.cuts);
        let _span = tracing::debug_span!("step", kind = "prefill", seq = %s.id, start = range.start, rows = range.len()).entered();
        self.cache.ensure(&mut s.cache.table, range.end)?;
        let rows: Vec<StepRow> = (range.clone())
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
        let slots: Vec<u32> = s.cache.ssm_slot.into_iter().collect();
        self.runner.forward(
            &self.cache,
            &StepInput {
                rows: &rows,
                tables: &[&s.cache.table],
                logit_rows,
                ssm_slots: &slots,
            },
        )?;
        s.computed = range.end;
        let id = s.id;
        if sample {
            self.prepare_masks([i]);
        }
        self.prefill_since_decode += range.len();
        self.stats.steps += 1;
        self.stats.prefill_steps += 1;
        self.stats.prefill_tokens += range.len() as u64;
        let mut done = None;
        if sample {
            let need = self.running[i].needs_logits();
            let picked = pick(&self.runner, 1, need)?
                .pop()
                .ok_or_else(|| ModelError::Step("a prefill step returned no logits".into()))?;
            done = self.record(i, picked, events);
        }
        if done.is_none() {
            self.take_in(&[(i, 0..range.len() as u32, range.start)])?;
        }
        // Published after the drafter's take-in, which writes the MTP head's KV of the chunk:
        // a published block is never written again.
        let caching = self.runner.options().prefix_caching;
        let interval = self.runner.ssm_snapshot_interval();
        prefix::publish(
            &mut self.cache,
            caching,
            interval,
            &mut self.running[i],
            range.end,
        )?;
        if let Some(reason) = done {
            self.retire(i, reason, events)?;
        }
        Ok(StepKind::Prefill {
            seq: id,
            start: range.start,
            rows: range.len(),
        })
    }
}

/// The first `n` logit rows of `runner`'s last step, as host logits when `need_logits`, else as
/// the device's argmax (4 bytes a row instead of the vocabulary's logits).
pub(super) fn pick(
    runner: &StepRunner,
    n: usize,
    need_logits: bool,
) -> Result<Vec<Picked>, ModelError> {
    Ok(if need_logits {
        runner.logits(n)?.into_iter().map(Picked::Logits).collect()
    } else {
        runner.greedy(n)?.into_iter().map(Picked::Token).collect()
    })
}
