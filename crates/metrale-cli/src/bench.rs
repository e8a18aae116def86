//! `metrale bench`: a random-weight model of a real shape on the device, its copy bandwidth and
//! GEMM rate, prefill throughput and decode step times, each beside its roofline; `--serve`
//! runs the serving ladder instead (with `--constrained N`, each rung again with N requests
//! under a JSON schema, compiled over `--tokenizer`'s vocabulary), `--serve --request-rate
//! R1,R2` the serving trace (Poisson arrivals at each rate; TTFT, inter-token and end-to-end
//! latency percentiles), `--serve --interference-prompt-tokens P` what one prompt of P tokens
//! arriving does to `--concurrency` streams decoding (their inter-token gaps and the prompt's
//! TTFT, with mixed steps on and off), `--speculative` the speculative-decoding figures (verify
//! and draft steps against a plain decode step, projected and end-to-end tokens/s), `--serve
//! --speculative` the serving ladder with each rung run again speculatively (an oracle's drafts
//! and the MTP head's, behind the speculation gate),
//! `--tensor-parallel-size N` decode steps of the model sharded over N ranks (on CUDA, GPUs
//! `--device` to `--device` + N - 1, through NCCL), each beside its floor per GPU.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use metrale::ForwardSelect;
use metrale::ModelConfig;
use metrale::bench::{self, BenchOptions, SpecBenchOptions};
use metrale::gpu::GpuBackend;

use crate::generate::BackendArg;
use crate::serve::{KvCacheDtypeArg, QuantizationArg};

mod serve;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Shape {
    /// Qwen3-8B: hidden 4096, 36 layers, 32/8 heads, head_dim 128, FFN 12288, vocab 151936.
    Qwen3_8b,
    /// Qwen3.5-9B: hidden 4096; 32 layers, 24 Gated DeltaNet + 8 gated attention; 16/4 heads of
    /// 256; linear heads 16 key / 32 value of 128; FFN 12288; vocab 248320.
    #[value(name = "qwen3.5-9b")]
    Qwen3_5_9b,
    /// Qwen3.5-35B-A3B: hidden 2048; 40 layers, 30 Gated DeltaNet + 10 gated attention; 16/2
    /// heads of 256; linear heads 16 key / 32 value of 128; a sparse-MoE FFN in every layer (256
    /// experts of 512, 8 per token, a shared expert of 512); vocab 248320.
    #[value(name = "qwen3.5-35b-a3b")]
    Qwen3_5_35bA3b,
    /// Qwen3-32B: hidden 5120, 64 layers, 64/8 heads, head_dim 128, FFN 25600, vocab 151936.
    #[value(name = "qwen3-32b")]
    Qwen3_32b,
    /// Qwen3-Next-80B-A3B's dimensions: hidden 2048; 48 layers, 36 Gated DeltaNet + 12 gated
    /// attention; 16/2 heads of 256; linear heads 16 key / 32 value of 128; a sparse-MoE FFN in
    /// every layer (512 experts of 512, 10 per token, a shared expert of 512); vocab 151936.
    #[value(name = "qwen3-next-80b-a3b")]
    Qwen3Next80bA3b,
    /// A tiny dense shape (a smoke test of the benchmark itself).
    Tiny,
    /// A tiny hybrid shape (a smoke test of the hybrid path).
    TinyHybrid,
    /// A tiny hybrid sparse-MoE shape (a smoke test of the expert path).
    TinyMoe,
    /// A tiny dense shape with Qwen3's vocabulary of 151936 (a smoke test of `--serve
    /// --constrained` with the Qwen3 tokenizer).
    TinyQwen3Vocab,
}

