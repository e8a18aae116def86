//! The serving trace behind `metrale bench --serve --request-rate R1,R2,...`, in the manner of
//! vLLM's `benchmark_serving`: for each arrival rate, `num_requests` requests arrive as a Poisson
//! process in wall time at one [`Scheduler`] over a random-weight model of a real shape, each with
//! a prompt and an output length drawn uniformly from their ranges; each generates its drawn
//! number of greedy tokens (EOS ignored). Reported per rate: completed requests, the run's
//! duration, requests and output tokens per second, and the p50 / p90 / p99 of the time to first
//! token (TTFT), the inter-token latency (ITL) and the end-to-end latency (E2E).
//!
//! How: the trace (arrival times, lengths, prompt tokens) is drawn before the run from the
//! engine's SplitMix64 (`sampling::Rng`) seeded with `TraceOptions::seed`. Gaps between
//! arrivals are exponential with mean `1 / rate` (the first request arrives at t = 0); every
//! rate draws the same unit-rate gaps and scales them by `1 / rate`, so the rates of one report
//! run the same requests, only closer together or further apart (`inf` submits them all at
//! t = 0). The driver loop, before each `Scheduler::step`, submits every request whose arrival
//! time has passed; when the scheduler is idle and the next arrival is in the future it sleeps
//! until then. Each token is stamped with the wall time at which the step that produced it
//! returned.
//!
//! Figures: a request's TTFT is its first token's time minus its arrival time (queueing,
//! prefill and the first token, as a client sees them); its ITL samples are the gaps between its
//! consecutive tokens; its E2E is its last token's time minus its arrival time. The duration
//! runs from t = 0 (the first arrival) to the last token of the rate's run. Percentiles are
//! over all requests (TTFT, E2E) or all ITL samples of all requests, by linear interpolation
//! ([`percentile`]).
//!
//! Invariants:
//! - Every request generates exactly its drawn output length (checked): `output_tokens` token
//!   events, so a request contributes `output_tokens - 1` ITL samples.
//! - The same options (seed included) give the same trace: arrival times, lengths and prompt
//!   tokens ([`trace_requests`]).
//! - The model is built once; every rate's run (and the untimed warm-up ahead of the first)
//!   starts from an idle scheduler with an empty prefix cache and ends with every KV block and
//!   SSM slot free (checked).
//! - Times are host wall times: `Scheduler::step` returns once the step's tokens are on the
//!   host, which is when a client of the engine could see them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrale_config::ModelConfig;
use metrale_gpu_runtime::GpuBackend;

use super::serve::{bench_request, bench_scheduler, check_all_freed};
use crate::error::ModelError;
use crate::options::ModelOptions;
use crate::sampling::Rng;
use crate::scheduler::{Scheduler, SeqEvent, SeqId};

/// An inclusive range of token counts; each request draws its count uniformly from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRange {
    /// Fewest tokens.
    pub min: usize,
    /// Most tokens (`min` for a fixed count).
    pub max: usize,
}

impl TokenRange {
    /// Every request gets `n` tokens.
    pub fn fixed(n: usize) -> TokenRange {
        TokenRange { min: n, max: n }
    }
}

/// What the serving trace runs.
#[derive(Debug, Clone)]
pub struct TraceOptions {
    /// The model shape.
    pub config: ModelConfig,
    /// Arrival rates, requests per second, one run each; `f64::INFINITY` submits every request
    /// at t = 0. Default 4, 16.
    pub request_rates: Vec<f64>,
    /// Requests of each rate's run. Default 200.
    pub num_requests: usize,
    /// Prompt tokens of a request. Default 128 (fixed).
    pub prompt_tokens: TokenRange,
    /// Tokens a request generates. Default 512 (fixed).
    pub output_tokens: TokenRange,
    /// Seed of the trace: arrival gaps, lengths and prompt tokens. Default 0.
    pub seed: u64,
    /// Most sequences the scheduler runs at once (the engine's `max_decode_seqs`); requests
    /// past it wait in the scheduler's queue, their wait counted in their TTFT. Default 128.
    pub max_decode_seqs: usize,
    /// Most tokens one step processes (the engine's `max_batch_tokens`). Default 512, the
    /// engine's default.
    pub max_batch_tokens: usize,
    /// Run an untimed warm-up ahead of the first rate: `max_decode_seqs` requests (at most
    /// `num_requests`) submitted at once, each of the fewest prompt and the most output tokens.
    /// The scheduler admits one sequence a step, so the decode width climbs one by one up to
    /// that count and comes down as they finish, and the decode graph of each width (captured
    /// the first time it runs) exists before any timing. Default true.
    pub warmup: bool,
}

