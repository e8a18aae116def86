//! The circuit executor against the legacy forward on every fixture (CPU): `circuit-reference`
//! decode is bitwise `legacy` (tokens and logits, eager and graph-captured, alone and
//! batched); its programs launch exactly what the legacy step launches at every decode width;
//! plans have golden digests; a model the circuit misdescribes is refused with every problem
//! named; switching forwards drops captured graphs;
//! the facade and the disclosure report the forward that runs.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use metrale::circuit::Step;
use metrale::{Engine, EngineOptions, GenerateRequest, Prompt};
use metrale_config::ModelConfig;
use metrale_gpu_runtime::{CpuBackend, DType, GpuBackend, GpuResult};
use metrale_model_engine::model::ModelWeights;
use metrale_model_engine::runner::{
    ForwardSelect, Fusions, ModelCircuit, checkpoint_plan, checkpoint_plans, plans_digest,
};
use metrale_model_engine::{KvCacheDtype, Model, ModelError, ModelOptions, Scheduler};
use metrale_model_layers::circuit_exec::{
    BindingProblem, Block, CircuitBindings, CircuitExecError, Part, WeightSlot,
};
use metrale_model_layers::layers::{Attention, DecoderLayer, Ffn, Mixer, Mlp};
use metrale_model_layers::ops_fused::LINEAR_SWIGLU_M_MAX;
use metrale_model_layers::weight_map::DenseWeight;
use metrale_model_layers::{LayerCtx, Ops, TransformerLayer};
use support::circuit::*;
use support::fixtures_dir;

fn cpu() -> Arc<dyn GpuBackend> {
    Arc::new(CpuBackend::default())
}

fn every_fixture() -> Vec<PathBuf> {
    let dirs = circuit_fixtures();
    assert!(
        dirs.len() >= 13,
        "expected the thirteen fixtures under {}",
        fixtures_dir().display()
    );
    dirs
}

fn name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[test]
fn circuit_reference_decode_is_bitwise_legacy_on_every_fixture() -> Result<()> {
    for dir in every_fixture() {
        // An FP8 KV cache binds its format into the same programs (graphed only: the eager
        // steps launch the same kernels).
        let runs = [
            (false, KvCacheDtype::Bf16),
            (true, KvCacheDtype::Bf16),
            (true, KvCacheDtype::Fp8),
        ];
        for (graphs, kv) in runs {
            let options = ModelOptions::default()
                .decode_graphs(graphs)
                .kv_cache_dtype(kv);
            let model = bitwise_same(&dir, &options, &cpu, REFERENCE)
                .with_context(|| format!("decode graphs {graphs}, {kv:?} KV"))?;
            let d = model.runner().forward_disclosure()?;
            // The disclosed plans are `metrale circuit plan`'s, whose header names an FP8 cache.
            let plans = checkpoint_plans(
                model.runner().model().config(),
                &options,
                Fusions::ReferenceOnly,
            )?;
            ensure!(
                d.plan_digest == Some(plans_digest(&plans)),
                "{kv:?} KV digest"
            );
            let fp8 = plans[0].text().contains("\nkv_cache e4m3\n");
            ensure!(fp8 == (kv == KvCacheDtype::Fp8), "{kv:?} KV header");
            eprintln!(
                "{}: circuit-reference bitwise legacy (graphs {graphs}, {kv:?} KV), {} launches per step",
                name(&dir),
                d.launches_per_step
            );
        }
    }
    Ok(())
}

#[test]
fn circuit_decode_is_bitwise_legacy_where_only_bit_identical_fusions_apply() -> Result<()> {
    // Every fused rule whose kernel exists today is `bit_identical`, so `circuit` must give
    // the legacy step's bytes on every fixture, eager and graphed.
    for dir in every_fixture() {
        for graphs in [false, true] {
            let options = ModelOptions::default().decode_graphs(graphs);
            bitwise_same(&dir, &options, &cpu, ALL)
                .with_context(|| format!("decode graphs {graphs}"))?;
        }
    }
    Ok(())
}

