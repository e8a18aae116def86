//! `MtpDrafter`: drafts with the checkpoint's multi-token-prediction head
//! (`StepRunner::mtp_step`; `runner::mtp` says which hidden state feeds it and why).
//!
//! After a target step, one head step takes in every row that joined a sequence's context:
//! the row at position `p` reads the target's final-norm output of that row and the token at
//! `p + 1` (the next prompt token, an accepted draft, or the token the model just chose), so
//! the head's own KV cache holds every position the target has. The last such row's logits
//! give draft 1. Draft `i + 1` comes from a head step of one row per sequence at the next
//! position, reading draft `i` and the head's own output for it. Drafts are greedy (argmax).
//!
//! Take-in lag: while no sequence drafts (the speculation gate has it off), the head need not be
//! current, so a take-in only copies its rows' final-norm output to the runner's archive
//! (`StepRunner::mtp_archive`) and the drafter remembers their sequence, position and token. The
//! head takes the archived rows in, in one step of their own, at the first take-in that drafts,
//! that does not fit in half the archive, or after which a sequence retires whose rows it holds or
//! the archive does (`DraftInput::leaving`: a finished sequence, a re-prefill's last chunk); the
//! archived rows' step runs eagerly, its row count differing from one to the next; then it takes in
//! that take-in's rows, from the archive as well, so the head's cache and drafts are bitwise those
//! of taking in every step. A take-in lists every running sequence, so rows of a sequence no longer
//! listed (preempted, to be recomputed and taken in again, or cancelled) are dropped. A plain
//! decode step then costs a row copy instead of a head step.
//!
//! Checks (`Drafter::check_next`): the head's row at `p` predicts the token at `p + 2`, which
//! the model has chosen by the next step (or which the prompt holds). Asked to check at a
//! take-in that holds such rows (prompt rows of the step just run, and with `held` archived
//! ones), the drafter takes its archived rows and the step's in with logits for the latest of
//! them (up to `CHECK_ROWS` in all, spread over the sequences; a step's own rows get theirs after
//! its drafts'), and counts the argmax tokens equal to the tokens chosen: first drafts as a draft
//! at that row would have made them, scored without a verify step, so the speculation gate can
//! tell a head that accepts nothing from one worth a probe, before its first verify step. A
//! take-in without such rows checks nothing (the gate asks again at the next).

use std::collections::HashMap;

use super::{DraftInput, Drafter};
use crate::error::ModelError;
use crate::runner::{MtpStep, StepRow, StepRunner};

/// Most archived rows one check scores (the logits of each cost an LM-head row).
pub const CHECK_ROWS: usize = 64;

/// See the module header.
#[derive(Debug)]
pub struct MtpDrafter {
    /// Whether take-ins without drafts go to the archive (the default) or run at once.
    lag: bool,
    /// A check asked for at the next take-in: `Some(held)`, scoring the archived rows too when
    /// `held` (else only the step's own rows).
    check: Option<bool>,
    /// The first drafts the last check scored (emptied when a check is asked for).
    last_check: Vec<CheckedDraft>,
    /// The archived rows not taken in yet.
    lagged: Vec<Lagged>,
    /// Archive rows in use (rows of dropped entries included, until the lag empties).
    used: usize,
    /// Rows archived so far.
    archived: u64,
}

impl Default for MtpDrafter {
    fn default() -> Self {
        MtpDrafter {
            lag: true,
            check: None,
            last_check: Vec::new(),
            lagged: Vec::new(),
            used: 0,
            archived: 0,
        }
    }
}

impl MtpDrafter {
    /// A drafter whose head takes in every step's rows at once (no archive; the tests' baseline).
    pub fn without_lag() -> MtpDrafter {
        MtpDrafter {
            lag: false,
            ..MtpDrafter::default()
        }
    }

    /// Rows this drafter has archived instead of taking them in at once, so far.
    pub fn archived_rows(&self) -> u64 {
        self.archived
    }

    /// The first drafts the last check scored (see the module header), in row order.
    pub fn last_check(&self) -> &[CheckedDraft] {
        &self.last_check
    }

