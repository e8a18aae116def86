//! The serving ladder behind `metrale bench --serve` (`cargo xtask bench --serve`): for each
//! concurrency C of a ladder (1, 2, 4, ... 128 by default), C requests of `prompt_tokens` random
//! prompt tokens each ask for `output_tokens` greedy tokens (EOS ignored), all submitted at once
//! to one [`Scheduler`] over a random-weight model of a real shape; the scheduler runs them to the
//! end exactly as the engine would (chunked prefill under the token budget, decode padded up the
//! ladder, graphs replayed).
//!
//! Reported per rung: the aggregate output tokens per second over the whole run (prefill
//! included), the median wall time of the decode steps that ran all C sequences, and that step's
//! floor: the weights once, plus every sequence's KV entries at the mean context of those steps
//! (`prompt_tokens + output_tokens / 2`) and its SSM state read and written, over the copy
//! bandwidth measured in the same run.
//!
//! Structured output (`ServeOptions::constrained` = K > 0): each rung runs a second time, right
//! after its plain run, with the same prompts, the first `min(K, C)` requests constrained to the
//! JSON schema [`serve_schema`] (compiled by `ServeOptions::schemas`, the facade's llguidance
//! path), and reports that run's median full-step time beside the plain one. The schema is an
//! array of at least `output_tokens` strings (compact layout: items apart by `", "`). Where no
//! token holds that separator whole (no token of the Qwen3 tokenizer does), each separator
//! straddles a token boundary of its own, so a value takes at least `output_tokens` tokens: a
//! constrained request cannot complete its value before its last token, decodes every step of
//! the run, and its output is the start of a valid value. Constrained requests honour EOS, which
//! their grammar allows only once the value is complete (and which ends a request whose
//! constraint fails); the plain requests beside them ignore it, as in the plain run.
//!
//! Speculative decoding (`ServeOptions::speculative`): the model gets an MTP head (a one-layer
//! head where the shape has none, as `metrale bench --speculative` does) and is built for `K`
//! drafts; each rung runs its plain requests with speculation off, then the same requests twice
//! more with speculation behind a fresh `SpeculationGate` (see `serve/speculative.rs`): drafted
//! by an oracle that proposes each request's own tokens from the plain run (every draft right:
//! the most speculation can give), and by the MTP head (random weights: next to no draft right,
//! so the gate should turn speculation off and the run cost about what plain decoding costs).
//! Each speculative run must generate exactly the plain run's tokens (greedy); a difference is
//! an error ([`ModelError::SpeculativeMismatch`]). Every rung of such a ladder starts with no
//! graph captured, as a fresh engine would, so one rung's verify shapes do not use up the bound
//! on speculative graphs (`ModelOptions::max_speculative_graphs`) of the next.
//!
//! Invariants:
//! - Step times are host wall times around `Scheduler::step`, which returns only after the
//!   step's tokens are on the host: what a client of the engine waits for, host work included
//!   (a constrained row's mask is computed on the host while the step's forward runs).
//! - The model is built once for the largest rung; every run starts from an idle scheduler
//!   whose blocks and slots are all free (checked) and an empty prefix cache, so a rung's
//!   constrained run shares nothing with its plain run.
//! - The two runs of a rung differ only in the constraints: the same prompts, greedy picking,
//!   so the unconstrained requests produce the same tokens in both (batch invariance).

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Instant;

use metrale_config::ModelConfig;
use metrale_gpu_runtime::GpuBackend;

use super::{copy_bandwidth, kv_bytes_per_token, median, ssm_bytes_per_seq, weight_bytes};
use crate::constraint::{ConstraintError, TokenConstraint};
use crate::error::ModelError;
use crate::factory;
use crate::generate::GenerateParams;
use crate::options::{ModelOptions, Quantization, Speculative};
use crate::runner::ModelCircuit;
use crate::sampling::SamplingParams;
use crate::scheduler::{Scheduler, SeqEvent, SeqId, SeqRequest, StepKind};

