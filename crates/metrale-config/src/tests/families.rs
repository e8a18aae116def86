//! One test per supported family on a realistic `config.json`, checking every field a user of
//! the config reads.

use super::{parse, parse_value};
use crate::{
    LayerType, ModelConfig, ModelFamily, MoeConfig, NormConvention, RopeScaling,
    supported_model_types,
};
use serde_json::json;
use std::path::Path;

use LayerType::{FullAttention as F, LinearAttention as L};

/// `LLLF` repeated: the Qwen3.5 / Qwen3-Next pattern with interval 4.
fn every_fourth_full(layers: usize) -> Vec<LayerType> {
    (0..layers)
        .map(|i| if (i + 1) % 4 == 0 { F } else { L })
        .collect()
}

#[test]
fn qwen3_8b_published_config_with_generation_config() {
    let mut c = parse(include_str!("../../testdata/qwen3_8b.json")).unwrap();
    assert_eq!(c.family, ModelFamily::Qwen3);
    assert_eq!(c.checkpoint.model_type, "qwen3");
    assert_eq!(
        (c.hidden_size, c.num_hidden_layers, c.intermediate_size),
        (4096, 36, 12288)
    );
    assert_eq!(
        (
            c.attention.num_attention_heads,
            c.attention.num_key_value_heads,
            c.attention.head_dim
        ),
        (32, 8, 128)
    );
    assert_eq!(
        (c.tokens.vocab_size, c.attention.max_position_embeddings),
        (151936, 40960)
    );
    assert_eq!(c.rms_norm_eps, 1e-6);
    assert_eq!(c.attention.rope.theta, 1.0e6);
    assert_eq!(
        (
            c.attention.rope.rotary_dim,
            c.attention.rope.scaling.clone()
        ),
        (128, RopeScaling::None)
    );
    assert_eq!(c.layer_types, vec![F; 36]);
    assert_eq!(c.norm, NormConvention::Standard);
    assert!(
        !c.attention.attn_output_gate && !c.tokens.tie_word_embeddings && !c.checkpoint.has_vision
    );
    assert!(c.linear.is_none() && c.moe.is_none());
    assert_eq!(c.mtp_num_layers, 0);
    assert_eq!(c.checkpoint.torch_dtype.as_deref(), Some("bfloat16"));
    assert_eq!(
        (c.tokens.bos_token_id, c.tokens.eos_token_ids.clone()),
        (Some(151643), vec![151645])
    );
    let generation = include_str!("../../testdata/qwen3_8b_generation.json");
    c.apply_generation_config(generation, Path::new("/ckpt/generation_config.json"))
        .unwrap();
    assert_eq!(
        c.tokens.eos_token_ids,
        vec![151645, 151643],
        "config first, then generation, deduped"
    );
    // Qwen3-8B's card: temperature 0.6, top-p 0.95, top-k 20.
    let g = &c.checkpoint.generation;
    assert_eq!(
        (
            g.temperature,
            g.top_p,
            g.top_k,
            g.min_p,
            g.repetition_penalty
        ),
        (Some(0.6), Some(0.95), Some(20), None, None)
    );
}

#[test]
fn llama3_1_8b_published_config() {
    let c = parse(include_str!("../../testdata/llama3_1_8b.json")).unwrap();
    assert_eq!(c.family, ModelFamily::Llama);
    assert_eq!(
        (
            c.attention.num_attention_heads,
            c.attention.num_key_value_heads
        ),
        (32, 8)
    );
    assert_eq!(
        c.attention.head_dim, 128,
        "hidden_size / num_attention_heads"
    );
    assert_eq!((c.intermediate_size, c.tokens.vocab_size), (14336, 128256));
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.attention.rope.theta, 500000.0);
    assert_eq!(
        c.attention.rope.scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }
    );
    assert_eq!(c.tokens.eos_token_ids, vec![128001, 128008, 128009]);
    assert_eq!(c.tokens.bos_token_id, Some(128000));
    assert_eq!(c.layer_types, vec![F; 32]);
    assert_eq!(c.norm, NormConvention::Standard);
}