/// How many launches fewer than legacy `Fusions::All` takes a step at `rows` rows: the fused
/// rules whose kernels exist today are `qk_norm_rope_kv_store` (each attention layer's rotation
/// and cache store in one launch) and, at the narrow widths only, `linear_swiglu` (the SwiGLU
/// in the gate/up projection of a dense FFN or a shared expert, one launch fewer each), which
/// reads bf16 weights only: an FP8 pack's gate/up projections keep their two launches.
fn fused_launches(config: &ModelConfig, rows: usize) -> usize {
    let attention_layers = config
        .layer_types
        .iter()
        .filter(|t| **t == metrale_config::LayerType::FullAttention)
        .count();
    if rows > LINEAR_SWIGLU_M_MAX as usize || config.checkpoint.quantization.is_some() {
        return attention_layers;
    }
    let shared = config
        .moe
        .as_ref()
        .is_some_and(|m| m.shared_expert_intermediate_size > 0);
    let swiglus = (0..config.layer_types.len())
        .filter(|&i| !config.layer_is_moe(i) || shared)
        .count();
    attention_layers + swiglus
}

#[test]
fn circuit_programs_launch_exactly_the_legacy_steps_launches() -> Result<()> {
    // Up to 64 sequences, so the ladder reaches every decode GEMM kernel (narrow to 16 rows,
    // wide to 64).
    let options = ModelOptions::default().max_decode_seqs(64);
    for dir in every_fixture() {
        let mut model = load(&dir, options.clone(), cpu(), ForwardSelect::Legacy)?;
        let ladder = model.runner().options().decode_ladder();
        let legacy: Vec<_> = ladder
            .iter()
            .map(|&w| model.runner().decode_launches(w))
            .collect::<Result<_, _>>()?;
        let config = model.runner().model().config().clone();
        for forward in [REFERENCE, ALL] {
            model.runner_mut().set_forward(forward)?;
            for (&w, want) in ladder.iter().zip(&legacy) {
                let got = model.runner().decode_launches(w)?;
                if forward == ALL {
                    ensure!(
                        got.len() + fused_launches(&config, w) == want.len(),
                        "{} circuit at width {w}: {} launches, legacy {}",
                        name(&dir),
                        got.len(),
                        want.len()
                    );
                    continue;
                }
                ensure!(
                    got == *want,
                    "{} {} at width {w}: {} launches, legacy {}; first difference at {:?}",
                    name(&dir),
                    forward.name(),
                    got.len(),
                    want.len(),
                    got.iter().zip(want).position(|(g, w)| g != w)
                );
            }
        }
    }
    Ok(())
}

