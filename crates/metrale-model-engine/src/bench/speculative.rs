//! The speculative-decoding benchmark behind `metrale bench --speculative`: on a random-weight
//! model with an MTP head, at batch 1 and a context of `context` tokens,
//! - a plain decode step, graph-replayed and eager;
//! - a verify step of `1 + K` rows for K = 1..`max_draft_tokens`, graph-replayed (as a
//!   single-sequence verify runs) and eager, and its ratios to the plain step, graphed to
//!   graphed and eager to eager;
//! - one draft: an MTP head step of one row with its LM head and argmax, graph-replayed (as a
//!   batch-1 draft runs) and eager;
//! - tokens/s projected at the published acceptance lengths ([`ACCEPTANCE_LENGTHS`] for K =
//!   1, 2, 3): `L / (verify(K) + K * draft)`, verify and drafts graphed, as batch 1 runs them;
//! - end to end, `output_tokens` greedy tokens after a prompt of `context` tokens: plain decode
//!   (graphed and eager), the oracle drafter at full acceptance (it drafts the plain run's own
//!   tokens), and the MTP head drafting (random weights: next to no acceptance, the worst case);
//!   each run twice, the figures of the second (warm: its step shapes' graphs captured, as a
//!   server runs) beside the first's rate and the graphs each captured, and each step's wall
//!   time beyond the graphed step it runs (plain decode, or the oracle's verify step).
//!
//! With `batch` > 1 it also times, graphed, a plain decode step of `batch` sequences and verify
//! steps of `batch` sequences of `1 + K` rows each, under the selected forward (`forward`:
//! the circuit's batched verify programs, or the legacy launches).
//!
//! Every step figure is printed beside its floor: the bytes it must move over the copy
//! bandwidth measured in the same run.
//!
//! Invariants:
//! - Step times are device-event medians after warm-up (`time_ms`); end-to-end rates are host
//!   wall time from the first token to the last, as a client sees them (prefill excluded).

mod end_to_end;

use std::sync::Arc;

use metrale_cache::{BlockTable, CacheManager};
use metrale_config::ModelConfig;
use metrale_gpu_runtime::GpuBackend;

use super::{
    attention_params, copy_bandwidth, kv_bytes_per_token, ssm_bytes_per_seq, time_ms, weight_bytes,
};
use crate::error::ModelError;
use crate::factory;
use crate::options::{MAX_DRAFT_TOKENS, ModelOptions, Quantization, Speculative};
use crate::runner::{ForwardSelect, ModelCircuit, MtpStep, StepRow, StepRunner};
use crate::scheduler::Scheduler;
use end_to_end::end_to_end;

/// Tokens per verify step published for Qwen3.5's MTP head at 1, 2 and 3 drafts.
pub const ACCEPTANCE_LENGTHS: [f64; 3] = [1.9, 2.7, 3.4];

/// What the speculative benchmark runs.
#[derive(Debug, Clone)]
pub struct SpecBenchOptions {
    /// The model shape; one without an MTP head gets a one-layer head.
    pub config: ModelConfig,
    /// Verify steps are timed for K = 1 to this. Default 4.
    pub max_draft_tokens: usize,
    /// Tokens in the sequence's cache. Default 1024.
    pub context: usize,
    /// Timed repetitions per step figure (the median is reported). Default 20.
    pub iters: usize,
    /// Tokens each end-to-end run generates. Default 128.
    pub output_tokens: usize,
    /// Bytes of each buffer of the copy-bandwidth measurement. Default 1 GiB.
    pub copy_bytes: usize,
    /// Sequences of the batched step figures (1: none). Default 1.
    pub batch: usize,
    /// The forward every step runs. Default legacy.
    pub forward: ForwardSelect,
}

impl SpecBenchOptions {
    /// Defaults for `config`.
    pub fn new(config: ModelConfig) -> SpecBenchOptions {
        SpecBenchOptions {
            config,
            max_draft_tokens: 4,
            context: 1024,
            iters: 20,
            output_tokens: 128,
            copy_bytes: 1 << 30,
            batch: 1,
            forward: ForwardSelect::Legacy,
        }
    }
}

