//! Speculative decoding through the facade: `generate_direct` with the MTP head drafting gives
//! the engine's plain greedy tokens and logits (bitwise) on every hybrid fixture with a
//! synthetic head; the engine refuses speculative options it does not run yet.

#![allow(clippy::unwrap_used)]

#[path = "../crates/metrale-model-engine/tests/support/mod.rs"]
mod support;

use std::ops::ControlFlow;

use metrale::{
    Engine, EngineOptions, GenerateRequest, ModelOptions, Prompt, Speculative, generate_direct,
};
use support::{HYBRID, MtpFixture};

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
        let options = EngineOptions {
            model: ModelOptions {
                speculative: Speculative::Mtp,
                num_draft_tokens: 3,
                ..Default::default()
            },
            ..Default::default()
        };
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

#[test]
fn the_engine_refuses_speculative_options_it_does_not_run() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let options = EngineOptions {
        model: ModelOptions {
            speculative: Speculative::Mtp,
            ..Default::default()
        },
        ..Default::default()
    };
    let e = Engine::load(fx.path(), options).unwrap_err().to_string();
    assert!(e.contains("speculative"), "{e}");
}
