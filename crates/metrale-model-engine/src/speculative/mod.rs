//! Speculative decoding: a `Drafter` proposes up to `K` tokens per sequence, the model checks
//! them all in one verify step (`TransformerModel::verify`: `1 + K` rows per sequence, every row
//! with logits), and each sequence keeps the drafts the model agrees with plus one token of the
//! model's own — between 1 and `K + 1` tokens per step instead of one.
//!
//! - Acceptance (`accept`): greedy keeps drafts while they equal the model's argmax; sampling
//!   keeps a draft with the model's probability of it and otherwise draws from the model's
//!   distribution without it (rejection sampling against a one-hot proposal), so the tokens
//!   follow exactly the distribution plain sampling draws from.
//! - Rollback: a hybrid model's verify step keeps the SSM state after every row in a slot of
//!   its own (the sequence holds `1 + K` slots); accepting `j` drafts makes row `j`'s slot the
//!   sequence's state (an exchange of slot ids, no copy, no recompute). KV entries of rejected
//!   rows sit past the accepted length and are overwritten by the next step; blocks wholly past
//!   it go back to the allocator.
//! - The scheduler speculates too (`scheduler::speculate`), behind a gate that measures
//!   tokens/s with and without speculation and keeps the faster (`gate`).
//! - Drafters: `MtpDrafter` (the checkpoint's MTP head, see `model::mtp` for which hidden
//!   state feeds it), `OracleDrafter` (a known continuation, with chosen drafts made wrong: the
//!   tests' way to reach every rollback depth).
//!
//! Invariants:
//! - Greedy decoding gives the same tokens and bitwise the same logits with and without
//!   speculation: a verify row computes exactly what a decode step computes.
//! - A drafter is called right after the target step whose rows it reads, before any other step.

mod accept;
mod gate;
mod mtp;
mod oracle;

use std::collections::BTreeMap;
use std::ops::{ControlFlow, Range};

use metrale_cache::BlockTable;

use crate::error::ModelError;
use crate::generate::{Live, record};
use crate::model::{StepRow, TransformerModel};

pub use accept::{Verdict, verify_drafts, verify_greedy};
pub use gate::{Clock, GateOptions, SpeculationGate, WallClock};
pub use mtp::MtpDrafter;
pub use oracle::OracleDrafter;

/// What a drafter sees of one sequence after a target step.
#[derive(Debug, Clone)]
pub struct DraftInput<'a> {
    /// The request's index in its batch.
    pub request: usize,
    /// The prompt.
    pub prompt: &'a [u32],
    /// The tokens generated so far; the last is the next token the target reads.
    pub generated: &'a [u32],
    /// The sequence's block table (covering every position a draft chain writes).
    pub table: &'a BlockTable,
    /// The rows of the target's last step that joined the sequence's context (a prefill chunk,
    /// or the accepted rows of a verify step), holding positions `first_position..`.
    pub step_rows: Range<u32>,
    /// The position of the first of `step_rows`.
    pub first_position: usize,
    /// Drafts wanted (0: only take in the rows).
    pub num_drafts: usize,
}

impl DraftInput<'_> {
    /// Tokens of the sequence so far (prompt, then generated).
    pub fn len(&self) -> usize {
        self.prompt.len() + self.generated.len()
    }

    /// Whether the sequence has no tokens (never, for a real sequence).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token at position `pos` of the sequence.
    pub fn token(&self, pos: usize) -> Option<u32> {
        match pos.checked_sub(self.prompt.len()) {
            None => self.prompt.get(pos).copied(),
            Some(g) => self.generated.get(g).copied(),
        }
    }
}

/// Proposes tokens for the model to verify.
pub trait Drafter {
    /// The model has just run a step; for each input, take in its rows and propose up to
    /// `num_drafts` tokens to follow the sequence (fewer, or none, is allowed). Returns one
    /// list per input.
    fn draft(
        &mut self,
        model: &mut TransformerModel,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError>;
}

/// Acceptance counts of a speculative run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpeculativeStats {
    /// `(drafts, accepted)` → how many sequence verifies checked that many drafts and kept
    /// that many.
    pub outcomes: BTreeMap<(usize, usize), usize>,
}

impl SpeculativeStats {
    /// Sequence verifies.
    pub fn verifies(&self) -> usize {
        self.outcomes.values().sum()
    }

    /// Drafts checked.
    pub fn drafted(&self) -> usize {
        self.outcomes.iter().map(|(&(k, _), n)| k * n).sum()
    }