#[test]
fn the_disclosure_names_the_forward_its_plans_and_launches() -> Result<()> {
    for dir in every_fixture() {
        let config = ModelConfig::from_dir(&dir)?;
        let options = ModelOptions::default();
        let mut model = load(&dir, options.clone(), cpu(), ForwardSelect::Legacy)?;
        let legacy = model.runner().forward_disclosure()?;
        ensure!(legacy.forward == "legacy" && legacy.plan_digest.is_none());
        // embed; per layer two norms, then the mixer's and the FFN's launches (a block-FP8
        // GDN layer's input projection two: its q|k|v|z rows and its bf16 b|a rows); the
        // head's 3.
        let fp8 = config.checkpoint.quantization.is_some();
        let per_layer: usize = config
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mixer = match t {
                    metrale_config::LayerType::FullAttention => 5,
                    metrale_config::LayerType::LinearAttention => 7 + usize::from(fp8),
                };
                let shared = config
                    .moe
                    .as_ref()
                    .is_some_and(|m| m.shared_expert_intermediate_size > 0);
                let ffn = if !config.layer_is_moe(i) {
                    3
                } else if shared {
                    10
                } else {
                    6
                };
                2 + mixer + ffn
            })
            .sum();
        ensure!(legacy.launches_per_step == 1 + per_layer + 3, "{legacy:?}");
        for (forward, fusions) in [
            ("circuit-reference", Fusions::ReferenceOnly),
            ("circuit", Fusions::All),
        ] {
            let select = ForwardSelect::Circuit { fusions };
            model.runner_mut().set_forward(select)?;
            ensure!(model.runner().forward_select() == select);
            let d = model.runner().forward_disclosure()?;
            // The plans `metrale circuit plan` prints from config.json alone.
            let plans = checkpoint_plans(&config, &options, fusions)?;
            ensure!(d.forward == forward, "{d:?}");
            ensure!(
                d.plan_digest == Some(plans_digest(&plans)),
                "{}",
                name(&dir)
            );
            ensure!(d.launches_per_step == plans[0].launches_per_step());
            // The disclosure counts the one-row program.
            let fused = if fusions == Fusions::All {
                fused_launches(&config, 1)
            } else {
                0
            };
            ensure!(
                d.launches_per_step + fused == legacy.launches_per_step,
                "{d:?}"
            );
            eprintln!(
                "{}: {forward}: {} launches per step (legacy {}), plans {}",
                name(&dir),
                d.launches_per_step,
                legacy.launches_per_step,
                d.plan_digest.map(|x| x.to_string()).unwrap_or_default()
            );
        }
    }
    Ok(())
}

/// The golden file of plan digests: one line per fixture.
fn golden_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/circuit_plans.txt")
}

/// Each fixture's reference plan at width 1 and at every decode width (default options):
/// `fixture digest-at-1 plans-digest launches`. To regenerate after an intended change,
/// delete the golden file and run the test twice (the first run writes it and fails, so the
/// change gets reviewed).
#[test]
fn plan_digests_match_their_golden_values() -> Result<()> {
    let options = ModelOptions::default();
    let mut lines = Vec::new();
    let mut texts = Vec::new();
    for dir in every_fixture() {
        let config = ModelConfig::from_dir(&dir)?;
        let plan = checkpoint_plan(
            &config,
            &options,
            Step::Decode,
            Fusions::ReferenceOnly,
            Step::Decode.width(1),
        )?;
        let plans = checkpoint_plans(&config, &options, Fusions::ReferenceOnly)?;
        ensure!(plans[0].text() == plan.text());
        lines.push(format!(
            "{} {} {} {}",
            name(&dir),
            plan.digest(),
            plans_digest(&plans),
            plan.launches_per_step()
        ));
        texts.push(format!("== {}\n{}", name(&dir), plan.text()));
    }
    let got = lines.join("\n") + "\n";
    let path = golden_path();
    let Ok(want) = std::fs::read_to_string(&path) else {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, &got)?;
        bail!(
            "{} was missing; written, review it and re-run",
            path.display()
        );
    };
    if want != got {
        bail!(
            "plan digests differ from {}:\n  golden:\n{want}  now:\n{got}\nthe plans now:\n{}\n\
             (if the change is intended, delete the golden file and re-run twice)",
            path.display(),
            texts.join("\n")
        );
    }
    Ok(())
}

#[test]
fn switching_forward_drops_captured_graphs_and_keeps_the_output() -> Result<()> {
    let dir = fixtures_dir().join("qwen3_5-tiny");
    let mut model = load(&dir, ModelOptions::default(), cpu(), ForwardSelect::Legacy)?;
    let legacy = workload(&mut model)?;
    ensure!(model.runner().graphs().decode_widths() == [1, 2, 4]);
    for forward in [REFERENCE, ForwardSelect::Legacy, ALL] {
        model.runner_mut().set_forward(forward)?;
        ensure!(
            model.runner().graphs().decode_widths().is_empty(),
            "graphs survived a switch to {}",
            forward.name()
        );
        let again = workload(&mut model)?;
        ensure!(model.runner().graphs().decode_widths() == [1, 2, 4]);
        for (a, b) in legacy.iter().zip(&again) {
            ensure!(
                bits(a) == bits(b),
                "{} differs after a switch",
                forward.name()
            );
        }
    }
    Ok(())
}

