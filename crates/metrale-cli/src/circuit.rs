//! `metrale circuit plan`: the plan a checkpoint's decode step (or, with `--step`, a single
//! sequence's verify or MTP draft step) compiles to, printed as its canonical text followed by
//! its SHA-256 digest, then the digest of every plan the engine compiles with these options
//! (what `metrale generate --forward ... --json` reports as `plan_digest`). Read from
//! `config.json` alone (no weights, no device), it is the plan `--forward circuit` (or
//! `circuit-reference`) runs when the engine loads the checkpoint with the same sizes.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use metrale::circuit::{Step, Width};
use metrale::{ForwardSelect, ModelConfig, ModelOptions, Speculative};

use crate::generate::ForwardArg;
use crate::serve::{KvCacheDtypeArg, QuantizationArg};

#[derive(Debug, Args)]
pub struct CircuitArgs {
    #[command(subcommand)]
    command: CircuitCommand,
}

#[derive(Debug, Subcommand)]
enum CircuitCommand {
    /// Print a checkpoint's decode plan and its digest.
    Plan(PlanArgs),
}

#[derive(Debug, Args)]
struct PlanArgs {
    /// Checkpoint directory (its config.json is read).
    #[arg(long)]
    model: PathBuf,
    /// Which step: decode, or a verify step or a single sequence's draft step of speculative
    /// decoding (their plans exist with `--num-draft-tokens` drafts; a draft plan needs the
    /// checkpoint's MTP head).
    #[arg(long, value_enum, default_value_t = StepArg::Decode)]
    step: StepArg,
    /// Rows of the step (decode: sequences, a rung of the decode ladder or not; verify: 2 to
    /// 1 + K of one sequence, or `--seqs` + 1 to `--seqs` * (1 + K) of several; draft: 1 to
    /// 1 + K).
    #[arg(long, default_value_t = 1)]
    rows: u64,
    /// Sequences of a verify or draft step (2 to `--circuit-speculative-seqs`: a batched
    /// plan); 1 otherwise.
    #[arg(long, default_value_t = 1)]
    seqs: u64,
    /// Verify and draft steps of up to this many sequences have plans of their own (see
    /// `seqs`).
    #[arg(long, default_value_t = ModelOptions::default().circuit_speculative_seqs)]
    circuit_speculative_seqs: usize,
    /// Drafts per verify step (K), which sets the verify and draft plans compiled; 0: none.
    #[arg(long, default_value_t = 0)]
    num_draft_tokens: usize,
    /// Which rules the plan may use.
    #[arg(long, value_enum, default_value_t = ForwardArg::Circuit)]
    forward: ForwardArg,
    /// Longest sequence, which sets the block-table width; default: the model's, capped at
    /// 4096.
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = ModelOptions::default().block_size)]
    block_size: usize,
    /// Most sequences per decode step, which sets the decode widths the engine compiles.
    #[arg(long, default_value_t = ModelOptions::default().max_decode_seqs)]
    max_decode_seqs: usize,
    /// How the projections are stored (`fp8`: quantized at load, as `generate --quantization
    /// fp8` loads them; an FP8 pack's are FP8 either way), which picks their kernels.
    #[arg(long, value_enum, default_value_t = QuantizationArg::None)]
    quantization: QuantizationArg,
    /// How the KV cache stores keys and values, as `generate --kv-cache-dtype` loads it (the
    /// plan's header names an FP8 cache).
    #[arg(long, value_enum, default_value_t = KvCacheDtypeArg::Auto)]
    kv_cache_dtype: KvCacheDtypeArg,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum StepArg {
    Decode,
    Verify,
    Draft,
}

pub fn run(args: CircuitArgs) -> Result<()> {
    match args.command {
        CircuitCommand::Plan(p) => plan(p),
    }
}

fn plan(args: PlanArgs) -> Result<()> {
    let ForwardSelect::Circuit { fusions } = args.forward.select() else {
        bail!("the legacy forward has no plan; use --forward circuit or circuit-reference");
    };
    let config = ModelConfig::from_dir(&args.model)
        .with_context(|| format!("reading {}", args.model.display()))?;
    let speculative = if args.num_draft_tokens > 0 {
        Speculative::Mtp
    } else {
        Speculative::Off
    };
    let options = ModelOptions::default()
        .max_seq_len(args.max_seq_len)
        .block_size(args.block_size)
        .max_decode_seqs(args.max_decode_seqs)
        .circuit_speculative_seqs(args.circuit_speculative_seqs)
        .quantization(args.quantization.select())
        .kv_cache_dtype(args.kv_cache_dtype.select())
        .speculative(speculative)
        .num_draft_tokens(args.num_draft_tokens.max(1));
    let step = match args.step {
        StepArg::Decode => Step::Decode,
        StepArg::Verify => Step::Verify,
        StepArg::Draft => Step::Draft,
    };
    let planning = || format!("planning {}", args.model.display());
    let width = if step != Step::Decode && args.seqs > 1 {
        Width::new(args.rows, args.seqs)
    } else if args.seqs == 1 {
        step.width(args.rows)
    } else {
        bail!("--seqs is for verify and draft steps; a decode step has a sequence per row");
    };
    let plan = metrale::circuit::checkpoint_plan(&config, &options, step, fusions, width)
        .with_context(planning)?;
    let all =
        metrale::circuit::checkpoint_plans(&config, &options, fusions).with_context(planning)?;
    print!("{}", plan.text());
    println!("digest {}", plan.digest());
    println!(
        "plans_digest {} ({} plans: the decode widths, then any verify and draft shapes)",
        metrale::circuit::plans_digest(&all),
        all.len()
    );
    Ok(())
}
