//! The interference scenario behind `metrale bench --serve --interference-prompt-tokens P`: what
//! a long prompt arriving does to the streams already decoding. For each concurrency N, N
//! requests of `prompt_tokens` random prompt tokens each generate `output_tokens` greedy tokens
//! (EOS ignored); once every one of them has generated a quarter of its tokens, one request
//! with a prompt of P tokens arrives and asks for one token. The rung runs twice on one
//! [`Scheduler`] over a random-weight model of a real shape, with mixed steps on
//! (`ModelOptions::mixed_steps`: each step holds every stream's row and a chunk of the prompt
//! sized to the token budget left) and off (prefill chunks and decode steps alternate).
//!
//! Reported per run: each stream's inter-token gaps (the wall times between the steps that gave
//! it consecutive tokens), their median over its whole output, and its largest gap among those
//! that overlap the long prompt's prefill (from its arrival to its first token); the median of
//! the streams' medians, the largest of their gaps, the worst ratio of a stream's largest gap
//! to its median; and the long prompt's time to first token. The bar mixed steps aim at: no
//! stream's gap past twice its median (ratio at most 2) while the long prompt prefills.
//!
//! Invariants:
//! - Times are host wall times read after `Scheduler::step` returns, which is when the step's
//!   tokens are on the host: what a client of the engine sees.
//! - Both runs of a rung start from an idle scheduler with an empty prefix cache and submit the
//!   same prompts; the model is built once, for the largest rung and the long prompt.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use metrale_config::ModelConfig;
use metrale_gpu_runtime::GpuBackend;

use super::median;
use super::serve::{bench_request, check_all_freed};
use crate::error::ModelError;
use crate::factory;
use crate::options::ModelOptions;
use crate::scheduler::{Scheduler, SeqEvent, SeqId, StepKind};

/// What the interference scenario runs.
#[derive(Debug, Clone)]
pub struct InterferenceOptions {
    /// The model shape.
    pub config: ModelConfig,
    /// Streams decoding when the long prompt arrives, one rung each. Default 64.
    pub concurrency: Vec<usize>,
    /// Prompt tokens of each stream. Default 128.
    pub prompt_tokens: usize,
    /// Tokens each stream generates. Default 512.
    pub output_tokens: usize,
    /// Prompt tokens of the request that arrives. Default 16384.
    pub long_prompt_tokens: usize,
    /// The engine's `max_batch_tokens`. Default 512, the engine's default.
    pub max_batch_tokens: usize,
    /// The engine's `mixed_chunk_attention`. Default `None`, the engine's default.
    pub mixed_chunk_attention: Option<usize>,
    /// The engine's `mixed_step_tokens`. Default `None`, the engine's default.
    pub mixed_step_tokens: Option<usize>,
    /// The engine's `mixed_step_slowdown_pct`. Default `None`, the engine's default.
    pub mixed_step_slowdown_pct: Option<u32>,
}

impl InterferenceOptions {
    /// Defaults for `config`.
    pub fn new(config: ModelConfig) -> InterferenceOptions {
        InterferenceOptions {
            config,
            concurrency: vec![64],
            prompt_tokens: 128,
            output_tokens: 512,
            long_prompt_tokens: 16384,
            max_batch_tokens: ModelOptions::default().max_batch_tokens,
            mixed_chunk_attention: None,
            mixed_step_tokens: None,
            mixed_step_slowdown_pct: None,
        }
    }
}

/// One run of a rung (mixed steps on or off).
#[derive(Debug, Clone, PartialEq)]
pub struct InterferenceRun {
    /// Whether mixed steps were on.
    pub mixed: bool,
    /// The long prompt's time from its arrival to its first token, ms.
    pub ttft_ms: f64,
    /// The median over the streams of each one's median inter-token gap, ms.
    pub median_gap_ms: f64,
    /// The median wall time of the run's plain decode steps of every stream (no prompt beside
    /// them): what a stream's gap is when nothing prefills, ms.
    pub plain_step_ms: f64,
    /// The largest gap of any stream while the long prompt prefilled, ms.
    pub max_gap_ms: f64,
    /// The largest ratio of a stream's largest gap while the long prompt prefilled to its own
    /// median gap.
    pub worst_ratio: f64,
    /// Steps from the long prompt's arrival to its first token.
    pub window_steps: usize,
    /// Of those, the steps that held no row of the streams (prefill steps).
    pub stalled_steps: usize,
    /// The slowest steps from the long prompt's arrival to its first token, slowest first (at
    /// most [`SLOWEST_STEPS`]): where the largest gap comes from.
    pub slowest_steps: Vec<WindowStep>,
    /// The median wall time of those steps, ms.
    pub median_window_step_ms: f64,
    /// Steps of the whole run, and the mixed ones among them.
    pub steps: u64,
    /// See `steps`.
    pub mixed_steps: u64,
}