/// The Qwen3 tokenizer committed in the repository, relative to its root (where `cargo xtask
/// bench` and the GPU bundle run the CLI).
const FIXTURE_TOKENIZER: &str = "tests/fixtures/qwen3-chat/tokenizer.json.gz";

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The model shape.
    #[arg(long, value_enum, default_value_t = Shape::Qwen3_8b)]
    shape: Shape,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = BackendArg::Cuda)]
    backend: BackendArg,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 8, 32, 64, 128])]
    batches: Vec<usize>,
    /// Context length of each decoding sequence.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Decode batches (of `--batches`) also timed launch by launch, and for dense shapes
    /// kernel by kernel.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 32])]
    breakdown_batches: Vec<usize>,
    /// Prefill tokens.
    #[arg(long, default_value_t = 2048)]
    prefill_tokens: usize,
    /// Timed repetitions per figure.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// The forwards whose decode steps are timed (legacy, circuit, circuit-reference).
    #[arg(
        long,
        value_delimiter = ',',
        default_values_t = vec!["legacy".to_string(), "circuit".to_string()]
    )]
    forwards: Vec<String>,
    /// Write the results as JSON here.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Run the serving ladder instead: requests through the scheduler at each concurrency.
    #[arg(long)]
    serve: bool,
    /// Run the serving trace instead of the ladder (with `--serve`): at each of these arrival
    /// rates (requests/s; `inf`: all at once), `--num-prompts` requests arrive as a Poisson
    /// process; printed: requests and output tokens per second, p50 / p90 / p99 of TTFT,
    /// inter-token and end-to-end latency.
    #[arg(long, value_delimiter = ',', requires = "serve")]
    request_rate: Vec<f64>,
    /// Run the interference scenario instead of the ladder (with `--serve`): at each
    /// `--concurrency`, that many streams (`--prompt-tokens` + `--output-tokens` each) decode,
    /// and once each has a quarter of its tokens a prompt of this many tokens arrives; run with
    /// mixed steps on and off, printed: the streams' median and largest inter-token gap, the
    /// worst largest-to-median ratio of a stream, and the long prompt's TTFT.
    #[arg(long, requires = "serve")]
    interference_prompt_tokens: Option<usize>,
    /// Serving ladder, trace and interference: the engine's `max_batch_tokens` (token budget
    /// of a step).
    #[arg(long, default_value_t = metrale::ModelOptions::default().max_batch_tokens)]
    max_batch_tokens: usize,
    /// Interference: the engine's `mixed_chunk_attention` (query-row by key pairs a mixed
    /// step's prompt chunk may read; default: unbounded).
    #[arg(long)]
    mixed_chunk_attention: Option<usize>,
    /// Interference: the engine's `mixed_step_tokens` (token budget of a mixed step; default:
    /// `--max-batch-tokens`).
    #[arg(long)]
    mixed_step_tokens: Option<usize>,
    /// Interference: the engine's `mixed_step_slowdown_pct` (a mixed step's wall time aimed
    /// at, in percent of a plain decode step's; default: not paced).
    #[arg(long)]
    mixed_step_slowdown_pct: Option<u32>,
    /// Serving trace: requests at each rate.
    #[arg(long, default_value_t = 200)]
    num_prompts: usize,
    /// Serving trace: prompts draw their length uniformly from `--prompt-tokens` to this
    /// (default: `--prompt-tokens`, a fixed length).
    #[arg(long)]
    prompt_tokens_max: Option<usize>,
    /// Serving trace: requests draw their output length uniformly from `--output-tokens` to
    /// this (default: `--output-tokens`, a fixed length).
    #[arg(long)]
    output_tokens_max: Option<usize>,
    /// Serving trace: seed of the arrival gaps, lengths and prompt tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Serving trace: most sequences the scheduler runs at once; later arrivals wait.
    #[arg(long, default_value_t = 128)]
    max_decode_seqs: usize,
    /// Serving ladder: requests in flight at each rung.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 2, 4, 8, 16, 32, 64, 128])]
    concurrency: Vec<usize>,
    /// Serving ladder and trace: prompt tokens per request (the trace's fewest).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Serving ladder, trace (its fewest) and `--speculative`: output tokens per request (per
    /// end-to-end run).
    #[arg(long, default_value_t = 512)]
    output_tokens: usize,
    /// Serving ladder: run each rung a second time with this many of its requests constrained
    /// to a JSON schema (an array of at least `--output-tokens` strings, so they decode every
    /// step), and print that run's step time beside the plain one's.
    #[arg(long, default_value_t = 0)]
    constrained: usize,
    /// `--constrained`: the tokenizer the schema is compiled over (`tokenizer.json`, or
    /// gzipped `.gz`); its vocabulary must fit the shape's. The default is the Qwen3 tokenizer
    /// committed in the repository, found from the repository's root.
    #[arg(long, default_value = FIXTURE_TOKENIZER)]
    tokenizer: PathBuf,
    /// Run the speculative-decoding benchmark instead, at batch 1 with `--context` tokens
    /// cached: a plain decode step (graphed and eager), verify steps of 1 + K rows, one MTP
    /// draft, tokens/s projected at acceptance lengths 1.9 / 2.7 / 3.4 for K = 1 / 2 / 3, and
    /// end-to-end runs of `--output-tokens` tokens (plain, oracle drafter, MTP head). A shape
    /// without an MTP head gets a one-layer head. With `--serve`: the serving ladder, each rung
    /// run plain and then again with K = `--num-draft-tokens` drafts behind a fresh speculation
    /// gate, drafted by an oracle (each request's plain tokens) and by the MTP head; printed per
    /// rung: tokens/s and its ratio to plain, drafts accepted per verify, verify and plain
    /// decode steps; a speculative run whose tokens differ from the plain run's is an error.
    #[arg(long)]
    speculative: bool,
    /// `--speculative`: verify steps are timed for K = 1 to this (1 to 8); with `--serve`, the
    /// drafts per verify step.
    #[arg(long, default_value_t = 4)]
    num_draft_tokens: usize,
    /// `--speculative`: also time a plain decode step and verify steps of this many
    /// sequences (1: none).
    #[arg(long, default_value_t = 1)]
    speculative_batch: usize,
    /// `--speculative`: the forward every step runs (legacy, circuit, circuit-reference); with
    /// `--serve`, every run of the ladder, the plain ones included.
    #[arg(long, default_value = "legacy")]
    speculative_forward: String,
    /// `--serve --speculative`: the model's bound on graphs of verify and MTP steps (a verify
    /// step's graph is keyed by its exact rows and sequences; past the bound a step of a new
    /// shape runs eagerly).
    #[arg(long, default_value_t = metrale::ModelOptions::default().max_speculative_graphs)]
    max_speculative_graphs: usize,
    /// `--serve --speculative`: meetings of a verify or MTP step shape before its graph is
    /// captured (1: at once).
    #[arg(long, default_value_t = metrale::ModelOptions::default().speculative_graph_after)]
    speculative_graph_after: u32,
    /// How the random weights' projections are stored (`fp8`: quantized at load; the floor
    /// counts their bytes).
    #[arg(long, value_enum, default_value_t = QuantizationArg::None)]
    quantization: QuantizationArg,
    /// How the decode measurement's KV cache stores keys and values (`fp8`: e4m3; the floor
    /// counts its bytes).
    #[arg(long, value_enum, default_value_t = KvCacheDtypeArg::Auto)]
    kv_cache_dtype: KvCacheDtypeArg,
    /// The prefill's rows attend in the prompt arithmetic (`paged_attention_prompt`, where the
    /// heads take it), as a served prompt's do with `--prompt-attention`.
    #[arg(long)]
    prompt_attention: bool,
    /// Shard the random model over this many ranks (1, 2, 4 or 8; on CUDA GPUs `--device` to
    /// `--device` + N - 1, through NCCL) and time its decode steps at `--batches`, each beside
    /// its floor per GPU: the rank's weight and KV bytes over the copy bandwidth plus the
    /// all-reduce and all-gather latencies (measured in the same run, at the step's sizes)
    /// times the collectives a step runs. bf16 weights and KV cache, the legacy forward.
    #[arg(long, default_value_t = 1)]
    tensor_parallel_size: usize,
}