    /// Take in `step` (the rows of the target step just run, depth 0), or archive its rows for
    /// later (see the module header). Returns whether the head ran a step of `step`'s rows (its
    /// logits are then the first drafts').
    fn take_in(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
        step: &MtpStep<'_>,
    ) -> Result<bool, ModelError> {
        let (cap, n) = (runner.mtp_archive_rows(), step.rows.len());
        let by_id: HashMap<usize, &DraftInput<'_>> =
            inputs.iter().map(|i| (i.request, i)).collect();
        self.lagged.retain(|l| by_id.contains_key(&l.request));
        if self.lagged.is_empty() {
            self.used = 0;
        }
        // A sequence that retires after this take-in has its rows taken in now.
        let leaving = inputs.iter().any(|i| {
            i.leaving
                && (!i.step_rows.is_empty() || self.lagged.iter().any(|l| l.request == i.request))
        });
        // A check asked for is this take-in's only (the gate asks again while it wants one).
        let asked = self.check.take();
        let held = asked == Some(true);
        let own_checkable = match asked {
            Some(_) => prompt_rows(step, inputs),
            None => Vec::new(),
        };
        let check = !own_checkable.is_empty()
            || (held && (self.lagged.iter()).any(|l| target(by_id[&l.request], l).is_some()));
        if self.lag
            && n > 0
            && step.logit_rows.is_empty()
            && !leaving
            && !check
            && self.used + n <= cap / 2
        {
            runner.mtp_archive(step.hidden_rows, self.used)?;
            self.lagged
                .extend(step.rows.iter().zip(self.used..).map(|(r, row)| Lagged {
                    request: inputs[r.seq as usize].request,
                    position: r.position,
                    token: r.token,
                    row: row as u32,
                }));
            self.used += n;
            self.archived += n as u64;
            return Ok(false);
        }
        if self.lagged.is_empty() && !check {
            if n > 0 {
                runner.mtp_step(step)?;
            }
            return Ok(n > 0);
        }
        // This step's rows go behind the archived ones (half the archive holds at most a
        // step's rows), since the archived rows' own head step overwrites the target's outputs.
        let base = self.used;
        if n > 0 {
            runner.mtp_archive(step.hidden_rows, base)?;
        }
        // Each sequence's archived rows, the latest first.
        let mut by_request: HashMap<usize, Vec<Lagged>> = HashMap::new();
        for l in std::mem::take(&mut self.lagged).into_iter().rev() {
            by_request.entry(l.request).or_default().push(l);
        }
        self.used = 0;
        let (mut rows, mut hidden, mut tables) = (Vec::new(), Vec::new(), Vec::new());
        // With a check: each sequence's rows whose token after next is known.
        let mut checkable: Vec<Vec<Scored>> = Vec::new();
        for inp in inputs {
            // The sequence's archived rows below this take-in's, in position order, the latest
            // copy of a position.
            let Some(mut mine) = by_request.remove(&inp.request) else {
                continue;
            };
            mine.retain(|l| (l.position as usize) < inp.first_position);
            mine.sort_by_key(|l| l.position);
            mine.dedup_by_key(|l| l.position);
            if mine.is_empty() {
                continue;
            }
            let seq = tables.len() as u32;
            tables.push(inp.table);
            if check && held {
                let scored = |(t, l): (usize, &Lagged)| {
                    Some(Scored {
                        row: (rows.len() + t) as u32,
                        request: l.request,
                        position: l.position as usize + 2,
                        chosen: target(inp, l)?,
                    })
                };
                checkable.push(mine.iter().enumerate().filter_map(scored).collect());
            }
            for l in mine {
                rows.push(StepRow {
                    token: l.token,
                    position: l.position,
                    seq,
                });
                hidden.push(l.row);
            }
        }
        if !rows.is_empty() {
            let limit = CHECK_ROWS.min(runner.sizes().max_logit_rows);
            let scored = latest_spread(&checkable, limit);
            let logit_rows: Vec<u32> = scored.iter().map(|c| c.row).collect();
            runner.mtp_flush(&MtpStep {
                rows: &rows,
                tables: &tables,
                hidden_rows: &hidden,
                logit_rows: &logit_rows,
                depth: 0,
            })?;
            if !scored.is_empty() {
                let argmax = runner.greedy(scored.len())?;
                self.last_check = checked(&scored, &argmax);
            }
        }
        if n == 0 {
            return Ok(false);
        }
        // This step's own rows, with their drafts' logits first, then those of the rows checked.
        let drafts = step.logit_rows.len();
        let room = (runner.sizes().max_logit_rows - drafts).min(CHECK_ROWS);
        let own_scored = latest_spread(&own_checkable, room.saturating_sub(self.last_check.len()));
        let logit_rows: Vec<u32> = (step.logit_rows.iter().copied())
            .chain(own_scored.iter().map(|c| c.row))
            .collect();
        let moved: Vec<u32> = (base..base + n).map(|i| i as u32).collect();
        let own = MtpStep {
            hidden_rows: &moved,
            logit_rows: &logit_rows,
            ..*step
        };
        // Eager unless it drafts only: a check's or a flush's shape is met once.
        if logit_rows.len() > drafts || drafts == 0 {
            runner.mtp_flush(&own)?;
        } else {
            runner.mtp_step_archived(&own)?;
        }
        if !own_scored.is_empty() {
            let argmax = runner.greedy(logit_rows.len())?;
            let own_checks = checked(&own_scored, &argmax[drafts..]);
            self.last_check.extend(own_checks);
        }
        Ok(true)
    }
}

