//! `TransformerModel::verify`: the step of speculative decoding that checks drafts. Each
//! sequence's rows are its last accepted token and its drafts, in position order; every row gets
//! logits, and every row computes bitwise what a decode step of that token would (GEMM rows do
//! not depend on the row count, attention rows read only their own context, and the GDN layers
//! run the rule token by token, as decode does). The GDN layers keep the state after each row in
//! the row's own SSM slot, so accepting `j` drafts makes row `j`'s slot the sequence's state:
//! rollback is the choice of a slot, with no recompute and no copy.
//!
//! With `decode_graphs`, a verify step is replayed from a graph captured the first time its
//! (rows, sequences) runs. Its launches depend on nothing else: every kernel takes only the
//! step's row, sequence and logit-row counts (all rows have logits) and reads the mix of drafts
//! (which rows belong to which sequence, their positions, slots and row slots) from the step
//! buffers `upload` fills before each step. So a batched verify step is graphed like a
//! single-sequence one, with one graph per (rows, sequences) pair met, up to
//! `ModelOptions::max_speculative_graphs` of them with the MTP steps' (then new shapes run
//! eagerly; no padding: a padded
//! row would cost a verify row).
//!
//! With the circuit forward (`ForwardSelect::Circuit`), a single-sequence verify step of
//! `2..=1 + K` rows replays the executor's verify program of that row count (compiled at boot,
//! `CircuitExec::verify_program`); a verify step of several sequences, or of one row, runs the
//! legacy launches, which the circuit has no program for.
//!
//! Invariants:
//! - A row slot is held, named by one row only, and never another sequence's own slot (a
//!   sequence's own slot may be named by one of its rows: the kernels read it first).
//! - The step's final-norm rows stay in `normed` for the drafter (`mtp_step` reads them).

use metrale_cache::BlockTable;
use metrale_gpu_runtime::GpuBackendExt;
use metrale_model_layers::StepShape;

use super::{GraphKey, StepInput, StepRow, TransformerModel};
use crate::error::ModelError;

impl TransformerModel {
    /// Run a verify step: `rows` as in [`TransformerModel::forward`] (rows of a sequence
    /// contiguous and in position order), logit row `r` for step row `r`, and `row_slots[r]` the
    /// SSM slot that keeps the state after row `r` (`u32::MAX`: none; hybrid models) while
    /// `ssm_slots` are only read. Read the logits with [`TransformerModel::logits`].
    pub fn verify(
        &mut self,
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
        };
        self.check(&input)?;
        self.check_row_slots(&input, row_slots)?;
        let shape = self.upload(&input, None, Some(row_slots))?;
        self.last_rows = shape.rows as usize;
        if !self.options.decode_graphs {
            return self.launch_verify(shape);
        }
        let key = GraphKey::Verify {
            rows: shape.rows,
            seqs: shape.num_seqs,
        };
        if !self.graph_room(key) {
            return self.launch_verify(shape);
        }
        self.map_before_capture(key, shape)?;
        self.replay(key, |m| m.launch_verify(shape))
    }

    /// The launches of a verify step of the selected forward: the circuit's verify program of
    /// a single sequence's row count when it has one, else the legacy step.
    pub(crate) fn launch_verify(&self, shape: StepShape) -> Result<(), ModelError> {
        let program = self
            .circuit
            .as_ref()
            .filter(|_| shape.num_seqs == 1)
            .and_then(|e| e.verify_program(u64::from(shape.rows)));
        match program {
            Some(p) => Ok(p.replay(self.gpu.as_ref(), self.stream)?),
            None => self.launch_step(shape),
        }
    }

    /// The (rows, sequences) of the verify steps captured as graphs so far, ascending.
    pub fn captured_verify_shapes(&self) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = (self.graphs.keys())
            .filter_map(|k| match *k {
                GraphKey::Verify { rows, seqs } => Some((rows, seqs)),
                _ => None,
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// The (rows, sequences) of the MTP steps captured as graphs so far, ascending, without
    /// repeats (a shape may have graphs for several logit-row counts and head layers).
    pub fn captured_mtp_shapes(&self) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = (self.graphs.keys())
            .filter_map(|k| match *k {
                GraphKey::Mtp { rows, seqs, .. } => Some((rows, seqs)),
                _ => None,
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    fn check_row_slots(&self, input: &StepInput<'_>, row_slots: &[u32]) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Step(m));
        if row_slots.len() != input.rows.len() {
            return bad(format!(
                "{} row slots for {} verify rows",
                row_slots.len(),
                input.rows.len()
            ));
        }
        let named: Vec<(usize, u32)> = row_slots
            .iter()
            .enumerate()
            .filter(|(_, s)| **s != u32::MAX)
            .map(|(r, &s)| (r, s))
            .collect();
        let Some(pool) = &self.ssm else {
            return match named.first() {
                Some((r, s)) => bad(format!(
                    "row {r} names SSM slot {s}, but the model keeps no SSM state"
                )),
                None => Ok(()),
            };
        };
        let mut seen: Vec<u32> = Vec::with_capacity(named.len());
        for &(r, slot) in &named {
            if !pool.is_held(slot) {
                return bad(format!("row {r}: SSM slot {slot} is not held"));
            }
            if seen.contains(&slot) {
                return bad(format!("two rows keep their state in SSM slot {slot}"));
            }
            seen.push(slot);
            let own = input.rows[r].seq as usize;
            if let Some(other) =
                (0..input.ssm_slots.len()).find(|&q| q != own && input.ssm_slots[q] == slot)
            {
                return bad(format!(
                    "row {r} keeps its state in SSM slot {slot}, which sequence {other} reads"
                ));
            }
        }
        Ok(())
    }

    /// The bytes of SSM slot `slot`: each GDN layer's conv window, then its recurrent state, in
    /// layer order (empty for a model without GDN layers). For checks: a rollback must leave
    /// exactly the bytes a run that never saw the rejected tokens has.
    pub fn ssm_slot_bytes(&self, slot: u32) -> Result<Vec<u8>, ModelError> {
        let Some(pool) = &self.ssm else {
            return Ok(Vec::new());
        };
        if slot as usize >= pool.num_slots() {
            return Err(ModelError::Step(format!(
                "SSM slot {slot} is past the {} slots",
                pool.num_slots()
            )));
        }
        let s = slot as usize;
        let mut out = Vec::new();
        for l in (0..).map_while(|i| pool.layer(i)) {
            for (base, bytes) in [
                (l.conv, l.conv_slot_bytes),
                (l.recurrent, l.recurrent_slot_bytes),
            ] {
                let part: Vec<u8> =
                    self.gpu
                        .download(base.offset(s * bytes), bytes, self.stream)?;
                out.extend(part);
            }
        }
        Ok(out)
    }
}