/// One verify step.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyFigure {
    /// Drafts verified (the step has `1 + drafts` rows).
    pub drafts: usize,
    /// Median step time, replayed from a graph, ms.
    pub graphed_ms: f64,
    /// Median step time, launched eagerly, ms.
    pub ms: f64,
    /// The step's bytes over the copy bandwidth, ms.
    pub floor_ms: f64,
}

/// One end-to-end run.
#[derive(Debug, Clone, PartialEq)]
pub struct EndToEnd {
    /// What decoded: `plain (graphed)`, `plain (eager)`, `oracle K=..`, `mtp K=..`.
    pub name: String,
    /// Drafts per verify step (0: plain decode).
    pub drafts: usize,
    /// Tokens generated.
    pub tokens: usize,
    /// Tokens per decode or verify step.
    pub tokens_per_step: f64,
    /// Tokens per second from the first token to the last.
    pub tok_s: f64,
    /// Whether the tokens equal the plain greedy run's (speculation is lossless).
    pub matches_plain: bool,
    /// Graphs the (warm) run captured: 0 unless some step shape ran past the graph bound.
    pub captures: u64,
    /// Tokens per second of the first, cold run of the same configuration (which captures
    /// the graphs of its step shapes).
    pub cold_tok_s: f64,
    /// Graphs the cold run captured.
    pub cold_captures: u64,
}

/// Everything the speculative benchmark measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecReport {
    /// Backend name.
    pub backend: String,
    /// Device-to-device copy bandwidth (read + write), GB/s.
    pub copy_gb_s: f64,
    /// Weight bytes a target step reads.
    pub weight_bytes: f64,
    /// Weight bytes a draft reads (the head's layer and `fc`, and the shared LM head).
    pub head_weight_bytes: f64,
    /// Tokens in the cache of the timed steps.
    pub context: usize,
    /// The plain decode step at batch 1.
    pub plain: StepTimes,
    /// Verify steps for K = 1 up.
    pub verify: Vec<VerifyFigure>,
    /// One draft: an MTP head step with logits and argmax (graph-replayed as a batch-1 draft
    /// runs).
    pub draft: StepTimes,
    /// End-to-end runs.
    pub end_to_end: Vec<EndToEnd>,
    /// The forward the steps ran (`legacy`, `circuit`, `circuit-reference`).
    pub forward: &'static str,
    /// With `batch` > 1: the batched plain decode step and verify steps.
    pub batched: Option<BatchedFigures>,
    /// Verify steps (timed or end to end) that ran a circuit verify program.
    pub verify_program_steps: u64,
}

/// Steps of several sequences, each with `context` tokens cached.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchedFigures {
    /// Sequences.
    pub seqs: usize,
    /// A plain decode step of one row a sequence.
    pub plain: StepTimes,
    /// Verify steps of `1 + K` rows a sequence, K = 1 up.
    pub verify: Vec<VerifyFigure>,
}

/// A step's median time replayed from a graph and launched eagerly, and its floor (its bytes
/// over the copy bandwidth), ms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    /// Replayed from a graph.
    pub graphed_ms: f64,
    /// Launched eagerly.
    pub eager_ms: f64,
    /// The floor.
    pub floor_ms: f64,
}

impl SpecReport {
    /// Tokens/s projected at acceptance length `length` with `k` drafts per verify step:
    /// `length / (verify(k) + k * draft)`, the verify step and the drafts graphed (as batch 1
    /// runs them); `None` when verify(k) was not timed.
    pub fn projected_tok_s(&self, k: usize, length: f64) -> Option<f64> {
        let v = self.verify.iter().find(|v| v.drafts == k)?;
        Some(length / ((v.graphed_ms + k as f64 * self.draft.graphed_ms) * 1e-3))
    }
}

/// Weight bytes one draft reads: `fc`, the head's layer (full attention and MLP), the LM head.
fn head_weight_bytes(c: &ModelConfig) -> f64 {
    let h = c.hidden_size as f64;
    let layer = attention_params(c) + 3.0 * h * c.intermediate_size as f64;
    2.0 * (2.0 * h * h + layer + h * c.tokens.vocab_size as f64)
}

