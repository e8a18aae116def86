//! The benchmark behind `metrale bench` and `cargo xtask bench`: a random-weight model of a real
//! shape built on the device (no checkpoint), the device's two ceilings measured in the same run
//! (copy bandwidth; bf16 GEMM rate, the vendor library's where the backend has one, beside our
//! own `linear`'s, and with FP8 weights the FP8 rates too: the vendor's e4m3 GEMM, the FP8
//! prefill's ceiling, beside our `linear` of a block-FP8 weight), then prefill throughput and decode step time, each printed beside its
//! roofline, and a kernel-by-kernel breakdown of decode steps (`breakdown`); the serving ladder
//! (`serve`), the serving trace (`trace`), what a long prompt arriving does to decoding streams
//! (`interference`), the speculative-decoding figures (`speculative`) and decode steps of a
//! model sharded over a tensor-parallel group (`tensor_parallel`).
//!
//! Invariants:
//! - Every timing is taken with device events after warm-up, as the median of several runs.
//! - A roofline is the work of the step over a ceiling measured in this run: bytes over the copy
//!   bandwidth, FLOPs over the GEMM rate.

mod breakdown;
mod ceilings;
mod interference;
mod profile;
mod serve;
mod shapes;
mod speculative;
mod table;
mod tensor_parallel;
mod trace;
mod work;

use std::sync::Arc;

use metrale_cache::{BlockTable, CacheManager};
use metrale_config::ModelConfig;
use metrale_gpu_runtime::{GpuBackend, StreamHandle};

pub use self::breakdown::{Breakdown, StepPart, decode_breakdown};
pub use self::interference::{
    InterferenceOptions, InterferencePoint, InterferenceReport, InterferenceRun, SLOWEST_STEPS,
    WindowStep, interference,
};
pub use self::profile::{launch_profile, step_profile};
pub use self::serve::{
    ConstrainedRun, JsonSchemaCompiler, ServeOptions, ServePoint, ServeReport, ServeSpeculation,
    SpeculativeRun, serve_ladder, serve_schema,
};
pub use self::shapes::{
    decode_staging_shapes_for_cpu, qwen3_5_9b, qwen3_5_35b_a3b, qwen3_8b, qwen3_32b,
    qwen3_next_80b_a3b, tiny_for_cpu, tiny_hybrid_for_cpu, tiny_moe_for_cpu,
    tiny_qwen3_vocab_for_cpu,
};
pub use self::speculative::{
    ACCEPTANCE_LENGTHS, EndToEnd, SpecBenchOptions, SpecReport, VerifyFigure, speculative_bench,
};
pub use self::tensor_parallel::{
    StepCollectives, TpBenchOptions, TpDecodeFigure, TpReport, tensor_parallel_bench,
    tensor_parallel_smoke,
};
pub use self::trace::{
    Percentiles, RequestTiming, TokenRange, TraceOptions, TracePoint, TraceReport, TraceRequest,
    percentile, serve_trace, trace_requests,
};

pub use self::ceilings::{Ceilings, Fp8Rates, ceilings, copy_bandwidth};
#[cfg(test)]
use self::work::experts_read;
use self::work::{
    attention_params, decode_weight_bytes, kv_bytes_per_token, matmul_params, ssm_bytes_per_seq,
    weight_bytes,
};

use crate::error::ModelError;
use crate::factory;
use crate::options::{KvCacheDtype, ModelOptions, Quantization};
use crate::runner::{ForwardSelect, Fusions, ModelCircuit, StepInput, StepRow, StepRunner};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The model shape.
    pub config: ModelConfig,
    /// Tokens of the prefill measurement. Default 2048.
    pub prefill_tokens: usize,
    /// Decode batch sizes. Default 1, 8, 32, 64, 128.
    pub decode_batches: Vec<usize>,
    /// Context length of every decoding sequence. Default 1024.
    pub context: usize,
    /// Timed repetitions per figure (the median is reported). Default 10.
    pub iters: usize,
    /// Bytes of each buffer of the copy-bandwidth measurement. Default 1 GiB.
    pub copy_bytes: usize,
    /// M = N = K of the GEMM-rate measurement. Default 8192.
    pub gemm_dim: usize,
    /// Decode batches broken down kernel by kernel (dense shapes only). Default 1 and 32.
    pub breakdown_batches: Vec<usize>,
    /// The forwards whose decode steps are timed, each at every batch. Default `legacy` and
    /// `circuit`.
    pub forwards: Vec<ForwardSelect>,
    /// Time the prefill launch by launch as well ([`launch_profile`]). Default true.
    pub prefill_profile: bool,
    /// How the random model's projections are stored (`Fp8`: quantized at load, and the
    /// floors count one byte a weight plus the scales). Default [`Quantization::AsStored`]
    /// (bf16).
    pub quantization: Quantization,
    /// How the decode measurement's KV cache stores keys and values (the floors count its
    /// bytes a token). Default [`KvCacheDtype::Auto`] (bf16 for the random models).
    pub kv_cache_dtype: KvCacheDtype,
    /// `ModelOptions::prompt_attention` for the prefill measurement (its rows are a prompt's).
    /// Default false.
    pub prompt_attention: bool,
}

