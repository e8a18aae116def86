//! `metrale generate`: one prompt, tokens printed as they come, optionally a JSON summary line
//! and the logits of every step in a safetensors file. With `--speculative mtp` the request runs
//! on its own through `metrale::generate_direct`. Without `--model` it runs the bundled tiny
//! checkpoint.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use metrale::circuit::Fusions;
use metrale::{
    Backend, Engine, EngineOptions, ForwardSelect, GenerateRequest, ModelConfig, ModelOptions,
    Prompt, SamplingParams, Speculative,
};

use crate::serve::{KvCacheDtypeArg, QuantizationArg};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The CPU reference backend.
    Cpu,
    /// An NVIDIA GPU (a build with the `cuda` feature).
    Cuda,
}

/// Which forward runs decode steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ForwardArg {
    /// The layers' own forwards.
    Legacy,
    /// The circuit executor, with every fused rule whose kernels the backend has.
    Circuit,
    /// The circuit executor with reference rules only: bitwise the legacy forward.
    CircuitReference,
}

impl ForwardArg {
    /// The engine's selection.
    pub fn select(self) -> ForwardSelect {
        match self {
            ForwardArg::Legacy => ForwardSelect::Legacy,
            ForwardArg::Circuit => ForwardSelect::Circuit {
                fusions: Fusions::All,
            },
            ForwardArg::CircuitReference => ForwardSelect::Circuit {
                fusions: Fusions::ReferenceOnly,
            },
        }
    }
}

/// Speculative decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpeculativeArg {
    /// Plain decode, through the engine.
    Off,
    /// The checkpoint's multi-token-prediction head drafts, the model verifies; the request runs
    /// on its own (`metrale::generate_direct`), not through the engine's scheduler.
    Mtp,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Checkpoint directory (config.json + safetensors). Default: the bundled tiny checkpoint.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text (needs the checkpoint's tokenizer.json).
    #[arg(long, conflicts_with = "token_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold (1 = all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampler (without one, a fresh seed per run).
    #[arg(long)]
    seed: Option<u64>,
    /// Do not stop at the model's EOS tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Where the model runs.
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Print a JSON summary as the last stdout line.
    #[arg(long)]
    json: bool,
    /// Write the logits of every generated token to this safetensors file (tensor `logits`,
    /// f32, [generated tokens, vocab]).
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Most tokens per step (prefill chunk size).
    #[arg(long, default_value_t = ModelOptions::default().max_batch_tokens)]
    max_batch_tokens: usize,
    /// Turn mixed steps off (prefill chunks and decode steps alternate; with one request they
    /// alternate anyway).
    #[arg(long)]
    no_mixed_steps: bool,
    /// Longest sequence; default: the model's, capped at 4096.
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Which forward runs decode steps (prefill always runs the legacy step).
    #[arg(long, value_enum, default_value_t = ForwardArg::Legacy)]
    forward: ForwardArg,
    /// Speculative decoding.
    #[arg(long, value_enum, default_value_t = SpeculativeArg::Off)]
    speculative: SpeculativeArg,
    /// Tokens drafted per sequence and verify step with `--speculative mtp` (1 to 8).
    #[arg(long, default_value_t = ModelOptions::default().num_draft_tokens)]
    num_draft_tokens: usize,
    /// How projection weights are stored: as the checkpoint has them, or block FP8 (bf16
    /// checkpoints quantized at load).
    #[arg(long, value_enum, default_value_t = QuantizationArg::None)]
    quantization: QuantizationArg,
    /// How the KV cache stores keys and values (`fp8`: e4m3, half the bytes a token).
    #[arg(long, value_enum, default_value_t = KvCacheDtypeArg::Auto)]
    kv_cache_dtype: KvCacheDtypeArg,
    /// Tensor-parallel ranks the model is split over (1, 2, 4 or 8; one thread a rank; on CUDA
    /// rank r on GPU `--device` + r, through NCCL).
    #[arg(long, default_value_t = ModelOptions::default().tensor_parallel_size)]
    tensor_parallel_size: usize,
}

