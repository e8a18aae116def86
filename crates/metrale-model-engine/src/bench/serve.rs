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
//! Invariants:
//! - Step times are host wall times around `Scheduler::step`, which returns only after the
//!   step's tokens are on the host: what a client of the engine waits for, host work included.
//! - The model is built once for the largest rung; every rung starts from an idle scheduler
//!   whose blocks and slots are all free (checked).

use std::sync::Arc;
use std::time::Instant;

use metrale_config::ModelConfig;
use metrale_gpu_runtime::GpuBackend;

use super::{copy_bandwidth, kv_bytes_per_token, median, ssm_bytes_per_seq, weight_bytes};
use crate::error::ModelError;
use crate::factory;
use crate::generate::GenerateParams;
use crate::options::{ModelOptions, Quantization};
use crate::sampling::SamplingParams;
use crate::scheduler::{Scheduler, SeqRequest, StepKind};

/// Timed copies behind the bandwidth the floors use (the median is taken).
const COPY_ITERS: usize = 10;

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
    /// Bytes such a step must move at the mean context (see the module header).
    pub step_bytes: f64,
    /// `step_bytes` over the measured copy bandwidth, ms.
    pub floor_ms: f64,
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
    /// The rungs, in the order run.
    pub points: Vec<ServePoint>,
}

/// Run the serving ladder on `gpu`.
pub fn serve_ladder(
    gpu: Arc<dyn GpuBackend>,
    opts: &ServeOptions,
) -> Result<ServeReport, ModelError> {
    let c = &opts.config;
    let copy_gb_s = copy_bandwidth(&gpu, opts.copy_bytes, COPY_ITERS)?;

    let max_c = opts.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let seq_len = opts.prompt_tokens + opts.output_tokens + 1;
    let block_size = ModelOptions::default().block_size;
    // Every sequence's whole context, plus the admission headroom of one block per sequence.
    let blocks = max_c * (seq_len.div_ceil(block_size) + 1) + 2;
    let options = ModelOptions::default()
        .max_batch_tokens(opts.max_batch_tokens)
        .max_seq_len(Some(seq_len))
        .num_kv_blocks(Some(blocks))
        .max_decode_seqs(max_c);
    let model = factory::random(c.clone(), gpu.clone(), 0x5eed)?;
    let weights = weight_bytes(c, Quantization::AsStored);
    let per_seq = (opts.prompt_tokens as f64 + opts.output_tokens as f64 / 2.0)
        * kv_bytes_per_token(c)
        + ssm_bytes_per_seq(c);
    let mut sched = Scheduler::new(model, options)?;
    let mut points = Vec::with_capacity(opts.concurrency.len());
    for (rung, &n) in opts.concurrency.iter().enumerate() {
        for i in 0..n {
            let prompt = (0..opts.prompt_tokens)
                .map(|p| ((rung * 7919 + i * 104_729 + p * 31) % c.tokens.vocab_size) as u32)
                .collect();
            let req = SeqRequest {
                prompt,
                params: GenerateParams {
                    max_new_tokens: opts.output_tokens,
                    sampling: SamplingParams::default(),
                    stop_token_ids: Vec::new(),
                    return_logits: false,
                },
                ignore_eos: true,
            };
            sched
                .add(req)
                .map_err(|e| ModelError::Step(format!("serve bench request refused: {e}")))?;
        }
        let (mut steps, mut full, mut tokens) = (0, Vec::new(), 0usize);
        let start = Instant::now();
        while !sched.is_idle() {
            let t = Instant::now();
            let report = sched.step().map_err(|f| *f.error)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            steps += 1;
            if report.kind == (StepKind::Decode { seqs: n }) {
                full.push(ms);
            }
            tokens += report
                .events
                .iter()
                .filter(|e| matches!(e, crate::scheduler::SeqEvent::Token { .. }))
                .count();
        }
        let wall_s = start.elapsed().as_secs_f64();
        let used = sched.stats().cache;
        if used.kv_blocks_used != 0 || used.ssm_slots_used != 0 {
            return Err(ModelError::Step(format!(
                "serve bench: {} KV blocks and {} SSM slots still held after rung {n}",
                used.kv_blocks_used, used.ssm_slots_used
            )));
        }
        let step_bytes = weights + n as f64 * per_seq;
        points.push(ServePoint {
            concurrency: n,
            wall_s,
            tok_s: tokens as f64 / wall_s,
            steps,
            full_steps: full.len(),
            step_ms: if full.is_empty() {
                f64::NAN
            } else {
                median(full)
            },
            step_bytes,
            floor_ms: step_bytes / (copy_gb_s * 1e9) * 1e3,
        });
    }
    Ok(ServeReport {
        backend: gpu.name().to_string(),
        copy_gb_s,
        weight_bytes: weights,
        prompt_tokens: opts.prompt_tokens,
        output_tokens: opts.output_tokens,
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
        s += "serve  conc.   tok/s   wall s   ms/step   floor ms   x floor   full steps\n";
        for p in &self.points {
            s += &format!(
                "       {:>5} {:>7.0} {:>8.2} {:>9.3} {:>10.3} {:>9.2} {:>6}/{}\n",
                p.concurrency,
                p.tok_s,
                p.wall_s,
                p.step_ms,
                p.floor_ms,
                p.step_ms / p.floor_ms,
                p.full_steps,
                p.steps
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_gpu_runtime::CpuBackend;

    #[test]
    fn the_ladder_runs_every_request_to_its_last_token_and_frees_everything() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new(Default::default()));
        let mut o = ServeOptions::new(super::super::tiny_hybrid_for_cpu().unwrap());
        o.concurrency = vec![1, 3];
        o.prompt_tokens = 5;
        o.output_tokens = 4;
        o.copy_bytes = 1 << 16;
        let r = serve_ladder(gpu, &o).unwrap();
        assert_eq!(r.points.len(), 2);
        for p in &r.points {
            // Every request produced all its tokens; the last decode steps ran all of them.
            assert!((p.tok_s * p.wall_s - (p.concurrency * 4) as f64).abs() < 1e-6);
            assert!(p.full_steps >= 1, "{p:?}");
            assert!(p.step_ms > 0.0 && p.floor_ms > 0.0, "{p:?}");
        }
        assert!(r.points[1].step_bytes > r.points[0].step_bytes);
        assert!(r.table().contains("serving ladder"));
    }
}
