//! The decode step of the scheduler: room in the KV cache for every decoding sequence's next
//! row (preempting the most recently admitted by recompute when the cache is full), and the
//! plain step (one row a sequence); `speculate` has the verify step that replaces it.

use metrale_cache::{BlockTable, CacheError};

use super::admit::with_logits;
use super::sequence::Seq;
use super::{Scheduler, SeqEvent, StepKind, prefix};
use crate::error::ModelError;
use crate::runner::StepRow;
use crate::sampling::SampleRow;

impl Scheduler {
    /// One decode step of every running sequence past its prompt: a verify step when some
    /// sequence has drafts, else a plain one; with speculation its tokens and time feed the
    /// gate.
    pub(super) fn decode(&mut self, events: &mut Vec<SeqEvent>) -> Result<StepKind, ModelError> {
        self.prefill_since_decode = 0;
        let start = self.spec.as_ref().map(|s| s.now());
        let before = events.len();
        let kind = if self.next_decode_speculates() {
            self.verify(events)?
        } else {
            self.plain_decode(events)?
        };
        if let (Some(spec), Some(start)) = (self.spec.as_mut(), start) {
            let tokens = (events[before..].iter())
                .filter(|e| matches!(e, SeqEvent::Token { .. }))
                .count();
            spec.record_step(matches!(kind, StepKind::Verify { .. }), tokens, start);
        }
        Ok(kind)
    }

    /// Room in the KV cache for the next decode step of every running sequence past its prompt:
    /// its next row and its drafts (a sequence whose drafts do not fit drops them; one whose
    /// next row does not fit makes the most recently admitted sequence give way, preempted).
    /// Returns the sequences that decode, in running order.
    pub(super) fn make_decode_room(&mut self) -> Result<Vec<usize>, ModelError> {
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            if s.in_prefill() {
                i += 1;
                continue;
            }
            let need = s.computed + 1 + s.drafts.len();
            match self.cache.ensure(&mut s.cache.table, need) {
                Ok(()) => i += 1,
                Err(CacheError::OutOfBlocks { .. }) if !s.drafts.is_empty() => s.drafts.clear(),
                // The victim is the last running sequence: this one or a newer one, so the
                // sequences already given room keep it.
                Err(CacheError::OutOfBlocks { .. }) => self.preempt(self.running.len() - 1)?,
                Err(e) => return Err(e.into()),
            }
        }
        Ok((0..self.running.len())
            .filter(|&i| !self.running[i].in_prefill())
            .collect())
    }

    /// One plain decode step of every running sequence past its prompt, after making room for
    /// each one's next row (preempting the most recently admitted when the cache is full).
    fn plain_decode(&mut self, events: &mut Vec<SeqEvent>) -> Result<StepKind, ModelError> {
        let idx = self.make_decode_room()?;
        if idx.is_empty() {
            return Ok(StepKind::Idle);
        }
        let _span = tracing::debug_span!("step", kind = "decode", seqs = idx.len()).entered();
        let rows: Vec<StepRow> = (idx.iter().enumerate())
            .map(|(k, &i)| {
                let s = &self.running[i];
                StepRow {
                    token: s.tokens[s.computed],
                    position: s.computed as u32,
                    seq: k as u32,
                }
            })
            .collect();
        let (tables, slots) = tables_and_slots(&self.running, &idx);
        let constrained = idx.iter().any(|&i| self.running[i].samples_masked());
        let sampled = if constrained {
            // The forward runs on the device while the host computes the constrained rows'
            // masks; the sampler follows their upload on the stream.
            let launched = (self.runner).decode_forward(&self.cache, &rows, &tables, &slots)?;
            self.prepare_masks(idx.iter().copied());
            let sampling: Vec<SampleRow> =
                idx.iter().map(|&i| self.running[i].sample_row()).collect();
            self.runner.sample_decoded(launched, &sampling)?
        } else {
            // Every row's sampling (a replayed row's pick is dropped below), inside the step.
            let sampling: Vec<SampleRow> =
                idx.iter().map(|&i| self.running[i].sample_row()).collect();
            (self.runner).decode_sampled(&self.cache, &rows, &tables, &slots, &sampling)?
        };
        // Host logits only when a row that samples now keeps them.
        let keep = (idx.iter()).any(|&i| {
            let s = &self.running[i];
            s.computed + 1 == s.tokens.len() && s.keeps_logits()
        });
        let picked = with_logits(&self.runner, sampled, keep)?;
        self.stats.steps += 1;
        self.stats.decode_steps += 1;
        let (mut done, mut ran) = (Vec::new(), Vec::new());
        for (q, (&i, row)) in idx.iter().zip(picked).enumerate() {
            let s = &mut self.running[i];
            s.computed += 1;
            let position = s.computed - 1;
            // A replayed row's token is known already; only the row of the last token samples.
            match (s.computed == s.tokens.len())
                .then(|| self.record(i, row, events))
                .flatten()
            {
                Some(reason) => done.push((i, reason)),
                None => ran.push((i, q as u32..q as u32 + 1, position)),
            }
        }
        self.take_in(&ran)?;
        // After the MTP head's take-in, which writes its own KV for these rows.
        prefix::publish_decoded(&self.runner, &mut self.cache, &mut self.running, &idx)?;
        for (i, reason) in done.into_iter().rev() {
            self.retire(i, reason, events)?;
        }
        Ok(StepKind::Decode { seqs: idx.len() })
    }

    /// Preempt running sequence `i` by recompute: release its cache and requeue it first. A
    /// re-prefill is dropped instead (see `reprefill`).
    fn preempt(&mut self, i: usize) -> Result<(), ModelError> {
        if self.running[i].reprefill {
            return self.end_reprefill(i, false);
        }
        let mut s = self.running.remove(i);
        tracing::debug!(seq = %s.id, generated = s.generated(), "preempted");
        let released = s.release(&mut self.cache);
        self.stats.preemptions += 1;
        self.waiting.push_front(s);
        released
    }
}

/// The block tables and SSM slots of running sequences `idx`, in that order: the per-sequence
/// inputs of a decode or verify step.
pub(super) fn tables_and_slots<'a>(
    running: &'a [Seq],
    idx: &[usize],
) -> (Vec<&'a BlockTable>, Vec<u32>) {
    let tables = idx.iter().map(|&i| &running[i].cache.table).collect();
    let slots = (idx.iter())
        .filter_map(|&i| running[i].cache.ssm_slot)
        .collect();
    (tables, slots)
}
