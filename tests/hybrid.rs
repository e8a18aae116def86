//! Qwen3.5, Qwen3-Next and Qwen3.5-MoE checkpoints written by transformers (Gated DeltaNet and
//! gated attention layers, dense and MoE FFNs) reproduce its greedy tokens and float32 logits on
//! the CPU backend, whole and with prefill cut into chunks.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

mod common;

use common::*;
use metrale::{Engine, EngineOptions, ModelOptions};

const HYBRID: &[&str] = &["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"];

fn check(options: EngineOptions) -> f64 {
    let dirs = fixtures_of(HYBRID);
    assert!(
        dirs.len() >= 3,
        "expected the three hybrid fixtures under {}",
        fixtures_dir().display()
    );
    let mut worst = 0.0f64;
    let mut failures = Vec::new();
    for dir in &dirs {
        let engine =
            Engine::load(dir, options.clone()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for p in read_reference(dir).unwrap() {
            let o = compare(&engine, &p).unwrap();
            worst = worst.max(o.worst_rel_l2);
            eprintln!(
                "{}/{}: {} steps, worst rel L2 {:.2e}",
                dir.display(),
                o.prompt,
                o.steps,
                o.worst_rel_l2
            );
            if let Some(f) = o.failure {
                failures.push(format!("{}/{}: {f}", dir.display(), o.prompt));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    worst
}

#[test]
fn hybrid_fixtures_match_transformers() {
    let worst = check(EngineOptions::default());
    eprintln!("worst logits relative L2 error over the hybrid fixtures: {worst:.3e}");
}

#[test]
fn hybrid_chunked_prefill_matches_transformers() {
    // 37-token chunks split GDN chunks of 64 and KV blocks of 16 in odd places.
    check(EngineOptions {
        model: ModelOptions {
            max_batch_tokens: 37,
            ..Default::default()
        },
        ..Default::default()
    });
}
