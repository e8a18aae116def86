//! Qwen3.5, Qwen3-Next and Qwen3.5-MoE checkpoints written by transformers (Gated DeltaNet and
//! gated attention layers, dense and MoE FFNs, causal-LM and multimodal-wrapper layouts)
//! reproduce its greedy tokens and float32 logits on the CPU backend, whole and with prefill cut
//! into chunks.

mod support;

use metrale::{Engine, EngineOptions, KvCacheDtype, ModelOptions};
use support::*;

/// Every hybrid `model_type`, the multimodal wrappers (`qwen3_5`, `qwen3_5_moe`) included.
const HYBRID: &[&str] = &[
    "qwen3_5_text",
    "qwen3_next",
    "qwen3_5_moe_text",
    "qwen3_5",
    "qwen3_5_moe",
];

/// The hybrid fixtures: `qwen3_5-tiny`, `qwen3_next-tiny`, `qwen3_5_moe-tiny`, then
/// `qwen3_5-vl-tiny`, `qwen3_5_moe-vl-tiny` (wrappers with a vision tower),
/// `qwen3_next-b-tiny` and `qwen3_5_moe-fp8-tiny` (a block-FP8 pack).
const HYBRID_FIXTURES: usize = 7;

#[test]
fn hybrid_fixtures_match_transformers() {
    let worst = check_fixtures(HYBRID, HYBRID_FIXTURES, &EngineOptions::default());
    eprintln!("worst logits relative L2 error over the hybrid fixtures: {worst:.3e}");
}

/// With an FP8 KV cache on the gated attention layers (scales 1.0), every hybrid fixture passes
/// the FP8 rule, the block-FP8 pack included.
#[test]
fn hybrid_fixtures_match_transformers_with_an_fp8_kv_cache() {
    let fp8 = ModelOptions::default().kv_cache_dtype(KvCacheDtype::Fp8);
    let options = EngineOptions::default().model(fp8);
    // Three prompts reach a near tie (under 0.4) or a routing near tie at their second step
    // under FP8: each prompt compares at least its first step, the others 3 to 12.
    let rule = Rule {
        min_steps: 1,
        ..Rule::FP8_KV
    };
    let worst = check_fixtures_by(HYBRID, HYBRID_FIXTURES, &options, rule);
    eprintln!("worst logits relative L2 error over the hybrid fixtures, FP8 KV: {worst:.3e}");
}

#[test]
fn hybrid_chunked_prefill_matches_transformers() {
    // 37-token chunks split GDN chunks of 64 and KV blocks of 16 in odd places.
    let options = EngineOptions::default().model(ModelOptions::default().max_batch_tokens(37));
    check_fixtures(HYBRID, HYBRID_FIXTURES, &options);
}

#[test]
fn wrapper_checkpoints_load_their_text_model_and_say_the_vision_tower_is_skipped() {
    let dirs = fixtures_of(&["qwen3_5", "qwen3_5_moe"]);
    assert_eq!(dirs.len(), 2, "the two multimodal wrapper fixtures");
    for dir in dirs {
        // The checkpoint really carries vision weights beside `model.language_model.*`.
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let names = st.names();
        let vision = names
            .iter()
            .filter(|n| n.starts_with("model.visual."))
            .count();
        assert!(vision > 0, "{}: no vision weights", dir.display());
        assert!(
            names
                .iter()
                .any(|n| n.starts_with("model.language_model.layers.")),
            "{}: no model.language_model.* weights",
            dir.display()
        );
        let engine = Engine::load(&dir, EngineOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let config = engine.config();
        assert!(
            config.checkpoint.has_vision,
            "{}: the engine must report the vision tower it does not run",
            dir.display()
        );
        assert!(
            config.checkpoint.model_type == "qwen3_5"
                || config.checkpoint.model_type == "qwen3_5_moe"
        );
    }
}

#[test]
fn an_fp8_hybrid_moe_pack_matches_transformers_and_quantizing_its_source_gives_the_pack() {
    // `qwen3_5_moe-fp8-tiny`: attention, GDN q/k/v, z and out, and every expert's projections
    // in e4m3 with block scales (the GDN a and b projections, routers and the shared expert's
    // gate in bf16); the reference is transformers in float32 on the dequantized weights.
    let dir = fixtures_dir().join("qwen3_5_moe-fp8-tiny");
    let config = metrale_config::ModelConfig::from_dir(&dir).unwrap();
    assert!(config.checkpoint.quantization.is_some() && config.moe.is_some());
    assert_fixture_passes(&dir);
    assert_source_quantized_at_load_is_the_pack(&dir);
}
