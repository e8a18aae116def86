//! The circuit executor on block-FP8 models (CPU): packs get plans of the FP8 kernels, which a
//! bf16 source quantized at load reproduces; models quantized at load run circuit programs
//! bitwise legacy; a pack storing a projection otherwise than the packs do is refused; the Gated
//! DeltaNet input projection of an FP8 model is read in FP8 beside its bf16 b and a rows. (The
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
fn a_pack_storing_a_projection_the_circuit_reads_as_fp8_in_bf16_is_refused() -> Result<()> {
    // Layer 0's Gated DeltaNet q/k/v projection in bf16 (its source's tensor), its z in e4m3:
    // the input projection then loads as one bf16 weight, which the circuit (a pack's layout:
    // q/k/v and z FP8) would misread.
    let src = fixtures_dir().join("qwen3_5_moe-fp8-tiny");
    let source = std::fs::read(src.join("source").join("model.safetensors"))?;
    let source = safetensors::SafeTensors::deserialize(&source)?;
    let qkv = "model.layers.0.linear_attn.in_proj_qkv.weight";
    let plain = source.tensor(qkv)?;
    let tmp = tempfile::tempdir()?;
    copy_fixture_with(&src, tmp.path(), |name, t| {
        if name == qkv {
            let t = TensorData {
                dtype: plain.dtype(),
                shape: plain.shape().to_vec(),
                data: plain.data().to_vec(),
            };
            vec![(name.to_string(), t)]
        } else if name.starts_with(qkv) {
            Vec::new()
        } else {
            vec![(name.to_string(), t)]
        }
    });
    let circuit = EngineOptions::default().forward(REFERENCE);
    let Err(e) = Engine::load(tmp.path(), circuit) else {
        bail!("the circuit accepted a bf16 projection it reads as FP8");
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
fn fp8_hybrid_models_hold_the_gdn_input_projection_in_fp8_and_its_b_and_a_rows_in_bf16()
-> Result<()> {
    use metrale_gpu_runtime::DType;
    use metrale_model_engine::{Quantization, factory};
    use metrale_model_layers::circuit_exec::{LinearRole, MixerFacts, WeightSlot};
    let dir = fixtures_dir();
    let pack = dir.join("qwen3_5_moe-fp8-tiny");
    // The pack (split q/k/v, z, b, a tensors), its source quantized at load, and Qwen3.5's and
    // Qwen3-Next's (fused, permuted in_proj_qkvz / in_proj_ba) bf16 fixtures quantized at load;
    // then the bf16 loads, which keep one fused bf16 projection.
    let cases = [
        (pack.clone(), Quantization::AsStored, true),
        (pack.join("source"), Quantization::Fp8, true),
        (dir.join("qwen3_5-tiny"), Quantization::Fp8, true),
        (dir.join("qwen3_next-tiny"), Quantization::Fp8, true),
        (pack.join("source"), Quantization::AsStored, false),
        (dir.join("qwen3_next-tiny"), Quantization::AsStored, false),
    ];
    for (path, quantization, fp8) in cases {
        let what = format!("{} {quantization:?}", path.display());
        let model = factory::load_quantized(&path, cpu(), quantization)?;
        let mut gdn_layers = 0;
        for layer in model.layers() {
            let l = layer.circuit_layer(model.dims()).context("a bound layer")?;
            let MixerFacts::Gdn(g) = l.mixer else {
                continue;
            };
            gdn_layers += 1;
            let h = g.heads;
            let hidden = model.dims().hidden as usize;
            let (pw, ba_rows) = (h.proj_width() as usize, 2 * h.num_v_heads as usize);
            let in_proj = l.weights[&WeightSlot::Linear(LinearRole::GdnInProj)].weight();
            let ba = l.weights.get(&WeightSlot::GdnInProjBa).map(|b| b.weight());
            // Bytes a decode step reads for the projection (FP8 scales aside).
            let bytes = in_proj.shape.iter().product::<usize>() * in_proj.dtype.size()
                + ba.map_or(0, |b| b.shape.iter().product::<usize>() * b.dtype.size());
            if fp8 {
                let ba = ba.with_context(|| format!("{what}: no separate b|a rows"))?;
                ensure!(
                    in_proj.dtype == DType::F8E4M3 && in_proj.scales.is_some(),
                    "{what}"
                );
                ensure!(
                    in_proj.shape == [pw - ba_rows, hidden],
                    "{what}: {:?}",
                    in_proj.shape
                );
                ensure!(
                    ba.dtype == DType::Bf16 && ba.shape == [ba_rows, hidden],
                    "{what}"
                );
                ensure!(2 * bytes < pw * hidden * 2 * 6 / 5, "{what}: {bytes} bytes");
            } else {
                ensure!(ba.is_none() && in_proj.dtype == DType::Bf16, "{what}");
                ensure!(
                    in_proj.shape == [pw, hidden] && bytes == pw * hidden * 2,
                    "{what}"
                );
            }
        }
        ensure!(gdn_layers > 0, "{what}: no GDN layer");
    }
    Ok(())
}

#[test]
fn an_fp8_packs_split_gdn_projection_gives_the_bits_of_its_dequantized_fused_projection()
-> Result<()> {
    // The pack's GDN q/k/v and z tensors rewritten as the bf16 their FP8 values stand for: the
    // input projection then loads as one fused bf16 weight of the same values. Every projected
    // element is the same dot product, so the split FP8 projection (legacy and circuit
    // forwards) gives that model's greedy tokens and logits bit for bit.
    let src = fixtures_dir().join("qwen3_5_moe-fp8-tiny");
    let pack = std::fs::read(src.join("model.safetensors"))?;
    let pack = safetensors::SafeTensors::deserialize(&pack)?;
    let is_qkvz = |name: &str| {
        name.contains(".linear_attn.in_proj_qkv.") || name.contains(".linear_attn.in_proj_z.")
    };
    let tmp = tempfile::tempdir()?;
    let mut rewritten = 0;
    copy_fixture_with(&src, tmp.path(), |name, t| {
        if !is_qkvz(name) {
            return vec![(name.to_string(), t)];
        }
        let Some(stem) = name.strip_suffix(".weight") else {
            return Vec::new(); // a scale tensor: the bf16 weight has none
        };
        let scales = pack
            .tensor(&format!("{stem}.weight_scale_inv"))
            .expect("the pack's scales");
        assert_eq!(
            scales.dtype(),
            safetensors::Dtype::F32,
            "the fixture's scales"
        );
        let scales: Vec<f32> = (scales.data().chunks_exact(4))
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let (n, k) = (t.shape[0], t.shape[1]);
        let shift = if scales.len() == n * k.div_ceil(128) {
            0
        } else {
            7
        };
        let w = metrale_gpu_runtime::fp8::dequant(&t.data, &scales, (n, k), shift);
        rewritten += 1;
        let t = TensorData {
            dtype: safetensors::Dtype::BF16,
            shape: t.shape,
            data: bytemuck::cast_slice(&w).to_vec(),
        };
        vec![(name.to_string(), t)]
    });
    ensure!(rewritten >= 2, "{rewritten} tensors rewritten");
    let prompts = support::read_reference(&src)?;
    let fused = Engine::load(tmp.path(), EngineOptions::default())?;
    let want = support::greedy_bits(&fused, &prompts);
    for forward in [None, Some(REFERENCE), Some(ALL)] {
        let options = forward.map_or_else(EngineOptions::default, |f| {
            EngineOptions::default().forward(f)
        });
        let split = Engine::load(&src, options)?;
        ensure!(
            support::greedy_bits(&split, &prompts) == want,
            "{forward:?}: the split FP8 projection's bits differ from the fused bf16 one's"
        );
    }
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
