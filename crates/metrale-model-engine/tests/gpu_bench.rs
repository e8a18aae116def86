//! `metrale bench` from the GPU bundle without the CLI: the ignored test prints the benchmark's
//! table (ceilings, prefill, decode, the kernel-by-kernel decode breakdown) for the Qwen3-8B
//! shape on the CUDA backend. A measurement, not a check: `run.sh` runs it with `--ignored`.

#![allow(clippy::unwrap_used)]
#![cfg(feature = "cuda")]

use std::sync::Arc;

use metrale_gpu_runtime::{CudaBackend, GpuBackend};
use metrale_model_engine::bench::{self, BenchOptions};

#[test]
#[ignore = "a measurement, not a check: run.sh runs it with --ignored"]
fn bench_the_qwen3_8b_shape_on_cuda() {
    let gpu: Arc<dyn GpuBackend> =
        Arc::new(CudaBackend::new(0).expect("a CUDA GPU (run this from the GPU bundle)"));
    let opts = BenchOptions::new(bench::qwen3_8b().unwrap());
    let report = bench::run(gpu, &opts).unwrap();
    print!("{}", report.table());
}