mod speculative;

pub use speculative::{ServeSpeculation, SpeculativeRun};

/// Timed copies behind the bandwidth the floors use (the median is taken).
const COPY_ITERS: usize = 10;

/// The JSON schema of the ladder's constrained requests (see the module header): an array of at
/// least `output_tokens` strings, as JSON text.
pub fn serve_schema(output_tokens: usize) -> String {
    format!(
        r#"{{"type": "array", "items": {{"type": "string"}}, "minItems": {}}}"#,
        output_tokens.max(1)
    )
}

/// What compiles a JSON schema into a request's constraint over a tokenizer's vocabulary: the
/// facade's llguidance compiler (`metrale::bench::SchemaCompiler`), the one the engine compiles
/// requests' schemas with. It lives above this crate, which has no tokenizer.
pub trait JsonSchemaCompiler: Send + Sync + Debug {
    /// Tokens of the tokenizer's vocabulary (special tokens included); the ladder refuses a
    /// model whose vocabulary is smaller.
    fn vocab_size(&self) -> usize;
    /// A fresh constraint to `schema` (JSON text) for one request, over a model of `vocab` ids
    /// whose EOS tokens are `eos`. Every call of one ladder passes the same `vocab` and `eos`.
    fn compile(
        &self,
        schema: &str,
        vocab: usize,
        eos: &[u32],
    ) -> Result<Box<dyn TokenConstraint>, ConstraintError>;
}

/// What the serving ladder runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The model shape.
    pub config: ModelConfig,
    /// Concurrency of each rung. Default 1, 2, 4, 8, 16, 32, 64, 128.
    pub concurrency: Vec<usize>,
    /// Prompt tokens of every request. Default 128.
    pub prompt_tokens: usize,
    /// Tokens every request generates. Default 512.
    pub output_tokens: usize,
    /// Most tokens one step processes (the engine's `max_batch_tokens`). Default 512, the
    /// engine's default.
    pub max_batch_tokens: usize,
    /// Bytes of each buffer of the copy-bandwidth measurement. Default 1 GiB.
    pub copy_bytes: usize,
    /// Requests of each rung constrained to [`serve_schema`] in the rung's second, constrained
    /// run (at most the rung's concurrency). Default 0: no constrained run.
    pub constrained: usize,
    /// What compiles the constrained requests' schema; needed when `constrained > 0`, and its
    /// tokenizer's vocabulary must fit the model's. Default `None`.
    pub schemas: Option<Arc<dyn JsonSchemaCompiler>>,
    /// Run each rung again with speculative decoding, an oracle's drafts and then the MTP
    /// head's (see the module header). Default `None`: plain decoding only.
    pub speculative: Option<ServeSpeculation>,
}

impl ServeOptions {
    /// Defaults for `config`.
    pub fn new(config: ModelConfig) -> ServeOptions {
        ServeOptions {
            config,
            concurrency: vec![1, 2, 4, 8, 16, 32, 64, 128],
            prompt_tokens: 128,
            output_tokens: 512,
            max_batch_tokens: ModelOptions::default().max_batch_tokens,
            copy_bytes: 1 << 30,
            constrained: 0,
            schemas: None,
            speculative: None,
        }
    }
}

/// One rung of the ladder.
#[derive(Debug, Clone, PartialEq)]
pub struct ServePoint {
    /// Requests in flight together.
    pub concurrency: usize,
    /// Wall time from submission to the last token, s.
    pub wall_s: f64,
    /// Output tokens over `wall_s`.
    pub tok_s: f64,
    /// Steps the scheduler ran (prefill and decode).
    pub steps: usize,
    /// Decode steps that ran all `concurrency` sequences.
    pub full_steps: usize,
    /// Median wall time of those steps, ms.
    pub step_ms: f64,
    /// Wall time outside those steps (prefill chunks, mixed and narrower decode steps), s.
    pub rest_s: f64,
    /// Bytes such a step must move at the mean context (see the module header).
    pub step_bytes: f64,
    /// `step_bytes` over the measured copy bandwidth, ms.
    pub floor_ms: f64,
    /// The rung's constrained run; `None` without `ServeOptions::constrained`.
    pub constrained: Option<ConstrainedRun>,
    /// The rung's speculative runs (the oracle's, then the MTP head's), each with exactly the
    /// plain run's tokens; empty without `ServeOptions::speculative`.
    pub speculative: Vec<SpeculativeRun>,
}

