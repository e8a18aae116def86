//! Speculative decoding in the scheduler (`ModelOptions::speculative` on, with the MTP head or a
//! drafter the caller sets).
//!
//! # Policy
//! - **Take-in.** Right after every target step (prefill chunk, decode or verify step) the
//!   drafter takes in the rows that joined each sequence's context, so the MTP head's KV cache
//!   covers every position the target's does, whichever mode runs. Without drafts this head step
//!   has no LM head (a few percent of a target step).
//! - **Drafts.** While the gate speculates, each sequence that is caught up (not replaying after
//!   a preemption) drafts up to `K` tokens with its take-in: never more than would pass
//!   `max_new_tokens` or the context, and fewer (none) when the KV cache cannot hold them.
//! - **Verify.** A decode step in which some sequence has drafts is a verify step
//!   ([`TransformerModel::verify`]): each decoding sequence's last token and its drafts, one
//!   row per token. Acceptance per sequence: greedy (the device's argmax unless the sequence
//!   needs host logits) or rejection sampling with its own sampler, so its tokens follow its
//!   plain distribution. The accepted tokens are recorded one by one under the stop
//!   conditions: a stop token or `max_new_tokens` inside the run ends the output exactly there.
//! - **Rollback.** A hybrid sequence holds `1 + K` SSM slots; row `t < k` keeps its state in
//!   spare slot `t`, row `k` in the sequence's own, and accepting `j < k` drafts exchanges the
//!   own slot with spare `j`. KV blocks wholly past the kept tokens go back to the allocator
//!   (entries of rejected rows inside a kept block are overwritten by later steps). Only prompt
//!   blocks are ever published to the prefix cache, so no rejected token reaches it.
//! - **Gate** ([`SpeculationGate`]): each decode step's tokens and duration (the drafting after
//!   it included), read from the scheduler's [`Clock`], feed the gate, which picks the mode of
//!   the steps that follow.
//! - **Prefix hits.** The head's KV at a shared prefix's positions is the cache's: at the last
//!   position of a hit it was computed with the next token of the prompt that published it,
//!   which may differ. This can cost acceptance, never output.

use std::ops::Range;

use metrale_cache::CacheError;

use crate::error::ModelError;
use crate::model::{StepRow, TransformerModel};
use crate::speculative::{
    Clock, DraftInput, Drafter, GateOptions, MtpDrafter, SpeculationGate, Verdict, WallClock,
    verify_drafts, verify_greedy,
};

use super::Scheduler;
use super::report::{SeqEvent, StepKind};

/// A verify step's rows as the host sees them: every row's logits (some sequence samples or
/// keeps logits), or only the device's argmax of each.
enum PickedRows {
    Logits(Vec<Vec<f32>>),
    Tokens(Vec<u32>),
}

/// The scheduler's speculative state.
pub(super) struct Speculation {
    pub drafter: Box<dyn Drafter + Send>,
    /// Drafts per verify step (the model's `num_draft_tokens`).
    pub k: usize,
    /// SSM slots each sequence holds besides its own: `k` on hybrid models, else 0.
    pub spares: usize,
    pub gate: SpeculationGate,
    pub clock: Box<dyn Clock>,
}

impl std::fmt::Debug for Speculation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Speculation")
            .field("k", &self.k)
            .field("spares", &self.spares)
            .field("gate", &self.gate)
            .finish_non_exhaustive()
    }
}

impl Speculation {
    /// Speculation with `drafter` for a model built for drafts; `None` when it is not.
    pub fn new(model: &TransformerModel, drafter: Box<dyn Drafter + Send>) -> Option<Speculation> {
        let k = model.options().draft_tokens();
        (k > 0).then(|| Speculation {
            drafter,
            k,
            spares: if model.has_ssm_state() { k } else { 0 },
            gate: SpeculationGate::new(GateOptions::default()),
            clock: Box::new(WallClock::default()),
        })
    }

    /// The MTP head's speculation when the model runs it.
    pub fn for_model(model: &TransformerModel) -> Option<Speculation> {
        model
            .has_mtp()
            .then(|| Speculation::new(model, Box::new(MtpDrafter)))
            .flatten()
    }
}

/// A sequence's rows in the step just run, for the drafter to take in: its index in `running`,
/// the rows, and the position of the first.
pub(super) type TakeIn = (usize, Range<u32>, usize);

