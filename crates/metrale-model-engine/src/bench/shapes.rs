//! The model shapes the benchmark builds with random weights, as their `config.json` files
//! would state them: Qwen3-8B, Qwen3.5-9B and the sparse-MoE Qwen3.5-35B-A3B for the GPU, and
//! for tensor parallelism Qwen3-32B and a Qwen3-Next-80B-A3B-shaped hybrid MoE; tiny
//! dense, hybrid and MoE shapes that run the same code on the CPU backend (one with Qwen3's
//! vocabulary, for the real tokenizer),
//! and small ones wide enough for the decode GEMM's staged input
//! (`decode_staging_shapes_for_cpu`).

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

/// A Qwen3.5 hybrid shape (every fourth layer gated attention, the others Gated DeltaNet, a
/// causal conv of 4) as its `config.json` would state it.
struct Hybrid {
    hidden: usize,
    layers: usize,
    /// Query and key/value heads of the attention layers, and their width.
    heads: (usize, usize, usize),
    ffn: usize,
    vocab: usize,
    /// Key heads, value heads and the width of both, of the GDN layers.
    linear: (usize, usize, usize),
    /// Share of each attention head's dimensions rotated.
    rotary: f32,
    max_positions: usize,
    mtp_layers: usize,
    /// Sparse-MoE FFNs in every layer (`ffn` then unused): routed experts, experts per token,
    /// one expert's width and the shared expert's.
    moe: Option<(usize, usize, usize, usize)>,
}

impl Hybrid {
    fn config(&self, name: &str) -> Result<ModelConfig, ModelError> {
        let Hybrid {
            hidden,
            layers,
            heads: (heads, kv_heads, head_dim),
            ffn,
            vocab,
            linear: (k_heads, v_heads, linear_dim),
            rotary,
            max_positions,
            mtp_layers,
            moe,
        } = *self;
        let (model_type, moe) = match moe {
            Some((experts, top_k, expert_ffn, shared_ffn)) => (
                "qwen3_5_moe_text",
                format!(
                    r#""num_experts": {experts}, "num_experts_per_tok": {top_k},
                    "moe_intermediate_size": {expert_ffn},
                    "shared_expert_intermediate_size": {shared_ffn}, "#
                ),
            ),
            None => ("qwen3_5_text", String::new()),
        };
        let text = format!(
            r#"{{"model_type": "{model_type}", {moe}"hidden_size": {hidden}, "num_hidden_layers": {layers},
            "num_attention_heads": {heads}, "num_key_value_heads": {kv_heads}, "head_dim": {head_dim},
            "intermediate_size": {ffn}, "vocab_size": {vocab}, "rms_norm_eps": 1e-6,
            "full_attention_interval": 4, "attn_output_gate": true,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": {linear_dim},
            "linear_num_key_heads": {k_heads}, "linear_num_value_heads": {v_heads},
            "linear_value_head_dim": {linear_dim},
            "rope_parameters": {{"rope_type": "default", "rope_theta": 10000000.0,
                "partial_rotary_factor": {rotary}}},
            "max_position_embeddings": {max_positions}, "tie_word_embeddings": false,
            "hidden_act": "silu", "mtp_num_hidden_layers": {mtp_layers}, "eos_token_id": 0}}"#
        );
        let path = format!("<bench shape {name}>");
        Ok(ModelConfig::from_json_str(
            &text,
            std::path::Path::new(&path),
        )?)
    }
}

/// The shape of Qwen3.5-9B's text model (no download): 32 layers, 24 Gated DeltaNet and 8
/// gated attention (every fourth), hidden 4096, 16/4 heads of 256 with a quarter rotated,
/// linear heads 16 key / 32 value of 128, FFN 12288, vocab 248320, and the one-layer MTP head
/// the checkpoint ships (`mtp_num_hidden_layers: 1`).
pub fn qwen3_5_9b() -> Result<ModelConfig, ModelError> {
    Hybrid {
        hidden: 4096,
        layers: 32,
        heads: (16, 4, 256),
        ffn: 12288,
        vocab: 248320,
        linear: (16, 32, 128),
        rotary: 0.25,
        max_positions: 262144,
        mtp_layers: 1,
        moe: None,
    }
    .config("qwen3.5-9b")
}

/// The shape of Qwen3.5-35B-A3B's text model (no download): 40 layers, 30 Gated DeltaNet and 10
/// gated attention (every fourth), hidden 2048, 16/2 heads of 256 with a quarter rotated, linear
/// heads 16 key / 32 value of 128, a sparse-MoE FFN in every layer (256 experts of 512, 8 per
/// token, a gated shared expert of 512), vocab 248320, and the one-layer MTP head.
pub fn qwen3_5_35b_a3b() -> Result<ModelConfig, ModelError> {
    Hybrid {
        hidden: 2048,
        layers: 40,
        heads: (16, 2, 256),
        ffn: 0,
        vocab: 248320,
        linear: (16, 32, 128),
        rotary: 0.25,
        max_positions: 262144,
        mtp_layers: 1,
        moe: Some((256, 8, 512, 512)),
    }
    .config("qwen3.5-35b-a3b")
}