/// Run the speculative benchmark on `gpu` (see the module header).
pub fn speculative_bench(
    gpu: Arc<dyn GpuBackend>,
    opts: &SpecBenchOptions,
) -> Result<SpecReport, ModelError> {
    let kmax = opts.max_draft_tokens;
    if !(1..=MAX_DRAFT_TOKENS).contains(&kmax) {
        return Err(ModelError::Options {
            option: "max_draft_tokens",
            problem: format!("{kmax}; 1 to {MAX_DRAFT_TOKENS} are allowed"),
        });
    }
    let mut c = opts.config.clone();
    c.mtp_num_layers = c.mtp_num_layers.max(1);
    let copy_gb_s = copy_bandwidth(&gpu, opts.copy_bytes, opts.iters)?;
    let block_size = ModelOptions::default().block_size;
    let max_seq_len = opts.context + opts.output_tokens + kmax + 2;
    let batch = opts.batch.max(1);
    let options = ModelOptions::default()
        .max_seq_len(max_seq_len)
        .block_size(block_size)
        .num_kv_blocks((batch + 1) * max_seq_len.div_ceil(block_size) + 2)
        .max_decode_seqs(batch)
        .decode_graphs(true)
        // Each step shape captured the first time it runs: the warm runs replay graphs only,
        // as in a server that has met its shapes more than once.
        .speculative_graph_after(1)
        .prefix_caching(false)
        .speculative(Speculative::Mtp)
        .num_draft_tokens(kmax);
    let model = factory::random(c.clone(), gpu.clone(), 0x5eed)?;
    let (mut runner, mut cache) = StepRunner::new(model, options)?;
    runner.set_forward(opts.forward)?;
    let steps = step_times(&mut runner, &mut cache, opts, &c, copy_gb_s)?;
    let batched = if batch > 1 {
        Some(batched_step_times(
            &mut runner,
            &mut cache,
            opts,
            &c,
            copy_gb_s,
        )?)
    } else {
        None
    };
    let mut sched = Scheduler::from_parts(runner, cache);
    let end_to_end = end_to_end(&mut sched, opts, kmax)?;
    let verify_program_steps = sched.runner().verify_program_steps();
    Ok(SpecReport {
        backend: gpu.name().to_string(),
        copy_gb_s,
        weight_bytes: weight_bytes(&c, Quantization::AsStored),
        head_weight_bytes: head_weight_bytes(&c),
        context: opts.context,
        plain: steps.0,
        verify: steps.1,
        draft: steps.2,
        end_to_end,
        forward: opts.forward.name(),
        batched,
        verify_program_steps,
    })
}