/// How many of a window's slowest steps a run reports.
pub const SLOWEST_STEPS: usize = 3;

/// One step while the long prompt prefilled: what it ran and its host wall time. A prefill
/// chunk that does not end its prompt samples nothing, so its step returns before the GPU has
/// run it, and the next step that waits for the GPU (one that samples) carries its time.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowStep {
    /// `Scheduler::step`'s wall time, ms.
    pub ms: f64,
    /// What the step ran.
    pub kind: StepKind,
}

impl WindowStep {
    /// The step in a few words: its time, kind and rows.
    pub fn describe(&self) -> String {
        let what = match self.kind {
            StepKind::Mixed {
                seqs, start, rows, ..
            } => format!("mixed, {seqs} decode + {rows} prompt rows from {start}"),
            StepKind::Prefill { start, rows, .. } => format!("prefill, {rows} rows from {start}"),
            StepKind::Decode { seqs } => format!("decode, {seqs} rows"),
            other => format!("{other:?}"),
        };
        format!("{:.3} ms {what}", self.ms)
    }
}

/// One rung: the same traffic with mixed steps on, then off.
#[derive(Debug, Clone, PartialEq)]
pub struct InterferencePoint {
    /// Streams decoding.
    pub concurrency: usize,
    /// Mixed steps on, then off.
    pub runs: Vec<InterferenceRun>,
}

/// The whole scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct InterferenceReport {
    /// Backend name.
    pub backend: String,
    /// See [`InterferenceOptions`].
    pub prompt_tokens: usize,
    /// See [`InterferenceOptions`].
    pub output_tokens: usize,
    /// See [`InterferenceOptions`].
    pub long_prompt_tokens: usize,
    /// See [`InterferenceOptions`].
    pub max_batch_tokens: usize,
    /// See [`InterferenceOptions`].
    pub mixed_chunk_attention: Option<usize>,
    /// See [`InterferenceOptions`].
    pub mixed_step_tokens: Option<usize>,
    /// See [`InterferenceOptions`].
    pub mixed_step_slowdown_pct: Option<u32>,
    /// The rungs, in the order run.
    pub points: Vec<InterferencePoint>,
}

/// A scheduler over a random-weight model of `config` for `streams` streams of `stream_len`
/// tokens and one sequence of `long_len`, each with its whole context in the KV cache.
fn interference_scheduler(
    gpu: &Arc<dyn GpuBackend>,
    opts: &InterferenceOptions,
    streams: usize,
) -> Result<Scheduler, ModelError> {
    let block_size = ModelOptions::default().block_size;
    let stream_len = opts.prompt_tokens + opts.output_tokens + 1;
    let long_len = opts.long_prompt_tokens + 2;
    // Every context, plus the admission headroom of one block per sequence.
    let blocks =
        streams * (stream_len.div_ceil(block_size) + 2) + long_len.div_ceil(block_size) + 2;
    let options = ModelOptions::default()
        .max_batch_tokens(opts.max_batch_tokens)
        .mixed_chunk_attention(opts.mixed_chunk_attention)
        .mixed_step_tokens(opts.mixed_step_tokens)
        .mixed_step_slowdown_pct(opts.mixed_step_slowdown_pct)
        .max_seq_len(Some(stream_len.max(long_len)))
        .num_kv_blocks(Some(blocks))
        .max_decode_seqs(streams + 1);
    let model = factory::random(opts.config.clone(), gpu.clone(), 0x5eed)?;
    Scheduler::new(model, options)
}

