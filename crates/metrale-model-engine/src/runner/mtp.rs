//! `StepRunner::mtp_step`: one step of the multi-token-prediction head, the drafter of
//! speculative decoding (`model/mtp.rs` has its launches).
//!
//! Which hidden state feeds the head, and at which position. A head row at position `p` reads
//! `h_p`, the target's *final-norm output* (after `model.norm`, the LM head's input) of the row
//! whose input token was `x_p`, together with the embedding of the next token `x_{p+1}`, and
//! runs its layer at position `p` (RoPE and KV slot of `p`); its output predicts `x_{p+2}`. For
//! the next draft the head is reused: the row at `p + 1` reads the embedding of the draft it
//! just made and, as its hidden state, the head's own output after `mtp.norm`. This is how vLLM
//! (`qwen3_next_mtp.py`, whose target model returns its hidden states after `self.norm`;
//! `eagle.py` shifts the input ids left by one and keeps the target's positions) and SGLang
//! (`qwen3_next_mtp.py`; `EagleDraftInput.prepare_for_extend` shifts the ids the same way) feed
//! the Qwen3-Next head. One row off in either the token or the position still runs, but its
//! drafts are rarely accepted.
//!
//! With `decode_graphs`, an MTP step replays a graph captured once its (rows, sequences, logit
//! rows, head layer) has run `ModelOptions::speculative_graph_after` times: its launches take
//! only those counts and read which rows belong to which sequence from the step buffers, so
//! batched drafts are graphed like single ones, up to `ModelOptions::max_speculative_graphs`
//! shapes with the verify steps'. The gather of the previous step's hidden rows, whose bound is
//! that step's row count, stays outside the graph. With the circuit forward, an MTP step through
//! the head's first layer with a logit row per sequence (each draft of a chain, and a take-in in
//! which every sequence drafts), of one sequence or up to `circuit_speculative_seqs`, replays the
//! executor's draft program of its rows and sequences; `draft_program_steps` counts them.
//!
//! Invariants:
//! - `hidden_rows` index the rows of the step run just before (a target step or an MTP step):
//!   the step's first launch gathers them out of `normed` (widened to f32), before anything
//!   overwrites it; or, in `mtp_step_archived`, the rows of the archive (`MtpBuffers::archive`,
//!   twice the step's rows of bf16 final-norm output), which `mtp_archive` fills from `normed`
//!   with the same values, so a row taken in from there computes what it computes at once.
//! - The head's layers use KV pools of their own through the sequences' block tables; they
//!   touch no SSM state and no target KV pool.

use metrale_cache::BlockTable;
use metrale_model_layers::StepShape;

use super::ranks::{MtpRankStep, check_hidden_rows, mtp_archive_copy, mtp_buffers, mtp_upload};
use super::{GraphKey, StepInput, StepRow, StepRunner};
use crate::error::ModelError;

/// One MTP step.
#[derive(Debug, Clone, Copy)]
pub struct MtpStep<'a> {
    /// The rows: `position` is `p`, `token` is the token *after* it (`x_{p+1}`), `seq` indexes
    /// `tables`; rows of a sequence contiguous and in position order.
    pub rows: &'a [StepRow],
    /// The block table of each sequence (the target's: the head's pools share its blocks).
    pub tables: &'a [&'a BlockTable],
    /// For each row, the row of the previous step whose final-norm output is its `h_p`.
    pub hidden_rows: &'a [u32],
    /// Rows whose logits (drafts) are wanted.
    pub logit_rows: &'a [u32],
    /// Which draft of a chain this step makes, from 0; the head's layer `depth % layers` runs
    /// (one layer in the Qwen3.5 / Qwen3-Next checkpoints).
    pub depth: usize,
}

impl StepRunner {
    /// Whether the MTP head is set up to run (`speculative = Mtp` and the checkpoint has one).
    pub fn has_mtp(&self) -> bool {
        self.forward.mtp.is_some()
    }

    /// MTP steps that ran the circuit's draft program (eagerly or from a graph) so far.
    pub fn draft_program_steps(&self) -> u64 {
        self.draft_program_steps
    }

    /// Rows the head's take-in archive holds (0 without the head): final-norm rows a drafter
    /// keeps with `mtp_archive` and takes in later with `mtp_step_archived`.
    pub fn mtp_archive_rows(&self) -> usize {
        self.forward.mtp.map_or(0, |m| m.archive_rows)
    }

