//! Qwen3.5, Qwen3-Next and Qwen3.5-MoE checkpoints written by transformers (Gated DeltaNet and
//! gated attention layers, dense and MoE FFNs) reproduce its greedy tokens and float32 logits on
//! the CPU backend, whole and with prefill cut into chunks.

mod common;

use common::*;
use metrale::{EngineOptions, ModelOptions};

const HYBRID: &[&str] = &["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"];

#[test]
fn hybrid_fixtures_match_transformers() {
    let worst = check_fixtures(HYBRID, 3, &EngineOptions::default());
    eprintln!("worst logits relative L2 error over the hybrid fixtures: {worst:.3e}");
}

#[test]
fn hybrid_chunked_prefill_matches_transformers() {
    // 37-token chunks split GDN chunks of 64 and KV blocks of 16 in odd places.
    let options = EngineOptions {
        model: ModelOptions {
            max_batch_tokens: 37,
            ..Default::default()
        },
        ..Default::default()
    };
    check_fixtures(HYBRID, 3, &options);
}
