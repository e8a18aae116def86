//! The work a benchmarked step does, which its rooflines divide by the measured ceilings:
//! matmul parameters (prefill FLOPs), the weight bytes a decode step reads (with the experts a
//! batch's rows choose and the storage format of each part), and the KV-cache and SSM-state
//! bytes each sequence adds.

use metrale_cache::KvDtype;
use metrale_config::{LayerType, ModelConfig};
use metrale_model_layers::layers::GdnShape;

use crate::options::Quantization;

/// Matmul parameters of one full-attention mixer (QKV with the output gate, O).
pub(super) fn attention_params(c: &ModelConfig) -> f64 {
    let (h, d) = (c.hidden_size as f64, c.attention.head_dim as f64);
    let q = c.attention.num_attention_heads as f64
        * d
        * if c.attention.attn_output_gate {
            2.0
        } else {
            1.0
        };
    let kv = 2.0 * c.attention.num_key_value_heads as f64 * d;
    h * (q + kv) + c.attention.num_attention_heads as f64 * d * h
}

/// The mixers' and dense FFNs' matmul parameters: those block FP8 quantizes, and the Gated
/// DeltaNet input projections, which stay bf16 under FP8 (the packs keep their a and b rows
/// in bf16, so the fused projection loads as bf16); and the number of sparse-MoE layers.
fn dense_params(c: &ModelConfig) -> (f64, f64, usize) {
    let h = c.hidden_size as f64;
    let (gdn_in, gdn_out) = GdnShape::from_config(c).map_or((0.0, 0.0), |g| {
        let v = (g.heads.num_v_heads * g.heads.v_head_dim) as f64;
        (h * g.heads.proj_width() as f64, v * h)
    });
    let (attn, mlp) = (attention_params(c), 3.0 * h * c.intermediate_size as f64);
    let (mut quantized, mut bf16, mut moe_layers) = (0.0, 0.0, 0);
    for (i, t) in c.layer_types.iter().enumerate() {
        match t {
            LayerType::FullAttention => quantized += attn,
            LayerType::LinearAttention => {
                quantized += gdn_out;
                bf16 += gdn_in;
            }
        }
        if c.layer_is_moe(i) {
            moe_layers += 1;
        } else {
            quantized += mlp;
        }
    }
    (quantized, bf16, moe_layers)
}

/// One sparse-MoE FFN's parameters besides its routed experts: (its projections, which FP8
/// quantizes — the shared expert —, and what stays bf16 — the router and the shared expert's
/// gate), and one routed expert's parameters.
fn moe_params(c: &ModelConfig) -> (f64, f64, f64) {
    let Some(m) = &c.moe else {
        return (0.0, 0.0, 0.0);
    };
    let h = c.hidden_size as f64;
    let shared = 3.0 * h * m.shared_expert_intermediate_size as f64;
    let gate = if m.shared_expert_intermediate_size > 0 {
        h
    } else {
        0.0
    };
    let expert = 3.0 * h * m.moe_intermediate_size as f64;
    (shared, m.num_experts as f64 * h + gate, expert)
}

/// Distinct experts a decode step of `batch` rows reads in each sparse-MoE layer, its rows'
/// choices spread evenly over the experts (as the benchmark's random routers spread them):
/// E (1 - (1 - K / E)^batch).
pub(super) fn experts_read(c: &ModelConfig, batch: usize) -> f64 {
    let Some(m) = &c.moe else {
        return 0.0;
    };
    let (e, k) = (m.num_experts as f64, m.num_experts_per_tok as f64);
    e * (1.0 - (1.0 - k / e).powi(batch as i32))
}

/// Matmul parameters touched per token (every projection, a token's routed experts, the LM head
/// included).
pub(super) fn matmul_params(c: &ModelConfig) -> f64 {
    let (quantized, gdn_in, moe_layers) = dense_params(c);
    let (shared, bf16, expert) = moe_params(c);
    let k = c.moe.as_ref().map_or(0, |m| m.num_experts_per_tok) as f64;
    let moe = moe_layers as f64 * (shared + bf16 + k * expert);
    quantized + gdn_in + moe + c.hidden_size as f64 * c.tokens.vocab_size as f64
}

/// Weight bytes a decode step of one row reads ([`decode_weight_bytes`]).
pub(super) fn weight_bytes(c: &ModelConfig, quantization: Quantization) -> f64 {
    decode_weight_bytes(c, quantization, 1)
}

/// Weight bytes a decode step of `batch` rows reads: every projection, the routed experts the
/// step's rows choose ([`experts_read`]) and the LM head (the embedding table too when it is
/// not tied to the LM head, counted once, as `matmul_params` counts the LM head). Under `Fp8`
/// the layers' projections and experts are a byte an element plus an f32 scale per 128 x 128
/// block; the LM head, the embedding, the routers and the Gated DeltaNet input projections
/// stay bf16.
pub(super) fn decode_weight_bytes(
    c: &ModelConfig,
    quantization: Quantization,
    batch: usize,
) -> f64 {
    let untied = if c.tokens.tie_word_embeddings {
        0.0
    } else {
        1.0
    };
    let head = (c.tokens.vocab_size * c.hidden_size) as f64;
    let projection_bytes = match quantization {
        Quantization::Fp8 => 1.0 + 4.0 / 16384.0,
        _ => 2.0,
    };
    let (quantized, gdn_in, moe_layers) = dense_params(c);
    let (shared, bf16, expert) = moe_params(c);
    let layers = moe_layers as f64;
    let projections = quantized + layers * (shared + experts_read(c, batch) * expert);
    projection_bytes * projections + 2.0 * (gdn_in + layers * bf16 + head * (1.0 + untied))
}

/// KV-cache bytes of one token over every attention layer (bf16 keys and values).
pub(super) fn kv_bytes_per_token(c: &ModelConfig, dtype: KvDtype) -> f64 {
    let layers = c
        .layer_types
        .iter()
        .filter(|t| **t == LayerType::FullAttention)
        .count() as f64;
    2.0 * dtype.bytes() as f64
        * (c.attention.num_key_value_heads * c.attention.head_dim) as f64
        * layers
}

/// Bytes of SSM state one sequence reads and writes per decode step (every GDN layer's
/// recurrent state and conv window, f32, read once and written once).
pub(super) fn ssm_bytes_per_seq(c: &ModelConfig) -> f64 {
    let Some(g) = GdnShape::from_config(c) else {
        return 0.0;
    };
    let hd = g.heads;
    let state = (hd.num_v_heads * hd.k_head_dim * hd.v_head_dim) as f64;
    let conv = (g.conv_kernel.saturating_sub(1) * hd.conv_dim()) as f64;
    let layers = c
        .layer_types
        .iter()
        .filter(|t| **t == LayerType::LinearAttention)
        .count() as f64;
    2.0 * 4.0 * (state + conv) * layers
}
