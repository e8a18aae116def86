//! `metrale serve`: the flags of the OpenAI-compatible server, turned into
//! `metrale_server::ServerOptions`; without `--model` it serves the bundled tiny checkpoint.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};
use metrale::chat::{ReasoningParser, ToolCallParser};
use metrale::{EngineOptions, GateOptions, KvCacheDtype, ModelOptions, Quantization, Speculative};
use metrale_server::{GenerationConfig, Server, ServerOptions};

use crate::generate::{BackendArg, ForwardArg, backend};

/// How projection weights are stored on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QuantizationArg {
    /// As the checkpoint stores them (block FP8 for an FP8 pack, else bf16).
    None,
    /// Block FP8 (e4m3, 128 x 128 blocks), bf16 checkpoints quantized at load.
    Fp8,
}

impl QuantizationArg {
    /// The library's option.
    pub fn select(self) -> Quantization {
        match self {
            QuantizationArg::None => Quantization::AsStored,
            QuantizationArg::Fp8 => Quantization::Fp8,
        }
    }
}

/// How the KV cache stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtypeArg {
    /// FP8 when the checkpoint's quantization config asks for an FP8 KV cache, else bf16.
    Auto,
    /// bf16.
    Bf16,
    /// FP8 e4m3 (half the bytes a token), with the checkpoint's per-layer k/v scales or 1.0.
    Fp8,
}

impl KvCacheDtypeArg {
    /// The library's option.
    pub fn select(self) -> KvCacheDtype {
        match self {
            KvCacheDtypeArg::Auto => KvCacheDtype::Auto,
            KvCacheDtypeArg::Bf16 => KvCacheDtype::Bf16,
            KvCacheDtypeArg::Fp8 => KvCacheDtype::Fp8,
        }
    }
}

/// Speculative decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpeculativeArg {
    /// Plain decode.
    Off,
    /// The checkpoint's MTP head drafts (Qwen3.5 / Qwen3-Next).
    Mtp,
}

/// Where a request's omitted sampling fields come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GenerationConfigArg {
    /// The checkpoint's generation_config.json (temperature, top_p, top_k, min_p,
    /// repetition_penalty), then OpenAI's defaults.
    Auto,
    /// OpenAI's defaults only (temperature 1, top_p 1, every token, no min_p or penalty).
    None,
}

/// `--tool-call-parser`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ToolCallParserArg {
    /// The format the checkpoint's chat template teaches (JSON for Qwen3, XML for Qwen3.5).
    Auto,
    /// `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
    #[value(name = "qwen3-json")]
    Qwen3Json,
    /// `<tool_call><function=NAME><parameter=P>...</tool_call>`.
    #[value(name = "qwen3-xml")]
    Qwen3Xml,
    /// Tool calls stay in the content.
    None,
}

/// `--reasoning-parser`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReasoningParserArg {
    /// `<think>...</think>` where the chat template writes think blocks.
    Auto,
    /// `<think>...</think>` as `reasoning_content`.
    Qwen3,
    /// Reasoning stays in the content.
    None,
}