/// A hybrid sparse-MoE shape of Qwen3-Next-80B-A3B's dimensions (no download), built as the
/// Qwen3.5 MoE family (the same tensors and bytes; Qwen3-Next's checkpoints order the GDN input
/// projection's rows per key head, which changes no figure): 48 layers, 36 Gated DeltaNet and
/// 12 gated attention (every fourth), hidden 2048, 16/2 heads of 256 with a quarter rotated,
/// linear heads 16 key / 32 value of 128, a sparse-MoE FFN in every layer (512 experts of 512,
/// 10 per token, a gated shared expert of 512), vocab 151936; without its MTP head, which a
/// decode step does not run.
pub fn qwen3_next_80b_a3b() -> Result<ModelConfig, ModelError> {
    Hybrid {
        hidden: 2048,
        layers: 48,
        heads: (16, 2, 256),
        ffn: 0,
        vocab: 151936,
        linear: (16, 32, 128),
        rotary: 0.25,
        max_positions: 262144,
        mtp_layers: 0,
        moe: Some((512, 10, 512, 512)),
    }
    .config("qwen3-next-80b-a3b")
}

/// A tiny hybrid sparse-MoE shape: the expert path of the benchmark on the CPU backend.
pub fn tiny_moe_for_cpu() -> Result<ModelConfig, ModelError> {
    Hybrid {
        hidden: 64,
        layers: 4,
        heads: (4, 2, 16),
        ffn: 0,
        vocab: 256,
        linear: (2, 4, 8),
        rotary: 0.5,
        max_positions: 4096,
        mtp_layers: 0,
        moe: Some((8, 2, 32, 48)),
    }
    .config("tiny moe")
}

/// A tiny hybrid shape with a one-layer MTP head: the Gated DeltaNet and speculative paths of
/// the benchmark on the CPU backend.
pub fn tiny_hybrid_for_cpu() -> Result<ModelConfig, ModelError> {
    Hybrid {
        hidden: 64,
        layers: 4,
        heads: (4, 2, 16),
        ffn: 96,
        vocab: 256,
        linear: (2, 4, 8),
        rotary: 0.5,
        max_positions: 4096,
        mtp_layers: 1,
        moe: None,
    }
    .config("tiny hybrid")
}

/// The shape of Qwen3-8B (no download).
pub fn qwen3_8b() -> Result<ModelConfig, ModelError> {
    dense_qwen3(4096, 36, 32, 8, 128, 12288, 151936)
}

/// The shape of Qwen3-32B (no download): 64 layers, hidden 5120, 64/8 heads of 128, FFN 25600,
/// vocab 151936.
pub fn qwen3_32b() -> Result<ModelConfig, ModelError> {
    dense_qwen3(5120, 64, 64, 8, 128, 25600, 151936)
}

/// A tiny dense shape: the same code path on the CPU backend.
pub fn tiny_for_cpu() -> Result<ModelConfig, ModelError> {
    dense_qwen3(64, 2, 4, 2, 16, 128, 256)
}

/// A tiny dense shape with Qwen3's vocabulary (151,936 ids), one layer of hidden size 32: the
/// serving ladder's constrained requests with the real Qwen3 tokenizer on the CPU backend.
pub fn tiny_qwen3_vocab_for_cpu() -> Result<ModelConfig, ModelError> {
    dense_qwen3(32, 1, 1, 1, 32, 64, 151936)
}

/// A dense and a hybrid shape small enough for the CPU backend whose projections' inputs (512
/// and 1024) cut into k segments of whole stages, so decode steps of 17..128 rows give the
/// decode GEMM its x as stage images (`ops_gemm::linear_stream_tma_takes_images`); the tiny
/// shapes' (64..256 inputs: segments of one chunk) never do.
pub fn decode_staging_shapes_for_cpu() -> Result<[ModelConfig; 2], ModelError> {
    let hybrid = Hybrid {
        hidden: 512,
        layers: 4,
        heads: (4, 2, 128),
        ffn: 1024,
        vocab: 256,
        linear: (2, 4, 128),
        rotary: 0.25,
        max_positions: 4096,
        mtp_layers: 0,
        moe: None,
    };
    Ok([
        dense_qwen3(512, 2, 4, 2, 128, 1024, 256)?,
        hybrid.config("staged hybrid")?,
    ])
}
