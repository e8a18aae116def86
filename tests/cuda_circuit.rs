//! The circuit executor on CUDA (GPU machine only): on every fixture, `circuit-reference`
//! decode is bitwise `legacy`, eager and graph-captured, alone and batched; its programs launch
//! exactly what the legacy step launches at every decode width; `circuit` gives the same
//! tokens and launches no more than the reference.

#![allow(clippy::unwrap_used, clippy::type_complexity)]
#![cfg(feature = "cuda")]

mod circuit_support;
mod common;

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use circuit_support::*;
use common::{fixtures_dir, fixtures_of};
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cuda::CudaBackend;
use metrale_model_engine::ModelOptions;
use metrale_model_engine::model_circuit::{ForwardSelect, ModelCircuit};

fn gpu() -> Arc<dyn GpuBackend> {
    Arc::new(CudaBackend::new(0).expect("a CUDA device"))
}

fn every_fixture() -> Vec<std::path::PathBuf> {
    let dirs = fixtures_of(FAMILIES);
    assert!(
        dirs.len() >= 7,
        "expected the seven fixtures under {}",
        fixtures_dir().display()
    );
    dirs
}

#[test]
fn circuit_reference_decode_is_bitwise_legacy_on_cuda() -> Result<()> {
    for dir in every_fixture() {
        for graphs in [false, true] {
            let options = ModelOptions {
                decode_graphs: graphs,
                ..Default::default()
            };
            let model = bitwise_same(&dir, &options, &gpu, REFERENCE)
                .with_context(|| format!("cuda, decode graphs {graphs}"))?;
            eprintln!(
                "cuda {}: circuit-reference bitwise legacy (graphs {graphs}), {} launches per step",
                dir.display(),
                model.forward_disclosure()?.launches_per_step
            );
        }
    }
    Ok(())
}

#[test]
fn circuit_programs_launch_exactly_the_legacy_steps_launches_on_cuda() -> Result<()> {
    for dir in every_fixture() {
        let mut model = load(&dir, ModelOptions::default(), gpu(), ForwardSelect::Legacy)?;
        let ladder = model.options().decode_ladder();
        let legacy: Vec<_> = ladder
            .iter()
            .map(|&w| model.decode_launches(w))
            .collect::<Result<_, _>>()?;
        model.set_forward(REFERENCE)?;
        for (&w, want) in ladder.iter().zip(&legacy) {
            ensure!(
                model.decode_launches(w)? == *want,
                "{} at width {w}",
                dir.display()
            );
        }
    }
    Ok(())
}

#[test]
fn circuit_gives_the_reference_tokens_on_cuda() -> Result<()> {
    for dir in every_fixture() {
        let options = ModelOptions::default();
        let mut reference = load(&dir, options.clone(), gpu(), REFERENCE)?;
        let mut all = load(&dir, options, gpu(), ALL)?;
        let (r, a) = (reference.forward_disclosure()?, all.forward_disclosure()?);
        ensure!(a.launches_per_step <= r.launches_per_step, "{a:?} vs {r:?}");
        let want = workload(&mut reference)?;
        let got = workload(&mut all)?;
        for (w, g) in want.iter().zip(&got) {
            ensure!(w.token_ids == g.token_ids, "{}", dir.display());
        }
        eprintln!(
            "cuda {}: circuit {} launches per step, circuit-reference {}",
            dir.display(),
            a.launches_per_step,
            r.launches_per_step
        );
    }
    Ok(())
}