pub fn run(args: BenchArgs) -> Result<()> {
    let backend = crate::generate::backend(args.backend, args.device);
    if args.tensor_parallel_size != 1 {
        return tensor_parallel(
            metrale::make_backends(backend, args.tensor_parallel_size)?,
            &args,
        );
    }
    let gpu: Arc<dyn GpuBackend> = metrale::make_backend(backend)?;
    let config = shape_config(args.shape)?;
    let tiny = matches!(
        args.shape,
        Shape::Tiny | Shape::TinyHybrid | Shape::TinyMoe | Shape::TinyQwen3Vocab
    );
    if args.serve && !args.request_rate.is_empty() {
        return serve::trace(gpu, config, &args);
    }
    if let (true, Some(p)) = (args.serve, args.interference_prompt_tokens) {
        return serve::interference(gpu, config, p, &args);
    }
    if args.serve {
        return serve::serve(gpu, config, tiny, &args);
    }
    if args.speculative {
        return speculative(gpu, config, tiny, &args);
    }
    let mut o = BenchOptions::new(config);
    o.decode_batches = args.batches.clone();
    o.context = args.context;
    o.breakdown_batches = args.breakdown_batches.clone();
    o.prefill_tokens = args.prefill_tokens;
    o.iters = args.iters;
    o.quantization = args.quantization.select();
    o.kv_cache_dtype = args.kv_cache_dtype.select();
    o.prompt_attention = args.prompt_attention;
    o.forwards = (args.forwards.iter())
        .map(|f| forward(f))
        .collect::<Result<_>>()?;
    if tiny {
        o.copy_bytes = 1 << 20;
        o.gemm_dim = 64;
    }
    let report = bench::run(gpu, &o)?;
    print!("{}", report.table());
    if let Some(path) = &args.json_out {
        let decode: Vec<_> = report
            .decode
            .iter()
            .map(|d| {
                serde_json::json!({
                    "forward": d.forward,
                    "launches": d.launches,
                    "batch": d.batch,
                    "ms": d.ms,
                    "floor_ms": d.floor_ms,
                    "bytes": d.bytes,
                    "ratio": d.ms / d.floor_ms,
                })
            })
            .collect();
        let json = serde_json::json!({
            "shape": format!("{:?}", args.shape),
            "backend": report.backend,
            "copy_gb_s": report.copy_gb_s,
            "gemm_tflop_s": report.gemm_tflop_s,
            "vendor_gemm_tflop_s": report.vendor_gemm_tflop_s,
            "fp8_gemm": report.fp8_gemm.as_ref().map(|f| serde_json::json!({
                "ours_tflop_s": f.ours_tflop_s,
                "vendor_tflop_s": f.vendor_tflop_s,
                "vendor_refused": f.vendor_refused,
            })),
            "weight_bytes": report.weight_bytes,
            "prefill": {
                "tokens": report.prefill_tokens,
                "ms": report.prefill_ms,
                "floor_ms": report.prefill_floor_ms,
            },
            "decode": decode,
        });
        write_json(path, &json)?;
    }
    Ok(())
}