impl TraceOptions {
    /// Defaults for `config`.
    pub fn new(config: ModelConfig) -> TraceOptions {
        TraceOptions {
            config,
            request_rates: vec![4.0, 16.0],
            num_requests: 200,
            prompt_tokens: TokenRange::fixed(128),
            output_tokens: TokenRange::fixed(512),
            seed: 0,
            max_decode_seqs: 128,
            max_batch_tokens: ModelOptions::default().max_batch_tokens,
            warmup: true,
        }
    }
}

/// One request of a trace, as drawn before the run.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// When it arrives, s after the first arrival.
    pub arrival_s: f64,
    /// Its prompt.
    pub prompt: Vec<u32>,
    /// Tokens it generates.
    pub output_tokens: usize,
}

/// What one request of a run saw.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestTiming {
    /// When it arrived, s after the first arrival.
    pub arrival_s: f64,
    /// Its prompt's tokens.
    pub prompt_tokens: usize,
    /// When each of its tokens came back, in order, s after the first arrival.
    pub token_s: Vec<f64>,
}

impl RequestTiming {
    /// Arrival to first token, s (NaN without tokens).
    pub fn ttft_s(&self) -> f64 {
        self.token_s
            .first()
            .map_or(f64::NAN, |t| t - self.arrival_s)
    }

    /// Arrival to last token, s (NaN without tokens).
    pub fn e2e_s(&self) -> f64 {
        self.token_s.last().map_or(f64::NAN, |t| t - self.arrival_s)
    }

    /// The gaps between consecutive tokens, s: one fewer than the tokens.
    pub fn itl_s(&self) -> impl Iterator<Item = f64> + '_ {
        self.token_s.windows(2).map(|w| w[1] - w[0])
    }
}

/// The p50, p90 and p99 of a set of latencies, ms (NaN for an empty set).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    /// Median, ms.
    pub p50_ms: f64,
    /// 90th percentile, ms.
    pub p90_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
}

impl Percentiles {
    /// The percentiles of `seconds` (any order), in ms.
    pub fn of_seconds(seconds: &[f64]) -> Percentiles {
        let mut ms: Vec<f64> = seconds.iter().map(|s| s * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        Percentiles {
            p50_ms: percentile(&ms, 50.0),
            p90_ms: percentile(&ms, 90.0),
            p99_ms: percentile(&ms, 99.0),
        }
    }
}

/// The `p`-th percentile (0 to 100) of `sorted` (ascending) by linear interpolation between the
/// closest ranks, as numpy's default (and vLLM's `benchmark_serving`): the value at fractional
/// index `p / 100 * (n - 1)`. NaN for an empty slice.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let Some(&last) = sorted.last() else {
        return f64::NAN;
    };
    let rank = (p / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, frac) = (rank.floor() as usize, rank.fract());
    match sorted.get(lo + 1) {
        Some(&hi) => sorted[lo] + (hi - sorted[lo]) * frac,
        None => last,
    }
}

/// One arrival rate's run.
#[derive(Debug, Clone, PartialEq)]
pub struct TracePoint {
    /// Arrival rate, requests per second (`inf`: all at once).
    pub request_rate: f64,
    /// Requests that ran to their last token (all of them, or the run fails).
    pub completed: usize,
    /// From the first arrival to the last token, s.
    pub duration_s: f64,
    /// `completed` over `duration_s`.
    pub req_s: f64,
    /// Output tokens of all requests.
    pub output_tokens: usize,
    /// `output_tokens` over `duration_s`.
    pub out_tok_s: f64,
    /// Steps the scheduler ran.
    pub steps: usize,
    /// Arrival to first token.
    pub ttft: Percentiles,
    /// Gaps between consecutive tokens of a request, over all requests.
    pub itl: Percentiles,
    /// ITL samples: the sum over requests of `output_tokens - 1`.
    pub itl_samples: usize,
    /// Arrival to last token.
    pub e2e: Percentiles,
    /// Every request, in arrival order.
    pub requests: Vec<RequestTiming>,
}

/// The whole trace benchmark.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceReport {
    /// Backend name.
    pub backend: String,
    /// Requests of each rate's run.
    pub num_requests: usize,
    /// Prompt tokens' range.
    pub prompt_tokens: TokenRange,
    /// Output tokens' range.
    pub output_tokens: TokenRange,
    /// The trace's seed.
    pub seed: u64,
    /// Most sequences the scheduler ran at once.
    pub max_decode_seqs: usize,
    /// One run per rate, in the order run.
    pub points: Vec<TracePoint>,
}