/// The checks of `scored` rows whose argmax tokens are `argmax`, in order.
fn checked(scored: &[Scored], argmax: &[u32]) -> Vec<CheckedDraft> {
    (scored.iter().zip(argmax))
        .map(|(c, &token)| CheckedDraft {
            request: c.request,
            position: c.position,
            token,
            accepted: token == c.chosen,
        })
        .collect()
}

/// The token two positions after archived row `l` of sequence `inp`, where the sequence has
/// chosen it: what a first draft made at the row would have been checked against.
fn target(inp: &DraftInput<'_>, l: &Lagged) -> Option<u32> {
    ((l.position as usize) < inp.first_position)
        .then(|| inp.token(l.position as usize + 2))
        .flatten()
}

/// The rows of `step` whose token after next is known (prompt rows of a prefill chunk), as
/// candidates for a check, each sequence's apart.
fn prompt_rows(step: &MtpStep<'_>, inputs: &[DraftInput<'_>]) -> Vec<Vec<Scored>> {
    let mut out: Vec<Vec<Scored>> = Vec::new();
    for (t, r) in step.rows.iter().enumerate() {
        let inp = &inputs[r.seq as usize];
        let Some(chosen) = inp.token(r.position as usize + 2) else {
            continue;
        };
        let c = Scored {
            row: t as u32,
            request: inp.request,
            position: r.position as usize + 2,
            chosen,
        };
        match out.last_mut() {
            Some(v) if v.last().is_some_and(|l| l.request == c.request) => v.push(c),
            _ => out.push(vec![c]),
        }
    }
    out
}

/// One first draft a check scored: the request (`DraftInput::request`), the position a draft
/// made at the row would have stood at, the head's token for it and whether it is the token the
/// model chose there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CheckedDraft {
    /// The request.
    pub request: usize,
    /// The position of the token the draft proposes (the row's plus two).
    pub position: usize,
    /// The head's argmax there.
    pub token: u32,
    /// Whether the model chose `token` there.
    pub accepted: bool,
}

/// An archived row a check may score: its row in the flush step, its sequence, the position
/// its draft stands for and the token chosen there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Scored {
    row: u32,
    request: usize,
    position: usize,
    chosen: u32,
}

/// Up to `limit` of the candidates, the latest of each sequence first and the sequences in
/// turn, in row order.
fn latest_spread(per_seq: &[Vec<Scored>], limit: usize) -> Vec<Scored> {
    let mut picked = Vec::new();
    for back in 1.. {
        let before = picked.len();
        for c in per_seq {
            if picked.len() < limit && back <= c.len() {
                picked.push(c[c.len() - back]);
            }
        }
        if picked.len() == before || picked.len() == limit {
            break;
        }
    }
    picked.sort_unstable();
    picked
}

/// A row archived for a later take-in: its sequence (`DraftInput::request`), position, the
/// token after it and its archive row.
#[derive(Debug, Clone, Copy)]
struct Lagged {
    request: usize,
    position: u32,
    token: u32,
    row: u32,
}

/// A sequence of a draft chain: its table index in the chain's steps, its last row in the
/// previous head step, the position of its next row.
struct Chain {
    input: usize,
    prev_row: u32,
    next_position: usize,
}

impl Drafter for MtpDrafter {
    fn check_next(&mut self, held: bool) -> bool {
        self.check = self.lag.then_some(held);
        self.last_check.clear();
        self.lag
    }

    fn take_checks(&mut self) -> (usize, usize) {
        let accepted = self.last_check.iter().filter(|c| c.accepted).count();
        (self.last_check.len(), accepted)
    }

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
        let step = MtpStep {
            rows: &rows,
            tables: &tables,
            hidden_rows: &hidden_rows,
            logit_rows: &logit_rows,
            depth: 0,
        };
        if !self.take_in(runner, inputs, &step)? {
            return Ok(drafts);
        }
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