impl BenchOptions {
    /// Defaults for `config`.
    pub fn new(config: ModelConfig) -> BenchOptions {
        BenchOptions {
            config,
            prefill_tokens: 2048,
            decode_batches: vec![1, 8, 32, 64, 128],
            context: 1024,
            iters: 10,
            copy_bytes: 1 << 30,
            gemm_dim: 8192,
            breakdown_batches: vec![1, 32],
            prefill_profile: true,
            quantization: Quantization::AsStored,
            kv_cache_dtype: KvCacheDtype::Auto,
            prompt_attention: false,
            forwards: vec![
                ForwardSelect::Legacy,
                ForwardSelect::Circuit {
                    fusions: Fusions::All,
                },
            ],
        }
    }
}

/// One decode figure.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeFigure {
    /// The forward that ran the step (`legacy`, `circuit`, `circuit-reference`).
    pub forward: &'static str,
    /// Kernel launches of a single-sequence step under that forward.
    pub launches: usize,
    /// Sequences in the step.
    pub batch: usize,
    /// Median step time, ms.
    pub ms: f64,
    /// Bytes the step must move (weights once, plus every sequence's KV).
    pub bytes: f64,
    /// `bytes` over the measured copy bandwidth, ms.
    pub floor_ms: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchReport {
    /// Backend name.
    pub backend: String,
    /// Device-to-device copy bandwidth (read + write), GB/s.
    pub copy_gb_s: f64,
    /// bf16 GEMM rate of the engine's own `linear`, TFLOP/s.
    pub gemm_tflop_s: f64,
    /// bf16 GEMM rate of the vendor library (cuBLASLt), TFLOP/s: the device's ceiling; `None`
    /// where the backend has no such library.
    pub vendor_gemm_tflop_s: Option<f64>,
    /// The FP8 GEMM rates, measured in runs with FP8 weights.
    pub fp8_gemm: Option<Fp8Rates>,
    /// Prefill tokens.
    pub prefill_tokens: usize,
    /// Median prefill time, ms.
    pub prefill_ms: f64,
    /// Prefill FLOPs over the device's GEMM rate (with FP8 weights the vendor's FP8 rate where
    /// it ran; else the vendor library's bf16 rate, else ours), ms.
    pub prefill_floor_ms: f64,
    /// Decode figures by batch.
    pub decode: Vec<DecodeFigure>,
    /// Weight bytes of the model.
    pub weight_bytes: f64,
    /// Decode steps kernel by kernel.
    pub breakdowns: Vec<Breakdown>,
    /// Real decode steps (the first forward's) launch by launch at the breakdown batches
    /// ([`step_profile`]), any family.
    pub profiles: Vec<Breakdown>,
    /// The prefill launch by launch (`context` is its token count), when
    /// [`BenchOptions::prefill_profile`] asked for it.
    pub prefill_profile: Option<Breakdown>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median time (of `iters`, ms) of a decode step of `batch` sequences, each with `context`
/// tokens cached, on `runner`'s device (rank 0's, whose events bracket a sharded step: its
/// collectives wait for every other rank); `held` runs while the sequences still hold their KV
/// blocks and SSM slots, which are released afterwards.
pub(crate) fn time_decode(
    runner: &mut StepRunner,
    cache: &mut CacheManager,
    (batch, context, iters): (usize, usize, usize),
    held: impl FnOnce(&mut StepRunner) -> Result<(), ModelError>,
) -> Result<f64, ModelError> {
    let gpu = runner.model().gpu().clone();
    let vocab = runner.model().config().tokens.vocab_size;
    let mut tables = Vec::with_capacity(batch);
    let mut slots = Vec::with_capacity(batch);
    for _ in 0..batch {
        let mut t = BlockTable::new();
        cache.ensure(&mut t, context + 1)?;
        tables.push(t);
        slots.extend(cache.alloc_ssm_slot(None)?);
    }
    let refs: Vec<&BlockTable> = tables.iter().collect();
    let rows: Vec<StepRow> = (0..batch)
        .map(|i| StepRow {
            token: (i * 13 % vocab) as u32,
            position: context as u32,
            seq: i as u32,
        })
        .collect();
    let ms = time_ms(gpu.as_ref(), gpu.default_stream(), iters, || {
        runner.decode(cache, &rows, &refs, &slots)
    })?;
    held(runner)?;
    for &slot in &slots {
        cache.free_ssm_slot(slot)?;
    }
    for mut t in tables {
        cache.release(&mut t)?;
    }
    Ok(ms)
}

/// Time `f` with device events: warm-up twice, then the median of `iters` runs, ms.
fn time_ms(
    gpu: &dyn GpuBackend,
    s: StreamHandle,
    iters: usize,
    mut f: impl FnMut() -> Result<(), ModelError>,
) -> Result<f64, ModelError> {
    let (a, b) = (gpu.create_event()?, gpu.create_event()?);
    for _ in 0..2 {
        f()?;
    }
    gpu.synchronize(s)?;
    let mut runs = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        gpu.record_event(a, s)?;
        f()?;
        gpu.record_event(b, s)?;
        gpu.synchronize(s)?;
        runs.push(gpu.event_elapsed_ms(a, b)? as f64);
    }
    Ok(median(runs))
}

