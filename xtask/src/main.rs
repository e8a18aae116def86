//! `cargo xtask`: setup-cuda, kernels, fixtures, gpu-bundle, bench, soak.

mod bundle;
mod cuda;
mod fixtures;
mod soak;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "xtask", about = "metrale developer tasks")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Install nvcc 13.0.88 (the GPU machine's) into .xtask/cuda-venv, or reuse it.
    SetupCuda,
    /// Compile every kernels/*.cu to target/kernels/<family>.cubin (sm_90a) and .ptx (compute_90).
    Kernels,
    /// Build target/gpu-bundle/: release CUDA test binaries, the CLI, fixtures and run.sh.
    GpuBundle,
    /// Regenerate the tiny test checkpoints and transformers references under tests/fixtures.
    Fixtures {
        /// Regenerate only this fixture (e.g. qwen3-tiny).
        #[arg(long)]
        only: Option<String>,
    },
    /// Soak the engine: many concurrent requests (random lengths, shared prefixes, cancellation)
    /// on the tiny checkpoints; asserts no leaks, no failures, outputs equal to solo runs.
    Soak(soak::SoakArgs),
    /// Benchmark on the GPU of this machine: compile the kernels, build `metrale` with CUDA and
    /// run `metrale bench` with the given arguments (e.g. `--shape qwen3.5-9b --json-out F`).
    Bench {
        /// Arguments passed to `metrale bench`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let root = fixtures::workspace_root();
    match cli.command {
        Cmd::Fixtures { only } => fixtures::run(&root, only.as_deref()),
        Cmd::SetupCuda => cuda::setup_cuda(&root).map(|nvcc| println!("{}", nvcc.display())),
        Cmd::Kernels => cuda::kernels(&root),
        Cmd::GpuBundle => bundle::gpu_bundle(&root),
        Cmd::Soak(args) => soak::run(&root, args),
        Cmd::Bench { args } => bench(&root, &args),
    }
}

/// `cargo xtask bench`: kernels, then `cargo run --release -p metrale-cli --features cuda --
/// bench ARGS` (the figures and their rooflines print as a table; `--json-out` keeps them).
fn bench(root: &std::path::Path, args: &[String]) -> anyhow::Result<()> {
    cuda::kernels(root)?;
    let status =
        std::process::Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
            .current_dir(root)
            .args([
                "run",
                "--release",
                "-p",
                "metrale-cli",
                "--features",
                "cuda",
                "--",
                "bench",
            ])
            .args(args)
            .status()?;
    anyhow::ensure!(status.success(), "metrale bench failed ({status})");
    Ok(())
}