/// A rung run again with some of its requests constrained to [`serve_schema`].
#[derive(Debug, Clone, PartialEq)]
pub struct ConstrainedRun {
    /// Requests that carried the constraint (the first ones submitted).
    pub requests: usize,
    /// Wall time from submission to the last token, s.
    pub wall_s: f64,
    /// Output tokens over `wall_s`.
    pub tok_s: f64,
    /// Steps the scheduler ran (prefill and decode).
    pub steps: usize,
    /// Decode steps that ran all the rung's sequences, the constrained ones among them.
    pub full_steps: usize,
    /// Median wall time of those steps, ms.
    pub step_ms: f64,
    /// The tokens each constrained request generated, in submission order.
    pub outputs: Vec<Vec<u32>>,
}

impl ServePoint {
    /// The constrained run's step time over the plain run's (1.1: the constrained requests
    /// cost the batch 10 % of its step time); `None` without a constrained run.
    pub fn constrained_ratio(&self) -> Option<f64> {
        self.constrained.as_ref().map(|c| c.step_ms / self.step_ms)
    }

    /// A speculative run's output tokens per second over the plain run's (2.0: twice as
    /// fast).
    pub fn speculative_ratio(&self, run: &SpeculativeRun) -> f64 {
        run.tok_s / self.tok_s
    }
}

/// The whole ladder.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeReport {
    /// Backend name.
    pub backend: String,
    /// Device-to-device copy bandwidth (read + write), GB/s.
    pub copy_gb_s: f64,
    /// Weight bytes of the model.
    pub weight_bytes: f64,
    /// Prompt and output tokens of every request.
    pub prompt_tokens: usize,
    /// See `prompt_tokens`.
    pub output_tokens: usize,
    /// The constrained requests' schema, when the rungs had constrained runs.
    pub schema: Option<String>,
    /// The speculative runs' settings, when the rungs had speculative runs.
    pub speculation: Option<ServeSpeculation>,
    /// The rungs, in the order run.
    pub points: Vec<ServePoint>,
}

/// What one run of a rung measured.
struct RunFigures {
    /// From submission to the last token.
    wall_s: f64,
    tokens: usize,
    steps: usize,
    full_ms: Vec<f64>,
    /// Every request's tokens, in submission order.
    outputs: Vec<Vec<u32>>,
}

impl RunFigures {
    /// Wall time outside the full decode steps, s.
    fn rest_s(&self) -> f64 {
        self.wall_s - self.full_ms.iter().sum::<f64>() / 1e3
    }

    /// Mean wall time of the full decode steps, ms (NaN without one).
    fn step_mean_ms(&self) -> f64 {
        self.full_ms.iter().sum::<f64>() / self.full_ms.len() as f64
    }

    fn step_ms(&self) -> f64 {
        if self.full_ms.is_empty() {
            f64::NAN
        } else {
            median(self.full_ms.clone())
        }
    }
}

/// Check `opts`' constrained settings against the model shape before anything is built.
fn check_constrained(opts: &ServeOptions) -> Result<(), ModelError> {
    if opts.constrained == 0 {
        return Ok(());
    }
    let Some(schemas) = &opts.schemas else {
        return Err(ModelError::Options {
            option: "constrained",
            problem: "constrained requests need a schema compiler (`ServeOptions::schemas`)".into(),
        });
    };
    let (tokenizer, model) = (schemas.vocab_size(), opts.config.tokens.vocab_size);
    if tokenizer > model {
        return Err(ModelError::TokenizerVocab { tokenizer, model });
    }
    Ok(())
}

