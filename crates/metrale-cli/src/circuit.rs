//! `metrale circuit plan`: the plan a checkpoint's decode step compiles to, printed as its
//! canonical text followed by its SHA-256 digest, then the digest of the plans at every decode
//! width (what `metrale generate --forward ... --json` reports as `plan_digest`). Read from
//! `config.json` alone (no weights, no device), it is the plan `--forward circuit` (or
//! `circuit-reference`) runs when the engine loads the checkpoint with the same sizes.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use metrale::{ForwardSelect, ModelConfig, ModelOptions};

use crate::generate::ForwardArg;

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
    /// Rows of the decode step (sequences, a rung of the decode ladder or not).
    #[arg(long, default_value_t = 1)]
    rows: u64,
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
    let options = ModelOptions {
        max_seq_len: args.max_seq_len,
        block_size: args.block_size,
        max_decode_seqs: args.max_decode_seqs,
        ..ModelOptions::default()
    };
    let planning = || format!("planning {}", args.model.display());
    let plan = metrale::circuit::checkpoint_plan(&config, &options, fusions, args.rows)
        .with_context(planning)?;
    let ladder =
        metrale::circuit::checkpoint_plans(&config, &options, fusions).with_context(planning)?;
    let widths: Vec<String> = ladder.iter().map(|p| p.rows().to_string()).collect();
    print!("{}", plan.text());
    println!("digest {}", plan.digest());
    println!(
        "plans_digest {} (decode widths {})",
        metrale::circuit::plans_digest(&ladder),
        widths.join(", ")
    );
    Ok(())
}
