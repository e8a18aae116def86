//! One sequence from prompt to finish: chunked prefill, then one decode step per token, with
//! stop conditions, a token callback for streaming, and the KV blocks released however it ends.

use std::ops::ControlFlow;

use metrale_cache::BlockTable;

use crate::error::ModelError;
use crate::model::{StepInput, StepRow, TransformerModel, prefill_chunk};
use crate::sampling::{Sampler, SamplingParams};

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
struct Live<'a> {
    prompt: &'a [u32],
    params: &'a GenerateParams,
    table: BlockTable,
    /// The SSM state slot (hybrid models).
    ssm_slot: Option<u32>,
    sampler: Sampler,
    /// Position of the next token fed to the model.
    pos: usize,
    out: Generation,
    done: bool,
}

/// Generate for several prompts together: each is prefilled on its own, then all decode in
/// shared steps until each finishes. `on_token(i, token)` sees sequence `i`'s tokens. Each
/// sequence's tokens and logits are those it would get alone (batch invariance).
pub fn generate_batch(
    model: &mut TransformerModel,
    requests: &[(&[u32], &GenerateParams)],
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) -> Result<Vec<Generation>, ModelError> {
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
    let result = run_batch(model, &mut live, on_token);
    let mut released = Ok(());
    for l in &mut live {
        released = released.and(
            l.table
                .release_all(&mut model.kv_cache().allocator)
                .map_err(ModelError::from),
        );
        if let Some(slot) = l.ssm_slot.take() {
            released = released.and(model.free_ssm_slot(slot));
        }
    }
    result?;
    released?;
    Ok(live.into_iter().map(|l| l.out).collect())
}

/// Record a chosen token and apply the stop conditions.
fn accept(
    l: &mut Live<'_>,
    i: usize,
    logits: Vec<f32>,
    max_len: usize,
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) {
    let token = l.sampler.sample(&logits);
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
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) -> Result<(), ModelError> {
    let max_len = model.max_seq_len();
    let block_size = model.kv_cache().block_size();
    let chunk = model.max_rows();
    let align = model.ssm_snapshot_interval();

    // Prefill each sequence in chunks cut as the scheduler cuts them (so a loop run is bitwise a
    // scheduled one); only its last prompt row needs logits.
    for (i, l) in live.iter_mut().enumerate() {
        if l.done {
            continue;
        }
        l.ssm_slot = model.alloc_ssm_slot()?;
        let slots: Vec<u32> = l.ssm_slot.into_iter().collect();
        let mut start = 0;
        while start < l.prompt.len() {
            let end = prefill_chunk(start, l.prompt.len(), chunk, align).end;
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
            start = end;
        }
        let logits = model
            .logits(1)?
            .pop()
            .ok_or_else(|| ModelError::Step("no logits".into()))?;
        accept(l, i, logits, max_len, on_token);
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
