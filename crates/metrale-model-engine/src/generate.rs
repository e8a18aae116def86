//! One sequence from prompt to finish: chunked prefill, then one decode step per token, with
//! stop conditions, a token callback for streaming, and the KV blocks released however it ends.
//! With a drafter (`speculative`), decode steps are verify steps of several tokens per sequence;
//! the tokens are the same under greedy decoding, and follow the same distribution when
//! sampling.

use std::ops::ControlFlow;

use metrale_cache::BlockTable;

use crate::error::ModelError;
use crate::model::{StepInput, StepRow, TransformerModel, prefill_chunk};
use crate::sampling::{Sampler, SamplingParams};
use crate::speculative::{self, DraftInput, Drafter, MtpDrafter, SpeculativeStats};

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Tokens that end generation (included in the output).
    pub stop_token_ids: Vec<u32>,
    /// Keep each step's logits in the output.
    pub return_logits: bool,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens`, or the model's `max_seq_len`, was reached.
    Length,
    /// A stop token was generated.
    Stop,
    /// The token callback asked to stop.
    Cancelled,
}

impl FinishReason {
    /// "length", "stop" or "cancelled".
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// What generation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated tokens.
    pub token_ids: Vec<u32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Row `i`: the logits that chose `token_ids[i]` (when asked for).
    pub logits: Option<Vec<Vec<f32>>>,
}

/// Generate for one prompt. `on_token` sees each token as it is chosen and may stop generation.
pub fn generate(
    model: &mut TransformerModel,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation, ModelError> {
    let mut out = generate_batch(model, &[(prompt, params)], &mut |_, t| on_token(t))?;
    out.pop()
        .ok_or_else(|| ModelError::Step("no generation".into()))
}

/// One sequence in flight.
#[derive(Debug)]
pub(crate) struct Live<'a> {
    pub prompt: &'a [u32],
    pub params: &'a GenerateParams,
    pub table: BlockTable,
    /// The SSM state slot (hybrid models).
    pub ssm_slot: Option<u32>,
    /// Speculative decoding on a hybrid model: one more slot per draft, which a verify step
    /// keeps the state after each of its rows in.
    pub spare_slots: Vec<u32>,
    /// The drafts the next verify step checks.
    pub drafts: Vec<u32>,
    pub sampler: Sampler,
    /// Position of the next token fed to the model.
    pub pos: usize,
    pub out: Generation,
    pub done: bool,
}

impl Live<'_> {
    /// Drafts the next verify step may check: at most `k_max`, no more than would finish the
    /// sequence (`max_new_tokens`), and none past the model's `max_len`.
    pub fn allowed_drafts(&self, k_max: usize, max_len: usize) -> usize {
        let left = self
            .params
            .max_new_tokens
            .saturating_sub(self.out.token_ids.len() + 1);
        k_max.min(left).min(max_len.saturating_sub(self.pos + 1))
    }

    /// What the drafter sees of this sequence after a target step whose rows `rows` (at
    /// positions from `first_position`) joined its context.
    pub fn draft_input(
        &self,
        request: usize,
        rows: std::ops::Range<u32>,
        first_position: usize,
        num_drafts: usize,
    ) -> DraftInput<'_> {
        DraftInput {
            request,
            prompt: self.prompt,
            generated: &self.out.token_ids,
            table: &self.table,
            step_rows: rows,
            first_position,
            num_drafts,
        }
    }
}

/// Generate for several prompts together: each is prefilled on its own, then all decode in
/// shared steps until each finishes. `on_token(i, token)` sees sequence `i`'s tokens. Each
/// sequence's tokens and logits are those it would get alone (batch invariance). A model loaded
/// with `speculative = Mtp` drafts with its MTP head and verifies (same greedy tokens).
pub fn generate_batch(
    model: &mut TransformerModel,
    requests: &[(&[u32], &GenerateParams)],
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) -> Result<Vec<Generation>, ModelError> {
    if model.has_mtp() {
        let mut drafter = MtpDrafter;
        return run_requests(model, requests, Some(&mut drafter), on_token).map(|r| r.0);
    }
    run_requests(model, requests, None, on_token).map(|r| r.0)
}

/// `generate_batch` without speculation, whatever the model is built for: one decode step per
/// token (the benchmark's baseline).
pub(crate) fn generate_plain(
    model: &mut TransformerModel,
    requests: &[(&[u32], &GenerateParams)],
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) -> Result<Vec<Generation>, ModelError> {
    run_requests(model, requests, None, on_token).map(|r| r.0)
}

/// `generate_batch` with speculative decoding by `drafter`: each decode step verifies the
/// drafts of every sequence at once. The model must be built for drafts
/// (`ModelOptions::speculative` not `Off`); `num_draft_tokens` bounds each sequence's drafts.
/// Returns the generations and the acceptance counts.
pub fn generate_speculative(
    model: &mut TransformerModel,
    requests: &[(&[u32], &GenerateParams)],
    drafter: &mut dyn Drafter,
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) -> Result<(Vec<Generation>, SpeculativeStats), ModelError> {
    if model.options().draft_tokens() == 0 {
        return Err(ModelError::Options {
            option: "speculative",
            problem: "speculative decoding needs a model built for drafts (speculative on)".into(),
        });
    }
    run_requests(model, requests, Some(drafter), on_token)
}

fn run_requests(
    model: &mut TransformerModel,
    requests: &[(&[u32], &GenerateParams)],
    drafter: Option<&mut dyn Drafter>,
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) -> Result<(Vec<Generation>, SpeculativeStats), ModelError> {
    let max_len = model.max_seq_len();
    for (i, (prompt, _)) in requests.iter().enumerate() {
        if prompt.is_empty() {
            return Err(ModelError::Step(format!("request {i}: empty prompt")));
        }
        if prompt.len() > max_len {
            return Err(ModelError::Step(format!(
                "request {i}: prompt of {} tokens exceeds max_seq_len {max_len}",
                prompt.len()
            )));
        }
    }
    if requests.len() > model.max_seqs() {
        return Err(ModelError::Step(format!(
            "{} requests exceed max_decode_seqs {}",
            requests.len(),
            model.max_seqs()
        )));
    }
    let mut live: Vec<Live<'_>> = requests
        .iter()
        .map(|&(prompt, params)| Live {
            prompt,
            params,
            table: BlockTable::new(),
            ssm_slot: None,
            spare_slots: Vec::new(),
            drafts: Vec::new(),
            sampler: Sampler::new(params.sampling),
            pos: prompt.len(),
            out: Generation {
                token_ids: Vec::new(),
                finish_reason: FinishReason::Length,
                logits: params.return_logits.then(Vec::new),
            },
            done: params.max_new_tokens == 0,
        })
        .collect();
    let mut stats = SpeculativeStats::default();
    let result = run_batch(model, &mut live, drafter, &mut stats, on_token);
    let mut released = Ok(());
    for l in &mut live {
        released = released.and(
            l.table
                .release_all(&mut model.kv_cache().allocator)
                .map_err(ModelError::from),
        );
        for slot in l.ssm_slot.take().into_iter().chain(l.spare_slots.drain(..)) {
            released = released.and(model.free_ssm_slot(slot));
        }
    }
    result?;
    released?;
    Ok((live.into_iter().map(|l| l.out).collect(), stats))
}

/// Sample a token from `logits`, record it and apply the stop conditions.
fn accept(
    l: &mut Live<'_>,
    i: usize,
    logits: Vec<f32>,
    max_len: usize,
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) {
    let token = l.sampler.sample(&logits);
    record(l, i, token, logits, max_len, on_token);
}

/// Record a chosen token (with the logits that chose it) and apply the stop conditions; `l.pos`
/// is already past the row that predicted it.
pub(crate) fn record(
    l: &mut Live<'_>,
    i: usize,
    token: u32,
    logits: Vec<f32>,
    max_len: usize,
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) {
    if let Some(all) = l.out.logits.as_mut() {
        all.push(logits);
    }
    l.out.token_ids.push(token);
    if on_token(i, token).is_break() {
        l.out.finish_reason = FinishReason::Cancelled;
        l.done = true;
    } else if l.params.stop_token_ids.contains(&token) {
        l.out.finish_reason = FinishReason::Stop;
        l.done = true;
    } else if l.out.token_ids.len() >= l.params.max_new_tokens || l.pos >= max_len {
        l.done = true;
    }
}

fn run_batch(
    model: &mut TransformerModel,
    live: &mut [Live<'_>],
    mut drafter: Option<&mut dyn Drafter>,
    stats: &mut SpeculativeStats,
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) -> Result<(), ModelError> {
    let max_len = model.max_seq_len();
    let block_size = model.kv_cache().block_size();
    let chunk = model.max_rows();
    let cuts = model.prefill_cuts();
    let k_max = if drafter.is_some() {
        model.options().draft_tokens()
    } else {
        0
    };

    // Prefill each sequence in chunks cut as the scheduler cuts them (so a loop run is bitwise a
    // scheduled one); only its last prompt row needs logits. A drafter takes in every chunk's
    // rows, and drafts after the last.
    for (i, l) in live.iter_mut().enumerate() {
        if l.done {
            continue;
        }
        l.ssm_slot = model.alloc_ssm_slot()?;
        if l.ssm_slot.is_some() {
            for _ in 0..k_max {
                if let Some(s) = model.alloc_ssm_slot()? {
                    l.spare_slots.push(s);
                }
            }
        }
        let slots: Vec<u32> = l.ssm_slot.into_iter().collect();
        let mut start = 0;
        while start < l.prompt.len() {
            let end = prefill_chunk(start, l.prompt.len(), chunk, cuts).end;
            l.table
                .ensure(end, block_size, &mut model.kv_cache().allocator)?;
            let rows: Vec<StepRow> = (start..end)
                .map(|p| StepRow {
                    token: l.prompt[p],
                    position: p as u32,
                    seq: 0,
                })
                .collect();
            let last = [(end - start - 1) as u32];
            let logit_rows: &[u32] = if end == l.prompt.len() { &last } else { &[] };
            model.forward(&StepInput {
                rows: &rows,
                tables: &[&l.table],
                logit_rows,
                ssm_slots: &slots,
            })?;
            let n = (end - start) as u32;
            if end == l.prompt.len() {
                let logits = model
                    .logits(1)?
                    .pop()
                    .ok_or_else(|| ModelError::Step("no logits".into()))?;
                accept(l, i, logits, max_len, on_token);
            }
            if let Some(d) = drafter.as_deref_mut().filter(|_| !l.done) {
                let k = if end == l.prompt.len() {
                    l.allowed_drafts(k_max, max_len)
                } else {
                    0
                };
                // A chain of k drafts writes the head's KV up to position pos + k - 2.
                l.table
                    .ensure(l.pos + k, block_size, &mut model.kv_cache().allocator)?;
                let mut drafts = d.draft(model, &[l.draft_input(i, 0..n, start, k)])?;
                l.drafts = drafts.pop().unwrap_or_default();
                l.drafts.truncate(k);
            }
            start = end;
        }
    }
    if let Some(d) = drafter {
        return speculative::decode(model, live, d, stats, on_token);
    }

    // Decode every unfinished sequence in one step until all are done.
    loop {
        let active: Vec<usize> = (0..live.len()).filter(|&i| !live[i].done).collect();
        if active.is_empty() {
            return Ok(());
        }
        let mut rows = Vec::with_capacity(active.len());
        for (slot, &i) in active.iter().enumerate() {
            let l = &mut live[i];
            l.table
                .ensure(l.pos + 1, block_size, &mut model.kv_cache().allocator)?;
            let token = *l
                .out
                .token_ids
                .last()
                .ok_or_else(|| ModelError::Step("decode before a first token".into()))?;
            rows.push(StepRow {
                token,
                position: l.pos as u32,
                seq: slot as u32,
            });
        }
        let tables: Vec<&BlockTable> = active.iter().map(|&i| &live[i].table).collect();
        let slots: Vec<u32> = active.iter().filter_map(|&i| live[i].ssm_slot).collect();
        model.decode(&rows, &tables, &slots)?;
        let logits = model.logits(active.len())?;
        for (&i, row) in active.iter().zip(logits) {
            let l = &mut live[i];
            l.pos += 1;
            accept(l, i, row, max_len, on_token);
        }
    }
}
