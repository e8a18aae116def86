//! The decode step of the scheduler: room in the KV cache for every decoding sequence's next
//! row (preempting the most recently admitted by recompute when the cache is full), and the
//! plain step (one row a sequence), mixed with a chunk of the sequence in prefill when the
//! policy mixes (`Scheduler::mixes`); `speculate` has the verify step that replaces it.

use metrale_cache::{BlockTable, CacheError};

use std::ops::Range;

use super::admit::{chunk_rows, with_logits};
use super::sequence::Seq;
use super::{Scheduler, SeqEvent, StepKind, prefix};
use crate::error::ModelError;
use crate::runner::{StepInput, StepRow, mixed_chunk, rows_within_attention};
use crate::sampling::SampleRow;

impl Scheduler {
    /// One decode step of every running sequence past its prompt: a verify step when some
    /// sequence has drafts, else a plain one; with speculation its tokens and time feed the
    /// gate.
    pub(super) fn decode(&mut self, events: &mut Vec<SeqEvent>) -> Result<StepKind, ModelError> {
        self.prefill_since_decode = 0;
        let start = self.spec.as_ref().map(|s| s.now());
        let paced_start = self.pacer.as_ref().map(|p| p.now());
        let width = self.decoding();
        let before = events.len();
        let kind = if self.next_decode_speculates() {
            self.verify(events)?
        } else {
            self.plain_decode(events)?
        };
        // A mixed step's time is not a decode step's: the gate compares decode steps.
        if let (Some(spec), Some(start), false) = (
            self.spec.as_mut(),
            start,
            matches!(kind, StepKind::Mixed { .. }),
        ) {
            let tokens = (events[before..].iter())
                .filter(|e| matches!(e, SeqEvent::Token { .. }))
                .count();
            spec.record_step(
                width,
                matches!(kind, StepKind::Verify { .. }),
                tokens,
                start,
            );
        }
        // Pacing times plain steps and mixed ones, each by its padded decode width.
        let timed = match kind {
            StepKind::Decode { seqs } => Some((seqs, None)),
            StepKind::Mixed { seqs, rows, .. } => Some((seqs, Some(rows))),
            _ => None,
        };
        if let (Some(start), Some((seqs, rows))) = (paced_start, timed)
            && let Some(w) = self.runner.options().decode_width(seqs)
            && let Some(pacer) = self.pacer.as_mut()
        {
            match rows {
                None => pacer.plain_step(w, start),
                Some(rows) => pacer.mixed_step(w, rows, start),
            }
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

    /// Whether the next decode step also holds a chunk of running sequence `p`, the one in
    /// prefill (a mixed step; see "Steps" in the module header of `scheduler`): mixing applies
    /// ([`Scheduler::may_mix`]) and, with mixed steps paced, the step's decode width has its
    /// plain steps timed (until then the step runs plain, and times one).
    pub(super) fn mixes(&self, p: usize) -> bool {
        self.may_mix(p) && !self.pace_waits(self.decoding())
    }

    /// Whether mixing applies to running sequence `p`, the one in prefill, pacing aside: mixing
    /// is on, the forward computes decode rows as decode steps do, the step is not a verify
    /// step, `p` is a request's (not a re-prefill, whose chunks sample nothing and count apart),
    /// and the chunk's smallest piece fits the step's rows beside the decode rows. Where it
    /// applies, the prompt's chunks never run alone while others decode.
    pub(super) fn may_mix(&self, p: usize) -> bool {
        let (o, r) = (self.runner.options(), &self.runner);
        if !o.mixed_steps
            || !r.forward_matches_decode()
            || self.next_decode_speculates()
            || self.running[p].reprefill
        {
            return false;
        }
        let d = self.decoding();
        d > 0 && d + self.mixed_range(p, d).len() <= r.sizes().max_rows
    }

    /// Running sequences past their prompt (a decode step's rows).
    fn decoding(&self) -> usize {
        self.running.iter().filter(|s| !s.in_prefill()).count()
    }

    /// With mixed steps paced, the paced chunk rows of a step of `d` decode rows; `None`
    /// without pacing, or while its padded decode width has not been timed.
    fn paced_rows(&self, d: usize) -> Option<usize> {
        let width = self.runner.options().decode_width(d)?;
        self.pacer.as_ref()?.rows(width)
    }

    /// Whether mixed steps are paced and a step of `d` decode rows must run plain first, its
    /// padded width not yet timed.
    fn pace_waits(&self, d: usize) -> bool {
        self.pacer.is_some() && self.paced_rows(d).is_none()
    }

    /// The prompt positions of running sequence `p`'s chunk in a step of `d` decode rows: the
    /// mixed step's token budget (`mixed_step_tokens`, at most the chunk budget) less the decode
    /// rows, within `mixed_chunk_attention` of attention work and the paced rows
    /// (`mixed_step_slowdown_pct`), at least one row, cut where `mixed_chunk` allows.
    fn mixed_range(&self, p: usize, d: usize) -> Range<usize> {
        let (chunk, cuts) = (self.policy.chunk, self.policy.cuts);
        let s = &self.running[p];
        let options = self.runner.options();
        let step = options.mixed_step_tokens.map_or(chunk, |t| t.min(chunk));
        let mut budget = step.saturating_sub(d);
        if let Some(pairs) = options.mixed_chunk_attention {
            budget = budget.min(rows_within_attention(s.computed, pairs));
        }
        if let Some(rows) = self.paced_rows(d) {
            budget = budget.min(rows);
        }
        mixed_chunk(s.computed, s.prompt_len, chunk, budget, cuts)
    }

    /// One plain decode step of every running sequence past its prompt, after making room for
    /// each one's next row (preempting the most recently admitted when the cache is full); when
    /// the step mixes, with a chunk of the sequence in prefill after the decode rows, in one
    /// forward whose logit rows are the chunk's last row (when it picks a token) and then the
    /// decode rows, all sampled by one sampler launch.
    fn plain_decode(&mut self, events: &mut Vec<SeqEvent>) -> Result<StepKind, ModelError> {
        let idx = self.make_decode_room()?;
        if idx.is_empty() {
            return Ok(StepKind::Idle);
        }
        let d = idx.len();
        let chunk = (self.running.iter().position(Seq::in_prefill))
            .filter(|&p| self.mixes(p))
            .map(|p| (p, self.mixed_range(p, d)));
        let _span = tracing::debug_span!(
            "step",
            kind = if chunk.is_some() { "mixed" } else { "decode" },
            seqs = d,
            prefill_rows = chunk.as_ref().map_or(0, |c| c.1.len())
        )
        .entered();
        let mut rows: Vec<StepRow> = (idx.iter().enumerate())
            .map(|(k, &i)| {
                let s = &self.running[i];
                StepRow {
                    token: s.tokens[s.computed],
                    position: s.computed as u32,
                    seq: k as u32,
                }
            })
            .collect();
        // The sequences whose rows the step samples, in logit-row order.
        let mut samplers = idx.clone();
        let mut chunk_samples = false;
        let sampled = if let Some((p, range)) = &chunk {
            let (p, range) = (*p, range.clone());
            let s = &mut self.running[p];
            self.cache.ensure(&mut s.cache.table, range.end)?;
            rows.extend(chunk_rows(s, range.clone(), d as u32));
            // The chunk's last row picks the sequence's first token when it ends the known
            // tokens: logit row 0, as after a prefill step (the choices fork from it).
            chunk_samples = range.end == s.tokens.len();
            let mut logit_rows: Vec<u32> = (0..d as u32).collect();
            if chunk_samples {
                logit_rows.insert(0, rows.len() as u32 - 1);
                samplers.insert(0, p);
            }
            let mut seqs = idx.clone();
            seqs.push(p);
            let (tables, slots) = tables_and_slots(&self.running, &seqs);
            let prompt_until: Vec<u32> = (seqs.iter())
                .map(|&i| self.running[i].prompt_len as u32)
                .collect();
            let input = StepInput {
                rows: &rows,
                tables: &tables,
                logit_rows: &logit_rows,
                ssm_slots: &slots,
                prompt_until: &prompt_until,
            };
            // The forward runs on the device while the host computes the constrained rows'
            // masks; the sampler follows their upload on the stream.
            self.runner.forward(&self.cache, &input)?;
            self.running[p].computed = range.end;
            self.prepare_masks(samplers.iter().copied());
            let sampling: Vec<SampleRow> = (samplers.iter())
                .map(|&i| self.running[i].sample_row())
                .collect();
            self.runner.sample(&sampling)?
        } else {
            let (tables, slots) = tables_and_slots(&self.running, &idx);
            if idx.iter().any(|&i| self.running[i].samples_masked()) {
                // As above, with the decode step's forward-only graph.
                let launched = (self.runner).decode_forward(&self.cache, &rows, &tables, &slots)?;
                self.prepare_masks(idx.iter().copied());
                let sampling: Vec<SampleRow> =
                    idx.iter().map(|&i| self.running[i].sample_row()).collect();
                self.runner.sample_decoded(launched, &sampling)?
            } else {
                // Every row's sampling (a replayed row's pick is dropped below), inside the
                // step.
                let sampling: Vec<SampleRow> =
                    idx.iter().map(|&i| self.running[i].sample_row()).collect();
                (self.runner).decode_sampled(&self.cache, &rows, &tables, &slots, &sampling)?
            }
        };
        // Host logits only when a row that samples now keeps them.
        let keep = (samplers.iter()).any(|&i| {
            let s = &self.running[i];
            s.computed + 1 >= s.tokens.len() && s.keeps_logits()
        });
        let mut picked = with_logits(&self.runner, sampled, keep)?.into_iter();
        let chunk_pick = if chunk_samples { picked.next() } else { None };
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
        let mut kind = StepKind::Decode { seqs: d };
        if let Some((p, range)) = &chunk {
            let p = *p;
            self.stats.prefill_steps += 1;
            self.stats.mixed_steps += 1;
            match self.chunk_ran(p, range.len(), chunk_pick, events)? {
                Some(reason) => done.push((p, reason)),
                None => ran.push((p, d as u32..(d + range.len()) as u32, range.start)),
            }
            kind = StepKind::Mixed {
                seqs: d,
                seq: self.running[p].id,
                start: range.start,
                rows: range.len(),
            };
        }
        let leaving: Vec<usize> = done.iter().map(|d| d.0).collect();
        self.take_in(&ran, &leaving)?;
        // After the MTP head's take-in, which writes its own KV for these rows.
        prefix::publish_decoded(&self.runner, &mut self.cache, &mut self.running, &idx)?;
        if let Some((p, range)) = chunk {
            self.publish_chunk(p, range.end)?;
        }
        // In running order (the sequence in prefill is after the decoding ones), last first.
        for (i, reason) in done.into_iter().rev() {
            self.retire(i, reason, events)?;
        }
        Ok(kind)
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
