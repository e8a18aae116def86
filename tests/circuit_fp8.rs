//! The circuit executor on block-FP8 models (CPU): packs get plans of the FP8 kernels, which a
//! bf16 source quantized at load reproduces; models quantized at load run circuit programs
//! bitwise legacy; a pack storing a projection otherwise than the packs do is refused. (The
//! FP8 fixtures also run every test of `circuit.rs`.)

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use metrale::circuit::Step;
use metrale::{Engine, EngineOptions};
use metrale_config::ModelConfig;
use metrale_gpu_runtime::{CpuBackend, GpuBackend};
use metrale_model_engine::ModelOptions;
use metrale_model_engine::runner::{Fusions, checkpoint_plan};
use support::circuit::*;
use support::{TensorData, copy_fixture_with, fixtures_dir};

fn cpu() -> Arc<dyn GpuBackend> {
    Arc::new(CpuBackend::default())
}

#[test]
fn fp8_packs_get_plans_of_the_fp8_kernels_which_quantizing_at_load_reproduces() -> Result<()> {
    let options = ModelOptions::default();
    let fp8 = ModelOptions::default().quantization(metrale_model_engine::Quantization::Fp8);
    for (fixture, kernels) in [
        ("qwen3-fp8-tiny", &["gemm::linear_stream_fp8"][..]),
        (
            "qwen3_5_moe-fp8-tiny",
            &["gemm::linear_stream_fp8", "moe::expert_linear_fp8"][..],
        ),
    ] {
        let dir = fixtures_dir().join(fixture);
        let pack = ModelConfig::from_dir(&dir)?;
        let source = ModelConfig::from_dir(&dir.join("source"))?;
        let plan = |c: &ModelConfig, o: &ModelOptions| {
            checkpoint_plan(
                c,
                o,
                Step::Decode,
                Fusions::ReferenceOnly,
                Step::Decode.width(1),
            )
        };
        let (p, bf16, quantized) = (
            plan(&pack, &options)?,
            plan(&source, &options)?,
            plan(&source, &fp8)?,
        );
        for k in kernels {
            ensure!(p.text().contains(k), "{fixture}: no {k} in\n{}", p.text());
            ensure!(
                !bf16.text().contains(k),
                "{fixture}: the bf16 plan names {k}"
            );
        }
        ensure!(p.text().contains("weights block_fp8"));
        ensure!(p.digest() != bf16.digest());
        // The same projections as the pack's loader stores: the same plan.
        ensure!(quantized.digest() == p.digest(), "{fixture}");
    }
    Ok(())
}

#[test]
fn a_pack_storing_a_projection_the_circuit_reads_as_bf16_in_fp8_is_refused() -> Result<()> {
    // The Gated DeltaNet a and b projections of layer 0 in e4m3 too: the fused input projection
    // then loads as FP8, which the circuit (a pack's layout: that projection bf16) would misread.
    let src = fixtures_dir().join("qwen3_5_moe-fp8-tiny");
    let tmp = tempfile::tempdir()?;
    copy_fixture_with(&src, tmp.path(), |name, t| {
        let quantize = name.starts_with("model.layers.0.linear_attn.in_proj_")
            && (name.ends_with("_a.weight") || name.ends_with("_b.weight"));
        if !quantize {
            return vec![(name.to_string(), t)];
        }
        let w: Vec<half::bf16> = bytemuck::cast_slice(&t.data).to_vec();
        let (q, scales) = metrale_gpu_runtime::fp8::quantize(&w, (t.shape[0], t.shape[1]));
        let stem = name.trim_end_matches(".weight");
        let scale_shape = vec![t.shape[0].div_ceil(128), t.shape[1].div_ceil(128)];
        vec![
            (
                name.to_string(),
                TensorData {
                    dtype: safetensors::Dtype::F8_E4M3,
                    data: q,
                    ..t
                },
            ),
            (
                format!("{stem}.weight_scale_inv"),
                TensorData {
                    dtype: safetensors::Dtype::F32,
                    shape: scale_shape,
                    data: bytemuck::cast_slice(&scales).to_vec(),
                },
            ),
        ]
    });
    let circuit = EngineOptions::default().forward(REFERENCE);
    let Err(e) = Engine::load(tmp.path(), circuit) else {
        bail!("the circuit accepted an FP8 projection it reads as bf16");
    };
    let e = e.to_string();
    ensure!(
        e.contains("gdn_in_proj") && e.contains("fp8_e4m3") && e.contains("bf16"),
        "{e}"
    );
    // The legacy forward reads the weight as stored.
    Engine::load(tmp.path(), EngineOptions::default())?;
    Ok(())
}

#[test]
fn models_quantized_at_load_run_circuit_programs_bitwise_legacy() -> Result<()> {
    // Dense, hybrid, Qwen3-Next's fused GDN input projection and MoE experts, quantized with
    // the packs' recipe: the circuit binds the layouts the loader stores.
    let options = ModelOptions::default().quantization(metrale_model_engine::Quantization::Fp8);
    for fixture in [
        "qwen3-tiny",
        "qwen3_5-tiny",
        "qwen3_next-tiny",
        "qwen3_5_moe-tiny",
    ] {
        let dir = fixtures_dir().join(fixture);
        for forward in [REFERENCE, ALL] {
            bitwise_same(&dir, &options, &cpu, forward)
                .with_context(|| format!("{fixture} {}", forward.name()))?;
        }
    }
    Ok(())
}