#[test]
fn llama_defaults_follow_transformers() {
    // LlamaConfig(): bos 1, eos 2, kv heads = heads, head_dim = hidden / heads, theta 10000.
    let c =
        parse_value(&json!({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4}))
            .unwrap();
    assert_eq!(
        (c.attention.num_key_value_heads, c.attention.head_dim),
        (4, 64)
    );
    assert_eq!(
        (c.tokens.bos_token_id, c.tokens.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    assert_eq!(
        (c.attention.rope.theta, c.attention.rope.rotary_dim),
        (10000.0, 64)
    );
    assert_eq!(
        (
            c.tokens.vocab_size,
            c.attention.max_position_embeddings,
            c.intermediate_size
        ),
        (32000, 2048, 11008)
    );
}

#[test]
fn qwen3_5_9b_multimodal_wrapper_reads_text_config() {
    let c = parse(include_str!("../../testdata/qwen3_5_9b.json")).unwrap();
    assert_eq!(c.family, ModelFamily::Qwen35);
    assert_eq!(c.checkpoint.model_type, "qwen3_5");
    assert!(c.checkpoint.has_vision);
    assert_eq!(
        (c.hidden_size, c.num_hidden_layers, c.intermediate_size),
        (4096, 32, 12288)
    );
    assert_eq!(
        (
            c.attention.num_attention_heads,
            c.attention.num_key_value_heads,
            c.attention.head_dim
        ),
        (16, 4, 256)
    );
    assert_eq!(c.tokens.vocab_size, 248320);
    assert_eq!(c.layer_types, every_fourth_full(32));
    assert_eq!(c.num_layers_of(F), 8);
    assert_eq!(c.norm, NormConvention::ZeroCentred);
    assert_eq!(c.gdn_norm(), NormConvention::Standard);
    assert!(c.attention.attn_output_gate);
    let lin = c.linear.clone().unwrap();
    assert_eq!((lin.num_key_heads, lin.num_value_heads), (16, 32));
    assert_eq!(
        (lin.key_head_dim, lin.value_head_dim, lin.conv_kernel_dim),
        (128, 128, 4)
    );
    assert_eq!(lin.conv_dim(), 2 * 16 * 128 + 32 * 128);
    assert!(c.moe.is_none() && !c.layer_is_moe(0));
    assert_eq!(
        (
            c.attention.rope.theta,
            c.attention.rope.partial_rotary_factor,
            c.attention.rope.rotary_dim
        ),
        (1.0e7, 0.25, 64)
    );
    assert_eq!(c.attention.rope.mrope_section, Some(vec![11, 11, 10]));
    assert!(c.attention.rope.mrope_interleaved);
    assert_eq!(c.mtp_num_layers, 1);
    assert_eq!(
        (c.tokens.eos_token_ids.clone(), c.tokens.bos_token_id),
        (vec![248044], None)
    );
    assert_eq!(c.checkpoint.torch_dtype.as_deref(), Some("bfloat16"));
    assert!(!c.tokens.tie_word_embeddings);
}

#[test]
fn qwen3_5_text_only_config_matches_the_wrapper() {
    let wrapper: serde_json::Value =
        serde_json::from_str(include_str!("../../testdata/qwen3_5_9b.json")).unwrap();
    let mut text = wrapper["text_config"].clone();
    text["tie_word_embeddings"] = json!(false);
    let c = parse_value(&text).unwrap();
    let w = parse_value(&wrapper).unwrap();
    assert_eq!(c.checkpoint.model_type, "qwen3_5_text");
    assert!(!c.checkpoint.has_vision);
    assert_eq!(
        (
            c.layer_types.clone(),
            c.attention.rope.clone(),
            c.linear.clone()
        ),
        (w.layer_types, w.attention.rope, w.linear)
    );
}

#[test]
fn qwen3_next_80b_published_config() {
    let c = parse(include_str!("../../testdata/qwen3_next_80b_a3b.json")).unwrap();
    assert_eq!(c.family, ModelFamily::Qwen3Next);
    assert_eq!(
        (c.hidden_size, c.num_hidden_layers, c.intermediate_size),
        (2048, 48, 5120)
    );
    assert_eq!(
        (
            c.attention.num_attention_heads,
            c.attention.num_key_value_heads,
            c.attention.head_dim
        ),
        (16, 2, 256)
    );
    assert_eq!(
        c.layer_types,
        every_fourth_full(48),
        "full_attention_interval 4"
    );
    assert_eq!(
        (c.attention.rope.theta, c.attention.rope.rotary_dim),
        (1.0e7, 64),
        "top-level partial_rotary_factor"
    );
    assert_eq!(c.norm, NormConvention::ZeroCentred);
    assert!(c.attention.attn_output_gate);
    let moe = c.moe.clone().unwrap();
    let expected = MoeConfig {
        num_experts: 512,
        num_experts_per_tok: 10,
        moe_intermediate_size: 512,
        shared_expert_intermediate_size: 512,
        norm_topk_prob: true,
        decoder_sparse_step: 1,
        mlp_only_layers: vec![],
    };
    assert_eq!(moe, expected);
    assert!((0..48).all(|i| c.layer_is_moe(i)));
    assert_eq!(
        c.mtp_num_layers, 0,
        "the published config declares no MTP layer count"
    );
    assert_eq!(
        (c.tokens.bos_token_id, c.tokens.eos_token_ids.clone()),
        (Some(151643), vec![151645])
    );
}

#[test]
fn qwen3_next_tiny_config_written_by_transformers() {
    let c = parse(include_str!("../../testdata/tiny_qwen3_next.json")).unwrap();
    assert_eq!(c.family, ModelFamily::Qwen3Next);
    assert_eq!(c.layer_types, vec![L, L, L, F]);
    assert_eq!(
        (
            c.attention.head_dim,
            c.attention.rope.rotary_dim,
            c.attention.rope.theta
        ),
        (8, 2, 10000.0)
    );
    let moe: Vec<bool> = (0..4).map(|i| c.layer_is_moe(i)).collect();
    assert_eq!(moe, vec![true, false, true, true], "mlp_only_layers [1]");
    assert_eq!(c.checkpoint.torch_dtype.as_deref(), Some("float32"));
    assert!(c.tokens.eos_token_ids.is_empty() && c.tokens.bos_token_id.is_none());
}

#[test]
fn qwen3_5_moe_35b_a3b_published_wrapper() {
    let c = parse(include_str!("../../testdata/qwen3_5_35b_a3b.json")).unwrap();
    assert_eq!(c.family, ModelFamily::Qwen35Moe);
    assert!(c.checkpoint.has_vision);
    assert_eq!(
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.attention.num_key_value_heads
        ),
        (2048, 40, 2)
    );
    assert_eq!(c.intermediate_size, 0, "no dense MLP in this family");
    assert_eq!(c.layer_types, every_fourth_full(40));
    let moe = c.moe.clone().unwrap();
    assert_eq!((moe.num_experts, moe.num_experts_per_tok), (256, 8));
    assert_eq!(
        (
            moe.moe_intermediate_size,
            moe.shared_expert_intermediate_size
        ),
        (512, 512)
    );
    assert!(
        moe.norm_topk_prob,
        "Qwen3_5MoeTopKRouter always renormalises"
    );
    assert!((0..40).all(|i| c.layer_is_moe(i)));
    assert_eq!(c.mtp_num_layers, 1);
    assert_eq!(c.norm, NormConvention::ZeroCentred);
}

#[test]
fn qwen3_5_moe_tiny_wrapper_written_by_transformers() {
    let c = parse(include_str!("../../testdata/tiny_qwen3_5_moe.json")).unwrap();
    assert_eq!(
        (c.family, c.checkpoint.model_type.as_str()),
        (ModelFamily::Qwen35Moe, "qwen3_5_moe")
    );
    assert!(c.checkpoint.has_vision);
    assert_eq!(c.layer_types, vec![L, L, L, F]);
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (
            moe.num_experts,
            moe.num_experts_per_tok,
            moe.moe_intermediate_size
        ),
        (4, 2, 16)
    );
    assert_eq!(c.linear.clone().unwrap().conv_dim(), 64);
}