/// Submit `prompts` (the first `constraints.len()` requests with those constraints) and run
/// the scheduler until it is idle again. The wall time ends at the last token: steps after it
/// (re-prefills of the finished conversations, `ModelOptions::reprefill_answers`) run before
/// the scheduler is idle, but no request waits for them.
fn run_once(
    sched: &mut Scheduler,
    prompts: &[Vec<u32>],
    constraints: Vec<Box<dyn TokenConstraint>>,
    output_tokens: usize,
) -> Result<RunFigures, ModelError> {
    let n = prompts.len();
    let mut constraints = constraints.into_iter();
    let mut ids: Vec<SeqId> = Vec::with_capacity(n);
    sched.clear_prefix_cache();
    for prompt in prompts {
        let constraint = constraints.next();
        // A constrained request's grammar allows EOS only once its value is complete.
        let req = bench_request(prompt.clone(), output_tokens, constraint.is_none());
        let id = sched
            .add_constrained(req, constraint.into_iter().collect())
            .map_err(|e| ModelError::Step(format!("serve bench request refused: {e}")))?;
        ids.push(id);
    }
    let mut outputs = vec![Vec::new(); n];
    let (mut steps, mut full_ms, mut tokens) = (0, Vec::new(), 0usize);
    let start = Instant::now();
    let mut last_token = start;
    while !sched.is_idle() {
        let t = Instant::now();
        let report = sched.step().map_err(|f| *f.error)?;
        let now = Instant::now();
        let ms = (now - t).as_secs_f64() * 1e3;
        steps += 1;
        if report.kind == (StepKind::Decode { seqs: n }) {
            full_ms.push(ms);
        }
        for e in report.events {
            match e {
                SeqEvent::Token { .. } => {
                    tokens += 1;
                    last_token = now;
                }
                SeqEvent::Finished { id, generation } => {
                    if let Some(i) = ids.iter().position(|&c| c == id) {
                        outputs[i] = generation.token_ids;
                    }
                }
            }
        }
    }
    let wall_s = (last_token - start).as_secs_f64();
    check_all_freed(sched, &format!("serve bench rung {n}"))?;
    Ok(RunFigures {
        wall_s,
        tokens,
        steps,
        full_ms,
        outputs,
    })
}

/// A benchmark request: `prompt`, then `output_tokens` greedy tokens, past EOS when
/// `ignore_eos`.
pub(super) fn bench_request(
    prompt: Vec<u32>,
    output_tokens: usize,
    ignore_eos: bool,
) -> SeqRequest {
    SeqRequest {
        prompt,
        params: GenerateParams {
            max_new_tokens: output_tokens,
            sampling: SamplingParams::default(),
            stop_token_ids: Vec::new(),
            return_logits: false,
        },
        ignore_eos,
    }
}

/// Fail unless every KV block and SSM slot of `sched` is free again (`run` names the run in
/// the error).
pub(super) fn check_all_freed(sched: &Scheduler, run: &str) -> Result<(), ModelError> {
    let used = sched.stats().cache;
    if used.kv_blocks_used != 0 || used.ssm_slots_used != 0 {
        return Err(ModelError::Step(format!(
            "{run}: {} KV blocks and {} SSM slots still held at the end",
            used.kv_blocks_used, used.ssm_slots_used
        )));
    }
    Ok(())
}