/// The batched step figures (see the module header): `opts.batch` sequences, each with
/// `context` tokens cached, its own SSM slot and one per draft; graphed and eager.
fn batched_step_times(
    runner: &mut StepRunner,
    cache: &mut CacheManager,
    opts: &SpecBenchOptions,
    c: &ModelConfig,
    copy_gb_s: f64,
) -> Result<BatchedFigures, ModelError> {
    let (kmax, n) = (opts.max_draft_tokens, opts.batch);
    let floor = |bytes: f64| bytes / (copy_gb_s * 1e9) * 1e3;
    let (weights, kv_token) = (
        weight_bytes(c, Quantization::AsStored),
        kv_bytes_per_token(c, metrale_cache::KvDtype::Bf16),
    );
    let ssm_half = ssm_bytes_per_seq(c) / 2.0;
    let mut tables = Vec::with_capacity(n);
    let (mut own, mut spares) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let mut table = BlockTable::new();
        cache.ensure(&mut table, opts.context + kmax + 1)?;
        tables.push(table);
        if let Some(slot) = cache.alloc_ssm_slot(None)? {
            own.push(slot);
            let mut mine = Vec::with_capacity(kmax);
            for _ in 0..kmax {
                mine.extend(cache.alloc_ssm_slot(None)?);
            }
            spares.push(mine);
        }
    }
    let refs: Vec<&BlockTable> = tables.iter().collect();
    let ctx = opts.context as u32;
    let vocab = c.tokens.vocab_size;
    let row = |q: usize, t: usize| StepRow {
        token: ((q * 131 + t * 7919 + 13) % vocab) as u32,
        position: ctx + t as u32,
        seq: q as u32,
    };
    let plain_rows: Vec<StepRow> = (0..n).map(|q| row(q, 0)).collect();
    let (graphed_ms, eager_ms) = graphed_and_eager(runner, opts.iters, |r| {
        r.decode(cache, &plain_rows, &refs, &own)
    })?;
    let nf = n as f64;
    let plain = StepTimes {
        graphed_ms,
        eager_ms,
        floor_ms: floor(weights + nf * ((opts.context + 1) as f64 * kv_token + 2.0 * ssm_half)),
    };
    let mut verify = Vec::with_capacity(kmax);
    for k in 1..=kmax {
        let rows: Vec<StepRow> = (0..n)
            .flat_map(|q| (0..=k).map(move |t| (q, t)))
            .map(|(q, t)| row(q, t))
            .collect();
        // Row t < k of sequence q keeps its state in q's spare t, row k in q's own slot.
        let row_slots: Vec<u32> = (0..n)
            .flat_map(|q| match own.get(q) {
                Some(&o) => spares[q][..k]
                    .iter()
                    .copied()
                    .chain([o])
                    .collect::<Vec<_>>(),
                None => vec![u32::MAX; k + 1],
            })
            .collect();
        let (graphed_ms, ms) = graphed_and_eager(runner, opts.iters, |r| {
            r.verify(cache, &rows, &refs, &own, &row_slots)
        })?;
        let per_seq = (opts.context + k + 1) as f64 * kv_token + (k + 2) as f64 * ssm_half;
        verify.push(VerifyFigure {
            drafts: k,
            graphed_ms,
            ms,
            floor_ms: floor(weights + nf * per_seq),
        });
    }
    for mut table in tables {
        cache.release(&mut table)?;
    }
    for slot in own.into_iter().chain(spares.into_iter().flatten()) {
        cache.free_ssm_slot(slot)?;
    }
    Ok(BatchedFigures {
        seqs: n,
        plain,
        verify,
    })
}

/// `step` timed replayed from graphs, then launched eagerly (medians of `iters`), ms.
fn graphed_and_eager(
    runner: &mut StepRunner,
    iters: usize,
    mut step: impl FnMut(&mut StepRunner) -> Result<(), ModelError>,
) -> Result<(f64, f64), ModelError> {
    let gpu = runner.model().gpu().clone();
    let s = gpu.default_stream();
    let graphed = time_ms(gpu.as_ref(), s, iters, || step(runner))?;
    runner.set_decode_graphs(false);
    let eager = time_ms(gpu.as_ref(), s, iters, || step(runner));
    runner.set_decode_graphs(true);
    Ok((graphed, eager?))
}