    /// Drafts accepted.
    pub fn accepted(&self) -> usize {
        self.outcomes.iter().map(|(&(_, j), n)| j * n).sum()
    }
}

/// The decode phase of `generate` with a drafter: verify steps over every unfinished sequence
/// until all are done. Each sequence's drafts were made after its prefill.
pub(crate) fn decode(
    model: &mut TransformerModel,
    live: &mut [Live<'_>],
    drafter: &mut dyn Drafter,
    stats: &mut SpeculativeStats,
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) -> Result<(), ModelError> {
    let max_len = model.max_seq_len();
    let block_size = model.kv_cache().block_size();
    let k_max = model.options().draft_tokens();
    loop {
        let active: Vec<usize> = (0..live.len()).filter(|&i| !live[i].done).collect();
        if active.is_empty() {
            return Ok(());
        }
        // One verify step: sequence q's rows are its last token, then its drafts.
        let (mut rows, mut row_slots, mut first) = (Vec::new(), Vec::new(), Vec::new());
        for (q, &i) in active.iter().enumerate() {
            let l = &mut live[i];
            let k = l.drafts.len();
            l.table
                .ensure(l.pos + k + 1, block_size, &mut model.kv_cache().allocator)?;
            let last = *l
                .out
                .token_ids
                .last()
                .ok_or_else(|| ModelError::Step("decode before a first token".into()))?;
            first.push(rows.len());
            for (t, &token) in std::iter::once(&last).chain(&l.drafts).enumerate() {
                rows.push(StepRow {
                    token,
                    position: (l.pos + t) as u32,
                    seq: q as u32,
                });
            }
            // Row t < k keeps its state in spare slot t, row k in the sequence's own slot.
            match l.ssm_slot {
                Some(own) => row_slots.extend(l.spare_slots[..k].iter().copied().chain([own])),
                None => row_slots.extend(std::iter::repeat_n(u32::MAX, k + 1)),
            }
        }
        let tables: Vec<&BlockTable> = active.iter().map(|&i| &live[i].table).collect();
        let ssm: Vec<u32> = active.iter().filter_map(|&i| live[i].ssm_slot).collect();
        model.verify(&rows, &tables, &ssm, &row_slots)?;
        let mut logits = model.logits(rows.len())?;

        let mut wants: Vec<(usize, Range<u32>, usize, usize)> = Vec::new();
        for (q, &i) in active.iter().enumerate().rev() {
            let l = &mut live[i];
            let k = l.drafts.len();
            let mine: Vec<Vec<f32>> = logits.drain(first[q]..).collect();
            let verdict = verify_drafts(&mut l.sampler, &mine, &l.drafts);
            let j = verdict.accepted;
            *stats.outcomes.entry((k, j)).or_default() += 1;
            if let Some(own) = l.ssm_slot.as_mut()
                && j < k
            {
                // Row j's slot holds the state after the last kept token: it becomes the
                // sequence's, and the old one a spare.
                std::mem::swap(own, &mut l.spare_slots[j]);
            }
            let pos0 = l.pos;
            for ((t, &token), row) in verdict.tokens.iter().enumerate().zip(mine) {
                l.pos = pos0 + t + 1;
                record(l, i, token, row, max_len, on_token);
                if l.done {
                    break;
                }
            }
            l.drafts.clear();
            // Blocks wholly past the kept tokens go back; the next step allocates again.
            l.table
                .truncate(l.pos, block_size, &mut model.kv_cache().allocator)?;
            let k_next = l.allowed_drafts(k_max, max_len);
            if !l.done && k_next > 0 {
                l.table.ensure(
                    l.pos + k_next + 1,
                    block_size,
                    &mut model.kv_cache().allocator,
                )?;
                let from = (first[q] as u32)..(first[q] + j + 1) as u32;
                wants.push((i, from, pos0, k_next));
            }
        }
        if wants.is_empty() {
            continue;
        }
        wants.reverse();
        let inputs: Vec<DraftInput<'_>> = wants
            .iter()
            .map(|(i, rows, pos0, k)| live[*i].draft_input(*i, rows.clone(), *pos0, *k))
            .collect();
        let drafts = drafter.draft(model, &inputs)?;
        for ((i, .., k), mut d) in wants.into_iter().zip(drafts) {
            d.truncate(k);
            live[i].drafts = d;
        }
    }
}