/// `metrale serve`'s flags.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Checkpoint directory (config.json + safetensors, tokenizer.json for text). Default: the
    /// bundled tiny checkpoint.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The model's name in the API (`/v1/models`, the requests' `model`). Default: the
    /// checkpoint directory's name.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Where the model runs.
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    pub backend: BackendArg,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Most tokens per step (prefill chunk size and token budget).
    #[arg(long, default_value_t = ModelOptions::default().max_batch_tokens)]
    pub max_batch_tokens: usize,
    /// Turn mixed steps off: prefill chunks and decode steps alternate, instead of each step
    /// holding every decoding request's next token and a chunk of a prompt in prefill.
    #[arg(long)]
    pub no_mixed_steps: bool,
    /// With mixed steps, the most query-row by key pairs of attention a step's prompt chunk
    /// may read (a chunk of r rows from position p reads about r * p + r^2 / 2): late in a
    /// long prompt its chunks get shorter, bounding the other requests' inter-token gap.
    /// Default: unbounded.
    #[arg(long)]
    pub mixed_chunk_attention: Option<usize>,
    /// With mixed steps, the token budget of a step holding decode rows and a prompt chunk
    /// (below `--max-batch-tokens`: the chunk gets the rest), bounding the other requests'
    /// inter-token gap. Default: `--max-batch-tokens`.
    #[arg(long)]
    pub mixed_step_tokens: Option<usize>,
    /// With mixed steps, the wall time a step holding decode rows and a prompt chunk aims at,
    /// in percent of a plain decode step of as many rows (more than 100): the engine times its
    /// steps and sizes the chunks to it, bounding the other requests' inter-token gap. Default:
    /// not paced.
    #[arg(long)]
    pub mixed_step_slowdown_pct: Option<u32>,
    /// Most requests running at once (the widest decode step).
    #[arg(long, default_value_t = ModelOptions::default().max_decode_seqs)]
    pub max_decode_seqs: usize,
    /// Longest sequence, prompt plus output. Default: the model's, capped at 4096.
    #[arg(long)]
    pub max_seq_len: Option<usize>,
    /// KV-cache blocks. Default: enough for `max_decode_seqs` sequences of `max_seq_len`.
    #[arg(long)]
    pub num_kv_blocks: Option<usize>,
    /// How the KV cache stores keys and values (`fp8`: e4m3, twice the tokens in the same
    /// memory).
    #[arg(long, value_enum, default_value_t = KvCacheDtypeArg::Auto)]
    pub kv_cache_dtype: KvCacheDtypeArg,
    /// Device memory for the KV cache in MiB: without `--num-kv-blocks`, as many blocks as fit
    /// (twice as many with `--kv-cache-dtype fp8`). Default: sized by `--num-kv-blocks`'s
    /// default.
    #[arg(long)]
    pub kv_cache_mib: Option<usize>,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = ModelOptions::default().block_size)]
    pub block_size: usize,
    /// Most requests waiting for admission; more get 429.
    #[arg(long, default_value_t = EngineOptions::default().max_queued_requests)]
    pub max_queued_requests: usize,
    /// Turn prefix caching off: every prompt is computed from its first token, and no KV block
    /// or SSM snapshot is kept for later requests.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// SSM state snapshots kept for prefix caching on hybrid models. Default: twice
    /// `--max-decode-seqs`.
    #[arg(long)]
    pub ssm_snapshot_slots: Option<usize>,
    /// Hybrid models: also end prefill chunks (and keep an SSM snapshot) at every multiple of
    /// this many tokens, a multiple of 64 with the default blocks. Default: only every
    /// `--max-batch-tokens`.
    #[arg(long)]
    pub ssm_snapshot_stride: Option<usize>,
    /// Hybrid models: do not prefill a finished conversation again (while the engine is idle) to
    /// cache its answer; a follow-up turn then resumes at the previous prompt's last snapshot
    /// and prefills the answer itself.
    #[arg(long)]
    pub no_reprefill_answers: bool,
    /// Prompt rows attend in their own arithmetic (`paged_attention_prompt`: one softmax chain a
    /// row over 64-key tiles, head_dim 128 and a bf16 KV cache), generated rows in the decode
    /// one; finished conversations are then re-prefilled for prefix caching.
    #[arg(long)]
    pub prompt_attention: bool,
    /// Which forward runs decode steps: the layers' own launches, or the circuit executor's
    /// programs (`circuit` fuses the ops whose fused kernel is byte-identical to the launches
    /// it replaces: the same tokens in fewer launches a step).
    #[arg(long, value_enum, default_value_t = ForwardArg::Legacy)]
    pub forward: ForwardArg,
    /// Speculative decoding: with `mtp` the checkpoint's MTP head drafts and decode steps verify
    /// the drafts, while the engine measures it faster than plain decode.
    #[arg(long, value_enum, default_value_t = SpeculativeArg::Off)]
    pub speculative: SpeculativeArg,
    /// Tokens drafted per sequence and verify step with `--speculative mtp` (1 to 8).
    #[arg(long, default_value_t = ModelOptions::default().num_draft_tokens)]
    pub num_draft_tokens: usize,
    /// How projection weights are stored: as the checkpoint has them, or block FP8 (bf16
    /// checkpoints quantized at load).
    #[arg(long, value_enum, default_value_t = QuantizationArg::None)]
    pub quantization: QuantizationArg,
    /// Tensor-parallel ranks the model is split over (1, 2, 4 or 8; one thread a rank; on CUDA
    /// rank r on GPU `--device` + r, through NCCL).
    #[arg(long, default_value_t = ModelOptions::default().tensor_parallel_size)]
    pub tensor_parallel_size: usize,
    /// With `--speculative mtp`: always speculate, instead of turning speculation off while it
    /// measures slower than plain decode.
    #[arg(long)]
    pub no_speculation_gate: bool,
    /// The gate switches modes when the other is faster by more than this many percent.
    #[arg(long, default_value_t = GateOptions::default().margin_percent)]
    pub speculation_margin_percent: u32,
    /// Where the sampling fields a request leaves out come from.
    #[arg(long, value_enum, default_value_t = GenerationConfigArg::Auto)]
    pub generation_config: GenerationConfigArg,
    /// How chat answers' tool calls are read into `tool_calls`.
    #[arg(long, value_enum, default_value_t = ToolCallParserArg::Auto)]
    pub tool_call_parser: ToolCallParserArg,
    /// How chat answers' reasoning is read into `reasoning_content`.
    #[arg(long, value_enum, default_value_t = ReasoningParserArg::Auto)]
    pub reasoning_parser: ReasoningParserArg,
}

