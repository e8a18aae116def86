//! `load`: a Hugging Face checkpoint directory to a `TransformerModel` on a backend; `random`: a
//! model of a given shape with pseudo-random weights filled on the device (benchmarks).
//!
//! Loading reads the config, picks the family's name table, and builds each layer from its kind
//! (full attention or Gated DeltaNet) and FFN (dense or MoE), fusing projections that run as one
//! GEMM (`layers.rs` says which).

mod layers;
mod random;

use std::path::Path;
use std::sync::Arc;

use metrale_config::{LayerType, ModelConfig};
use metrale_gpu_runtime::GpuBackend;
use metrale_model_layers::TransformerLayer;
use metrale_model_layers::layers::{DecoderLayer, Ffn, Mixer};
use metrale_model_layers::weight_map::{SafetensorsSource, WeightLoader, WeightNames};

use crate::error::ModelError;
use crate::model::{ModelWeights, TransformerModel};
use crate::options::ModelOptions;

pub use random::random;

/// Load the checkpoint in `dir` onto `gpu`.
pub fn load(
    dir: &Path,
    options: ModelOptions,
    gpu: Arc<dyn GpuBackend>,
) -> Result<TransformerModel, ModelError> {
    let config = ModelConfig::from_dir(dir)?;
    if config.has_vision {
        tracing::info!(
            "{}: the checkpoint has a vision tower; metrale runs its text model only",
            dir.display()
        );
    }
    let source = SafetensorsSource::open(dir)?;
    let names = WeightNames::detect(&source, &config)?;
    let loader = WeightLoader::new(&source, gpu.as_ref(), gpu.default_stream());
    let (h, v) = (config.hidden_size, config.vocab_size);
    let embed = loader.upload_bf16(&names.embed_tokens(), &[v, h])?;
    let final_norm = loader.upload_bf16(&names.final_norm(), &[h])?;
    let lm_head = if config.tie_word_embeddings {
        embed.clone()
    } else {
        loader.upload_bf16(&names.lm_head(), &[v, h])?
    };

    let mut decoder: Vec<Box<dyn TransformerLayer>> = Vec::with_capacity(config.num_hidden_layers);
    for (i, kind) in config.layer_types.iter().enumerate() {
        let n = names.layer(i);
        let mixer = match kind {
            LayerType::FullAttention => Mixer::Attention(layers::attention(&loader, &config, &n)?),
            LayerType::LinearAttention => Mixer::GatedDeltaNet(layers::gdn(&loader, &config, &n)?),
        };
        let ffn = if config.layer_is_moe(i) {
            Ffn::Moe(layers::moe(&loader, &config, &n)?)
        } else {
            Ffn::Dense(layers::mlp(&loader, &config, &n)?)
        };
        decoder.push(Box::new(DecoderLayer {
            input_norm: loader.upload_bf16(&n.input_layernorm(), &[h])?,
            post_norm: loader.upload_bf16(&n.post_attention_layernorm(), &[h])?,
            mixer,
            ffn,
        }));
    }
    if let Some(mtp) = names.mtp() {
        tracing::info!(
            "{}: {} MTP layer(s) present; speculative decoding is not wired yet, so they are not loaded",
            dir.display(),
            mtp.layers.len()
        );
    }
    gpu.synchronize(gpu.default_stream())?;
    TransformerModel::new(
        config,
        options,
        gpu,
        ModelWeights {
            embed,
            final_norm,
            lm_head,
        },
        decoder,
    )
}
