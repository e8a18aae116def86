//! Shared by the integration tests: reading a transformers fixture and comparing the engine's
//! greedy run against it by the project's rule.
//!
//! The rule: greedy tokens equal transformers' up to the first step whose transformers top-1
//! margin is below `MARGIN`; logits within `LOGITS_REL_L2` relative L2 error at every step up to
//! and including that one (they share the same prefix).
//!
//! MoE models add a second kind of near tie: transformers' router can rank two experts within
//! 1e-4 of each other, which bf16 activations cannot resolve, so the engine may route that token
//! to the other expert and every later step differs. MoE fixtures record transformers' smallest
//! top-k routing gap at every position (`route_gaps`), and a step is compared only while every
//! position it depends on was routed with a gap of at least `ROUTE_TIE`.

#![allow(dead_code)]

pub mod circuit;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use metrale::{Engine, GenerateRequest, ModelOptions, Prompt};
use metrale_gpu_runtime::GpuBackend;
use metrale_model_engine::Scheduler;
use metrale_model_engine::factory;
use metrale_model_engine::generate::{GenerateParams, SeqRequest, generate};

/// Below this top-1 margin transformers' own choice is a near tie and may flip under rounding.
pub const MARGIN: f32 = 0.1;
/// Relative L2 error of a logits row allowed against transformers' float32 logits. The engine
/// keeps activations in bf16 between kernels, so it cannot match float32 more closely than bf16
/// rounding of the activations allows: the worst seen is 1.5% on the dense fixtures, 1.7% on
/// Qwen3.5 and 2.7% on Qwen3.5-MoE, where most of it is the rounding of the GDN input projection
/// (keeping that projection in f32 brings the MoE fixtures to about 1.2%); 2.2% on
/// `qwen3_5-vl-tiny`, `qwen3_5_moe-vl-tiny` and `qwen3_next-b-tiny`. Block-FP8 packs are held to
/// the same bound: the reference runs on their exact weights (e4m3 · scale in float32), the
/// engine on bf16(e4m3 · scale') (docs/ARCHITECTURE.md); the worst seen is 2.6% on
/// `qwen3_5_moe-fp8-tiny` and 0.62% on `qwen3-fp8-tiny`. Every broken checkpoint in
/// `tests/mutations.rs` errs by far more.
pub const LOGITS_REL_L2: f64 = 3e-2;
/// Below this gap between the k-th and (k+1)-th router probability, an expert choice may flip
/// under bf16 rounding.
pub const ROUTE_TIE: f32 = 0.01;

/// The comparison's two limits: a near tie's top-1 margin and the logits' relative L2 error.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub margin: f32,
    pub logits_rel_l2: f64,
    /// Steps every prompt must compare, so the rule has something to fail on.
    pub min_steps: usize,
}

impl Rule {
    /// The bf16 engine's rule (`MARGIN`, `LOGITS_REL_L2`).
    pub const BF16: Rule = Rule {
        margin: MARGIN,
        logits_rel_l2: LOGITS_REL_L2,
        min_steps: 4,
    };
    /// With an FP8 KV cache at scale 1.0 (the fixtures ship no scales): every key and value
    /// rounded to e4m3 (3 mantissa bits; the tiny random models' values, mostly below 2^-6,
    /// fall in e4m3's subnormal steps of 2^-9) on top of the bf16 engine's rounding. The worst
    /// seen on the dense fixtures is 7.4% (`qwen3-tiny`), the rest 2-4.5%, on the hybrid ones
    /// 6.2% (`qwen3_5_moe-vl-tiny`); a near tie is
    /// anything under 0.4 (`qwen3-tiny`'s `one_block` flips a margin of 0.36), which leaves
    /// `qwen3-yarn-tiny`'s long prompt 3 steps to compare.
    pub const FP8_KV: Rule = Rule {
        margin: 0.4,
        logits_rel_l2: 0.1,
        min_steps: 3,
    };
}

/// One prompt of a fixture.
#[derive(Debug, Clone)]
pub struct RefPrompt {
    pub name: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub margins: Vec<f32>,
    pub logits: Vec<Vec<f32>>,
    /// MoE fixtures: transformers' smallest routing gap at each position it computed.
    pub route_gaps: Option<Vec<f32>>,
}

impl RefPrompt {
    /// Steps whose inputs were all routed decisively (all steps for a dense model).
    pub fn route_horizon(&self) -> usize {
        let Some(g) = &self.route_gaps else {
            return self.greedy_ids.len();
        };
        match g.iter().position(|&x| x < ROUTE_TIE) {
            Some(q) => (q + 1)
                .saturating_sub(self.prompt_ids.len())
                .min(self.greedy_ids.len()),
            None => self.greedy_ids.len(),
        }
    }
}