#[test]
fn the_facade_runs_the_forward_it_was_given() -> Result<()> {
    for fixture in ["qwen3-tiny", "qwen3_next-tiny"] {
        let dir = fixtures_dir().join(fixture);
        let run = |forward: ForwardSelect| -> Result<(String, Vec<u32>, Vec<Vec<u32>>)> {
            let engine = Engine::load(&dir, EngineOptions::default().forward(forward))?;
            let out = engine.generate(
                &GenerateRequest::new(Prompt::TokenIds(vec![3, 14, 15, 92, 65, 35]))
                    .max_new_tokens(8)
                    .ignore_eos(true)
                    .return_logits(true),
            )?;
            let logits = out.logits.unwrap_or_default();
            Ok((
                engine.forward_disclosure().forward.to_string(),
                out.token_ids,
                logits
                    .iter()
                    .map(|r| r.iter().map(|x| x.to_bits()).collect())
                    .collect(),
            ))
        };
        let (legacy_name, tokens, logits) = run(ForwardSelect::Legacy)?;
        let (circuit_name, c_tokens, c_logits) = run(REFERENCE)?;
        ensure!(legacy_name == "legacy" && circuit_name == "circuit-reference");
        ensure!(tokens.len() == 8 && tokens == c_tokens, "{fixture}");
        ensure!(logits == c_logits, "{fixture}: logits differ");
    }
    Ok(())
}

/// A layer type that gives the executor no binding.
#[derive(Debug)]
struct Opaque(DecoderLayer);

impl TransformerLayer for Opaque {
    fn forward(&self, cx: &LayerCtx<'_>) -> GpuResult<()> {
        self.0.forward(cx)
    }

    fn uses_kv_cache(&self) -> bool {
        self.0.uses_kv_cache()
    }
}

impl CircuitBindings for Opaque {}

/// `qwen3-tiny`'s shape with random weights, its layers made by `layer(i, weights)`.
fn random_model(
    layer: &dyn Fn(usize, DecoderLayer) -> Box<dyn TransformerLayer>,
    count: usize,
) -> Result<Scheduler> {
    let config = ModelConfig::from_dir(&fixtures_dir().join("qwen3-tiny"))?;
    let gpu = cpu();
    let ops = Ops::new(gpu.clone())?;
    let s = gpu.default_stream();
    let mut seed = 0u64;
    let mut weight = |shape: &[usize], offset: f32| -> Result<DenseWeight> {
        let n: usize = shape.iter().product();
        let ptr = gpu.alloc(n * 2)?;
        seed += 1;
        ops.fill_uniform_bf16(s, ptr, n as u64, seed, offset, 0.05)?;
        Ok(DenseWeight {
            ptr,
            shape: shape.to_vec(),
            dtype: DType::Bf16,
            scales: None,
        })
    };
    let (h, v, f) = (
        config.hidden_size,
        config.tokens.vocab_size,
        config.intermediate_size,
    );
    let (hq, hkv, d) = (
        config.attention.num_attention_heads,
        config.attention.num_key_value_heads,
        config.attention.head_dim,
    );
    let mut layers = Vec::new();
    for i in 0..count {
        let decoder = DecoderLayer {
            input_norm: weight(&[h], 1.0)?,
            post_norm: weight(&[h], 1.0)?,
            mixer: Mixer::Attention(Attention {
                qkv: weight(&[(hq + 2 * hkv) * d, h], 0.0)?,
                q_norm: Some(weight(&[d], 1.0)?),
                k_norm: Some(weight(&[d], 1.0)?),
                o_proj: weight(&[h, hq * d], 0.0)?,
            }),
            ffn: Ffn::Dense(Mlp {
                gate_up: weight(&[2 * f, h], 0.0)?,
                down: weight(&[h, f], 0.0)?,
                ffn: f as u32,
            }),
        };
        layers.push(layer(i, decoder));
    }
    let embed = weight(&[v, h], 0.0)?;
    let weights = ModelWeights {
        embed_rows: metrale_model_layers::ops::VocabRows::whole(v as u32),
        final_norm: weight(&[h], 1.0)?,
        lm_head: weight(&[v, h], 0.0)?,
        embed,
        mtp: None,
        kv_scales: Vec::new(),
    };
    gpu.synchronize(s)?;
    let model = Model::new(config, gpu, weights, layers)?;
    Ok(Scheduler::new(model, ModelOptions::default())?)
}

