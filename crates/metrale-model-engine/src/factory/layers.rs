//! Loading one layer's parts. Projections that run as one GEMM are fused here, on dim 0:
//! attention `[q (with gates) ; k ; v]`, MLP `[gate ; up]`, the GDN input projection
//! `[q | k | v | z | b | a]` (Qwen3-Next's per-key-head grouping permuted into it; a block-FP8
//! model's as `[q | k | v | z]` in FP8 and `[b | a]` in bf16, two GEMMs), stacked MoE
//! experts `[E, 2F, H]` and `[E, H, F]`. A tensor-parallel rank loads its shard of each
//! (`sharded.rs`).

use metrale_config::{LayerType, ModelConfig, ModelFamily, MoeConfig};
use metrale_gpu_runtime::DType;
use metrale_model_layers::layers::{
    Attention, DecoderLayer, Ffn, GatedDeltaNet, GdnShape, InProjSource, Mixer, Mlp, MoeMlp,
    MoeShape, SharedExpert,
};
use metrale_model_layers::weight_map::{
    DenseWeight, ExpertNames, GdnNames, GdnProjectionNames, LayerNames,
};

use super::{Loader, sharded};

use crate::error::ModelError;

/// A config or checkpoint the loader does not build, in words.
pub(super) fn unsupported(what: &str) -> ModelError {
    ModelError::Unsupported(what.to_string())
}

/// The MoE FFN's shape and settings of `c`, for a layer the config makes MoE.
pub(super) fn moe_settings(c: &ModelConfig) -> Result<(MoeShape, &MoeConfig), ModelError> {
    match (MoeShape::from_config(c), c.moe.as_ref()) {
        (Some(shape), Some(m)) => Ok((shape, m)),
        _ => Err(unsupported("a MoE layer in a config without MoE settings")),
    }
}

/// A whole decoder layer: its norms, its mixer of `kind`, and a dense or MoE FFN.
pub fn decoder_layer(
    loader: &Loader<'_>,
    c: &ModelConfig,
    n: &LayerNames,
    kind: LayerType,
    moe_ffn: bool,
) -> Result<DecoderLayer, ModelError> {
    let h = c.hidden_size;
    let mixer = match (kind, loader.shard) {
        (LayerType::FullAttention, None) => Mixer::Attention(attention(loader, c, n)?),
        (LayerType::FullAttention, Some(sh)) => {
            Mixer::Attention(sharded::attention(loader, c, n, sh)?)
        }
        (LayerType::LinearAttention, None) => Mixer::GatedDeltaNet(gdn(loader, c, n)?),
        (LayerType::LinearAttention, Some(sh)) => {
            Mixer::GatedDeltaNet(sharded::gdn(loader, c, n, sh)?)
        }
    };
    let ffn = match (moe_ffn, loader.shard) {
        (true, None) => Ffn::Moe(Box::new(moe(loader, c, n)?)),
        (true, Some(sh)) => Ffn::Moe(Box::new(sharded::moe(loader, c, n, sh)?)),
        (false, None) => Ffn::Dense(mlp(loader, c, n)?),
        (false, Some(sh)) => Ffn::Dense(sharded::mlp(loader, c, n, sh)?),
    };
    Ok(DecoderLayer {
        input_norm: loader.upload_bf16(&n.input_layernorm(), &[h])?,
        post_norm: loader.upload_bf16(&n.post_attention_layernorm(), &[h])?,
        mixer,
        ffn,
    })
}

/// A full-attention layer (plain or gated, with or without q/k norm).
pub fn attention(
    loader: &Loader<'_>,
    c: &ModelConfig,
    n: &LayerNames,
) -> Result<Attention, ModelError> {
    let (h, hq, hkv, d) = (
        c.hidden_size,
        c.attention.num_attention_heads,
        c.attention.num_key_value_heads,
        c.attention.head_dim,
    );
    let q_rows = if c.attention.attn_output_gate {
        2 * hq * d
    } else {
        hq * d
    };
    let qkv = loader.linears(&[
        (&n.q_proj(), &[q_rows, h]),
        (&n.k_proj(), &[hkv * d, h]),
        (&n.v_proj(), &[hkv * d, h]),
    ])?;
    let (q_norm, k_norm) = if c.family == ModelFamily::Llama {
        (None, None)
    } else {
        (
            Some(loader.upload_bf16(&n.q_norm(), &[d])?),
            Some(loader.upload_bf16(&n.k_norm(), &[d])?),
        )
    };
    Ok(Attention {
        qkv,
        q_norm,
        k_norm,
        o_proj: loader.linear(&n.o_proj(), &[h, hq * d])?,
    })
}