impl ServeArgs {
    /// The engine options these flags give.
    pub fn engine_options(&self) -> EngineOptions {
        let speculative = match self.speculative {
            SpeculativeArg::Off => Speculative::Off,
            SpeculativeArg::Mtp => Speculative::Mtp,
        };
        let model = ModelOptions::default()
            .quantization(self.quantization.select())
            .tensor_parallel_size(self.tensor_parallel_size)
            .max_batch_tokens(self.max_batch_tokens)
            .mixed_steps(!self.no_mixed_steps)
            .mixed_chunk_attention(self.mixed_chunk_attention)
            .mixed_step_tokens(self.mixed_step_tokens)
            .mixed_step_slowdown_pct(self.mixed_step_slowdown_pct)
            .max_decode_seqs(self.max_decode_seqs)
            .max_seq_len(self.max_seq_len)
            .num_kv_blocks(self.num_kv_blocks)
            .kv_cache_dtype(self.kv_cache_dtype.select())
            .kv_cache_bytes(self.kv_cache_mib.map(|m| m << 20))
            .block_size(self.block_size)
            .prefix_caching(!self.no_prefix_caching)
            .ssm_snapshot_slots(self.ssm_snapshot_slots)
            .ssm_snapshot_stride(self.ssm_snapshot_stride)
            .reprefill_answers(!self.no_reprefill_answers)
            .prompt_attention(self.prompt_attention)
            .speculative(speculative)
            .num_draft_tokens(self.num_draft_tokens);
        let gate = GateOptions::default()
            .enabled(!self.no_speculation_gate)
            .margin_percent(self.speculation_margin_percent);
        EngineOptions::default()
            .backend(backend(self.backend, self.device))
            .model(model)
            .max_queued_requests(self.max_queued_requests)
            .speculation_gate(gate)
            .forward(self.forward.select())
    }

    /// The server options these flags give, serving `model` (the flag's, or the bundled
    /// checkpoint).
    pub fn server_options(&self, model: PathBuf) -> ServerOptions {
        ServerOptions::new(model)
            .served_model_name(self.served_model_name.clone())
            .host(self.host.clone())
            .port(self.port)
            .engine(self.engine_options())
            .generation_config(match self.generation_config {
                GenerationConfigArg::Auto => GenerationConfig::Auto,
                GenerationConfigArg::None => GenerationConfig::Ignore,
            })
            .tool_call_parser(match self.tool_call_parser {
                ToolCallParserArg::Auto => ToolCallParser::Auto,
                ToolCallParserArg::Qwen3Json => ToolCallParser::Qwen3Json,
                ToolCallParserArg::Qwen3Xml => ToolCallParser::Qwen3Xml,
                ToolCallParserArg::None => ToolCallParser::None,
            })
            .reasoning_parser(match self.reasoning_parser {
                ReasoningParserArg::Auto => ReasoningParser::Auto,
                ReasoningParserArg::Qwen3 => ReasoningParser::Qwen3,
                ReasoningParserArg::None => ReasoningParser::None,
            })
    }
}