impl Scheduler {
    /// Draft with `drafter` (the model must be built for drafts, `speculative` not `Off`),
    /// replacing the MTP head; only while the scheduler is idle.
    pub fn set_drafter(
        &mut self,
        model: &TransformerModel,
        drafter: Box<dyn Drafter + Send>,
    ) -> Result<(), ModelError> {
        self.check_idle("set a drafter")?;
        let old = self.spec.take();
        let mut spec = Speculation::new(model, drafter).ok_or(ModelError::Options {
            option: "speculative",
            problem: "a drafter needs a model built for drafts (speculative on)".into(),
        })?;
        if let Some(old) = old {
            (spec.gate, spec.clock) = (old.gate, old.clock);
        }
        self.spec = Some(spec);
        Ok(())
    }

    /// The gate's settings (it starts afresh, speculating).
    pub fn set_speculation_gate(&mut self, opts: GateOptions) {
        if let Some(spec) = self.spec.as_mut() {
            spec.gate = SpeculationGate::new(opts);
        }
    }

    /// Where the gate reads time (tests inject a clock).
    pub fn set_clock(&mut self, clock: Box<dyn Clock>) {
        if let Some(spec) = self.spec.as_mut() {
            spec.clock = clock;
        }
    }

    /// The speculation gate, when the scheduler speculates.
    pub fn speculation_gate(&self) -> Option<&SpeculationGate> {
        self.spec.as_ref().map(|s| &s.gate)
    }

    /// Whether the next decode step is a verify step (some running sequence has drafts).
    pub fn next_decode_speculates(&self) -> bool {
        self.running.iter().any(|s| !s.drafts.is_empty())
    }

    fn check_idle(&self, what: &str) -> Result<(), ModelError> {
        if self.is_idle() {
            Ok(())
        } else {
            Err(ModelError::Step(format!(
                "cannot {what} while requests are in flight"
            )))
        }
    }

    /// After a target step: the listed sequences take in their rows and, while the gate
    /// speculates, draft for their next step.
    pub(super) fn take_in(
        &mut self,
        model: &mut TransformerModel,
        ran: &[TakeIn],
    ) -> Result<(), ModelError> {
        let Some(spec) = self.spec.as_mut() else {
            return Ok(());
        };
        if ran.is_empty() {
            return Ok(());
        }
        let speculating = spec.gate.speculating();
        let mut wanted = Vec::with_capacity(ran.len());
        for &(i, _, _) in ran {
            let s = &mut self.running[i];
            let caught_up = s.computed + 1 == s.tokens.len() && !s.in_prefill();
            let left = s
                .params
                .max_new_tokens
                .saturating_sub(s.generated() + 1)
                .min(self.limits.max_context.saturating_sub(s.tokens.len()));
            let mut k = if speculating && caught_up {
                spec.k.min(left)
            } else {
                0
            };
            if k > 0 {
                match s.table.ensure(
                    s.computed + k + 1,
                    self.block_size,
                    &mut model.kv_cache().allocator,
                ) {
                    Ok(()) => {}
                    Err(CacheError::OutOfBlocks { .. }) => k = 0,
                    Err(e) => return Err(e.into()),
                }
            }
            wanted.push(k);
        }
        let inputs: Vec<DraftInput<'_>> = ran
            .iter()
            .zip(&wanted)
            .map(|(&(i, ref rows, first), &k)| {
                let s = &self.running[i];
                DraftInput {
                    request: s.id.0 as usize,
                    prompt: &s.tokens[..s.prompt_len],
                    generated: &s.tokens[s.prompt_len..],
                    table: &s.table,
                    step_rows: rows.clone(),
                    first_position: first,
                    num_drafts: k,
                }
            })
            .collect();
        let drafts = spec.drafter.draft(model, &inputs)?;
        drop(inputs);
        for ((&(i, ..), &k), mut d) in ran.iter().zip(&wanted).zip(drafts) {
            d.truncate(k);
            self.running[i].drafts = d;
        }
        Ok(())
    }