/// The fixtures folder: `tests/fixtures` under the working directory when there is one (the GPU
/// bundle runs its test binaries from the bundle root, which holds a copy), else the
/// workspace's.
pub fn fixtures_dir() -> PathBuf {
    let here = PathBuf::from("tests/fixtures");
    if here.is_dir() {
        here
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
    }
}

/// Every fixture directory whose `reference.json` says `model_type` is one of `types`.
pub fn fixtures_of(types: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(fixtures_dir()) {
        for e in rd.flatten() {
            let p = e.path();
            let Ok(text) = std::fs::read_to_string(p.join("reference.json")) else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            if types.iter().any(|t| v["model_type"] == *t) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Read a fixture's prompts and reference logits.
pub fn read_reference(dir: &Path) -> Result<Vec<RefPrompt>> {
    let text = std::fs::read_to_string(dir.join("reference.json"))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let bytes = std::fs::read(dir.join("reference_logits.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let ids = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|i| i.as_u64())
                    .map(|i| i as u32)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for (i, p) in v["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .enumerate()
    {
        let t = st.tensor(&format!("prompt{i}"))?;
        let vocab = t.shape()[1];
        let flat: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.push(RefPrompt {
            name: p["name"].as_str().unwrap_or("?").to_string(),
            prompt_ids: ids(&p["prompt_ids"]),
            greedy_ids: ids(&p["greedy_ids"]),
            margins: p["top1_margins"]
                .as_array()
                .context("margins")?
                .iter()
                .filter_map(|m| m.as_f64())
                .map(|m| m as f32)
                .collect(),
            logits: flat.chunks(vocab).map(<[f32]>::to_vec).collect(),
            route_gaps: p["route_gaps"].as_array().map(|a| {
                a.iter()
                    .filter_map(|m| m.as_f64())
                    .map(|m| m as f32)
                    .collect()
            }),
        });
    }
    Ok(out)
}

/// Relative L2 error of `got` against `want`.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// The outcome of one prompt.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub prompt: String,
    /// Steps compared (tokens before the first near tie, logits through it).
    pub steps: usize,
    pub worst_rel_l2: f64,
    /// The first problem, when the rule fails.
    pub failure: Option<String>,
}

/// Run `engine` greedily on `p` and apply the rule.
pub fn compare(engine: &Engine, p: &RefPrompt) -> Result<Outcome> {
    compare_by(engine, p, Rule::BF16)
}

/// Run `engine` greedily on `p` and apply `rule`.
pub fn compare_by(engine: &Engine, p: &RefPrompt, rule: Rule) -> Result<Outcome> {
    let req = GenerateRequest::new(Prompt::TokenIds(p.prompt_ids.clone()))
        .max_new_tokens(p.greedy_ids.len())
        .ignore_eos(true)
        .return_logits(true);
    let out = engine.generate(&req)?;
    let logits = out.logits.unwrap_or_default();
    let tie = p
        .margins
        .iter()
        .position(|&m| m < rule.margin)
        .unwrap_or(p.greedy_ids.len());
    let horizon = p.route_horizon();
    // Logits are compared through the greedy near tie (same prefix), but never past a routing
    // near tie (a different prefix state).
    let steps = (tie + 1).min(p.greedy_ids.len()).min(horizon);
    let mut o = Outcome {
        prompt: p.name.clone(),
        steps,
        worst_rel_l2: 0.0,
        failure: None,
    };
    for step in 0..steps {
        let (Some(got), Some(want)) = (logits.get(step), p.logits.get(step)) else {
            o.failure.get_or_insert(format!(
                "step {step}: no logits (generated {})",
                out.token_ids.len()
            ));
            break;
        };
        let e = rel_l2(got, want);
        o.worst_rel_l2 = o.worst_rel_l2.max(e);
        let bound = rule.logits_rel_l2;
        if e > bound {
            o.failure.get_or_insert(format!(
                "step {step}: logits relative L2 error {e:.4} > {bound}"
            ));
        }
        if step < tie && out.token_ids.get(step) != p.greedy_ids.get(step) {
            o.failure.get_or_insert(format!(
                "step {step}: token {:?}, transformers chose {} (margin {:.3})",
                out.token_ids.get(step),
                p.greedy_ids[step],
                p.margins[step]
            ));
        }
    }
    Ok(o)
}

/// Apply the rule to every prompt of every fixture of `types` (at least `min` fixtures) on an
/// engine built with `options`; panics listing every failure. Each prompt must compare at
/// least `rule.min_steps` steps, so the rule has something to fail on. Returns the worst logits error.
pub fn check_fixtures(types: &[&str], min: usize, options: &metrale::EngineOptions) -> f64 {
    check_fixtures_by(types, min, options, Rule::BF16)
}

/// `check_fixtures` under `rule`.
pub fn check_fixtures_by(
    types: &[&str],
    min: usize,
    options: &metrale::EngineOptions,
    rule: Rule,
) -> f64 {
    let dirs = fixtures_of(types);
    assert!(
        dirs.len() >= min,
        "expected {min} fixtures of {types:?} under {}",
        fixtures_dir().display()
    );
    check_fixture_dirs(&dirs, options, rule)
}

/// [`check_fixtures_by`] on the fixtures in `dirs`.
pub fn check_fixture_dirs(dirs: &[PathBuf], options: &metrale::EngineOptions, rule: Rule) -> f64 {
    let (mut worst, mut failures) = (0.0f64, Vec::new());
    for dir in dirs {
        let engine =
            Engine::load(dir, options.clone()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let prompts = read_reference(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for p in prompts {
            let o = compare_by(&engine, &p, rule)
                .unwrap_or_else(|e| panic!("{}/{}: {e}", dir.display(), p.name));
            worst = worst.max(o.worst_rel_l2);
            eprintln!(
                "{}/{}: {} steps, worst rel L2 {:.2e}",
                dir.display(),
                o.prompt,
                o.steps,
                o.worst_rel_l2
            );
            if o.steps < rule.min_steps {
                failures.push(format!(
                    "{}/{}: only {} comparable steps",
                    dir.display(),
                    o.prompt,
                    o.steps
                ));
            }
            if let Some(f) = o.failure {
                failures.push(format!("{}/{}: {f}", dir.display(), o.prompt));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    worst
}

/// A 300-token prompt prefilled in one step (past the decode sizes: `linear_tma` reads the stage
/// images that the norms, `silu_mul` and attention write) gives bitwise the logits and tokens of
/// the same prompt prefilled in steps of 64 rows (decode-sized kernels, no images), on a dense
/// model (every row computes alone, whichever kernel runs it). Panics naming the fixture.
pub fn check_staged_prefill(dir: &Path, gpu: impl Fn() -> std::sync::Arc<dyn GpuBackend>) {
    let prompt: Vec<u32> = (0..300u32).map(|i| 1 + (i * 37 + i / 7) % 300).collect();
    let params = GenerateParams {
        max_new_tokens: 4,
        sampling: Default::default(),
        stop_token_ids: Vec::new(),
        return_logits: true,
    };
    let run = |max_batch_tokens: usize| {
        let options = ModelOptions::default().max_batch_tokens(max_batch_tokens);
        let model = factory::load(dir, gpu()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let mut sched =
            Scheduler::new(model, options).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let req = SeqRequest {
            prompt: prompt.clone(),
            params: params.clone(),
            ignore_eos: true,
        };
        let out = generate(
            &mut sched,
            req,
            &mut |_| std::ops::ControlFlow::Continue(()),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let bits: Vec<Vec<u32>> = (out.logits.unwrap_or_default().iter())
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect();
        (out.token_ids, bits)
    };
    let (whole, chunked) = (run(512), run(64));
    assert_eq!(
        whole.1.len(),
        params.max_new_tokens,
        "{}: logits",
        dir.display()
    );
    assert!(
        whole == chunked,
        "{}: the prompt prefilled whole differs from it prefilled in chunks of 64",
        dir.display()
    );
}

/// Greedy tokens and the bits of every step's logits of `engine` on each reference prompt.
pub fn greedy_bits(engine: &Engine, prompts: &[RefPrompt]) -> Vec<(Vec<u32>, Vec<Vec<u32>>)> {
    prompts
        .iter()
        .map(|p| {
            let req =
                metrale::GenerateRequest::new(metrale::Prompt::TokenIds(p.prompt_ids.clone()))
                    .max_new_tokens(p.greedy_ids.len())
                    .ignore_eos(true)
                    .return_logits(true);
            let out = engine.generate(&req).expect("generate");
            let logits = out.logits.unwrap_or_default();
            let bits = (logits.iter())
                .map(|row| row.iter().map(|v| v.to_bits()).collect())
                .collect();
            (out.token_ids, bits)
        })
        .collect()
}

/// An FP8 fixture's pack (`dir`) and its bf16 source (`dir/source`) quantized at load give the
/// same greedy tokens and logits bit for bit; the source as bf16 does not (so the comparison
/// can fail).
pub fn assert_source_quantized_at_load_is_the_pack(dir: &Path) {
    let options = metrale::EngineOptions::default;
    let prompts = read_reference(dir).expect("the fixture's reference");
    let pack = Engine::load(dir, options()).expect("the pack loads");
    let fp8 = ModelOptions::default().quantization(metrale::Quantization::Fp8);
    let quantized =
        Engine::load(dir.join("source"), options().model(fp8)).expect("the source loads");
    let plain = Engine::load(dir.join("source"), options()).expect("the source loads");
    let pack_bits = greedy_bits(&pack, &prompts);
    // (`assert!`, not `assert_eq!`: a mismatch would print every logit.)
    assert!(
        greedy_bits(&quantized, &prompts) == pack_bits,
        "{}: the source quantized at load differs from the pack",
        dir.display()
    );
    assert!(greedy_bits(&plain, &prompts) != pack_bits);
}

/// The outcome of every prompt of the fixture in `dir` under `options`.
pub fn check_fixture(dir: &Path, options: metrale::EngineOptions) -> Vec<Outcome> {
    let engine = Engine::load(dir, options).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    read_reference(dir)
        .expect("the fixture's reference")
        .iter()
        .map(|p| compare(&engine, p).expect("the comparison runs"))
        .collect()
}

/// Every prompt of the fixture in `dir` passes the rule, each comparing at least 4 steps.
pub fn assert_fixture_passes(dir: &Path) {
    for o in check_fixture(dir, metrale::EngineOptions::default()) {
        assert!(o.failure.is_none(), "{}: {:?}", o.prompt, o.failure);
        assert!(
            o.steps >= 4,
            "{}: only {} steps compared",
            o.prompt,
            o.steps
        );
    }
}

/// One tensor of a checkpoint being rewritten ([`copy_fixture_with`]).
pub struct TensorData {
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// A copy of the fixture in `src` in `dst` (its config, generation config and reference files),
/// its `model.safetensors` rewritten tensor by tensor: `edit` gets each tensor and returns what
/// takes its place (none, itself, or several).
pub fn copy_fixture_with(
    src: &Path,
    dst: &Path,
    mut edit: impl FnMut(&str, TensorData) -> Vec<(String, TensorData)>,
) {
    for f in [
        "config.json",
        "generation_config.json",
        "reference.json",
        "reference_logits.safetensors",
    ] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy a fixture file");
    }
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read the checkpoint");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    let mut tensors = Vec::new();
    for (name, view) in st.tensors() {
        let tensor = TensorData {
            dtype: view.dtype(),
            shape: view.shape().to_vec(),
            data: view.data().to_vec(),
        };
        tensors.extend(edit(&name, tensor));
    }
    let views = tensors.iter().map(|(n, t)| {
        let view = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data)
            .expect("a consistent tensor");
        (n.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors"))
        .expect("write the checkpoint");
}

/// A copy of the fixture `name` in `dst`, its `model.safetensors` holding `extra` tensors too
/// (name, shape, f32 values) and its config edited by `config`.
pub fn copy_with_tensors(
    name: &str,
    dst: &Path,
    extra: &[(String, Vec<usize>, Vec<f32>)],
    config: impl FnOnce(&mut serde_json::Value),
) -> Result<()> {
    for e in std::fs::read_dir(fixtures_dir().join(name))?.flatten() {
        std::fs::copy(e.path(), dst.join(e.file_name()))?;
    }
    let path = dst.join("model.safetensors");
    let bytes = std::fs::read(&path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    let data: Vec<Vec<u8>> = extra
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    for ((n, shape, _), d) in extra.iter().zip(&data) {
        let dtype = safetensors::Dtype::F32;
        views.push((
            n.clone(),
            safetensors::tensor::TensorView::new(dtype, shape.clone(), d)?,
        ));
    }
    safetensors::serialize_to_file(views, None, &path)?;
    let p = dst.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p)?)?;
    config(&mut v);
    std::fs::write(p, v.to_string()).context("writing config.json")
}

/// Per-layer FP8 KV scales for every layer of a `layers`-layer checkpoint, `k` and `v` each
/// of `shape`.
pub fn kv_scale_tensors(
    layers: usize,
    (k, v): (f32, f32),
    shape: &[usize],
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    (0..layers)
        .flat_map(|i| {
            [("k", k), ("v", v)].map(|(which, s)| {
                let n = shape.iter().product::<usize>();
                (
                    format!("model.layers.{i}.self_attn.{which}_scale"),
                    shape.to_vec(),
                    vec![s; n],
                )
            })
        })
        .collect()
}