/// The engine's backend for a command-line choice.
pub fn backend(arg: BackendArg, device: usize) -> Backend {
    match arg {
        BackendArg::Cpu => Backend::Cpu,
        BackendArg::Cuda => Backend::cuda(device),
    }
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => crate::bundled::checkpoint()?,
    };
    let speculative = match args.speculative {
        SpeculativeArg::Off => Speculative::Off,
        SpeculativeArg::Mtp => Speculative::Mtp,
    };
    let model = ModelOptions::default()
        .quantization(args.quantization.select())
        .kv_cache_dtype(args.kv_cache_dtype.select())
        .tensor_parallel_size(args.tensor_parallel_size)
        .max_batch_tokens(args.max_batch_tokens)
        .mixed_steps(!args.no_mixed_steps)
        .max_seq_len(args.max_seq_len)
        .speculative(speculative)
        .num_draft_tokens(args.num_draft_tokens);
    let options = EngineOptions::default()
        .backend(backend(args.backend, args.device))
        .model(model)
        .forward(args.forward.select());
    let prompt = match (&args.prompt, &args.token_ids) {
        (Some(t), None) => Prompt::Text(t.clone()),
        (None, Some(ids)) => Prompt::TokenIds(ids.clone()),
        (None, None) => Prompt::Text("hello".into()),
        (Some(_), Some(_)) => bail!("give either --prompt or --token-ids, not both"),
    };
    let mut sampling = SamplingParams::default()
        .temperature(args.temperature)
        .top_k(args.top_k)
        .top_p(args.top_p);
    sampling.seed = args.seed;
    let request = GenerateRequest::new(prompt)
        .max_new_tokens(args.max_new_tokens)
        .sampling(sampling)
        .ignore_eos(args.ignore_eos)
        .return_logits(args.logits_out.is_some());
    let stdout = std::io::stdout();
    let mut printed = 0usize;
    let on_token = |id: u32, text: Option<&str>| {
        let mut lock = stdout.lock();
        // Stream the text as it grows; without a tokenizer, the ids.
        let _ = match text {
            Some(t) if t.len() >= printed && t.is_char_boundary(printed) => {
                let r = write!(lock, "{}", &t[printed..]);
                printed = t.len();
                r
            }
            _ => write!(lock, "{id} "),
        };
        let _ = lock.flush();
        ControlFlow::Continue(())
    };
    let (out, forward) = if args.speculative == SpeculativeArg::Off {
        let engine =
            Engine::load(&dir, options).with_context(|| format!("loading {}", dir.display()))?;
        let forward = engine.forward_disclosure().clone();
        if args.forward != ForwardArg::Legacy {
            eprintln!(
                "forward {}: plan digest {}, {} launches per step",
                forward.forward,
                forward
                    .plan_digest
                    .map_or_else(|| "none".into(), |d| d.to_string()),
                forward.launches_per_step
            );
        }
        (engine.generate_stream(&request, on_token)?, Some(forward))
    } else {
        let out = metrale::generate_direct(&dir, options, &request, on_token)
            .with_context(|| format!("generating with {}", dir.display()))?;
        (out, None)
    };
    println!();
    if let Some(path) = &args.logits_out {
        let vocab = ModelConfig::from_dir(&dir)?.tokens.vocab_size;
        write_logits(path, out.logits.as_deref().unwrap_or(&[]), vocab)?;
    }
    if args.json {
        let line = serde_json::json!({
            "token_ids": out.token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason.as_str(),
            "forward": forward.as_ref().map(|f| f.forward.to_string()),
            "plan_digest": forward.as_ref().and_then(|f| f.plan_digest.map(|d| d.to_string())),
            "launches_per_step": forward.as_ref().map(|f| f.launches_per_step),
            "speculative": format!("{:?}", args.speculative).to_lowercase(),
        });
        println!("{line}");
    }
    Ok(())
}

fn write_logits(path: &std::path::Path, rows: &[Vec<f32>], vocab: usize) -> Result<()> {
    let mut bytes = Vec::with_capacity(rows.len() * vocab * 4);
    for r in rows {
        for v in r {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    let view = safetensors::tensor::TensorView::new(
        safetensors::Dtype::F32,
        vec![rows.len(), vocab],
        &bytes,
    )
    .context("building the logits tensor")?;
    safetensors::serialize_to_file([("logits", view)], None, path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