/// The model config of `shape`.
fn shape_config(shape: Shape) -> Result<ModelConfig> {
    Ok(match shape {
        Shape::Qwen3_8b => bench::qwen3_8b()?,
        Shape::Qwen3_5_9b => bench::qwen3_5_9b()?,
        Shape::Qwen3_5_35bA3b => bench::qwen3_5_35b_a3b()?,
        Shape::Qwen3_32b => bench::qwen3_32b()?,
        Shape::Qwen3Next80bA3b => bench::qwen3_next_80b_a3b()?,
        Shape::Tiny => bench::tiny_for_cpu()?,
        Shape::TinyHybrid => bench::tiny_hybrid_for_cpu()?,
        Shape::TinyMoe => bench::tiny_moe_for_cpu()?,
        Shape::TinyQwen3Vocab => bench::tiny_qwen3_vocab_for_cpu()?,
    })
}

/// `--tensor-parallel-size N`: decode steps of the sharded model, printed as a table (and JSON
/// with `--json-out`).
fn tensor_parallel(gpus: Vec<Arc<dyn GpuBackend>>, args: &BenchArgs) -> Result<()> {
    anyhow::ensure!(
        !args.serve && !args.speculative,
        "--tensor-parallel-size times decode steps; it runs without --serve and --speculative"
    );
    anyhow::ensure!(
        matches!(args.quantization, QuantizationArg::None)
            && !matches!(args.kv_cache_dtype, KvCacheDtypeArg::Fp8),
        "--tensor-parallel-size shards bf16 weights and a bf16 KV cache"
    );
    let mut o = bench::TpBenchOptions::new(shape_config(args.shape)?);
    o.decode_batches = args.batches.clone();
    o.context = args.context;
    o.iters = args.iters;
    if matches!(
        args.shape,
        Shape::Tiny | Shape::TinyHybrid | Shape::TinyMoe | Shape::TinyQwen3Vocab
    ) {
        o.copy_bytes = 1 << 20;
    }
    let report = bench::tensor_parallel_bench(&gpus, &o)?;
    print!("{}", report.table());
    if let Some(path) = &args.json_out {
        let decode: Vec<_> = (report.decode.iter())
            .map(|d| {
                let c = &d.collectives;
                serde_json::json!({
                    "batch": d.batch,
                    "rows": d.rows,
                    "ms": d.ms,
                    "floor_ms": d.floor_ms,
                    "ratio": d.ms / d.floor_ms,
                    "rank_bytes": d.rank_bytes,
                    "collectives": c.count(),
                    "all_reduces": c.all_reduces,
                    "all_reduce_us": c.all_reduce_us,
                    "expert_all_reduces": c.expert_all_reduces,
                    "expert_all_reduce_us": c.expert_all_reduce_us,
                    "gather_us": c.gather_us,
                    "collectives_ms": c.ms(),
                })
            })
            .collect();
        let json = serde_json::json!({
            "shape": format!("{:?}", args.shape),
            "backend": report.backend,
            "tensor_parallel_size": report.ranks,
            "copy_gb_s": report.copy_gb_s,
            "rank_weight_bytes": report.rank_weight_bytes,
            "decode": decode,
        });
        write_json(path, &json)?;
    }
    Ok(())
}

