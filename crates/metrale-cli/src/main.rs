//! The `metrale` command line: `generate` runs one prompt through a checkpoint, `serve` serves
//! it over HTTP (the `metrale-server` crate), `bench` and `circuit plan` are development tools
//! (the facade's `unstable` surface).

mod bench;
mod bundled;
mod circuit;
mod generate;
mod serve;

use clap::{Parser, Subcommand};

/// metrale: an LLM inference engine for Qwen3 and the hybrid Qwen3.5 / Qwen3-Next families.
#[derive(Debug, Parser)]
#[command(name = "metrale", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate tokens for one prompt.
    Generate(generate::GenerateArgs),
    /// Benchmark a random-weight model of a real shape on the device.
    Bench(bench::BenchArgs),
    /// Inspect the circuit a checkpoint's decode step compiles to.
    Circuit(circuit::CircuitArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Circuit(args) => circuit::run(args),
        Command::Serve(args) => serve::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
