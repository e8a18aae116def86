//! The model shapes the benchmark builds with random weights, as their `config.json` files
//! would state them: Qwen3-8B and Qwen3.5-9B for the GPU, and tiny dense and hybrid shapes that
//! run the same code on the CPU backend.

use metrale_config::ModelConfig;

use crate::error::ModelError;

/// A dense Qwen3 shape as its `config.json` would state it.
#[allow(clippy::too_many_arguments)]
fn dense_qwen3(
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
) -> Result<ModelConfig, ModelError> {
    let text = format!(
        r#"{{"model_type": "qwen3", "hidden_size": {hidden}, "num_hidden_layers": {layers},
            "num_attention_heads": {heads}, "num_key_value_heads": {kv_heads}, "head_dim": {head_dim},
            "intermediate_size": {ffn}, "vocab_size": {vocab}, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": false,
            "hidden_act": "silu", "eos_token_id": 0}}"#
    );
    Ok(ModelConfig::from_json_str(
        &text,
        std::path::Path::new("<bench shape>"),
    )?)
}

/// The shape of Qwen3.5-9B's text model (no download): 32 layers, 24 Gated DeltaNet and 8
/// gated attention (every fourth), hidden 4096, 16/4 heads of 256 with a quarter rotated,
/// linear heads 16 key / 32 value of 128, FFN 12288, vocab 248320, and the one-layer MTP head
/// the checkpoint ships (`mtp_num_hidden_layers: 1`).
pub fn qwen3_5_9b() -> Result<ModelConfig, ModelError> {
    let text = r#"{"model_type": "qwen3_5_text", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "intermediate_size": 12288, "vocab_size": 248320, "rms_norm_eps": 1e-6,
        "full_attention_interval": 4, "attn_output_gate": true,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "tie_word_embeddings": false, "hidden_act": "silu",
        "mtp_num_hidden_layers": 1, "eos_token_id": 0}"#;
    Ok(ModelConfig::from_json_str(
        text,
        std::path::Path::new("<bench shape qwen3.5-9b>"),
    )?)
}

/// A tiny hybrid shape with a one-layer MTP head: the Gated DeltaNet and speculative paths of
/// the benchmark on the CPU backend.
pub fn tiny_hybrid_for_cpu() -> Result<ModelConfig, ModelError> {
    let text = r#"{"model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 96, "vocab_size": 256, "rms_norm_eps": 1e-6,
        "full_attention_interval": 4, "attn_output_gate": true,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_value_head_dim": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5},
        "max_position_embeddings": 4096, "tie_word_embeddings": false, "hidden_act": "silu",
        "mtp_num_hidden_layers": 1, "eos_token_id": 0}"#;
    Ok(ModelConfig::from_json_str(
        text,
        std::path::Path::new("<bench shape tiny hybrid>"),
    )?)
}

/// The shape of Qwen3-8B (no download).
pub fn qwen3_8b() -> Result<ModelConfig, ModelError> {
    dense_qwen3(4096, 36, 32, 8, 128, 12288, 151936)
}

/// A tiny dense shape: the same code path on the CPU backend.
pub fn tiny_for_cpu() -> Result<ModelConfig, ModelError> {
    dense_qwen3(64, 2, 4, 2, 16, 128, 256)
}