/// A scheduler over a random-weight model of `config` (seed fixed) that holds `max_seqs`
/// sequences of up to `seq_len` tokens at once, each with its whole context in the KV cache.
pub(super) fn bench_scheduler(
    config: &ModelConfig,
    gpu: &Arc<dyn GpuBackend>,
    max_seqs: usize,
    seq_len: usize,
    max_batch_tokens: usize,
) -> Result<Scheduler, ModelError> {
    let options = bench_model_options(max_seqs, seq_len, max_batch_tokens);
    let model = factory::random(config.clone(), gpu.clone(), 0x5eed)?;
    Scheduler::new(model, options)
}

/// The options of [`bench_scheduler`]'s model.
fn bench_model_options(max_seqs: usize, seq_len: usize, max_batch_tokens: usize) -> ModelOptions {
    let block_size = ModelOptions::default().block_size;
    // Every sequence's whole context, plus the admission headroom of one block per sequence.
    let blocks = max_seqs * (seq_len.div_ceil(block_size) + 1) + 2;
    ModelOptions::default()
        .max_batch_tokens(max_batch_tokens)
        .max_seq_len(Some(seq_len))
        .num_kv_blocks(Some(blocks))
        .max_decode_seqs(max_seqs)
}

/// The ladder's scheduler: [`bench_scheduler`]'s, or with speculation a model with an MTP head
/// (a one-layer one where `config` has none) built for `K` drafts and the speculation's bound
/// on speculative graphs, its sequences `K` tokens longer (a verify step writes the drafts' KV
/// past the last token), under the speculative runs' forward.
fn ladder_scheduler(
    opts: &ServeOptions,
    gpu: &Arc<dyn GpuBackend>,
    max_seqs: usize,
    seq_len: usize,
) -> Result<Scheduler, ModelError> {
    let Some(spec) = &opts.speculative else {
        return bench_scheduler(&opts.config, gpu, max_seqs, seq_len, opts.max_batch_tokens);
    };
    spec.check()?;
    let config = speculative::with_head(&opts.config);
    let k = spec.num_draft_tokens;
    let options = bench_model_options(max_seqs, seq_len + k, opts.max_batch_tokens)
        .speculative(Speculative::Mtp)
        .num_draft_tokens(k)
        .max_speculative_graphs(spec.max_speculative_graphs)
        .speculative_graph_after(spec.speculative_graph_after);
    let model = factory::random(config, gpu.clone(), 0x5eed)?;
    let mut sched = Scheduler::new(model, options)?;
    sched.runner_mut().set_forward(spec.forward)?;
    Ok(sched)
}