/// Run one rung's traffic with mixed steps `mixed`.
fn run_once(
    sched: &mut Scheduler,
    prompts: &[Vec<u32>],
    long_prompt: &[u32],
    output_tokens: usize,
    mixed: bool,
) -> Result<InterferenceRun, ModelError> {
    sched.clear_prefix_cache();
    sched.runner_mut().set_mixed_steps(mixed);
    let before = sched.stats().steps;
    let mut ids = HashMap::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let id = (sched.add(bench_request(p.clone(), output_tokens, true)))
            .map_err(|e| ModelError::Step(format!("interference bench request refused: {e}")))?;
        ids.insert(id, i);
    }
    // Each stream's token times (s since the start).
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); prompts.len()];
    let arrive_after = (output_tokens / 4).max(1);
    let start = Instant::now();
    let (mut long, mut arrival, mut first) = (None::<SeqId>, 0.0, None::<f64>);
    let (mut window, mut plain) = (Vec::new(), Vec::new());
    while !sched.is_idle() {
        if long.is_none() && times.iter().all(|t| t.len() >= arrive_after) {
            let req = bench_request(long_prompt.to_vec(), 1, true);
            let id = (sched.add(req))
                .map_err(|e| ModelError::Step(format!("the long prompt was refused: {e}")))?;
            long = Some(id);
            arrival = start.elapsed().as_secs_f64();
        }
        let before_step = start.elapsed().as_secs_f64();
        let report = sched.step().map_err(|f| *f.error)?;
        let now = start.elapsed().as_secs_f64();
        let step_ms = (now - before_step) * 1e3;
        if report.kind
            == (StepKind::Decode {
                seqs: prompts.len(),
            })
        {
            plain.push(step_ms);
        }
        if long.is_some() && first.is_none() {
            window.push(WindowStep {
                ms: step_ms,
                kind: report.kind,
            });
        }
        for e in report.events {
            if let SeqEvent::Token { id, .. } = e {
                match ids.get(&id) {
                    Some(&i) => times[i].push(now),
                    None if Some(id) == long => first = Some(now),
                    None => {}
                }
            }
        }
    }
    check_all_freed(
        sched,
        &format!("interference bench, {} streams", prompts.len()),
    )?;
    let first = first.ok_or_else(|| {
        ModelError::Step("interference bench: the streams ended before the long prompt".into())
    })?;
    let (mut medians, mut max_gap, mut worst) = (Vec::new(), 0.0f64, 0.0f64);
    for t in &times {
        let gaps: Vec<(f64, f64)> = t.windows(2).map(|w| (w[0], w[1])).collect();
        if gaps.is_empty() {
            continue;
        }
        let m = median(gaps.iter().map(|(a, b)| b - a).collect());
        // The gaps that overlap the long prompt's prefill.
        let during = (gaps.iter())
            .filter(|&&(a, b)| b > arrival && a < first)
            .map(|(a, b)| b - a)
            .fold(0.0, f64::max);
        medians.push(m);
        max_gap = max_gap.max(during);
        worst = worst.max(during / m);
    }
    let after = sched.stats().steps;
    let window_steps = window.len();
    let stalled_steps = (window.iter())
        .filter(|w| matches!(w.kind, StepKind::Prefill { .. }))
        .count();
    let median_window_step_ms = median(window.iter().map(|w| w.ms).collect());
    window.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    window.truncate(SLOWEST_STEPS);
    Ok(InterferenceRun {
        mixed,
        ttft_ms: (first - arrival) * 1e3,
        median_gap_ms: if medians.is_empty() {
            f64::NAN
        } else {
            median(medians) * 1e3
        },
        plain_step_ms: if plain.is_empty() {
            f64::NAN
        } else {
            median(plain)
        },
        max_gap_ms: max_gap * 1e3,
        worst_ratio: worst,
        window_steps,
        stalled_steps,
        slowest_steps: window,
        median_window_step_ms,
        steps: after.steps - before.steps,
        mixed_steps: after.mixed_steps - before.mixed_steps,
    })
}