/// A token count uniform in `range` (the modulo bias is below 2^-40 for the counts used here).
fn draw_tokens(rng: &mut Rng, range: TokenRange) -> usize {
    range.min + (rng.next_u64() % (range.max - range.min + 1) as u64) as usize
}

/// Exponential with mean 1: `-ln(1 - u)`, `1 - u` in (0, 1].
fn draw_exponential(rng: &mut Rng) -> f64 {
    -(1.0 - rng.next_f64()).ln()
}

/// Check `opts` before anything is built.
fn check_options(opts: &TraceOptions) -> Result<(), ModelError> {
    let bad = |option, problem: String| Err(ModelError::Options { option, problem });
    if opts.request_rates.is_empty() {
        return bad("request_rates", "no arrival rate".into());
    }
    if let Some(r) = opts.request_rates.iter().find(|r| r.is_nan() || **r <= 0.0) {
        return bad(
            "request_rates",
            format!("{r}: a rate is requests per second, above 0 (inf: all at once)"),
        );
    }
    if opts.num_requests == 0 {
        return bad("num_requests", "no request".into());
    }
    for (option, r) in [
        ("prompt_tokens", opts.prompt_tokens),
        ("output_tokens", opts.output_tokens),
    ] {
        if r.min == 0 || r.min > r.max {
            return bad(
                option,
                format!(
                    "{}..={}: the range must be at least 1 token and min <= max",
                    r.min, r.max
                ),
            );
        }
    }
    if opts.max_decode_seqs == 0 {
        return bad("max_decode_seqs", "0 sequences".into());
    }
    Ok(())
}

/// The trace `opts` runs at `rate`: `num_requests` requests in arrival order, the same for the
/// same options (see the module header).
pub fn trace_requests(opts: &TraceOptions, rate: f64) -> Vec<TraceRequest> {
    let vocab = opts.config.tokens.vocab_size as u64;
    let mut rng = Rng::new(opts.seed);
    let mut clock = 0.0;
    (0..opts.num_requests)
        .map(|_| {
            let arrival_s = clock / rate;
            clock += draw_exponential(&mut rng);
            let prompt_tokens = draw_tokens(&mut rng, opts.prompt_tokens);
            let output_tokens = draw_tokens(&mut rng, opts.output_tokens);
            let prompt = (0..prompt_tokens)
                .map(|_| (rng.next_u64() % vocab) as u32)
                .collect();
            TraceRequest {
                arrival_s,
                prompt,
                output_tokens,
            }
        })
        .collect()
}

/// What one run measured: every request's timing, and the steps run.
struct TraceRun {
    requests: Vec<RequestTiming>,
    steps: usize,
}

/// Run `requests` through `sched`, each submitted once its arrival time has passed, until the
/// last has finished.
fn run_trace(sched: &mut Scheduler, requests: &[TraceRequest]) -> Result<TraceRun, ModelError> {
    sched.clear_prefix_cache();
    let n = requests.len();
    let mut timings: Vec<RequestTiming> = requests
        .iter()
        .map(|r| RequestTiming {
            arrival_s: r.arrival_s,
            prompt_tokens: r.prompt.len(),
            token_s: Vec::with_capacity(r.output_tokens),
        })
        .collect();
    let mut index: HashMap<SeqId, usize> = HashMap::with_capacity(n);
    let (mut next, mut steps) = (0, 0);
    let start = Instant::now();
    loop {
        let now = start.elapsed().as_secs_f64();
        while let Some(r) = requests.get(next).filter(|r| r.arrival_s <= now) {
            let id = sched
                .add(bench_request(r.prompt.clone(), r.output_tokens, true))
                .map_err(|e| ModelError::Step(format!("trace bench request refused: {e}")))?;
            index.insert(id, next);
            next += 1;
        }
        if sched.is_idle() {
            let Some(r) = requests.get(next) else { break };
            std::thread::sleep(Duration::from_secs_f64((r.arrival_s - now).max(0.0)));
            continue;
        }
        let report = sched.step().map_err(|f| *f.error)?;
        let t = start.elapsed().as_secs_f64();
        steps += 1;
        for e in report.events {
            if let SeqEvent::Token { id, .. } = e
                && let Some(&i) = index.get(&id)
            {
                timings[i].token_s.push(t);
            }
        }
    }
    check_all_freed(sched, "trace bench")?;
    for (i, (r, t)) in requests.iter().zip(&timings).enumerate() {
        if t.token_s.len() != r.output_tokens {
            return Err(ModelError::Step(format!(
                "trace bench: request {i} generated {} tokens, not its {}",
                t.token_s.len(),
                r.output_tokens
            )));
        }
    }
    Ok(TraceRun {
        requests: timings,
        steps,
    })
}

