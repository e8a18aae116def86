//! Qwen3 and Llama checkpoints written by transformers reproduce its greedy tokens and float32
//! logits on the CPU backend, and deliberately broken checkpoints (wrong RoPE base, swapped
//! heads, the other norm convention) fail the same comparison.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

mod support;

use std::path::Path;

use metrale::{Engine, EngineOptions, ModelOptions};
use support::*;

fn check_fixture(dir: &Path, options: EngineOptions) -> Vec<Outcome> {
    let engine = Engine::load(dir, options).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    read_reference(dir)
        .unwrap()
        .iter()
        .map(|p| compare(&engine, p).unwrap())
        .collect()
}

#[test]
fn dense_fixtures_match_transformers() {
    let worst = check_fixtures(&["qwen3", "llama"], 5, &EngineOptions::default());
    eprintln!("worst logits relative L2 error over all dense fixtures: {worst:.3e}");
}

#[test]
fn yarn_fixture_matches_transformers_past_its_original_context() {
    // `qwen3-yarn-tiny`: YaRN with factor 4 over an original context of 32 positions; one
    // prompt runs past it. Both the frequencies and the factor on cos and sin must match.
    let dir = fixtures_dir().join("qwen3-yarn-tiny");
    let config = metrale_config::ModelConfig::from_dir(&dir).unwrap();
    let rope = &config.attention.rope;
    let metrale_config::RopeScaling::Yarn {
        original_max_position_embeddings,
        ..
    } = rope.scaling
    else {
        panic!(
            "{}: not a YaRN checkpoint: {:?}",
            dir.display(),
            rope.scaling
        );
    };
    assert!(rope.attention_scaling() > 1.0);
    let prompts = read_reference(&dir).unwrap();
    assert!(
        prompts
            .iter()
            .any(|p| p.prompt_ids.len() > original_max_position_embeddings)
    );
    for o in check_fixture(&dir, EngineOptions::default()) {
        assert!(o.failure.is_none(), "{}: {:?}", o.prompt, o.failure);
        assert!(
            o.steps >= 4,
            "{}: only {} steps compared",
            o.prompt,
            o.steps
        );
    }
}

#[test]
fn a_prompt_prefilled_whole_is_the_prompt_prefilled_in_chunks() {
    for name in ["qwen3-tiny", "qwen3-gqa4-hd128"] {
        check_staged_prefill(&fixtures_dir().join(name), || {
            std::sync::Arc::new(metrale_gpu_runtime::CpuBackend::default())
        });
    }
}

#[test]
fn chunked_prefill_gives_the_same_result() {
    // Prefill chunks of 5 tokens cut every prompt (and every block) in odd places.
    let options = EngineOptions::default().model(ModelOptions::default().max_batch_tokens(5));
    for dir in fixtures_of(&["qwen3"]).iter().take(2) {
        for o in check_fixture(dir, options.clone()) {
            assert!(
                o.failure.is_none(),
                "{}/{}: {:?}",
                dir.display(),
                o.prompt,
                o.failure
            );
        }
    }
}