#[test]
fn a_model_the_circuit_misdescribes_is_refused_naming_every_problem() -> Result<()> {
    // Layer 0 has no binding, layer 1 a k norm but no q norm, and the model has one layer more
    // than its config.
    let mut model = random_model(
        &|i, mut l| match i {
            0 => Box::new(Opaque(l)),
            1 => {
                if let Mixer::Attention(a) = &mut l.mixer {
                    a.q_norm = None;
                }
                Box::new(l)
            }
            _ => Box::new(l),
        },
        5,
    )?;
    let before = workload(&mut model)?;
    let err = model
        .runner_mut()
        .set_forward(REFERENCE)
        .err()
        .context("refused")?;
    let text = err.to_string();
    let ModelError::Circuit(CircuitExecError::Bindings { problems }) = err else {
        bail!("not a binding refusal: {text}");
    };
    let want = [
        BindingProblem::Unbound {
            part: Part::Layer(0),
        },
        BindingProblem::Unmodelled {
            part: Part::Layer(1),
            feature: "a per-head norm on only one of q and k".into(),
        },
        BindingProblem::FactDisagrees {
            part: Part::Layer(1),
            fact: "the q/k norm",
            model: "false".into(),
            circuit: "true".into(),
        },
        BindingProblem::MissingWeight {
            block: Block::Layer(1),
            slot: WeightSlot::QNorm,
        },
        BindingProblem::LayerCount {
            model: 5,
            circuit: 4,
        },
    ];
    ensure!(problems == want, "{problems:#?}");
    ensure!(text.contains("(5 problems)"), "{text}");
    eprintln!("{text}");
    // The refused build left the legacy forward running.
    ensure!(model.runner().forward_select() == ForwardSelect::Legacy);
    let after = workload(&mut model)?;
    ensure!(before.iter().zip(&after).all(|(a, b)| bits(a) == bits(b)));
    Ok(())
}

#[test]
fn circuit_programs_compile_past_the_decode_kernels_rows() -> Result<()> {
    // Up to 256 sequences: above 128 rows a projection runs the prefill kernel through its
    // tensor map after `permute_k32_tiles` writes x's stage images (an FP8 one `linear_tma_fp8`
    // through its byte map, or the bf16 kernel after dequantizing into scratch memory where it
    // has no map). There the legacy step stores keys and values
    // with the rotation (`qk_norm_rope_kv_store`), as `circuit` does: its programs launch what
    // legacy launches.
    let options = ModelOptions::default().max_decode_seqs(256);
    for fixture in ["qwen3-tiny", "qwen3-fp8-tiny"] {
        let dir = fixtures_dir().join(fixture);
        let mut model = load(&dir, options.clone(), cpu(), ForwardSelect::Legacy)?;
        let wide = [256];
        let legacy: Vec<_> = (wide.iter())
            .map(|&w| model.runner().decode_launches(w))
            .collect::<Result<_, _>>()?;
        model.runner_mut().set_forward(ALL)?;
        for (&w, want) in wide.iter().zip(&legacy) {
            let got = model.runner().decode_launches(w)?;
            ensure!(
                got == *want,
                "{fixture} width {w}: {} launches, legacy {}",
                got.len(),
                want.len()
            );
        }
        // The reference plans compile there too.
        model.runner_mut().set_forward(REFERENCE)?;
    }
    Ok(())
}
