//! The decode step of the scheduler: room in the KV cache for every decoding sequence's next
//! row (preempting the most recently admitted by recompute when the cache is full), and the
//! plain step (one row a sequence); `speculate` has the verify step that replaces it.

use metrale_cache::{BlockTable, CacheError};

use super::sequence::release;
use super::{Scheduler, SeqEvent, StepKind, pick, prefix};
use crate::error::ModelError;
use crate::model::{StepRow, TransformerModel};

impl Scheduler {
    /// One decode step of every running sequence past its prompt: a verify step when some
    /// sequence has drafts, else a plain one; with speculation its tokens and time feed the
    /// gate.
    pub(super) fn decode(
        &mut self,
        model: &mut TransformerModel,
        events: &mut Vec<SeqEvent>,
    ) -> Result<StepKind, ModelError> {
        self.prefill_since_decode = 0;
        let start = self.spec.as_ref().map(|s| s.clock.now());
        let before = events.len();
        let kind = if self.next_decode_speculates() {
            self.verify(model, events)?
        } else {
            self.plain_decode(model, events)?
        };
        if let (Some(spec), Some(start)) = (self.spec.as_mut(), start) {
            let tokens = events[before..]
                .iter()
                .filter(|e| matches!(e, SeqEvent::Token { .. }))
                .count();
            let speculative = matches!(kind, StepKind::Verify { .. });
            if tokens > 0 {
                let elapsed = spec.clock.now().saturating_sub(start);
                spec.gate.record(speculative, tokens, elapsed);
            }
        }
        Ok(kind)
    }

    /// Room in the KV cache for the next decode step of every running sequence past its prompt:
    /// its next row and its drafts (a sequence whose drafts do not fit drops them; one whose
    /// next row does not fit makes the most recently admitted sequence give way, preempted).
    /// Returns the sequences that decode, in running order.
    pub(super) fn make_decode_room(
        &mut self,
        model: &mut TransformerModel,
    ) -> Result<Vec<usize>, ModelError> {
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            if s.in_prefill() {
                i += 1;
                continue;
            }
            let need = s.computed + 1 + s.drafts.len();
            match s
                .table
                .ensure(need, self.block_size, &mut model.kv_cache().allocator)
            {
                Ok(()) => i += 1,
                Err(CacheError::OutOfBlocks { .. }) if !s.drafts.is_empty() => s.drafts.clear(),
                // The victim is the last running sequence: this one or a newer one, so the
                // sequences already given room keep it.
                Err(CacheError::OutOfBlocks { .. }) => {
                    self.preempt(model, self.running.len() - 1)?
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok((0..self.running.len())
            .filter(|&i| !self.running[i].in_prefill())
            .collect())
    }

    /// One plain decode step of every running sequence past its prompt, after making room for
    /// each one's next row (preempting the most recently admitted when the cache is full).
    fn plain_decode(
        &mut self,
        model: &mut TransformerModel,
        events: &mut Vec<SeqEvent>,
    ) -> Result<StepKind, ModelError> {
        let idx = self.make_decode_room(model)?;
        if idx.is_empty() {
            return Ok(StepKind::Idle);
        }
        let _span = tracing::debug_span!("step", kind = "decode", seqs = idx.len()).entered();
        let rows: Vec<StepRow> = idx
            .iter()
            .enumerate()
            .map(|(k, &i)| {
                let s = &self.running[i];
                StepRow {
                    token: s.tokens[s.computed],
                    position: s.computed as u32,
                    seq: k as u32,
                }
            })
            .collect();
        let (tables, slots) = self.tables_and_slots(&idx);
        model.decode(&rows, &tables, &slots)?;
        // Host logits only when a row that samples now needs them (see `Seq::needs_logits`).
        let need = idx.iter().any(|&i| {
            let s = &self.running[i];
            s.computed + 1 == s.tokens.len() && s.needs_logits()
        });
        let picked = pick(model, idx.len(), need)?;
        self.stats.steps += 1;
        self.stats.decode_steps += 1;
        let (mut done, mut ran) = (Vec::new(), Vec::new());
        for (q, (&i, row)) in idx.iter().zip(picked).enumerate() {
            let s = &mut self.running[i];
            s.computed += 1;
            let position = s.computed - 1;
            // A replayed row's token is known already; only the row of the last token samples.
            match (s.computed == s.tokens.len())
                .then(|| self.accept(i, row, events))
                .flatten()
            {
                Some(reason) => done.push((i, reason)),
                None => ran.push((i, q as u32..q as u32 + 1, position)),
            }
        }
        self.take_in(model, &ran)?;
        // After the MTP head's take-in, which writes its own KV for these rows.
        for &i in &idx {
            prefix::publish_decoded(model, &mut self.running[i])?;
        }
        for (i, reason) in done.into_iter().rev() {
            self.retire(model, i, reason, events)?;
        }
        Ok(StepKind::Decode { seqs: idx.len() })
    }

    /// The block tables and SSM slots of running sequences `idx`, in that order: the per-sequence
    /// inputs of a decode or verify step.
    pub(super) fn tables_and_slots(&self, idx: &[usize]) -> (Vec<&BlockTable>, Vec<u32>) {
        let tables = idx.iter().map(|&i| &self.running[i].table).collect();
        let slots = idx
            .iter()
            .filter_map(|&i| self.running[i].ssm_slot)
            .collect();
        (tables, slots)
    }

    /// Preempt running sequence `i` by recompute: release its cache and requeue it first.
    pub(super) fn preempt(
        &mut self,
        model: &mut TransformerModel,
        i: usize,
    ) -> Result<(), ModelError> {
        let mut s = self.running.remove(i);
        tracing::debug!(seq = %s.id, generated = s.generated(), "preempted");
        let released = release(model, &mut s);
        self.stats.preemptions += 1;
        self.waiting.push_front(s);
        released
    }
}
