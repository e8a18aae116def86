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
    let worst = check_fixtures(&["qwen3", "llama"], 4, &EngineOptions::default());
    eprintln!("worst logits relative L2 error over all dense fixtures: {worst:.3e}");
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
