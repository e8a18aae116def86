//! `MtpDrafter`: drafts with the checkpoint's multi-token-prediction head
//! (`StepRunner::mtp_step`; `runner::mtp` says which hidden state feeds it and why).
//!
//! After a target step, one head step takes in every row that joined a sequence's context:
//! the row at position `p` reads the target's final-norm output of that row and the token at
//! `p + 1` (the next prompt token, an accepted draft, or the token the model just chose), so
//! the head's own KV cache holds every position the target has. The last such row's logits
//! give draft 1. Draft `i + 1` comes from a head step of one row per sequence at the next
//! position, reading draft `i` and the head's own output for it. Drafts are greedy (argmax).

use super::{DraftInput, Drafter};
use crate::error::ModelError;
use crate::runner::{MtpStep, StepRow, StepRunner};

/// See the module header.
#[derive(Debug, Default)]
pub struct MtpDrafter;

/// A sequence of a draft chain: its table index in the chain's steps, its last row in the
/// previous head step, the position of its next row.
struct Chain {
    input: usize,
    prev_row: u32,
    next_position: usize,
}

impl Drafter for MtpDrafter {
    fn draft(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError> {
        let mut drafts = vec![Vec::new(); inputs.len()];
        if inputs.is_empty() {
            return Ok(drafts);
        }
        // Take in every new row; the last row of each sequence that wants drafts gives draft 1.
        let (mut rows, mut hidden_rows, mut logit_rows) = (Vec::new(), Vec::new(), Vec::new());
        let mut chains = Vec::new();
        for (q, inp) in inputs.iter().enumerate() {
            for (t, step_row) in inp.step_rows.clone().enumerate() {
                let p = inp.first_position + t;
                let token = inp.token(p + 1).ok_or_else(|| {
                    ModelError::Step(format!(
                        "request {}: no token after position {p} to draft from",
                        inp.request
                    ))
                })?;
                rows.push(StepRow {
                    token,
                    position: p as u32,
                    seq: q as u32,
                });
                hidden_rows.push(step_row);
            }
            if inp.num_drafts > 0 && !inp.step_rows.is_empty() {
                let last = rows.len() as u32 - 1;
                logit_rows.push(last);
                chains.push(Chain {
                    input: q,
                    prev_row: last,
                    next_position: inp.first_position + inp.step_rows.len(),
                });
            }
        }
        let tables: Vec<_> = inputs.iter().map(|i| i.table).collect();
        runner.mtp_step(&MtpStep {
            rows: &rows,
            tables: &tables,
            hidden_rows: &hidden_rows,
            logit_rows: &logit_rows,
            depth: 0,
        })?;
        for (c, t) in chains.iter().zip(runner.greedy(chains.len())?) {
            drafts[c.input].push(t);
        }
        // Reuse the head for each further draft.
        for depth in 1.. {
            chains.retain(|c| inputs[c.input].num_drafts > depth);
            if chains.is_empty() {
                break;
            }
            let rows: Vec<StepRow> = chains
                .iter()
                .enumerate()
                .map(|(q, c)| StepRow {
                    token: drafts[c.input][depth - 1],
                    position: (c.next_position + depth - 1) as u32,
                    seq: q as u32,
                })
                .collect();
            let hidden_rows: Vec<u32> = chains.iter().map(|c| c.prev_row).collect();
            let logit_rows: Vec<u32> = (0..chains.len() as u32).collect();
            let tables: Vec<_> = chains.iter().map(|c| inputs[c.input].table).collect();
            runner.mtp_step(&MtpStep {
                rows: &rows,
                tables: &tables,
                hidden_rows: &hidden_rows,
                logit_rows: &logit_rows,
                depth,
            })?;
            for (q, (c, t)) in chains
                .iter_mut()
                .zip(runner.greedy(logit_rows.len())?)
                .enumerate()
            {
                drafts[c.input].push(t);
                c.prev_row = q as u32;
            }
        }
        Ok(drafts)
    }
}