    /// One verify step of every running sequence past its prompt (see the module header).
    pub(super) fn verify(
        &mut self,
        model: &mut TransformerModel,
        events: &mut Vec<SeqEvent>,
    ) -> Result<StepKind, ModelError> {
        let idx = self.make_decode_room(model)?;
        if idx.is_empty() {
            return Ok(StepKind::Idle);
        }
        let (mut rows, mut row_slots, mut first) = (Vec::new(), Vec::new(), Vec::new());
        for (q, &i) in idx.iter().enumerate() {
            let s = &self.running[i];
            let k = s.drafts.len();
            first.push(rows.len());
            let last = s.tokens[s.computed];
            for (t, &token) in std::iter::once(&last).chain(&s.drafts).enumerate() {
                rows.push(StepRow {
                    token,
                    position: (s.computed + t) as u32,
                    seq: q as u32,
                });
            }
            match s.ssm_slot {
                Some(own) => row_slots.extend(s.spare_slots[..k].iter().copied().chain([own])),
                None => row_slots.extend(std::iter::repeat_n(u32::MAX, k + 1)),
            }
        }
        let drafts: usize = idx.iter().map(|&i| self.running[i].drafts.len()).sum();
        let _span =
            tracing::debug_span!("step", kind = "verify", seqs = idx.len(), drafts).entered();
        let (tables, slots) = self.tables_and_slots(&idx);
        model.verify(&rows, &tables, &slots, &row_slots)?;
        let need = idx.iter().any(|&i| self.running[i].needs_logits());
        let mut picked = if need {
            PickedRows::Logits(model.logits(rows.len())?)
        } else {
            PickedRows::Tokens(model.greedy(rows.len())?)
        };
        self.stats.steps += 1;
        self.stats.decode_steps += 1;
        self.stats.verify_steps += 1;

        let (mut done, mut ran) = (Vec::new(), Vec::new());
        let max = self.limits.max_context;
        for (q, &i) in idx.iter().enumerate() {
            let s = &mut self.running[i];
            let (pos0, k, f) = (s.computed, s.drafts.len(), first[q]);
            if s.computed + 1 < s.tokens.len() {
                // Replaying a preempted sequence's known token: nothing to sample.
                s.computed += 1;
                ran.push((i, f as u32..f as u32 + 1, pos0));
                continue;
            }
            let mine = f..f + k + 1;
            let (verdict, mut logits): (Verdict, Vec<Vec<f32>>) = match &mut picked {
                PickedRows::Logits(all) => {
                    let rows: Vec<Vec<f32>> = all[mine].iter_mut().map(std::mem::take).collect();
                    (verify_drafts(&mut s.sampler, &rows, &s.drafts), rows)
                }
                PickedRows::Tokens(argmax) => (verify_greedy(&argmax[mine], &s.drafts), Vec::new()),
            };
            let j = verdict.accepted;
            if k > 0 {
                self.stats.draft_verifies += 1;
                self.stats.drafted += k as u64;
                self.stats.accepted += j as u64;
            }
            if let Some(own) = s.ssm_slot.as_mut()
                && j < k
            {
                // Row j's slot holds the state after the last kept token.
                std::mem::swap(own, &mut s.spare_slots[j]);
            }
            s.drafts.clear();
            let mut reason = None;
            for (t, &token) in verdict.tokens.iter().enumerate() {
                s.computed += 1;
                let row = logits.get_mut(t).map(std::mem::take);
                let (token, r) = s.record(token, row, max);
                self.stats.tokens_generated += 1;
                events.push(SeqEvent::Token { id: s.id, token });
                if r.is_some() {
                    reason = r;
                    break;
                }
            }
            match reason {
                Some(r) => done.push((i, r)),
                None => {
                    s.table.truncate(
                        s.computed,
                        self.block_size,
                        &mut model.kv_cache().allocator,
                    )?;
                    ran.push((i, f as u32..(f + j + 1) as u32, pos0));
                }
            }
        }
        self.take_in(model, &ran)?;
        // The kept rows' blocks (where decode steps compute what prefill steps do), after the
        // MTP head's take-in has written its KV for them.
        for &i in &idx {
            super::prefix::publish_decoded(model, &mut self.running[i])?;
        }
        for (i, reason) in done.into_iter().rev() {
            self.retire(model, i, reason, events)?;
        }
        Ok(StepKind::Verify {
            seqs: idx.len(),
            drafts,
        })
    }
}
