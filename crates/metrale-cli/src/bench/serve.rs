//! The serving benchmarks of `metrale bench --serve`: the ladder (with `--constrained N` and
//! `--speculative` its constrained and speculative runs), the trace (`--request-rate`) and the
//! interference scenario (`--interference-prompt-tokens`).

use std::sync::Arc;

use anyhow::{Context, Result};
use metrale::ModelConfig;
use metrale::bench::{self, InterferenceOptions, ServeOptions, TokenRange, TraceOptions};
use metrale::gpu::GpuBackend;

use super::{BenchArgs, print_and_write, read_tokenizer};

/// `--serve`: the serving ladder, printed as a table (and JSON with `--json-out`).
pub(super) fn serve(
    gpu: Arc<dyn GpuBackend>,
    config: ModelConfig,
    tiny: bool,
    args: &BenchArgs,
) -> Result<()> {
    let mut o = ServeOptions::new(config);
    o.concurrency = args.concurrency.clone();
    o.prompt_tokens = args.prompt_tokens;
    o.output_tokens = args.output_tokens;
    o.max_batch_tokens = args.max_batch_tokens;
    if tiny {
        o.copy_bytes = 1 << 20;
    }
    if args.speculative {
        anyhow::ensure!(
            args.speculative_batch == 1,
            "--speculative-batch times verify steps of `--speculative` alone; the serving ladder \
             runs its rungs' requests (`--concurrency`)"
        );
        o.speculative = Some(
            bench::ServeSpeculation::default()
                .num_draft_tokens(args.num_draft_tokens)
                .forward(super::forward(&args.speculative_forward)?)
                .max_speculative_graphs(args.max_speculative_graphs)
                .speculative_graph_after(args.speculative_graph_after),
        );
    }
    if args.constrained > 0 {
        o.constrained = args.constrained;
        let json = read_tokenizer(&args.tokenizer)?;
        o.schemas = Some(Arc::new(bench::SchemaCompiler::new(&json).with_context(
            || format!("reading the tokenizer {}", args.tokenizer.display()),
        )?));
    }
    let report = bench::serve_ladder(gpu, &o)?;
    let head = serde_json::json!({
        "backend": report.backend,
        "copy_gb_s": report.copy_gb_s,
        "weight_bytes": report.weight_bytes,
        "prompt_tokens": report.prompt_tokens,
        "output_tokens": report.output_tokens,
        "constrained_schema": report.schema,
        "speculation": report.speculation.map(|s| serde_json::json!({
            "num_draft_tokens": s.num_draft_tokens,
            "forward": s.forward.name(),
            "gate": s.gate.enabled,
            "max_speculative_graphs": s.max_speculative_graphs,
            "speculative_graph_after": s.speculative_graph_after,
        })),
    });
    print_and_write(args, &report.table(), head, "serve", &report.points, |p| {
        let constrained = p.constrained.as_ref().map(|c| {
            let lens: Vec<usize> = c.outputs.iter().map(Vec::len).collect();
            serde_json::json!({
                "requests": c.requests,
                "tok_s": c.tok_s,
                "wall_s": c.wall_s,
                "step_ms": c.step_ms,
                "vs_plain": c.step_ms / p.step_ms,
                "full_steps": c.full_steps,
                "steps": c.steps,
                "output_tokens": lens,
            })
        });
        let speculative: Vec<_> = (p.speculative.iter())
            .map(|r| {
                serde_json::json!({
                    "drafter": r.drafter,
                    "tok_s": r.tok_s,
                    "wall_s": r.wall_s,
                    "vs_plain": p.speculative_ratio(r),
                    "accepted_per_verify": r.accepted_per_verify(),
                    "draft_verifies": r.draft_verifies,
                    "drafted": r.drafted,
                    "accepted": r.accepted,
                    "verify_steps": r.verify_steps,
                    "plain_steps": r.plain_steps,
                    "steps": r.steps,
                    "gate_switches": r.switches,
                    "gate_on": r.gate_on,
                    "captures": r.captures,
                    "full_steps": r.full_steps,
                    "step_ms": r.step_ms,
                    "step_mean_ms": r.step_mean_ms,
                    "rest_s": r.rest_s,
                    "drafter_s": r.drafter_s,
                })
            })
            .collect();
        serde_json::json!({
            "concurrency": p.concurrency,
            "tok_s": p.tok_s,
            "wall_s": p.wall_s,
            "step_ms": p.step_ms,
            "floor_ms": p.floor_ms,
            "ratio": p.step_ms / p.floor_ms,
            "full_steps": p.full_steps,
            "steps": p.steps,
            "rest_s": p.rest_s,
            "constrained": constrained,
            "speculative": speculative,
        })
    })
}