/// A dense SwiGLU MLP.
pub fn mlp(loader: &Loader<'_>, c: &ModelConfig, n: &LayerNames) -> Result<Mlp, ModelError> {
    let (h, f) = (c.hidden_size, c.intermediate_size);
    Ok(Mlp {
        gate_up: loader.linears(&[(&n.mlp_gate_proj(), &[f, h]), (&n.mlp_up_proj(), &[f, h])])?,
        down: loader.linear(&n.mlp_down_proj(), &[h, f])?,
        ffn: f as u32,
    })
}

/// A Gated DeltaNet layer's shape and tensor names, or the error naming what the config or the
/// family lacks.
pub(crate) fn gdn_spec(
    c: &ModelConfig,
    n: &LayerNames,
) -> Result<(GdnShape, GdnNames), ModelError> {
    let shape = GdnShape::from_config(c).ok_or_else(|| {
        unsupported("a linear-attention layer in a config without linear-attention settings")
    })?;
    let names = n
        .gdn()
        .ok_or_else(|| unsupported("a linear-attention layer in a family without GDN weights"))?;
    Ok((shape, names))
}

/// A Gated DeltaNet mixer.
pub fn gdn(
    loader: &Loader<'_>,
    c: &ModelConfig,
    n: &LayerNames,
) -> Result<GatedDeltaNet, ModelError> {
    let (shape, names) = gdn_spec(c, n)?;
    let hd = shape.heads;
    let (h, k) = (c.hidden_size, shape.conv_kernel as usize);
    let (key_dim, value_dim) = (
        (hd.num_k_heads * hd.k_head_dim) as usize,
        (hd.num_v_heads * hd.v_head_dim) as usize,
    );
    let vh = hd.num_v_heads as usize;
    let conv_dim = 2 * key_dim + value_dim;
    let (in_proj, in_proj_ba) = match &names.projections {
        GdnProjectionNames::Split {
            in_proj_qkv,
            in_proj_z,
            in_proj_b,
            in_proj_a,
        } => {
            let qkvz: [(&str, &[usize]); 2] =
                [(in_proj_qkv, &[conv_dim, h]), (in_proj_z, &[value_dim, h])];
            let ba: [(&str, &[usize]); 2] = [(in_proj_b, &[vh, h]), (in_proj_a, &[vh, h])];
            if loader.fp8_rows(&qkvz) {
                // As a pack loads: q/k/v and z block FP8, b and a bf16 beside them.
                let ba = loader.upload_bf16_concat(&ba)?;
                (loader.linears(&qkvz)?, Some(ba))
            } else {
                (loader.linears(&[qkvz[0], qkvz[1], ba[0], ba[1]])?, None)
            }
        }
        GdnProjectionNames::Fused {
            in_proj_qkvz,
            in_proj_ba,
        } => {
            let qkvz_shape = [2 * key_dim + 2 * value_dim, h];
            let ba = loader.source.load_bf16(in_proj_ba, &[2 * vh, h])?;
            let rows = shape.qwen3_next_in_proj_rows();
            // The permuted rows of each source tensor, in the fused projection's order.
            let (mut qkvz_rows, mut ba_rows) = (Vec::new(), Vec::new());
            for r in &rows {
                match *r {
                    InProjSource::Qkvz(i) => qkvz_rows.push(i),
                    InProjSource::Ba(i) => ba_rows.push(i),
                }
            }
            let permuted_ba = gather_rows(&ba, &ba_rows, h);
            if loader.fp8_rows(&[(in_proj_qkvz, &qkvz_shape)]) {
                // q/k/v and z block FP8, permuted with a scale row per weight row (the
                // permutation moves rows across 128-row blocks); b and a bf16.
                let q = loader
                    .source
                    .quantize_fp8_concat(&[(in_proj_qkvz, &qkvz_shape)])?;
                let q = q.select_rows(&qkvz_rows).ok_or_else(|| {
                    unsupported("a Qwen3-Next in_proj_qkvz row permutation past the tensor")
                })?;
                let in_proj = loader.upload_fp8(in_proj_qkvz, &q)?;
                let ba = loader.upload(in_proj_ba, &permuted_ba, vec![2 * vh, h], DType::Bf16)?;
                (in_proj, Some(ba))
            } else {
                let qkvz = loader.source.load_bf16(in_proj_qkvz, &qkvz_shape)?;
                let mut fused = gather_rows(&qkvz, &qkvz_rows, h);
                fused.extend_from_slice(&permuted_ba);
                let width = fused.len() / h;
                let w = loader.upload(in_proj_qkvz, &fused, vec![width, h], DType::Bf16)?;
                (w, None)
            }
        }
    };
    Ok(GatedDeltaNet {
        in_proj,
        in_proj_ba,
        conv1d: loader.upload_bf16(&names.conv1d, &[conv_dim, 1, k])?,
        a_log: loader.upload_f32(&names.a_log, &[vh])?,
        dt_bias: loader.upload_f32(&names.dt_bias, &[vh])?,
        norm: loader.upload_bf16(&names.norm, &[hd.v_head_dim as usize])?,
        out_proj: loader.linear(&names.out_proj, &[h, value_dim])?,
        shape,
    })
}

