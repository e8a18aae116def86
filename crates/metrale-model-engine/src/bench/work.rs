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

/// The mixers' and dense FFNs' matmul parameters: those block FP8 quantizes (the Gated DeltaNet
/// input projections' q/k/v and z rows among them), and those that stay bf16 under FP8 (the
/// Gated DeltaNet input projections' b and a rows, which the packs keep in bf16); and the number
/// of sparse-MoE layers.
fn dense_params(c: &ModelConfig) -> (f64, f64, usize) {
    let h = c.hidden_size as f64;
    let (gdn_qkvz, gdn_ba, gdn_out) = GdnShape::from_config(c).map_or((0.0, 0.0, 0.0), |g| {
        let v = (g.heads.num_v_heads * g.heads.v_head_dim) as f64;
        let ba = 2.0 * g.heads.num_v_heads as f64;
        (h * (g.heads.proj_width() as f64 - ba), h * ba, v * h)
    });
    let (attn, mlp) = (attention_params(c), 3.0 * h * c.intermediate_size as f64);
    let (mut quantized, mut bf16, mut moe_layers) = (0.0, 0.0, 0);
    for (i, t) in c.layer_types.iter().enumerate() {
        match t {
            LayerType::FullAttention => quantized += attn,
            LayerType::LinearAttention => {
                quantized += gdn_qkvz + gdn_out;
                bf16 += gdn_ba;
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
    let (quantized, gdn_ba, moe_layers) = dense_params(c);
    let (shared, bf16, expert) = moe_params(c);
    let k = c.moe.as_ref().map_or(0, |m| m.num_experts_per_tok) as f64;
    let moe = moe_layers as f64 * (shared + bf16 + k * expert);
    quantized + gdn_ba + moe + c.hidden_size as f64 * c.tokens.vocab_size as f64
}

/// Weight bytes a decode step of one row reads ([`decode_weight_bytes`]).
pub(super) fn weight_bytes(c: &ModelConfig, quantization: Quantization) -> f64 {
    decode_weight_bytes(c, quantization, 1)
}

/// Weight bytes a decode step of `batch` rows reads: every projection, the routed experts the
/// step's rows choose ([`experts_read`]) and the LM head (the embedding table too when it is
/// not tied to the LM head, counted once, as `matmul_params` counts the LM head). Under `Fp8`
/// the layers' projections and experts are a byte an element plus an f32 scale per 128 x 128
/// block; the LM head, the embedding, the routers and the Gated DeltaNet input projections' b
/// and a rows stay bf16.
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
    let (quantized, gdn_ba, moe_layers) = dense_params(c);
    let (shared, bf16, expert) = moe_params(c);
    let layers = moe_layers as f64;
    let projections = quantized + layers * (shared + experts_read(c, batch) * expert);
    projection_bytes * projections + 2.0 * (gdn_ba + layers * bf16 + head * (1.0 + untied))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_fp8_qwen3_5_floor_reads_the_gdn_qkvz_rows_at_a_byte_and_b_and_a_in_bf16() {
        let c = super::super::shapes::qwen3_5_9b().expect("the shape");
        // Qwen3.5-9B by hand: 8 gated attention layers (qkv 10240 rows, o 4096), 32 FFNs of
        // 12288, 24 GDN layers (in_proj q|k|v|z 12288 rows and b|a 64, out 4096), hidden
        // 4096, untied embedding and LM head of 248320 rows.
        let h = 4096.0;
        let fp8_params =
            8.0 * (10240.0 + 4096.0) * h + 32.0 * 3.0 * 12288.0 * h + 24.0 * (12288.0 + 4096.0) * h;
        let bf16_params = 24.0 * 64.0 * h + 2.0 * 248320.0 * h;
        let want = fp8_params * (1.0 + 4.0 / 16384.0) + 2.0 * bf16_params;
        let got = weight_bytes(&c, Quantization::Fp8);
        assert!((got - want).abs() < 1.0, "{got} bytes, want {want}");
        let bf16 = weight_bytes(&c, Quantization::AsStored);
        assert!(
            (bf16 - 2.0 * (fp8_params + bf16_params)).abs() < 1.0,
            "{bf16}"
        );
    }
}
