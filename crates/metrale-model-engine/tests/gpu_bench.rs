//! The speculative benchmark's own check, on every GPU bundle run: on the tiny hybrid shape its
//! end-to-end runs (oracle and MTP drafting, eager and graphed plain decode) all give the plain
//! greedy tokens on CUDA, and the oracle keeps every draft. (The benchmark's figures come from
//! `metrale bench`, which the bundle's `run.sh` runs.)

#![allow(clippy::unwrap_used)]
#![cfg(feature = "cuda")]

use std::sync::Arc;

use metrale_gpu_runtime::{CudaBackend, GpuBackend};
use metrale_model_engine::bench::{self, SpecBenchOptions};

#[test]
fn the_speculative_benchmark_is_lossless_on_cuda() {
    let gpu: Arc<dyn GpuBackend> =
        Arc::new(CudaBackend::new(0).expect("a CUDA GPU (run this from the GPU bundle)"));
    let mut o = SpecBenchOptions::new(bench::tiny_hybrid_for_cpu().unwrap());
    o.context = 100;
    o.iters = 3;
    o.output_tokens = 40;
    o.copy_bytes = 1 << 24;
    let r = bench::speculative_bench(gpu, &o).unwrap();
    print!("{}", r.table());
    for e in &r.end_to_end {
        assert!(e.matches_plain, "{e:?}");
        if e.name.starts_with("oracle") {
            assert!(e.tokens_per_step > e.drafts as f64, "{e:?}");
        }
    }
}
