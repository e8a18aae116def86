//! Speculative decoding in the scheduler (`ModelOptions::speculative` on, with the MTP head or a
//! drafter the caller sets): the one take-in / draft / verify / accept / rollback of the engine.
//!
//! # Policy
//! - **Take-in.** Right after every target step (prefill chunk, decode or verify step) the
//!   drafter takes in the rows that joined each sequence's context, so the MTP head's KV cache
//!   covers every position the target's does, whichever mode runs. Without drafts the MTP head
//!   lags: its take-in copies the rows' hidden states to an archive, and one head step takes
//!   them in before the next drafts (`speculative::mtp`), so a plain step costs a row copy, not
//!   a head step.
//! - **Drafts.** While the gate speculates, each sequence that is caught up (not replaying after
//!   a preemption) drafts up to `K` tokens with its take-in: never more than would pass
//!   `max_new_tokens` or the context (`StopRule::drafts_allowed`), and fewer (none) when the KV
//!   cache cannot hold them.
//! - **Verify.** A decode step in which some sequence has drafts is a verify step
//!   ([`StepRunner::verify`](crate::runner::StepRunner::verify)): each decoding sequence's last
//!   token and its drafts, one row per token. Acceptance per sequence: greedy (the device
//!   sampler's greedy rows) or rejection sampling on the host logits with its own sampler, so
//!   its tokens follow its plain distribution. A sequence without drafts takes the device
//!   sampler's pick of its row; sequences whose sampling needs more than temperature, top-k and
//!   top-p (penalties, bias, min-p, min_tokens, logprobs) never draft. The accepted tokens are recorded one by one
//!   under the stop rule: a stop token or `max_new_tokens` inside the run ends the output
//!   exactly there.
//! - **Rollback.** A hybrid sequence holds `1 + K` SSM slots; row `t < k` keeps its state in
//!   spare slot `t`, row `k` in the sequence's own, and accepting `j < k` drafts exchanges the
//!   own slot with spare `j`. KV blocks wholly past the kept tokens go back to the allocator
//!   (entries of rejected rows inside a kept block are overwritten by later steps). Blocks are
//!   published to the prefix cache only once final, so no rejected token reaches it.
//! - **Gate** ([`SpeculationGate`]): each decode step's tokens and duration (the drafting after
//!   it included), read from the scheduler's [`Clock`], feed the gate's class of the step's
//!   batch width, which picks the mode of the steps of that width that follow. Each verify
//!   feeds it whether a sequence's first draft was kept; until it knows the acceptance it asks
//!   for checks of the prompt rows taken in (`wants_acceptance`), and before a probe of
//!   speculation for a check of the held rows too (`wants_check`), which the take-in has the
//!   drafter make (`Drafter::check_next`); drafts made at a take-in whose check turns
//!   speculation off go unverified. A disabled gate always speculates.
//! - **Prefix hits.** The head's KV at a shared prefix's positions is the cache's: at the last
//!   position of a hit it was computed with the next token of the prompt that published it,
//!   which may differ. This can cost acceptance, never output.

use std::ops::Range;
use std::time::Duration;

use metrale_cache::CacheError;

use super::Scheduler;
use super::decode::tables_and_slots;
use super::report::{SeqEvent, StepKind};
use super::sequence::{Picked, Seq};
use crate::error::ModelError;
use crate::runner::{StepRow, StepRunner};
use crate::sampling::SampleRow;
use crate::speculative::{
    Clock, DraftInput, Drafter, GateOptions, MtpDrafter, SpeculationGate, Verdict, WallClock,
    verify_drafts, verify_greedy,
};

pub use crate::speculative::SpeculativeStats;

/// The scheduler's speculative state: the drafter, the gate and its clock, and the acceptance
/// counts.
pub struct Speculation {
    drafter: Box<dyn Drafter + Send>,
    /// Drafts per verify step (the runner's `num_draft_tokens`).
    k: usize,
    /// SSM slots each sequence holds besides its own: `k` on hybrid models, else 0.
    spares: usize,
    gate: SpeculationGate,
    clock: Box<dyn Clock>,
    outcomes: SpeculativeStats,
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
    /// Speculation with `drafter` for a runner built for drafts; `None` when it is not.
    fn new(runner: &StepRunner, drafter: Box<dyn Drafter + Send>) -> Option<Speculation> {
        let k = runner.options().draft_tokens();
        let hybrid = runner.model().cache_layers().num_ssm > 0;
        (k > 0).then(|| Speculation {
            drafter,
            k,
            spares: if hybrid { k } else { 0 },
            gate: SpeculationGate::new(GateOptions::default(), k),
            clock: Box::new(WallClock::default()),
            outcomes: SpeculativeStats::default(),
        })
    }