/// The step figures (see the module header) on one sequence with `context` tokens in its
/// cache, its own SSM slot and one per draft: the plain step, the verify steps, one draft.
fn step_times(
    runner: &mut StepRunner,
    cache: &mut CacheManager,
    opts: &SpecBenchOptions,
    c: &ModelConfig,
    copy_gb_s: f64,
) -> Result<(StepTimes, Vec<VerifyFigure>, StepTimes), ModelError> {
    let kmax = opts.max_draft_tokens;
    let floor = |bytes: f64| bytes / (copy_gb_s * 1e9) * 1e3;
    let (weights, kv_token) = (
        weight_bytes(c, Quantization::AsStored),
        kv_bytes_per_token(c, metrale_cache::KvDtype::Bf16),
    );
    // The SSM state is read once per step and written once per row.
    let ssm_half = ssm_bytes_per_seq(c) / 2.0;
    let mut table = BlockTable::new();
    cache.ensure(&mut table, opts.context + kmax + 1)?;
    let own = cache.alloc_ssm_slot(None)?;
    let mut spares = Vec::new();
    if own.is_some() {
        for _ in 0..kmax {
            spares.extend(cache.alloc_ssm_slot(None)?);
        }
    }
    let slots: Vec<u32> = own.into_iter().collect();
    let token = |i: usize| ((i * 7919 + 13) % c.tokens.vocab_size) as u32;
    let ctx = opts.context as u32;
    let row = |t: usize| StepRow {
        token: token(t),
        position: ctx + t as u32,
        seq: 0,
    };
    let tables = [&table];
    let (graphed_ms, eager_ms) = graphed_and_eager(runner, opts.iters, |r| {
        r.decode(cache, &[row(0)], &tables, &slots)
    })?;
    let plain = StepTimes {
        graphed_ms,
        eager_ms,
        floor_ms: floor(weights + (opts.context + 1) as f64 * kv_token + 2.0 * ssm_half),
    };
    let mut verify = Vec::with_capacity(kmax);
    for k in 1..=kmax {
        let rows: Vec<StepRow> = (0..=k).map(row).collect();
        // Row t < k keeps its state in spare t, row k in the sequence's own slot.
        let row_slots: Vec<u32> = match own {
            Some(o) => spares[..k].iter().copied().chain([o]).collect(),
            None => vec![u32::MAX; k + 1],
        };
        let (graphed_ms, ms) = graphed_and_eager(runner, opts.iters, |r| {
            r.verify(cache, &rows, &tables, &slots, &row_slots)
        })?;
        let bytes = weights + (opts.context + k + 1) as f64 * kv_token + (k + 2) as f64 * ssm_half;
        verify.push(VerifyFigure {
            drafts: k,
            graphed_ms,
            ms,
            floor_ms: floor(bytes),
        });
    }
    // One draft: a head step of one row reading the previous step's row 0, with the LM head
    // and the device's argmax, as every draft after the first of a chain runs.
    let draft_row = [StepRow {
        position: ctx,
        ..row(1)
    }];
    let (graphed_ms, eager_ms) = graphed_and_eager(runner, opts.iters, |r| {
        r.mtp_step(&MtpStep {
            rows: &draft_row,
            tables: &tables,
            hidden_rows: &[0],
            logit_rows: &[0],
            depth: 1,
        })?;
        r.greedy(1).map(drop)
    })?;
    let head_kv = kv_token / c.layer_types.len().max(1) as f64;
    let draft = StepTimes {
        graphed_ms,
        eager_ms,
        floor_ms: floor(head_weight_bytes(c) + (opts.context + 1) as f64 * head_kv),
    };
    cache.release(&mut table)?;
    for slot in own.into_iter().chain(spares) {
        cache.free_ssm_slot(slot)?;
    }
    Ok((plain, verify, draft))
}

/// The target the table checks: a verify step of 1 + 3 rows costs at most this many plain
/// steps.
pub const VERIFY_BAR: f64 = 1.15;