/// Run the whole benchmark on `gpu`.
pub fn run(gpu: Arc<dyn GpuBackend>, opts: &BenchOptions) -> Result<BenchReport, ModelError> {
    let ceil = ceilings(&gpu, opts)?;
    let device_tflop_s = (ceil.fp8.as_ref().and_then(|f| f.vendor_tflop_s))
        .or(ceil.vendor_gemm_tflop_s)
        .unwrap_or(ceil.gemm_tflop_s);
    let c = &opts.config;
    let max_batch = opts.decode_batches.iter().copied().max().unwrap_or(1);
    let block_size = 16;
    let blocks_per_seq = (opts.context + 1).div_ceil(block_size);
    let num_kv_blocks = max_batch * blocks_per_seq + opts.prefill_tokens.div_ceil(block_size) + 1;
    // The benchmark drives the runner directly; no scheduler shares prefixes.
    let options = ModelOptions::default()
        .max_batch_tokens(opts.prefill_tokens)
        .max_seq_len(opts.prefill_tokens.max(opts.context + 1))
        .block_size(block_size)
        .num_kv_blocks(num_kv_blocks)
        .max_decode_seqs(max_batch)
        .decode_graphs(true)
        .prefix_caching(false)
        .kv_cache_dtype(opts.kv_cache_dtype)
        .prompt_attention(opts.prompt_attention);
    let model = factory::random_quantized(c.clone(), gpu.clone(), 0x5eed, opts.quantization)?;
    let (mut runner, mut cache) = StepRunner::new(model, options)?;
    let prefill = prefill(&mut runner, &mut cache, opts)?;
    let prefill_flops = 2.0 * matmul_params(c) * opts.prefill_tokens as f64;
    let (decode, profiles) = decode(&mut runner, &mut cache, opts, ceil.copy_gb_s)?;
    drop((runner, cache));
    // The breakdown builds its own bf16 weights: only for bf16 runs.
    let dense = (c.layer_types.iter()).all(|t| *t == metrale_config::LayerType::FullAttention)
        && c.moe.is_none()
        && opts.quantization == Quantization::AsStored;
    let mut breakdowns = Vec::new();
    if dense {
        for &batch in &opts.breakdown_batches {
            breakdowns.push(decode_breakdown(
                &gpu,
                c,
                (batch as u32, opts.context as u32),
                opts.kv_cache_dtype.resolve(c),
                opts.iters,
            )?);
        }
    }
    Ok(BenchReport {
        backend: gpu.name().to_string(),
        copy_gb_s: ceil.copy_gb_s,
        gemm_tflop_s: ceil.gemm_tflop_s,
        vendor_gemm_tflop_s: ceil.vendor_gemm_tflop_s,
        fp8_gemm: ceil.fp8,
        prefill_tokens: opts.prefill_tokens,
        prefill_ms: prefill.0,
        prefill_floor_ms: prefill_flops / (device_tflop_s * 1e12) * 1e3,
        decode,
        weight_bytes: weight_bytes(c, opts.quantization),
        breakdowns,
        profiles,
        prefill_profile: prefill.1,
    })
}