/// Rows `rows` of the row-major `[_, k]` matrix `m`, in that order.
fn gather_rows(m: &[half::bf16], rows: &[usize], k: usize) -> Vec<half::bf16> {
    let mut out = Vec::with_capacity(rows.len() * k);
    for &i in rows {
        out.extend_from_slice(&m[i * k..(i + 1) * k]);
    }
    out
}

/// A sparse-MoE FFN with its shared expert.
pub fn moe(loader: &Loader<'_>, c: &ModelConfig, n: &LayerNames) -> Result<MoeMlp, ModelError> {
    let (shape, cfg) = moe_settings(c)?;
    let names = n.moe();
    let (h, e, f) = (c.hidden_size, cfg.num_experts, cfg.moe_intermediate_size);
    let (experts_gate_up, experts_down) = match &names.experts {
        ExpertNames::PerExpert(list) => {
            let mut gu: Vec<(&str, &[usize])> = Vec::with_capacity(2 * e);
            let mut down: Vec<(&str, &[usize])> = Vec::with_capacity(e);
            let (fh, hf) = ([f, h], [h, f]);
            for x in list {
                gu.push((&x.gate_proj, &fh));
                gu.push((&x.up_proj, &fh));
                down.push((&x.down_proj, &hf));
            }
            let mut gate_up = loader.linears(&gu)?;
            gate_up.shape = vec![e, 2 * f, h];
            let mut down = loader.linears(&down)?;
            down.shape = vec![e, h, f];
            (gate_up, down)
        }
        ExpertNames::Fused {
            gate_up_proj,
            down_proj,
        } => (
            fused_experts(loader, gate_up_proj, [e, 2 * f, h])?,
            fused_experts(loader, down_proj, [e, h, f])?,
        ),
    };
    let fs = cfg.shared_expert_intermediate_size;
    let shared = if fs > 0 && loader.source.contains(&names.shared_expert.gate_proj) {
        let s = &names.shared_expert;
        Some(SharedExpert {
            gate_up: loader.linears(&[(&s.gate_proj, &[fs, h]), (&s.up_proj, &[fs, h])])?,
            down: loader.linear(&s.down_proj, &[h, fs])?,
            gate: if loader.source.contains(&names.shared_expert_gate) {
                Some(loader.upload_bf16(&names.shared_expert_gate, &[1, h])?)
            } else {
                None
            },
            ffn: fs as u32,
        })
    } else {
        None
    };
    Ok(MoeMlp {
        router: loader.upload_bf16(&names.router, &[e, h])?,
        experts_gate_up,
        experts_down,
        shared,
        shape,
    })
}

/// A fused stacked expert weight `[E, n, k]` (transformers' in-memory layout): bf16, quantized
/// at load as the `[E * n, k]` matrix the expert kernels read when the model is.
fn fused_experts(
    loader: &Loader<'_>,
    name: &str,
    [e, n, k]: [usize; 3],
) -> Result<DenseWeight, ModelError> {
    let mut w = loader.upload_bf16(name, &[e, n, k])?;
    w.shape = vec![e * n, k];
    let mut w = loader.as_configured(w)?;
    w.shape = vec![e, n, k];
    Ok(w)
}
