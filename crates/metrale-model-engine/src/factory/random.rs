//! `random`: a model of a given shape (dense, or hybrid with Gated DeltaNet layers) with
//! pseudo-random weights filled on the device by `init::fill_uniform_bf16`, for benchmarks (no
//! checkpoint, no host-side weight traffic beyond a few small f32 vectors).

use std::sync::Arc;

use metrale_config::{LayerType, ModelConfig};
use metrale_gpu_runtime::{DType, GpuBackend, GpuBackendExt};
use metrale_model_layers::layers::{
    Attention, DecoderLayer, Ffn, GatedDeltaNet, GdnShape, Mixer, Mlp,
};
use metrale_model_layers::weight_map::DenseWeight;
use metrale_model_layers::{Ops, TransformerLayer};

use crate::error::ModelError;
use crate::model::{ModelWeights, TransformerModel};
use crate::options::ModelOptions;

/// A model of `config`'s shape with weights drawn from `seed`: norm weights near 1 (near 0 for
/// the zero-centred convention), projections uniform with scale `1/sqrt(fan_in)`. Dense FFNs
/// only (no MoE).
pub fn random(
    config: ModelConfig,
    options: ModelOptions,
    gpu: Arc<dyn GpuBackend>,
    seed: u64,
) -> Result<TransformerModel, ModelError> {
    if config.moe.is_some() {
        return Err(ModelError::Unsupported(
            "random weights are built for dense-FFN models only".into(),
        ));
    }
    let norm_offset = if config.norm == metrale_config::NormConvention::ZeroCentred {
        0.0
    } else {
        1.0
    };
    let ops = Ops::new(gpu.clone())?;
    let s = gpu.default_stream();
    let mut next_seed = seed;
    let mut weight =
        |shape: &[usize], offset: f32, scale: f32| -> Result<DenseWeight, ModelError> {
            let n: usize = shape.iter().product();
            let ptr = gpu.alloc(n * 2)?;
            next_seed = next_seed.wrapping_add(1);
            ops.fill_uniform_bf16(s, ptr, n as u64, next_seed, offset, scale)?;
            Ok(DenseWeight {
                ptr,
                shape: shape.to_vec(),
                dtype: DType::Bf16,
            })
        };
    let (h, v) = (config.hidden_size, config.vocab_size);
    let (hq, hkv, d, f) = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
    );
    let q_rows = if config.attn_output_gate {
        2 * hq * d
    } else {
        hq * d
    };
    let proj = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    let embed = weight(&[v, h], 0.0, 1.0)?;
    let final_norm = weight(&[h], norm_offset, 0.1)?;
    let lm_head = if config.tie_word_embeddings {
        embed.clone()
    } else {
        weight(&[v, h], 0.0, proj(h))?
    };
    let mut layers: Vec<Box<dyn TransformerLayer>> = Vec::with_capacity(config.num_hidden_layers);
    let gdn = GdnShape::from_config(&config);
    for kind in config.layer_types.clone() {
        let mixer = match (kind, gdn) {
            (LayerType::FullAttention, _) => Mixer::Attention(Attention {
                qkv: weight(&[q_rows + 2 * hkv * d, h], 0.0, proj(h))?,
                q_norm: Some(weight(&[d], norm_offset, 0.1)?),
                k_norm: Some(weight(&[d], norm_offset, 0.1)?),
                o_proj: weight(&[h, hq * d], 0.0, proj(hq * d))?,
            }),
            (LayerType::LinearAttention, Some(shape)) => {
                let hd = shape.heads;
                let (vh, dv) = (hd.num_v_heads as usize, hd.v_head_dim as usize);
                let small = |v: Vec<f32>| -> Result<DenseWeight, ModelError> {
                    let ptr = gpu.alloc_upload(&v, s)?;
                    Ok(DenseWeight {
                        ptr,
                        shape: vec![v.len()],
                        dtype: DType::F32,
                    })
                };
                Mixer::GatedDeltaNet(GatedDeltaNet {
                    in_proj: weight(&[hd.proj_width() as usize, h], 0.0, proj(h))?,
                    conv1d: weight(
                        &[hd.conv_dim() as usize, 1, shape.conv_kernel as usize],
                        0.0,
                        0.5,
                    )?,
                    a_log: small((0..vh).map(|i| (1.0 + i as f32 / vh as f32).ln()).collect())?,
                    dt_bias: small(vec![0.5; vh])?,
                    norm: weight(&[dv], 1.0, 0.1)?,
                    out_proj: weight(&[h, vh * dv], 0.0, proj(vh * dv))?,
                    shape,
                })
            }
            (LayerType::LinearAttention, None) => {
                return Err(ModelError::Unsupported(
                    "linear-attention layers without linear-attention settings".into(),
                ));
            }
        };
        let mlp = Mlp {
            gate_up: weight(&[2 * f, h], 0.0, proj(h))?,
            down: weight(&[h, f], 0.0, proj(f))?,
            ffn: f as u32,
        };
        layers.push(Box::new(DecoderLayer {
            input_norm: weight(&[h], norm_offset, 0.1)?,
            post_norm: weight(&[h], norm_offset, 0.1)?,
            mixer,
            ffn: Ffn::Dense(mlp),
        }));
    }
    gpu.synchronize(s)?;
    TransformerModel::new(
        config,
        options,
        gpu,
        ModelWeights {
            embed,
            final_norm,
            lm_head,
            mtp: None,
        },
        layers,
    )
}
