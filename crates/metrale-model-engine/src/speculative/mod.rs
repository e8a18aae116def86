//! Speculative decoding: a `Drafter` proposes up to `K` tokens per sequence, the model checks
//! them all in one verify step (`StepRunner::verify`: `1 + K` rows per sequence, every row with
//! logits), and each sequence keeps the drafts the model agrees with plus one token of the
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
//! - The scheduler runs it (`scheduler::speculate`, the one verify / accept / rollback), behind
//!   a gate that measures tokens/s with and without speculation and keeps the faster (`gate`).
//! - Drafters: `MtpDrafter` (the checkpoint's MTP head, see `runner::mtp` for which hidden
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
use std::ops::Range;

use metrale_cache::BlockTable;

use crate::error::ModelError;
use crate::runner::StepRunner;

pub use accept::{Verdict, verify_drafts, verify_greedy};
pub use gate::{Clock, GateOptions, SpeculationGate, WallClock};
pub use mtp::{CheckedDraft, MtpDrafter};
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
    /// The sequence retires right after this take-in (it finished): a drafter holding rows of
    /// it for later takes them in now or never. Sequences that ran no row this step come with
    /// empty `step_rows`.
    pub leaving: bool,
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
    /// The runner has just run a step; for each input, take in its rows and propose up to
    /// `num_drafts` tokens to follow the sequence (fewer, or none, is allowed). Returns one
    /// list per input.
    fn draft(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError>;

    /// At the next `draft`, also check first drafts against tokens the model has chosen (or
    /// the prompt holds), without a verify step: at the rows it takes in whose token after next
    /// is known, and with `held` at the rows it held back as well (the MTP head:
    /// `speculative::mtp`). Returns whether this drafter can; the default cannot.
    fn check_next(&mut self, held: bool) -> bool {
        let _ = held;
        false
    }

    /// The check `check_next` asked for, once `draft` ran: first drafts scored and how many
    /// matched the model's tokens (none scored: nothing to check yet).
    fn take_checks(&mut self) -> (usize, usize) {
        (0, 0)
    }
}

/// Acceptance counts of speculative decoding, and its gate's state.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct SpeculativeStats {
    /// `(drafts, accepted)` → how many sequence verifies checked that many drafts and kept
    /// that many (a sequence without drafts in a verify step counts as `(0, 0)`).
    pub outcomes: BTreeMap<(usize, usize), usize>,
    /// Whether the gate has speculation on (probes aside) at the batch width of the last
    /// decode step.
    pub on: bool,
    /// Times the gate switched speculation on or off, every batch width together.
    pub switches: u64,
    /// The gate's moving average of decode tokens/s without speculation at the batch width of
    /// the last decode step.
    pub plain_tok_s: Option<f64>,
    /// The same with speculation.
    pub speculative_tok_s: Option<f64>,
    /// Host wall time the drafter took after the target steps (take-ins and drafts, the
    /// launches they queue but not their device time), every step together.
    pub drafter_time: std::time::Duration,
}

impl SpeculativeStats {
    /// Sequence verifies.
    pub fn verifies(&self) -> usize {
        self.outcomes.values().sum()
    }

    /// Sequence verifies that checked at least one draft.
    pub fn draft_verifies(&self) -> usize {
        (self.outcomes.iter())
            .filter(|((k, _), _)| *k > 0)
            .map(|(_, n)| n)
            .sum()
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