/// One prefill of `prefill_tokens` tokens from position 0, timed, and launch by launch when
/// asked.
fn prefill(
    runner: &mut StepRunner,
    cache: &mut CacheManager,
    opts: &BenchOptions,
) -> Result<(f64, Option<Breakdown>), ModelError> {
    let gpu = runner.model().gpu().clone();
    let s = gpu.default_stream();
    let mut table = BlockTable::new();
    cache.ensure(&mut table, opts.prefill_tokens)?;
    let vocab = opts.config.tokens.vocab_size;
    let rows: Vec<StepRow> = (0..opts.prefill_tokens)
        .map(|p| StepRow {
            token: (p * 7 % vocab) as u32,
            position: p as u32,
            seq: 0,
        })
        .collect();
    let last = [(rows.len() - 1) as u32];
    let slot: Vec<u32> = cache.alloc_ssm_slot(None)?.into_iter().collect();
    let input = StepInput {
        rows: &rows,
        tables: &[&table],
        logit_rows: &last,
        ssm_slots: &slot,
        // A prompt: with `prompt_attention` its rows attend in the prompt arithmetic.
        prompt_until: &[opts.prefill_tokens as u32],
    };
    let ms = time_ms(gpu.as_ref(), s, opts.iters, || {
        runner.forward(cache, &input)
    })?;
    let profile = if opts.prefill_profile {
        let launches = runner.forward_launches(cache, &input)?;
        Some(Breakdown {
            batch: 1,
            context: opts.prefill_tokens as u32,
            parts: launch_profile(gpu.as_ref(), &launches, opts.iters.min(3))?,
        })
    } else {
        None
    };
    for &slot in &slot {
        cache.free_ssm_slot(slot)?;
    }
    cache.release(&mut table)?;
    Ok((ms, profile))
}

/// Decode steps of every batch of `decode_batches` under every forward of `forwards`, each
/// sequence holding `context` tokens, beside their floors at `copy_gb_s`; and the first
/// forward's steps launch by launch at the breakdown batches.
fn decode(
    runner: &mut StepRunner,
    cache: &mut CacheManager,
    opts: &BenchOptions,
    copy_gb_s: f64,
) -> Result<(Vec<DecodeFigure>, Vec<Breakdown>), ModelError> {
    let c = &opts.config;
    let (mut decode, mut profiles) = (Vec::new(), Vec::new());
    for (nth, &forward) in opts.forwards.iter().enumerate() {
        // The forwards that cannot run this model are left out, and say so.
        if let Err(e) = runner.set_forward(forward) {
            tracing::warn!(forward = forward.name(), error = %e, "forward skipped");
            continue;
        }
        let launches = runner.forward_disclosure()?.launches_per_step;
        for &batch in &opts.decode_batches {
            let shape = (batch, opts.context, opts.iters);
            let ms = time_decode(runner, cache, shape, |runner| {
                if nth == 0 && opts.breakdown_batches.contains(&batch) {
                    let width = runner.options().decode_width(batch).unwrap_or(batch);
                    profiles.push(Breakdown {
                        batch: batch as u32,
                        context: opts.context as u32,
                        parts: step_profile(runner, width, opts.iters)?,
                    });
                }
                Ok(())
            })?;
            let kv = opts.kv_cache_dtype.resolve(c);
            let per_seq =
                (opts.context + 1) as f64 * kv_bytes_per_token(c, kv) + ssm_bytes_per_seq(c);
            let bytes = decode_weight_bytes(c, opts.quantization, batch) + batch as f64 * per_seq;
            decode.push(DecodeFigure {
                forward: forward.name(),
                launches,
                batch,
                ms,
                bytes,
                floor_ms: bytes / (copy_gb_s * 1e9) * 1e3,
            });
        }
    }
    Ok((decode, profiles))
}

/// A bench report run on a tiny shape on the CPU backend, used by the tests.
pub fn smoke(gpu: Arc<dyn GpuBackend>, config: ModelConfig) -> Result<BenchReport, ModelError> {
    run(gpu, &smoke_options(config))
}

/// The options of [`smoke`]: a 32-token prefill, decode batches 1 and 3 at context 20, one
/// timed run each, small ceilings, breakdowns at batches 2 and 3.
fn smoke_options(config: ModelConfig) -> BenchOptions {
    let mut o = BenchOptions::new(config);
    o.prefill_tokens = 32;
    o.decode_batches = vec![1, 3];
    o.context = 20;
    o.iters = 1;
    o.copy_bytes = 1 << 16;
    o.gemm_dim = 32;
    o.breakdown_batches = vec![2, 3];
    o
}

#[cfg(test)]
mod tests;
