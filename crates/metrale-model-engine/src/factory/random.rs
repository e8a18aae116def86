//! `random`: a dense model of a given shape with pseudo-random weights filled on the device by
//! `init::fill_uniform_bf16`, for benchmarks (no checkpoint, no host-side weight traffic).

use std::sync::Arc;

use metrale_config::{LayerType, ModelConfig};
use metrale_gpu_runtime::{DType, GpuBackend};
use metrale_model_layers::layers::{Attention, DecoderLayer, Ffn, Mixer, Mlp};
use metrale_model_layers::weight_map::DenseWeight;
use metrale_model_layers::{Ops, TransformerLayer};

use crate::error::ModelError;
use crate::model::{ModelWeights, TransformerModel};
use crate::options::ModelOptions;

/// A model of `config`'s shape with weights drawn from `seed`: norm weights near 1, projections
/// uniform with scale `1/sqrt(fan_in)`. Dense attention models only.
pub fn random(
    config: ModelConfig,
    options: ModelOptions,
    gpu: Arc<dyn GpuBackend>,
    seed: u64,
) -> Result<TransformerModel, ModelError> {
    if config
        .layer_types
        .iter()
        .any(|t| *t != LayerType::FullAttention)
        || config.moe.is_some()
    {
        return Err(ModelError::Unsupported(
            "random weights are built for dense attention models only".into(),
        ));
    }
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
    let final_norm = weight(&[h], 1.0, 0.1)?;
    let lm_head = if config.tie_word_embeddings {
        embed.clone()
    } else {
        weight(&[v, h], 0.0, proj(h))?
    };
    let mut layers: Vec<Box<dyn TransformerLayer>> = Vec::with_capacity(config.num_hidden_layers);
    for _ in 0..config.num_hidden_layers {
        let attention = Attention {
            qkv: weight(&[q_rows + 2 * hkv * d, h], 0.0, proj(h))?,
            q_norm: Some(weight(&[d], 1.0, 0.1)?),
            k_norm: Some(weight(&[d], 1.0, 0.1)?),
            o_proj: weight(&[h, hq * d], 0.0, proj(hq * d))?,
        };
        let mlp = Mlp {
            gate_up: weight(&[2 * f, h], 0.0, proj(h))?,
            down: weight(&[h, f], 0.0, proj(f))?,
            ffn: f as u32,
        };
        layers.push(Box::new(DecoderLayer {
            input_norm: weight(&[h], 1.0, 0.1)?,
            post_norm: weight(&[h], 1.0, 0.1)?,
            mixer: Mixer::Attention(attention),
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
        },
        layers,
    )
}
