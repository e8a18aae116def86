//! The circuit executor on CUDA (GPU machine only): on every fixture, `circuit-reference`
//! decode is bitwise `legacy`, eager and graph-captured, alone and batched, with bf16 and FP8 KV
//! caches; its programs launch
//! exactly what the legacy step launches at every decode width; `circuit` (whose only fused
//! kernel today is bit-identical) is bitwise `legacy` too, in fewer launches.

#![allow(clippy::unwrap_used, clippy::type_complexity)]
#![cfg(feature = "cuda")]

mod support;

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cuda::CudaBackend;
use metrale_model_engine::runner::{ForwardSelect, ModelCircuit};
use metrale_model_engine::{KvCacheDtype, ModelOptions};
use support::circuit::*;
use support::fixtures_dir;

fn gpu() -> Arc<dyn GpuBackend> {
    Arc::new(CudaBackend::new(0).expect("a CUDA device"))
}

fn every_fixture() -> Vec<std::path::PathBuf> {
    let dirs = circuit_fixtures();
    assert!(
        dirs.len() >= 11,
        "expected the eleven fixtures under {}",
        fixtures_dir().display()
    );
    dirs
}

#[test]
fn circuit_reference_decode_is_bitwise_legacy_on_cuda() -> Result<()> {
    for dir in every_fixture() {
        // The FP8 KV cache too (graphed: the eager steps launch the same kernels).
        let runs = [
            (false, KvCacheDtype::Bf16),
            (true, KvCacheDtype::Bf16),
            (true, KvCacheDtype::Fp8),
        ];
        for (graphs, kv) in runs {
            let options = ModelOptions::default()
                .decode_graphs(graphs)
                .kv_cache_dtype(kv);
            let model = bitwise_same(&dir, &options, &gpu, REFERENCE)
                .with_context(|| format!("cuda, decode graphs {graphs}, {kv:?} KV"))?;
            eprintln!(
                "cuda {}: circuit-reference bitwise legacy (graphs {graphs}, {kv:?} KV), {} launches per step",
                dir.display(),
                model.runner().forward_disclosure()?.launches_per_step
            );
        }
    }
    Ok(())
}

#[test]
fn circuit_programs_launch_exactly_the_legacy_steps_launches_on_cuda() -> Result<()> {
    for dir in every_fixture() {
        let mut model = load(&dir, ModelOptions::default(), gpu(), ForwardSelect::Legacy)?;
        let ladder = model.runner().options().decode_ladder();
        let legacy: Vec<_> = ladder
            .iter()
            .map(|&w| model.runner().decode_launches(w))
            .collect::<Result<_, _>>()?;
        model.runner_mut().set_forward(REFERENCE)?;
        for (&w, want) in ladder.iter().zip(&legacy) {
            ensure!(
                model.runner().decode_launches(w)? == *want,
                "{} at width {w}",
                dir.display()
            );
        }
    }
    Ok(())
}

#[test]
fn circuit_is_bitwise_legacy_on_cuda_with_fewer_launches() -> Result<()> {
    // Every fused rule whose kernel exists today (`qk_norm_rope_kv_store`) is `bit_identical`,
    // so `circuit` must give the legacy bytes, eager and graphed, in fewer launches.
    for dir in every_fixture() {
        for graphs in [false, true] {
            let options = ModelOptions::default().decode_graphs(graphs);
            let all = bitwise_same(&dir, &options, &gpu, ALL)
                .with_context(|| format!("cuda, decode graphs {graphs}"))?;
            let reference = load(&dir, options, gpu(), REFERENCE)?;
            let (a, r) = (
                all.runner().forward_disclosure()?,
                reference.runner().forward_disclosure()?,
            );
            ensure!(a.launches_per_step < r.launches_per_step, "{a:?} vs {r:?}");
            eprintln!(
                "cuda {}: circuit bitwise legacy (graphs {graphs}), {} launches per step, circuit-reference {}",
                dir.display(),
                a.launches_per_step,
                r.launches_per_step
            );
        }
    }
    Ok(())
}