#[test]
fn from_dir_reads_both_files() {
    let dir = tempfile::tempdir().unwrap();
    let config = include_str!("../../testdata/qwen3_8b.json");
    std::fs::write(dir.path().join(ModelConfig::CONFIG_FILE), config).unwrap();
    let generation = json!({"eos_token_id": 7, "bos_token_id": 9});
    let generation_path = dir.path().join(ModelConfig::GENERATION_CONFIG_FILE);
    std::fs::write(generation_path, generation.to_string()).unwrap();
    let c = ModelConfig::from_dir(dir.path()).unwrap();
    assert_eq!(c.tokens.eos_token_ids, vec![151645, 7]);
    assert_eq!(
        c.tokens.bos_token_id,
        Some(151643),
        "the config's bos is kept"
    );
}

#[test]
fn every_supported_type_parses_with_defaults_alone() {
    for model_type in supported_model_types() {
        let value = if model_type == "qwen3_5" || model_type == "qwen3_5_moe" {
            json!({"model_type": model_type, "text_config": {}})
        } else {
            json!({"model_type": model_type})
        };
        let c = parse_value(&value).unwrap_or_else(|e| panic!("{model_type}: {e}"));
        assert_eq!(c.layer_types.len(), c.num_hidden_layers, "{model_type}");
        assert_eq!(c.family.is_hybrid(), c.linear.is_some(), "{model_type}");
    }
}