/// Print a run's `table` and, with `--json-out`, write `head` (an object) with the shape and,
/// under `key`, each of `points` as `point` writes it.
fn print_and_write<P>(
    args: &BenchArgs,
    table: &str,
    mut head: serde_json::Value,
    key: &str,
    points: &[P],
    point: impl Fn(&P) -> serde_json::Value,
) -> Result<()> {
    print!("{table}");
    if let Some(path) = &args.json_out {
        head["shape"] = serde_json::json!(format!("{:?}", args.shape));
        head[key] = points.iter().map(point).collect();
        write_json(path, &head)?;
    }
    Ok(())
}

/// `--json-out`: `json`, pretty-printed, into `path`.
fn write_json(path: &Path, json: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(json)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// The text of the `tokenizer.json` at `path`, decompressed when its name ends in `.gz`.
fn read_tokenizer(path: &Path) -> Result<String> {
    let hint = || {
        format!(
            "reading the tokenizer {} (pass --tokenizer PATH, or run from the repository's root \
             for the default {FIXTURE_TOKENIZER})",
            path.display()
        )
    };
    let bytes = std::fs::read(path).with_context(hint)?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut text = String::new();
        flate2::read::GzDecoder::new(bytes.as_slice())
            .read_to_string(&mut text)
            .with_context(hint)?;
        Ok(text)
    } else {
        String::from_utf8(bytes).with_context(hint)
    }
}

