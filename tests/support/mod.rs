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
/// `qwen3_5-vl-tiny`, `qwen3_5_moe-vl-tiny` and `qwen3_next-b-tiny`. Every broken checkpoint in
/// `tests/mutations.rs` errs by far more.
pub const LOGITS_REL_L2: f64 = 3e-2;
/// Below this gap between the k-th and (k+1)-th router probability, an expert choice may flip
/// under bf16 rounding.
pub const ROUTE_TIE: f32 = 0.01;

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
    let req = GenerateRequest::new(Prompt::TokenIds(p.prompt_ids.clone()))
        .max_new_tokens(p.greedy_ids.len())
        .ignore_eos(true)
        .return_logits(true);
    let out = engine.generate(&req)?;
    let logits = out.logits.unwrap_or_default();
    let tie = p
        .margins
        .iter()
        .position(|&m| m < MARGIN)
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
        if e > LOGITS_REL_L2 {
            o.failure.get_or_insert(format!(
                "step {step}: logits relative L2 error {e:.4} > {LOGITS_REL_L2}"
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
/// least 4 steps, so the rule has something to fail on. Returns the worst logits error.
pub fn check_fixtures(types: &[&str], min: usize, options: &metrale::EngineOptions) -> f64 {
    let dirs = fixtures_of(types);
    assert!(
        dirs.len() >= min,
        "expected {min} fixtures of {types:?} under {}",
        fixtures_dir().display()
    );
    check_fixture_dirs(&dirs, options)
}

/// [`check_fixtures`] on the fixtures in `dirs`.
pub fn check_fixture_dirs(dirs: &[PathBuf], options: &metrale::EngineOptions) -> f64 {
    let (mut worst, mut failures) = (0.0f64, Vec::new());
    for dir in dirs {
        let engine =
            Engine::load(dir, options.clone()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let prompts = read_reference(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for p in prompts {
            let o = compare(&engine, &p)
                .unwrap_or_else(|e| panic!("{}/{}: {e}", dir.display(), p.name));
            worst = worst.max(o.worst_rel_l2);
            eprintln!(
                "{}/{}: {} steps, worst rel L2 {:.2e}",
                dir.display(),
                o.prompt,
                o.steps,
                o.worst_rel_l2
            );
            if o.steps < 4 {
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