/// Run the serving ladder on `gpu`.
pub fn serve_ladder(
    gpu: Arc<dyn GpuBackend>,
    opts: &ServeOptions,
) -> Result<ServeReport, ModelError> {
    let c = &opts.config;
    check_constrained(opts)?;
    let schema = (opts.constrained > 0).then(|| serve_schema(opts.output_tokens));
    let copy_gb_s = copy_bandwidth(&gpu, opts.copy_bytes, COPY_ITERS)?;

    let max_c = opts.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let seq_len = opts.prompt_tokens + opts.output_tokens + 1;
    let mut sched = ladder_scheduler(opts, &gpu, max_c, seq_len)?;
    let weights = weight_bytes(c, Quantization::AsStored);
    let per_seq = (opts.prompt_tokens as f64 + opts.output_tokens as f64 / 2.0)
        * kv_bytes_per_token(c, metrale_cache::KvDtype::Bf16)
        + ssm_bytes_per_seq(c);
    let mut points = Vec::with_capacity(opts.concurrency.len());
    for (rung, &n) in opts.concurrency.iter().enumerate() {
        let prompts: Vec<Vec<u32>> = (0..n)
            .map(|i| {
                (0..opts.prompt_tokens)
                    .map(|p| ((rung * 7919 + i * 104_729 + p * 31) % c.tokens.vocab_size) as u32)
                    .collect()
            })
            .collect();
        if opts.speculative.is_some() {
            // Each rung as a fresh engine: no graph of an earlier rung, plain decoding first.
            sched.runner_mut().clear_graphs()?;
            sched.set_drafter(None)?;
        }
        let plain = run_once(&mut sched, &prompts, Vec::new(), opts.output_tokens)?;
        let constrained = match (&schema, &opts.schemas) {
            (Some(schema), Some(schemas)) => {
                let k = opts.constrained.min(n);
                let constraints = (0..k)
                    .map(|_| schemas.compile(schema, c.tokens.vocab_size, &c.tokens.eos_token_ids))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| ModelError::Options {
                        option: "schemas",
                        problem: e.to_string(),
                    })?;
                let run = run_once(&mut sched, &prompts, constraints, opts.output_tokens)?;
                Some(ConstrainedRun {
                    requests: k,
                    wall_s: run.wall_s,
                    tok_s: run.tokens as f64 / run.wall_s,
                    steps: run.steps,
                    full_steps: run.full_ms.len(),
                    step_ms: run.step_ms(),
                    outputs: run.outputs.into_iter().take(k).collect(),
                })
            }
            _ => None,
        };
        let speculative = match &opts.speculative {
            Some(spec) => speculative::runs(&mut sched, spec, &prompts, &plain.outputs, opts)?,
            None => Vec::new(),
        };
        let step_bytes = weights + n as f64 * per_seq;
        points.push(ServePoint {
            concurrency: n,
            wall_s: plain.wall_s,
            tok_s: plain.tokens as f64 / plain.wall_s,
            steps: plain.steps,
            full_steps: plain.full_ms.len(),
            step_ms: plain.step_ms(),
            rest_s: plain.rest_s(),
            step_bytes,
            floor_ms: step_bytes / (copy_gb_s * 1e9) * 1e3,
            constrained,
            speculative,
        });
    }
    Ok(ServeReport {
        backend: gpu.name().to_string(),
        copy_gb_s,
        weight_bytes: weights,
        prompt_tokens: opts.prompt_tokens,
        output_tokens: opts.output_tokens,
        schema,
        speculation: opts.speculative,
        points,
    })
}

impl ServeReport {
    /// The human-readable table: each rung's step time beside its floor.
    pub fn table(&self) -> String {
        let mut s = format!(
            "backend {}: copy {:.0} GB/s, weights {:.2} GB; serving ladder, prompt {} + output {} tokens per request\n",
            self.backend,
            self.copy_gb_s,
            self.weight_bytes / 1e9,
            self.prompt_tokens,
            self.output_tokens
        );
        s += "serve  conc.   tok/s   wall s   ms/step   floor ms   x floor   full steps   rest s\n";
        for p in &self.points {
            s += &format!(
                "       {:>5} {:>7.0} {:>8.2} {:>9.3} {:>10.3} {:>9.2} {:>6}/{:<5} {:>8.3}\n",
                p.concurrency,
                p.tok_s,
                p.wall_s,
                p.step_ms,
                p.floor_ms,
                p.step_ms / p.floor_ms,
                p.full_steps,
                p.steps,
                p.rest_s
            );
        }
        if let Some(schema) = &self.schema {
            s += &format!(
                "constrained runs: the first requests of each rung under the JSON schema {schema}\n"
            );
            s += "json   conc.  reqs   ms/step   plain ms   x plain   full steps   tokens each\n";
            for p in &self.points {
                let Some(c) = &p.constrained else { continue };
                let lens: Vec<String> = c.outputs.iter().map(|o| o.len().to_string()).collect();
                s += &format!(
                    "       {:>5} {:>5} {:>9.3} {:>10.3} {:>9.3} {:>6}/{:<5} {}\n",
                    p.concurrency,
                    c.requests,
                    c.step_ms,
                    p.step_ms,
                    c.step_ms / p.step_ms,
                    c.full_steps,
                    c.steps,
                    lens.join(",")
                );
            }
        }
        if let Some(spec) = &self.speculation {
            s += &speculative::table(spec, &self.points);
        }
        s
    }
}

#[cfg(test)]
mod tests;
