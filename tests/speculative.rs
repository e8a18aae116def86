//! Speculative decoding through the facade: `generate_direct` with the MTP head drafting gives
//! the engine's plain greedy tokens and logits (bitwise) on every hybrid fixture with a
//! synthetic head; so does the engine's scheduler with the head drafting, for concurrent
//! requests; the engine refuses external drafts.

#![allow(clippy::unwrap_used)]

#[path = "../crates/metrale-model-engine/tests/support/mod.rs"]
mod engine_support;

use std::ops::ControlFlow;

use engine_support::{HYBRID, MtpFixture};
use metrale::{
    Engine, EngineOptions, GateOptions, GenerateRequest, KvCacheDtype, ModelOptions, Prompt,
    Speculative, generate_direct,
};

fn request(prompt: &[u32]) -> GenerateRequest {
    GenerateRequest::new(Prompt::TokenIds(prompt.to_vec()))
        .max_new_tokens(16)
        .ignore_eos(true)
        .return_logits(true)
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn generate_direct_with_mtp_gives_the_engines_greedy_output() {
    for name in HYBRID {
        let fx = MtpFixture::new(name);
        let engine = Engine::load(fx.path(), EngineOptions::default()).unwrap();
        let options = EngineOptions::default().model(
            ModelOptions::default()
                .speculative(Speculative::Mtp)
                .num_draft_tokens(3),
        );
        for prompt in fx.prompts().iter().take(2) {
            let want = engine.generate(&request(prompt)).unwrap();
            let mut streamed = Vec::new();
            let got = generate_direct(fx.path(), options.clone(), &request(prompt), |t, _| {
                streamed.push(t);
                ControlFlow::Continue(())
            })
            .unwrap();
            assert_eq!(got.token_ids, want.token_ids, "{name}");
            assert_eq!(streamed, want.token_ids, "{name}: streamed tokens");
            assert_eq!(got.finish_reason, want.finish_reason, "{name}");
            assert!(
                bits(got.logits.as_deref().unwrap()) == bits(want.logits.as_deref().unwrap()),
                "{name}: logits"
            );
        }
    }
}

/// The engine with the MTP head drafting (the gate off, so every decode step verifies) gives
/// the plain engine's greedy tokens and logits for concurrent requests of different lengths,
/// and reports its drafts in the metrics; with bf16 and with FP8 KV caches (a rejected
/// draft's e4m3 bytes are written over as its bf16 values are).
#[test]
fn the_engine_with_mtp_gives_the_plain_engines_greedy_output() {
    mtp_gives_the_plain_greedy_output(KvCacheDtype::Bf16);
    mtp_gives_the_plain_greedy_output(KvCacheDtype::Fp8);
}

fn mtp_gives_the_plain_greedy_output(kv: KvCacheDtype) {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let model = ModelOptions::default().kv_cache_dtype(kv);
    let plain = Engine::load(fx.path(), EngineOptions::default().model(model.clone())).unwrap();
    let spec = Engine::load(
        fx.path(),
        EngineOptions::default()
            .model(model.speculative(Speculative::Mtp).num_draft_tokens(2))
            .speculation_gate(GateOptions::default().enabled(false)),
    )
    .unwrap();
    let reqs: Vec<GenerateRequest> = fx
        .prompts()
        .iter()
        .zip([3, 16, 9, 1])
        .map(|(p, n)| request(p).max_new_tokens(n))
        .collect();
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| spec.submit(r.clone()).unwrap())
        .collect();
    for (r, h) in reqs.iter().zip(handles) {
        let got = h.wait().unwrap();
        let want = plain.generate(r).unwrap();
        assert_eq!(got.token_ids, want.token_ids);
        assert_eq!(got.finish_reason, want.finish_reason);
        assert!(bits(got.logits.as_deref().unwrap()) == bits(want.logits.as_deref().unwrap()));
    }
    let m = spec.metrics();
    let sp = m.speculation.unwrap();
    assert!(m.steps.verify_steps > 0 && sp.drafted > 0, "{m:?}");
    assert!(sp.on);
    assert!(sp.mean_acceptance_length >= 1.0);
    assert_eq!(plain.metrics().speculation, None);
}

#[test]
fn the_engine_refuses_external_drafts() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let options =
        EngineOptions::default().model(ModelOptions::default().speculative(Speculative::External));
    let e = Engine::load(fx.path(), options).unwrap_err().to_string();
    assert!(e.contains("speculative"), "{e}");
}