impl SpecReport {
    /// The human-readable table: each step figure beside its floor, the ratios to both plain
    /// steps (eager to eager is the like-for-like one), the projections and the end-to-end runs.
    pub fn table(&self) -> String {
        let mut s = format!(
            "backend {}, {} forward: copy {:.0} GB/s; target weights {:.2} GB, draft weights {:.2} GB (MTP head + LM head); batch 1, context {}\n",
            self.backend,
            self.forward,
            self.copy_gb_s,
            self.weight_bytes / 1e9,
            self.head_weight_bytes / 1e9,
            self.context
        );
        s += "step                              ms/step   floor ms   x floor   / plain eager   / plain graphed\n";
        let mut line = |name: &str, ms: f64, floor: f64| {
            s += &format!(
                "  {name:<30} {ms:>9.3} {floor:>10.3} {:>9.2} {:>14.3}x {:>15.3}x\n",
                ms / floor,
                ms / self.plain.eager_ms,
                ms / self.plain.graphed_ms
            );
        };
        line(
            "plain decode (graphed)",
            self.plain.graphed_ms,
            self.plain.floor_ms,
        );
        line(
            "plain decode (eager)",
            self.plain.eager_ms,
            self.plain.floor_ms,
        );
        for v in &self.verify {
            let rows = v.drafts + 1;
            let name = format!("verify K={} (graphed, {rows} rows)", v.drafts);
            line(&name, v.graphed_ms, v.floor_ms);
            let name = format!("verify K={} (eager, {rows} rows)", v.drafts);
            line(&name, v.ms, v.floor_ms);
        }
        line(
            "draft, 1 MTP step (graphed)",
            self.draft.graphed_ms,
            self.draft.floor_ms,
        );
        line(
            "draft, 1 MTP step (eager)",
            self.draft.eager_ms,
            self.draft.floor_ms,
        );
        if let Some(v) = self.verify.iter().find(|v| v.drafts == 3) {
            let verdict = |r: f64| if r <= VERIFY_BAR { "met" } else { "NOT met" };
            let (g, e) = (
                v.graphed_ms / self.plain.graphed_ms,
                v.ms / self.plain.eager_ms,
            );
            s += &format!(
                "bar: verify K=3 <= {VERIFY_BAR}x a plain step: graphed/graphed {g:.3}x ({}), eager/eager {e:.3}x ({})\n",
                verdict(g),
                verdict(e)
            );
        }
        s += &format!(
            "projected tok/s = L / (verify(K) + K x draft), graphed verify and drafts; plain decode {:.1} tok/s graphed, {:.1} eager\n",
            1e3 / self.plain.graphed_ms,
            1e3 / self.plain.eager_ms
        );
        for (i, &l) in ACCEPTANCE_LENGTHS.iter().enumerate() {
            if let Some(t) = self.projected_tok_s(i + 1, l) {
                s += &format!(
                    "  K={} L={l}: {t:>9.1} tok/s = {:.2}x plain graphed, {:.2}x plain eager\n",
                    i + 1,
                    t * self.plain.graphed_ms / 1e3,
                    t * self.plain.eager_ms / 1e3
                );
            }
        }
        if let Some(b) = &self.batched {
            s += &format!(
                "batch {} ({} forward; {} verify steps ran circuit programs)   ms/step   floor ms   x floor   / plain batch\n",
                b.seqs, self.forward, self.verify_program_steps
            );
            let mut line = |name: &str, ms: f64, floor: f64| {
                s += &format!(
                    "  {name:<30} {ms:>9.3} {floor:>10.3} {:>9.2} {:>13.3}x\n",
                    ms / floor,
                    ms / b.plain.graphed_ms
                );
            };
            line(
                "plain decode (graphed)",
                b.plain.graphed_ms,
                b.plain.floor_ms,
            );
            for v in &b.verify {
                let rows = b.seqs * (v.drafts + 1);
                let name = format!("verify K={} (graphed, {rows} rows)", v.drafts);
                line(&name, v.graphed_ms, v.floor_ms);
            }
        }
        let base = self
            .end_to_end
            .iter()
            .find(|e| e.drafts == 0)
            .map_or(f64::NAN, |e| e.tok_s);
        s += "end to end (host wall time, first token to last; warm run, cold run beside)   tok/s   tokens/step   ms/step   over its step   / plain graphed   captures   cold tok/s   cold captures   same tokens as plain\n";
        for e in &self.end_to_end {
            let ms = e.tokens_per_step / e.tok_s * 1e3;
            // What a step costs end to end beyond its graphed figure (host work, sampling,
            // acceptance): plain decode and the oracle's verify steps (it drafts for free).
            let step = match (e.drafts, e.name.starts_with("oracle")) {
                (0, _) if e.name.contains("eager") => Some(self.plain.eager_ms),
                (0, _) => Some(self.plain.graphed_ms),
                (k, true) => (self.verify.iter().find(|v| v.drafts == k)).map(|v| v.graphed_ms),
                _ => None,
            };
            let over = step.map_or_else(|| "-".to_string(), |t| format!("{:+.3}", ms - t));
            s += &format!(
                "  {:<44} {:>9.1} {:>13.2} {:>9.3} {:>15} {:>16.2}x {:>10} {:>12.1} {:>15}   {}\n",
                e.name,
                e.tok_s,
                e.tokens_per_step,
                ms,
                over,
                e.tok_s / base,
                e.captures,
                e.cold_tok_s,
                e.cold_captures,
                if e.matches_plain { "yes" } else { "NO" }
            );
        }
        s
    }
}

#[cfg(test)]
mod tests;