/// Run the interference scenario on `gpu`.
pub fn interference(
    gpu: Arc<dyn GpuBackend>,
    opts: &InterferenceOptions,
) -> Result<InterferenceReport, ModelError> {
    let c = &opts.config;
    let max_n = opts.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let mut sched = interference_scheduler(&gpu, opts, max_n)?;
    let vocab = c.tokens.vocab_size;
    let long_prompt: Vec<u32> = (0..opts.long_prompt_tokens)
        .map(|p| ((p * 7919 + 13) % vocab) as u32)
        .collect();
    let mut points = Vec::with_capacity(opts.concurrency.len());
    for (rung, &n) in opts.concurrency.iter().enumerate() {
        let prompts: Vec<Vec<u32>> = (0..n)
            .map(|i| {
                (0..opts.prompt_tokens)
                    .map(|p| ((rung * 7919 + i * 104_729 + p * 31 + 1) % vocab) as u32)
                    .collect()
            })
            .collect();
        let runs = [true, false]
            .into_iter()
            .map(|mixed| {
                run_once(
                    &mut sched,
                    &prompts,
                    &long_prompt,
                    opts.output_tokens,
                    mixed,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        points.push(InterferencePoint {
            concurrency: n,
            runs,
        });
    }
    Ok(InterferenceReport {
        backend: gpu.name().to_string(),
        prompt_tokens: opts.prompt_tokens,
        output_tokens: opts.output_tokens,
        long_prompt_tokens: opts.long_prompt_tokens,
        max_batch_tokens: opts.max_batch_tokens,
        mixed_chunk_attention: opts.mixed_chunk_attention,
        mixed_step_tokens: opts.mixed_step_tokens,
        mixed_step_slowdown_pct: opts.mixed_step_slowdown_pct,
        points,
    })
}

impl InterferenceReport {
    /// The human-readable table: each rung's runs with mixed steps on and off.
    pub fn table(&self) -> String {
        let mut s = format!(
            "backend {}: interference, streams of prompt {} + output {} tokens, a prompt of {} tokens arrives; max_batch_tokens {}; mixed_chunk_attention {}; mixed_step_tokens {}; mixed_step_slowdown_pct {}\n",
            self.backend,
            self.prompt_tokens,
            self.output_tokens,
            self.long_prompt_tokens,
            self.max_batch_tokens,
            self.mixed_chunk_attention
                .map_or_else(|| "none".to_string(), |p| p.to_string()),
            self.mixed_step_tokens
                .map_or_else(|| "max_batch_tokens".to_string(), |t| t.to_string()),
            self.mixed_step_slowdown_pct
                .map_or_else(|| "none".to_string(), |t| t.to_string())
        );
        s += "interf streams  mixed   ttft ms   median gap ms   plain step ms   max gap ms   worst max/median   max/plain   stalled/steps\n";
        for p in &self.points {
            for r in &p.runs {
                s += &format!(
                    "       {:>6}  {:>5} {:>9.1} {:>15.3} {:>15.3} {:>12.3} {:>18.2} {:>12.2} {:>8}/{}\n",
                    p.concurrency,
                    if r.mixed { "on" } else { "off" },
                    r.ttft_ms,
                    r.median_gap_ms,
                    r.plain_step_ms,
                    r.max_gap_ms,
                    r.worst_ratio,
                    r.max_gap_ms / r.plain_step_ms,
                    r.stalled_steps,
                    r.window_steps
                );
            }
        }
        for p in &self.points {
            for r in &p.runs {
                let slowest: Vec<String> =
                    r.slowest_steps.iter().map(WindowStep::describe).collect();
                s += &format!(
                    "steps while the prompt prefilled, {} streams, mixed {}: median {:.3} ms; slowest {}\n",
                    p.concurrency,
                    if r.mixed { "on" } else { "off" },
                    r.median_window_step_ms,
                    slowest.join("; ")
                );
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_gpu_runtime::CpuBackend;

    /// The scenario on the CPU backend, on a dense and a hybrid tiny shape: with mixed steps
    /// on, no step of the long prompt's prefill leaves the streams out; with them off, some
    /// do; every figure is there.
    #[test]
    fn mixed_steps_keep_every_stream_in_every_step_of_a_long_prefill() {
        for config in [
            crate::bench::tiny_for_cpu().unwrap(),
            crate::bench::tiny_hybrid_for_cpu().unwrap(),
        ] {
            let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new(Default::default()));
            let mut o = InterferenceOptions::new(config);
            o.concurrency = vec![1, 3];
            o.prompt_tokens = 4;
            o.output_tokens = 24;
            o.long_prompt_tokens = 200;
            o.max_batch_tokens = 80;
            let r = interference(gpu, &o).unwrap();
            assert_eq!(r.points.len(), 2);
            for p in &r.points {
                let (on, off) = (&p.runs[0], &p.runs[1]);
                assert!(on.mixed && !off.mixed);
                assert_eq!(on.stalled_steps, 0, "{p:?}");
                assert!(on.mixed_steps >= 1 && off.mixed_steps == 0, "{p:?}");
                assert!(off.stalled_steps >= 2, "{p:?}");
                for run in &p.runs {
                    assert!(run.ttft_ms > 0.0 && run.median_gap_ms > 0.0, "{run:?}");
                    assert!(run.max_gap_ms > 0.0 && run.worst_ratio >= 1.0, "{run:?}");
                    assert!(run.plain_step_ms > 0.0, "{run:?}");
                    // The slowest step of the window is at most the largest gap it made.
                    let slowest = &run.slowest_steps;
                    assert_eq!(
                        slowest.len(),
                        SLOWEST_STEPS.min(run.window_steps),
                        "{run:?}"
                    );
                    assert!(slowest.windows(2).all(|w| w[0].ms >= w[1].ms), "{run:?}");
                    assert!(slowest[0].ms <= run.max_gap_ms + 1e-6, "{run:?}");
                }
            }
            let table = r.table();
            assert!(table.contains("max/plain"), "{table}");
            assert!(
                table.contains("slowest") && table.contains("prompt rows from"),
                "{table}"
            );
        }
    }
}