/// Load the checkpoint, listen, and serve until Ctrl-C (SIGINT) or SIGTERM; requests in flight
/// finish first.
pub fn run(args: ServeArgs) -> Result<()> {
    let model = match &args.model {
        Some(dir) => dir.clone(),
        None => crate::bundled::checkpoint()?,
    };
    let server = Server::bind(args.server_options(model))?;
    println!(
        "metrale serve: model `{}` on http://{}",
        server.model_id(),
        server.local_addr()
    );
    server.run_until(async {
        metrale_server::shutdown_signal().await;
        eprintln!("metrale serve: shutting down");
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use metrale::ForwardSelect;
    use metrale::circuit::Fusions;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<ServeArgs, clap::Error> {
        let mut argv = vec!["metrale-serve"];
        argv.extend(args);
        Cli::try_parse_from(argv).map(|c| c.serve)
    }

    #[test]
    fn prefix_caching_is_on_by_default_and_the_flags_reach_the_options() {
        let model = |args: &[&str]| parse(args).map(|a| a.engine_options().model);
        let default = model(&[]).expect("no flags");
        assert!(default.prefix_caching);
        assert_eq!(default.ssm_snapshot_slots, None);
        assert_eq!(default.ssm_snapshot_stride, None);
        assert!(default.reprefill_answers);
        let off = model(&["--no-prefix-caching", "--ssm-snapshot-slots", "3"]).expect("valid");
        assert!(!off.prefix_caching);
        assert!(
            !model(&["--no-reprefill-answers"])
                .expect("valid")
                .reprefill_answers
        );
        assert_eq!(off.ssm_snapshot_slots, Some(3));
        let strided = model(&["--ssm-snapshot-stride", "128"]).expect("valid");
        assert_eq!(strided.ssm_snapshot_stride, Some(128));
        assert!(default.mixed_steps);
        let alternating = model(&["--no-mixed-steps", "--max-batch-tokens", "64"]).expect("valid");
        assert!(!alternating.mixed_steps);
        assert_eq!(default.mixed_chunk_attention, None);
        let budgeted = model(&["--mixed-chunk-attention", "500000"]).expect("valid");
        assert_eq!(budgeted.mixed_chunk_attention, Some(500_000));
        assert_eq!(default.mixed_step_tokens, None);
        let short = model(&["--mixed-step-tokens", "256"]).expect("valid");
        assert_eq!(short.mixed_step_tokens, Some(256));
        assert_eq!(default.mixed_step_slowdown_pct, None);
        let paced = model(&["--mixed-step-slowdown-pct", "175"]).expect("valid");
        assert_eq!(paced.mixed_step_slowdown_pct, Some(175));
        assert_eq!(alternating.max_batch_tokens, 64);
        assert!(!default.prompt_attention);
        assert!(
            model(&["--prompt-attention"])
                .expect("valid")
                .prompt_attention
        );
        assert!(model(&["--ssm-snapshot-slots", "many"]).is_err());
    }

    #[test]
    fn speculation_is_off_by_default_and_its_flags_reach_the_options() {
        let engine = |args: &[&str]| parse(args).map(|a| a.engine_options());
        let default = engine(&[]).expect("no flags");
        assert_eq!(default.model.speculative, Speculative::Off);
        assert!(default.speculation_gate.enabled);
        let on = engine(&[
            "--speculative",
            "mtp",
            "--num-draft-tokens",
            "3",
            "--no-speculation-gate",
            "--speculation-margin-percent",
            "9",
        ])
        .expect("valid");
        assert_eq!(on.model.speculative, Speculative::Mtp);
        assert_eq!(on.model.num_draft_tokens, 3);
        assert!(!on.speculation_gate.enabled);
        assert_eq!(on.speculation_gate.margin_percent, 9);
        assert!(engine(&["--speculative", "eagle"]).is_err());
    }

    #[test]
    fn decode_steps_run_the_legacy_forward_unless_the_flag_names_another() {
        let forward = |args: &[&str]| parse(args).map(|a| a.engine_options().forward_select());
        assert_eq!(forward(&[]).expect("no flags"), ForwardSelect::Legacy);
        let fused = ForwardSelect::Circuit {
            fusions: Fusions::All,
        };
        assert_eq!(forward(&["--forward", "circuit"]).expect("valid"), fused);
        assert!(forward(&["--forward", "fast"]).is_err());
    }

    #[test]
    fn the_parser_flags_default_to_auto_and_reach_the_server_options() {
        let server = |args: &[&str]| parse(args).map(|a| a.server_options(PathBuf::from("m")));
        let default = server(&[]).expect("no flags");
        assert_eq!(default.tool_call_parser, ToolCallParser::Auto);
        assert_eq!(default.reasoning_parser, ReasoningParser::Auto);
        let set = server(&[
            "--tool-call-parser",
            "qwen3-xml",
            "--reasoning-parser",
            "none",
        ])
        .expect("valid");
        assert_eq!(set.tool_call_parser, ToolCallParser::Qwen3Xml);
        assert_eq!(set.reasoning_parser, ReasoningParser::None);
        assert!(server(&["--tool-call-parser", "hermes"]).is_err());
    }

    #[test]
    fn the_address_and_name_flags_reach_the_server_options() {
        let args = parse(&[
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--served-model-name",
            "m",
        ])
        .expect("valid");
        let o = args.server_options(PathBuf::from("ckpt"));
        assert_eq!((o.host.as_str(), o.port), ("0.0.0.0", 0));
        assert_eq!(o.model_id(), "m");
        assert_eq!(o.model, PathBuf::from("ckpt"));
        let default = parse(&[])
            .expect("no flags")
            .server_options(PathBuf::from("x"));
        assert_eq!((default.host.as_str(), default.port), ("127.0.0.1", 8000));
        assert_eq!(default.engine, EngineOptions::default());
    }
}