/// The figures of one rate's run.
fn trace_point(request_rate: f64, run: TraceRun) -> TracePoint {
    let requests = run.requests;
    let duration_s = requests
        .iter()
        .filter_map(|r| r.token_s.last().copied())
        .fold(0.0, f64::max);
    let output_tokens: usize = requests.iter().map(|r| r.token_s.len()).sum();
    let ttft: Vec<f64> = requests.iter().map(RequestTiming::ttft_s).collect();
    let e2e: Vec<f64> = requests.iter().map(RequestTiming::e2e_s).collect();
    let itl: Vec<f64> = requests.iter().flat_map(RequestTiming::itl_s).collect();
    TracePoint {
        request_rate,
        completed: requests.len(),
        duration_s,
        req_s: requests.len() as f64 / duration_s,
        output_tokens,
        out_tok_s: output_tokens as f64 / duration_s,
        steps: run.steps,
        ttft: Percentiles::of_seconds(&ttft),
        itl: Percentiles::of_seconds(&itl),
        itl_samples: itl.len(),
        e2e: Percentiles::of_seconds(&e2e),
        requests,
    }
}

/// Run the serving trace on `gpu`, one run per rate of `opts.request_rates`.
pub fn serve_trace(
    gpu: Arc<dyn GpuBackend>,
    opts: &TraceOptions,
) -> Result<TraceReport, ModelError> {
    check_options(opts)?;
    let seq_len = opts.prompt_tokens.max + opts.output_tokens.max + 1;
    let mut sched = bench_scheduler(
        &opts.config,
        &gpu,
        opts.max_decode_seqs,
        seq_len,
        opts.max_batch_tokens,
    )?;
    if opts.warmup {
        let mut warm = opts.clone();
        warm.num_requests = opts.max_decode_seqs.min(opts.num_requests);
        warm.prompt_tokens = TokenRange::fixed(opts.prompt_tokens.min);
        warm.output_tokens = TokenRange::fixed(opts.output_tokens.max);
        run_trace(&mut sched, &trace_requests(&warm, f64::INFINITY))?;
    }
    let mut points = Vec::with_capacity(opts.request_rates.len());
    for &rate in &opts.request_rates {
        let run = run_trace(&mut sched, &trace_requests(opts, rate))?;
        points.push(trace_point(rate, run));
    }
    Ok(TraceReport {
        backend: gpu.name().to_string(),
        num_requests: opts.num_requests,
        prompt_tokens: opts.prompt_tokens,
        output_tokens: opts.output_tokens,
        seed: opts.seed,
        max_decode_seqs: opts.max_decode_seqs,
        points,
    })
}

impl TraceReport {
    /// The human-readable table: one row per rate.
    pub fn table(&self) -> String {
        let range = |r: TokenRange| match r.min == r.max {
            true => r.min.to_string(),
            false => format!("{}..={}", r.min, r.max),
        };
        let mut s = format!(
            "backend {}: serving trace, {} requests per rate (Poisson arrivals, seed {}), prompt {} + output {} tokens, at most {} sequences at once\n",
            self.backend,
            self.num_requests,
            self.seed,
            range(self.prompt_tokens),
            range(self.output_tokens),
            self.max_decode_seqs
        );
        s += "trace    rate  done  dur. s   req/s  out tok/s |  TTFT ms p50     p90     p99 |   ITL ms p50     p90     p99 |   E2E ms p50      p90      p99\n";
        for p in &self.points {
            s += &format!(
                "      {:>6.2} {:>5} {:>7.2} {:>7.2} {:>10.1} | {:>11.2} {:>7.2} {:>7.2} | {:>11.2} {:>7.2} {:>7.2} | {:>11.1} {:>8.1} {:>8.1}\n",
                p.request_rate,
                p.completed,
                p.duration_s,
                p.req_s,
                p.out_tok_s,
                p.ttft.p50_ms,
                p.ttft.p90_ms,
                p.ttft.p99_ms,
                p.itl.p50_ms,
                p.itl.p90_ms,
                p.itl.p99_ms,
                p.e2e.p50_ms,
                p.e2e.p90_ms,
                p.e2e.p99_ms
            );
        }
        s
    }
}

#[cfg(test)]
mod tests;