    /// The MTP head's speculation when the runner runs it.
    pub(super) fn for_runner(runner: &StepRunner) -> Option<Speculation> {
        (runner.has_mtp())
            .then(|| Speculation::new(runner, Box::new(MtpDrafter::default())))
            .flatten()
    }

    /// SSM slots each sequence holds besides its own.
    pub(super) fn spares(&self) -> usize {
        self.spares
    }

    /// Set the gate's settings (it starts afresh, speculating).
    pub fn set_gate(&mut self, opts: GateOptions) {
        self.gate = SpeculationGate::new(opts, self.k);
    }

    /// Read time from `clock` (tests inject one).
    pub fn set_clock(&mut self, clock: Box<dyn Clock>) {
        self.clock = clock;
    }

    /// The gate.
    pub fn gate(&self) -> &SpeculationGate {
        &self.gate
    }

    /// Acceptance counts so far and the gate's state at the width of the last decode step.
    pub fn stats(&self) -> SpeculativeStats {
        let width = self.gate.last_class();
        let (plain, speculative) = self.gate.rates(width);
        SpeculativeStats {
            on: self.gate.is_on(width),
            switches: self.gate.switches(),
            plain_tok_s: plain,
            speculative_tok_s: speculative,
            ..self.outcomes.clone()
        }
    }

    pub(super) fn now(&self) -> Duration {
        self.clock.now()
    }

    /// A decode step of `width` sequences that started at `start` generated `tokens`,
    /// speculating or not.
    pub(super) fn record_step(
        &mut self,
        width: usize,
        speculative: bool,
        tokens: usize,
        start: Duration,
    ) {
        if tokens > 0 {
            let elapsed = self.clock.now().saturating_sub(start);
            self.gate.record(width, speculative, tokens, elapsed);
        }
    }
}

/// A sequence's rows in the step just run, for the drafter to take in: its index in `running`,
/// the rows, and the position of the first.
pub(super) type TakeIn = (usize, Range<u32>, usize);

/// A verify step's rows as the host sees them: every row's logits (some sequence samples with
/// drafts or keeps logits), or only the device sampler's token of each.
enum PickedRows {
    Logits(Vec<Vec<f32>>),
    Tokens(Vec<u32>),
}

impl Scheduler {
    /// Draft with `drafter` (the runner must be built for drafts, `speculative` not `Off`),
    /// replacing the MTP head, or decode plainly (`None`); only while the scheduler is idle.
    /// The gate's settings and clock are kept.
    pub fn set_drafter(
        &mut self,
        drafter: Option<Box<dyn Drafter + Send>>,
    ) -> Result<(), ModelError> {
        if !self.is_idle() {
            return Err(ModelError::Step(
                "cannot change the drafter while requests are in flight".into(),
            ));
        }
        let old = self.spec.take();
        let Some(drafter) = drafter else {
            return Ok(());
        };
        let mut spec = Speculation::new(&self.runner, drafter).ok_or(ModelError::Options {
            option: "speculative",
            problem: "a drafter needs a model built for drafts (speculative on)".into(),
        })?;
        if let Some(old) = old {
            (spec.gate, spec.clock) = (old.gate, old.clock);
        }
        self.spec = Some(spec);
        Ok(())
    }

    /// Whether the next decode step is a verify step (some running sequence has drafts).
    pub fn next_decode_speculates(&self) -> bool {
        self.running.iter().any(|s| !s.drafts.is_empty())
    }

    /// Speculative decoding's state (gate, clock, counts), when the scheduler speculates.
    pub fn speculation(&mut self) -> Option<&mut Speculation> {
        self.spec.as_mut()
    }