    /// Copy the final-norm output of rows `hidden_rows` of the step run just before (as
    /// `MtpStep::hidden_rows` index them) to archive rows `at..`, on every rank. The copy leaves
    /// the step's outputs as they are: the next step may still read them.
    pub fn mtp_archive(&mut self, hidden_rows: &[u32], at: usize) -> Result<(), ModelError> {
        let (cap, prev) = (mtp_buffers(&self.forward)?.archive_rows, self.last_rows);
        if hidden_rows.is_empty() || at + hidden_rows.len() > cap {
            return Err(ModelError::Step(format!(
                "{} rows at archive row {at} do not fit its {cap} rows",
                hidden_rows.len()
            )));
        }
        check_hidden_rows(hidden_rows, prev, "the previous step")?;
        self.on_ranks(
            |me| mtp_archive_copy(&me.forward, hidden_rows, at, prev),
            |peer, _, _| mtp_archive_copy(&peer.forward, hidden_rows, at, prev),
        )
    }

    /// Run one MTP step (see the module header); its logits replace the last step's.
    pub fn mtp_step(&mut self, step: &MtpStep<'_>) -> Result<(), ModelError> {
        self.run_mtp_step(step, false, true)
    }

    /// [`StepRunner::mtp_step`] with `hidden_rows` indexing the archive (`mtp_archive`) instead
    /// of the previous step.
    pub fn mtp_step_archived(&mut self, step: &MtpStep<'_>) -> Result<(), ModelError> {
        self.run_mtp_step(step, true, true)
    }

    /// [`StepRunner::mtp_step_archived`] for the take-in of archived rows ahead of a step's own
    /// (a lag's flush): it runs eagerly, never from a graph, since its row count differs from
    /// one flush to the next.
    pub fn mtp_flush(&mut self, step: &MtpStep<'_>) -> Result<(), ModelError> {
        self.run_mtp_step(step, true, false)
    }

    fn run_mtp_step(
        &mut self,
        step: &MtpStep<'_>,
        archived: bool,
        graphed: bool,
    ) -> Result<(), ModelError> {
        let archive_rows = mtp_buffers(&self.forward)?.archive_rows;
        let input = StepInput {
            rows: step.rows,
            tables: step.tables,
            logit_rows: step.logit_rows,
            ssm_slots: &[],
            prompt_until: &[],
        };
        self.io().check_rows(&input)?;
        if step.hidden_rows.len() != step.rows.len() {
            return Err(ModelError::Step(format!(
                "{} hidden rows for {} MTP rows",
                step.hidden_rows.len(),
                step.rows.len()
            )));
        }
        let prev = self.last_rows;
        match archived {
            true => check_hidden_rows(step.hidden_rows, archive_rows, "the archive")?,
            false => check_hidden_rows(step.hidden_rows, prev, "the previous step")?,
        }
        let layers = self.forward.head_pools.len().max(1);
        let rank_step = MtpRankStep {
            input,
            hidden_rows: step.hidden_rows,
            prev,
            layer: step.depth % layers,
            archived,
            graphed,
        };
        let shape = mtp_upload(&self.forward, self.io(), &rank_step)?;
        self.last_rows = step.rows.len();
        self.on_ranks(
            |me| me.mtp_launch(shape, rank_step.layer, rank_step.graphed),
            |peer, sizes, options| peer.mtp(sizes, options, &rank_step),
        )
    }

    /// Rank 0's launches of [`StepRunner::mtp_step`] after its uploads.
    fn mtp_launch(
        &mut self,
        shape: StepShape,
        layer: usize,
        graphed: bool,
    ) -> Result<(), ModelError> {
        if self.forward.draft_program(shape, layer).is_some() {
            self.draft_program_steps += 1;
        }
        let key = GraphKey::Mtp {
            rows: shape.rows,
            seqs: shape.num_seqs,
            logit_rows: shape.logit_rows,
            layer,
        };
        if !self.options.decode_graphs || !graphed || !self.graphs.admit(key)? {
            return self.forward.mtp(shape, layer);
        }
        let forward = &self.forward;
        self.graphs.replay(key, || forward.mtp(shape, layer))
    }
}