/// The forward named `name`.
fn forward(name: &str) -> Result<ForwardSelect> {
    ForwardSelect::from_name(name).with_context(|| {
        format!(
            "unknown forward `{name}` (expected one of {})",
            ForwardSelect::NAMES.join(", ")
        )
    })
}

/// `--speculative`: the speculative-decoding figures, printed as a table (and JSON with
/// `--json-out`).
fn speculative(
    gpu: Arc<dyn GpuBackend>,
    config: ModelConfig,
    tiny: bool,
    args: &BenchArgs,
) -> Result<()> {
    let mut o = SpecBenchOptions::new(config);
    o.max_draft_tokens = args.num_draft_tokens;
    o.context = args.context;
    o.iters = args.iters;
    o.output_tokens = args.output_tokens;
    o.batch = args.speculative_batch;
    o.forward = forward(&args.speculative_forward)?;
    if tiny {
        o.copy_bytes = 1 << 20;
    }
    let r = bench::speculative_bench(gpu, &o)?;
    print!("{}", r.table());
    if let Some(path) = &args.json_out {
        let verify: Vec<_> = r
            .verify
            .iter()
            .map(|v| {
                serde_json::json!({
                    "drafts": v.drafts,
                    "ms": v.ms,
                    "floor_ms": v.floor_ms,
                    "vs_plain_eager": v.ms / r.plain.eager_ms,
                    "vs_plain_graphed": v.ms / r.plain.graphed_ms,
                })
            })
            .collect();
        let projected: Vec<_> = bench::ACCEPTANCE_LENGTHS
            .iter()
            .enumerate()
            .filter_map(|(i, &l)| {
                r.projected_tok_s(i + 1, l).map(
                    |t| serde_json::json!({"drafts": i + 1, "acceptance_length": l, "tok_s": t}),
                )
            })
            .collect();
        let e2e: Vec<_> = r
            .end_to_end
            .iter()
            .map(|e| {
                serde_json::json!({
                    "name": e.name,
                    "drafts": e.drafts,
                    "tokens": e.tokens,
                    "tokens_per_step": e.tokens_per_step,
                    "tok_s": e.tok_s,
                    "matches_plain": e.matches_plain,
                    "captures": e.captures,
                    "cold_tok_s": e.cold_tok_s,
                    "cold_captures": e.cold_captures,
                })
            })
            .collect();
        let json = serde_json::json!({
            "shape": format!("{:?}", args.shape),
            "backend": r.backend,
            "copy_gb_s": r.copy_gb_s,
            "weight_bytes": r.weight_bytes,
            "head_weight_bytes": r.head_weight_bytes,
            "context": r.context,
            "plain": {
                "graphed_ms": r.plain.graphed_ms,
                "eager_ms": r.plain.eager_ms,
                "floor_ms": r.plain.floor_ms,
            },
            "verify": verify,
            "draft": {
                "ms": r.draft.graphed_ms,
                "eager_ms": r.draft.eager_ms,
                "floor_ms": r.draft.floor_ms,
            },
            "projected": projected,
            "end_to_end": e2e,
            "forward": r.forward,
            "verify_program_steps": r.verify_program_steps,
            "batched": r.batched.as_ref().map(|b| serde_json::json!({
                "seqs": b.seqs,
                "plain": {
                    "graphed_ms": b.plain.graphed_ms,
                    "eager_ms": b.plain.eager_ms,
                    "floor_ms": b.plain.floor_ms,
                },
                "verify": b.verify.iter().map(|v| serde_json::json!({
                    "drafts": v.drafts,
                    "graphed_ms": v.graphed_ms,
                    "eager_ms": v.ms,
                    "floor_ms": v.floor_ms,
                })).collect::<Vec<_>>(),
            })),
        });
        write_json(path, &json)?;
    }
    Ok(())
}