/// `--serve --request-rate`: the serving trace, printed as a table (and JSON with
/// `--json-out`).
pub(super) fn trace(gpu: Arc<dyn GpuBackend>, config: ModelConfig, args: &BenchArgs) -> Result<()> {
    anyhow::ensure!(
        args.constrained == 0 && !args.speculative,
        "--constrained and --speculative run with the serving ladder, not with --request-rate"
    );
    let mut o = TraceOptions::new(config);
    o.request_rates = args.request_rate.clone();
    o.num_requests = args.num_prompts;
    o.prompt_tokens = TokenRange {
        min: args.prompt_tokens,
        max: args.prompt_tokens_max.unwrap_or(args.prompt_tokens),
    };
    o.output_tokens = TokenRange {
        min: args.output_tokens,
        max: args.output_tokens_max.unwrap_or(args.output_tokens),
    };
    o.seed = args.seed;
    o.max_decode_seqs = args.max_decode_seqs;
    o.max_batch_tokens = args.max_batch_tokens;
    let report = bench::serve_trace(gpu, &o)?;
    let head = serde_json::json!({
        "backend": report.backend,
        "num_requests": report.num_requests,
        "prompt_tokens": {"min": report.prompt_tokens.min, "max": report.prompt_tokens.max},
        "output_tokens": {"min": report.output_tokens.min, "max": report.output_tokens.max},
        "seed": report.seed,
        "max_decode_seqs": report.max_decode_seqs,
    });
    let percentiles = |p: bench::Percentiles| {
        serde_json::json!({
            "p50_ms": p.p50_ms,
            "p90_ms": p.p90_ms,
            "p99_ms": p.p99_ms,
        })
    };
    print_and_write(args, &report.table(), head, "trace", &report.points, |p| {
        let requests: Vec<_> = p
            .requests
            .iter()
            .map(|r| {
                serde_json::json!({
                    "arrival_s": r.arrival_s,
                    "prompt_tokens": r.prompt_tokens,
                    "output_tokens": r.token_s.len(),
                    "ttft_ms": r.ttft_s() * 1e3,
                    "e2e_ms": r.e2e_s() * 1e3,
                })
            })
            .collect();
        // JSON has no infinity: an all-at-once rate is written as the string "inf".
        let rate = match p.request_rate.is_finite() {
            true => serde_json::json!(p.request_rate),
            false => serde_json::json!("inf"),
        };
        serde_json::json!({
            "request_rate": rate,
            "completed": p.completed,
            "duration_s": p.duration_s,
            "req_s": p.req_s,
            "output_tokens": p.output_tokens,
            "out_tok_s": p.out_tok_s,
            "steps": p.steps,
            "ttft": percentiles(p.ttft),
            "itl": percentiles(p.itl),
            "itl_samples": p.itl_samples,
            "e2e": percentiles(p.e2e),
            "requests": requests,
        })
    })
}

/// `--serve --interference-prompt-tokens`: the interference scenario, printed as a table (and
/// JSON with `--json-out`).
pub(super) fn interference(
    gpu: Arc<dyn GpuBackend>,
    config: ModelConfig,
    long_prompt_tokens: usize,
    args: &BenchArgs,
) -> Result<()> {
    anyhow::ensure!(
        args.constrained == 0 && args.request_rate.is_empty() && !args.speculative,
        "--interference-prompt-tokens runs alone, without --constrained, --request-rate or \
         --speculative"
    );
    let mut o = InterferenceOptions::new(config);
    o.concurrency = args.concurrency.clone();
    o.prompt_tokens = args.prompt_tokens;
    o.output_tokens = args.output_tokens;
    o.long_prompt_tokens = long_prompt_tokens;
    o.max_batch_tokens = args.max_batch_tokens;
    o.mixed_chunk_attention = args.mixed_chunk_attention;
    o.mixed_step_tokens = args.mixed_step_tokens;
    o.mixed_step_slowdown_pct = args.mixed_step_slowdown_pct;
    let report = bench::interference(gpu, &o)?;
    let head = serde_json::json!({
        "backend": report.backend,
        "prompt_tokens": report.prompt_tokens,
        "output_tokens": report.output_tokens,
        "long_prompt_tokens": report.long_prompt_tokens,
        "max_batch_tokens": report.max_batch_tokens,
        "mixed_chunk_attention": report.mixed_chunk_attention,
        "mixed_step_tokens": report.mixed_step_tokens,
        "mixed_step_slowdown_pct": report.mixed_step_slowdown_pct,
    });
    print_and_write(
        args,
        &report.table(),
        head,
        "interference",
        &report.points,
        |p| {
            let runs: Vec<_> = p
                .runs
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "mixed_steps": r.mixed,
                        "ttft_ms": r.ttft_ms,
                        "median_gap_ms": r.median_gap_ms,
                        "plain_step_ms": r.plain_step_ms,
                        "max_gap_ms": r.max_gap_ms,
                        "worst_ratio": r.worst_ratio,
                        "window_steps": r.window_steps,
                        "stalled_steps": r.stalled_steps,
                        "median_window_step_ms": r.median_window_step_ms,
                        "slowest_steps": r
                            .slowest_steps
                            .iter()
                            .map(|w| serde_json::json!({"ms": w.ms, "step": w.describe()}))
                            .collect::<Vec<_>>(),
                        "steps": r.steps,
                        "mixed_step_count": r.mixed_steps,
                    })
                })
                .collect();
            serde_json::json!({"concurrency": p.concurrency, "runs": runs})
        },
    )
}