    /// After a target step: the listed sequences take in their rows and, while the gate
    /// speculates, draft for their next step. The drafter also sees every other running
    /// sequence, without rows, and which of them retire after this step (`leaving`, indices in
    /// `running`), so one that keeps rows for later knows which are still there.
    pub(super) fn take_in(&mut self, ran: &[TakeIn], leaving: &[usize]) -> Result<(), ModelError> {
        let Some(spec) = self.spec.as_mut() else {
            return Ok(());
        };
        if ran.is_empty() && leaving.is_empty() {
            return Ok(());
        }
        // The next decode step's width: every running sequence past its prompt.
        let width = (self.running.iter()).filter(|s| !s.in_prefill()).count();
        let speculating = spec.gate.speculating(width);
        // A probe of speculation waits for the drafter to check its first drafts, held rows
        // included; until the gate knows the acceptance, prompt rows are checked as they come.
        let held = spec.gate.wants_check(width);
        let check = held || spec.gate.wants_acceptance();
        let checking = check && spec.drafter.check_next(held);
        let mut wanted = Vec::with_capacity(ran.len());
        for &(i, _, _) in ran {
            let s = &mut self.running[i];
            let mut k = if speculating && s.caught_up() && s.may_draft() {
                (s.stop).drafts_allowed(spec.k, s.generated(), s.tokens.len())
            } else {
                0
            };
            if k > 0 {
                match self.cache.ensure(&mut s.cache.table, s.computed + k + 1) {
                    Ok(()) => {}
                    Err(CacheError::OutOfBlocks { .. }) => k = 0,
                    Err(e) => return Err(e.into()),
                }
            }
            wanted.push(k);
        }
        let input = |i: usize, step_rows, first_position, num_drafts, leaving| {
            let s = &self.running[i];
            DraftInput {
                request: s.id.0 as usize,
                prompt: &s.tokens[..s.prompt_len],
                generated: &s.tokens[s.prompt_len..],
                table: &s.cache.table,
                step_rows,
                first_position,
                num_drafts,
                leaving,
            }
        };
        let mut inputs: Vec<DraftInput<'_>> = (ran.iter().zip(&wanted))
            .map(|(&(i, ref rows, first), &k)| {
                input(i, rows.clone(), first, k, leaving.contains(&i))
            })
            .collect();
        let mut listed = vec![false; self.running.len()];
        for r in ran {
            listed[r.0] = true;
        }
        for i in (0..listed.len()).filter(|&i| !listed[i]) {
            let at = self.running[i].computed;
            inputs.push(input(i, 0..0, at, 0, leaving.contains(&i)));
        }
        // Host time for the stats (the wall clock: the gate's clock times steps only).
        let started = std::time::Instant::now();
        let drafts = spec.drafter.draft(&mut self.runner, &inputs)?;
        spec.outcomes.drafter_time += started.elapsed();
        drop(inputs);
        // The check may have just found speculation hopeless: then these drafts go unverified.
        let mut keep = true;
        if check {
            let outcome = checking.then(|| spec.drafter.take_checks());
            spec.gate.checked(width, outcome);
            keep = spec.gate.speculating(width);
        }
        for ((&(i, ..), &k), mut d) in ran.iter().zip(&wanted).zip(drafts) {
            d.truncate(if keep { k } else { 0 });
            self.running[i].drafts = d;
        }
        Ok(())
    }

