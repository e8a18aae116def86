//! The sampling surface against transformers (`reference_sampling.json`, written by
//! `xtask/fixtures/gen_fixtures.py` with one full float32 forward per step): greedy
//! continuations under the repetition penalty (RepetitionPenaltyLogitsProcessor), OpenAI-style
//! presence and frequency penalties and a logit bias match step for step while the processed
//! top-1 margin is clear, each step's top-20 logprobs (log_softmax of the raw logits) match
//! within the fixtures' logits tolerance, and tokens sampled at temperature 1 with min-p lie in
//! the set transformers' MinPLogitsWarper keeps. On the CPU backend, a dense and a hybrid
//! fixture.

#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;

use metrale::{Engine, EngineOptions, GenerateRequest, Prompt, SamplingParams};
use serde_json::Value;
use support::{LOGITS_REL_L2, MARGIN, fixtures_dir, read_reference};

/// The processed top-1 margin below which a token may differ from the reference: twice the
/// plain greedy `MARGIN` and 0.05 (a penalty divides or shifts both leaders by different
/// amounts, so their errors, each within `LOGITS_REL_L2` of float32's row, add up).
const PROCESSED_MARGIN: f32 = 2.0 * MARGIN + 0.05;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn f(v: &Value) -> f32 {
    v.as_f64().unwrap() as f32
}

/// The engine's sampling parameters of a reference case.
fn params_of(case: &Value) -> SamplingParams {
    let num = |k: &str, d: f32| case.get(k).map_or(d, f);
    let bias = case.get("logit_bias").map_or(Vec::new(), |b| {
        b.as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap() as u32, f(&p[1])))
            .collect()
    });
    SamplingParams::greedy()
        .repetition_penalty(num("repetition_penalty", 1.0))
        .presence_penalty(num("presence_penalty", 0.0))
        .frequency_penalty(num("frequency_penalty", 0.0))
        .logit_bias(bias)
        .top_logprobs(20)
}

fn check(dir: &Path) {
    let engine = Engine::load(dir, EngineOptions::default()).unwrap();
    let text = std::fs::read_to_string(dir.join("reference_sampling.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    // The reference's own greedy paths (`reference.json`), along which the min-p sets are.
    let greedy: Vec<Vec<u32>> = (read_reference(dir).unwrap().into_iter())
        .map(|r| r.greedy_ids)
        .collect();
    let (mut compared, mut worst) = (0usize, 0.0f32);
    for (pi, p) in doc["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&p["prompt_ids"]);
        for case in p["cases"].as_array().unwrap() {
            let name = format!("{}/{}/{}", dir.display(), p["name"], case["name"]);
            let steps = case["steps"].as_array().unwrap();
            let req = GenerateRequest::new(Prompt::TokenIds(prompt.clone()))
                .max_new_tokens(steps.len())
                .ignore_eos(true)
                .sampling(params_of(case));
            let out = engine.generate(&req).unwrap();
            let lps = out.logprobs.unwrap();
            for (i, s) in steps.iter().enumerate() {
                let want = s["token"].as_u64().unwrap() as u32;
                let clear = f(&s["margin"]) >= PROCESSED_MARGIN;
                if clear {
                    assert_eq!(out.token_ids[i], want, "{name}: step {i}");
                }
                // Logprobs of the same prefix: rank by rank within the logits tolerance (the
                // relative L2 bound on a row of this std), ids wherever the reference ranks
                // are apart by more than it.
                let tol = 3.0 * LOGITS_REL_L2 as f32 * f(&s["logits_std"]).max(1.0);
                let (rids, rlps) = (ids(&s["top_ids"]), &s["top_logprobs"]);
                let rlps: Vec<f32> = rlps.as_array().unwrap().iter().map(f).collect();
                assert_eq!(lps[i].top.len(), 20, "{name}: step {i}");
                for (j, &(id, lp)) in lps[i].top.iter().enumerate() {
                    let d = (lp - rlps[j]).abs();
                    worst = worst.max(d);
                    assert!(d <= tol, "{name}: step {i} rank {j}: {lp} vs {}", rlps[j]);
                    let apart = |k: usize| (rlps[j] - rlps[k]).abs() > 2.0 * tol;
                    if (j == 0 || apart(j - 1)) && (j + 1 == rlps.len() || apart(j + 1)) {
                        assert_eq!(id, rids[j], "{name}: step {i} rank {j}");
                    }
                }
                compared += 1;
                if !clear {
                    // A near tie: this step's logprobs had the reference's prefix, the next
                    // may not.
                    break;
                }
            }
        }
        // min-p: every token drawn at temperature 1 after the greedy prefix is in the set
        // transformers keeps, and more than one is drawn where more than one is kept.
        let plain = &greedy[pi];
        for (s, kept) in p["min_p_kept"].as_array().unwrap().iter().enumerate() {
            let kept = ids(kept);
            let mut seen = std::collections::BTreeSet::new();
            let context: Vec<u32> = prompt.iter().chain(&plain[..s]).copied().collect();
            for seed in 0..24 {
                let req = GenerateRequest::new(Prompt::TokenIds(context.clone()))
                    .max_new_tokens(1)
                    .ignore_eos(true)
                    .sampling(
                        SamplingParams::default()
                            .temperature(1.0)
                            .min_p(f(&p["min_p"]))
                            .seed(seed),
                    );
                let t = engine.generate(&req).unwrap().token_ids[0];
                assert!(kept.contains(&t), "min-p step {s}: {t} not in {kept:?}");
                seen.insert(t);
            }
            assert!(
                kept.len() == 1 || seen.len() > 1,
                "min-p step {s}: only {seen:?}"
            );
        }
    }
    assert!(
        compared >= 16,
        "{}: only {compared} steps compared",
        dir.display()
    );
    eprintln!(
        "{}: {compared} steps, worst logprob error {worst:.2e}",
        dir.display()
    );
}

#[test]
fn dense_sampling_matches_transformers() {
    check(&fixtures_dir().join("qwen3-tiny"));
}

#[test]
fn hybrid_sampling_matches_transformers() {
    check(&fixtures_dir().join("qwen3_5-tiny"));
}
