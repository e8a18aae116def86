//! `StepRunner::verify`: the step of speculative decoding that checks drafts. Each sequence's
//! rows are its last accepted token and its drafts, in position order; every row gets logits,
//! and every row computes bitwise what a decode step of that token would (GEMM rows do not
//! depend on the row count, attention rows read only their own context, and the GDN layers run
//! the rule token by token, as decode does). The GDN layers keep the state after each row in the
//! row's own SSM slot, so accepting `j` drafts makes row `j`'s slot the sequence's state:
//! rollback is the choice of a slot, with no recompute and no copy.
//!
//! With `decode_graphs`, a verify step is replayed from a graph captured once its (rows,
//! sequences) has run `ModelOptions::speculative_graph_after` times (2: the first runs eagerly).
//! Its launches depend on nothing else: every kernel takes only the
//! step's row, sequence and logit-row counts (all rows have logits) and reads the mix of drafts
//! (which rows belong to which sequence, their positions, slots and row slots) from the step
//! buffers. A batched verify step is graphed like a single-sequence one, one graph per (rows,
//! sequences) met, up to `ModelOptions::max_speculative_graphs` of them with the MTP steps'
//! (then new shapes run eagerly; no padding: a padded row would cost a verify row). With the
//! circuit forward, a verify step of one sequence, or of up to `circuit_speculative_seqs`, replays
//! the executor's verify program of its rows and sequences; `verify_program_steps` counts them.
//!
//! Invariants:
//! - A row slot is held, named by one row only, and never another sequence's own slot (a
//!   sequence's own slot may be named by one of its rows: the kernels read it first).
//! - The step's final-norm rows stay in `normed` for the drafter (`mtp_step` reads them).

use metrale_cache::{BlockTable, CacheManager};

use metrale_model_layers::StepShape;

use super::{GraphKey, StepInput, StepRow, StepRunner};
use crate::error::ModelError;

impl StepRunner {
    /// Run a verify step: `rows` as in [`StepRunner::forward`] (rows of a sequence contiguous
    /// and in position order), logit row `r` for step row `r`, and `row_slots[r]` the SSM slot
    /// that keeps the state after row `r` (`u32::MAX`: none; hybrid models) while `ssm_slots`
    /// are only read. Read the logits with [`StepRunner::logits`].
    pub fn verify(
        &mut self,
        cache: &CacheManager,
        rows: &[StepRow],
        tables: &[&BlockTable],
        ssm_slots: &[u32],
        row_slots: &[u32],
    ) -> Result<(), ModelError> {
        let logit_rows: Vec<u32> = (0..rows.len() as u32).collect();
        let input = StepInput {
            rows,
            tables,
            logit_rows: &logit_rows,
            ssm_slots,
            prompt_until: &[],
        };
        self.io().check(cache, &input)?;
        self.io().check_row_slots(cache, &input, row_slots)?;
        let shape = self.io().upload(&input, None, Some(row_slots))?;
        self.last_rows = shape.rows as usize;
        self.on_ranks(
            |me| me.verify_launch(shape),
            |peer, sizes, options| peer.verify(sizes, options, &input, row_slots),
        )
    }

    /// Verify steps that ran a circuit verify program (eagerly or from a graph) so far.
    pub fn verify_program_steps(&self) -> u64 {
        self.verify_program_steps
    }

    /// Rank 0's launches of [`StepRunner::verify`] after its upload.
    fn verify_launch(&mut self, shape: StepShape) -> Result<(), ModelError> {
        if self.forward.verify_program(shape).is_some() {
            self.verify_program_steps += 1;
        }
        let key = GraphKey::Verify {
            rows: shape.rows,
            seqs: shape.num_seqs,
        };
        if !self.options.decode_graphs || !self.graphs.admit(key)? {
            return self.forward.verify(shape);
        }
        self.map_before_capture(key, shape)?;
        let forward = &self.forward;
        self.graphs.replay(key, || forward.verify(shape))
    }
}