    /// One verify step of every running sequence past its prompt (see the module header).
    pub(super) fn verify(&mut self, events: &mut Vec<SeqEvent>) -> Result<StepKind, ModelError> {
        let idx = self.make_decode_room()?;
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
            // Row t < k keeps its state in spare slot t, row k in the sequence's own slot.
            match s.cache.ssm_slot {
                Some(own) => {
                    row_slots.extend(s.cache.spare_slots[..k].iter().copied().chain([own]))
                }
                None => row_slots.extend(std::iter::repeat_n(u32::MAX, k + 1)),
            }
        }
        let drafts: usize = idx.iter().map(|&i| self.running[i].drafts.len()).sum();
        let _span =
            tracing::debug_span!("step", kind = "verify", seqs = idx.len(), drafts).entered();
        let (tables, slots) = tables_and_slots(&self.running, &idx);
        self.runner
            .verify(&self.cache, &rows, &tables, &slots, &row_slots)?;
        // Constrained rows' masks while the device runs the step (a constrained sequence
        // never drafts: its one row takes the sampler's pick under its mask).
        self.prepare_masks(idx.iter().copied());
        // Every row through the device sampler: a sequence without drafts takes its pick; one
        // with drafts has greedy rows (its drafts checked against them) or, when it samples,
        // its host logits (rejection sampling).
        let mut sampling = Vec::with_capacity(rows.len());
        for &i in &idx {
            let s = &self.running[i];
            if s.drafts.is_empty() {
                sampling.push(s.sample_row());
            } else {
                sampling.extend(std::iter::repeat_n(SampleRow::greedy(), s.drafts.len() + 1));
            }
        }
        let sampled = self.runner.sample(&sampling)?;
        let need = idx.iter().any(|&i| self.running[i].needs_verify_logits());
        let mut picked = if need {
            PickedRows::Logits(self.runner.logits(rows.len())?)
        } else {
            PickedRows::Tokens(sampled.iter().map(|t| t.token).collect())
        };
        self.stats.steps += 1;
        self.stats.decode_steps += 1;
        self.stats.verify_steps += 1;
        let (mut done, mut ran) = (Vec::new(), Vec::new());
        for (q, &i) in idx.iter().enumerate() {
            let (f, s) = (first[q], &mut self.running[i]);
            let pos0 = s.computed;
            if s.computed + 1 < s.tokens.len() {
                // Replaying a preempted sequence's known token: nothing to sample.
                s.computed += 1;
                ran.push((i, f as u32..f as u32 + 1, pos0));
                continue;
            }
            if s.drafts.is_empty() {
                // A plain row: the device sampler's pick.
                s.computed += 1;
                let row = match (&mut picked, s.keeps_logits()) {
                    (PickedRows::Logits(all), true) => Some(std::mem::take(&mut all[f])),
                    _ => None,
                };
                if let Some(spec) = self.spec.as_mut() {
                    *spec.outcomes.outcomes.entry((0, 0)).or_default() += 1;
                }
                match self.record(i, Picked::Sampled(sampled[f].clone(), row), events) {
                    Some(r) => done.push((i, r)),
                    None => ran.push((i, f as u32..f as u32 + 1, pos0)),
                }
                continue;
            }
            let s = &mut self.running[i];
            let k = s.drafts.len();
            let (verdict, logits) = verdict_of(s, f, &mut picked);
            let j = verdict.accepted;
            if let Some(spec) = self.spec.as_mut() {
                *spec.outcomes.outcomes.entry((k, j)).or_default() += 1;
                spec.gate.record_first_drafts(1, usize::from(j > 0));
            }
            let (tokens, reason) = s.keep(&verdict, logits);
            self.stats.tokens_generated += tokens.len() as u64;
            events.extend(tokens.into_iter().map(|token| SeqEvent::Token {
                id: s.id,
                token,
                logprobs: None,
            }));
            match reason {
                Some(r) => done.push((i, r)),
                None => {
                    self.cache.truncate(&mut s.cache.table, s.computed)?;
                    ran.push((i, f as u32..(f + j + 1) as u32, pos0));
                }
            }
        }
        let leaving: Vec<usize> = done.iter().map(|d| d.0).collect();
        self.take_in(&ran, &leaving)?;
        // The kept rows' blocks (where decode steps compute what prefill steps do), after the
        // MTP head's take-in has written its KV for them.
        super::prefix::publish_decoded(&self.runner, &mut self.cache, &mut self.running, &idx)?;
        for (i, reason) in done.into_iter().rev() {
            self.retire(i, reason, events)?;
        }
        Ok(StepKind::Verify {
            seqs: idx.len(),
            drafts,
        })
    }
}

/// The verdict on `s`'s drafts from its verify rows (step rows `f..f + 1 + drafts`): greedy on
/// the device sampler's greedy rows, or rejection sampling on the host logits, which it takes.
fn verdict_of(s: &mut Seq, f: usize, picked: &mut PickedRows) -> (Verdict, Vec<Vec<f32>>) {
    let mine = f..f + s.drafts.len() + 1;
    match picked {
        PickedRows::Logits(all) => {
            let rows: Vec<Vec<f32>> = all[mine].iter_mut().map(std::mem::take).collect();
            (verify_drafts(&mut s.sampler, &rows, &s.drafts), rows)
        }
        PickedRows::Tokens(argmax) => (verify_greedy(&argmax[mine], &s.drafts), Vec::new()),
    }
}
