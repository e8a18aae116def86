//! `load`: a Hugging Face checkpoint directory to a `Model` (its weights) on a backend;
//! `random`: a model of a given shape with pseudo-random weights filled on the device
//! (benchmarks). A `StepRunner` and a `CacheManager` (`StepRunner::new`), or a `Scheduler`
//! (`Scheduler::new`), run it.
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
use metrale_model_layers::layers::MtpHead;
use metrale_model_layers::weight_map::{SafetensorsSource, WeightLoader, WeightNames};

use crate::error::ModelError;
use crate::model::{Model, ModelWeights};

pub use random::random;

/// Load the checkpoint in `dir` onto `gpu`.
pub fn load(dir: &Path, gpu: Arc<dyn GpuBackend>) -> Result<Model, ModelError> {
    let config = ModelConfig::from_dir(dir)?;
    if config.checkpoint.has_vision {
        tracing::info!(
            "{}: the checkpoint has a vision tower; metrale runs its text model only",
            dir.display()
        );
    }
    let source = SafetensorsSource::open(dir)?;
    let names = WeightNames::detect(&source, &config)?;
    let loader = WeightLoader::new(&source, gpu.as_ref(), gpu.default_stream());
    let (h, v) = (config.hidden_size, config.tokens.vocab_size);
    let embed = loader.upload_bf16(&names.embed_tokens(), &[v, h])?;
    let final_norm = loader.upload_bf16(&names.final_norm(), &[h])?;
    let lm_head = if config.tokens.tie_word_embeddings {
        embed.clone()
    } else {
        loader.upload_bf16(&names.lm_head(), &[v, h])?
    };

    let mut decoder: Vec<Box<dyn TransformerLayer>> = Vec::with_capacity(config.num_hidden_layers);
    for (i, kind) in config.layer_types.iter().enumerate() {
        let layer = layers::decoder_layer(
            &loader,
            &config,
            &names.layer(i),
            *kind,
            config.layer_is_moe(i),
        )?;
        decoder.push(Box::new(layer));
    }
    let mtp = match names.mtp() {
        Some(m) => {
            let moe = config.moe.is_some();
            let mut mtp_layers = Vec::with_capacity(m.layers.len());
            for n in &m.layers {
                mtp_layers.push(layers::decoder_layer(
                    &loader,
                    &config,
                    n,
                    LayerType::FullAttention,
                    moe,
                )?);
            }
            tracing::info!(
                "{}: loaded the MTP head ({} layer(s))",
                dir.display(),
                mtp_layers.len()
            );
            Some(MtpHead {
                fc: loader.upload_bf16(&m.fc, &[h, 2 * h])?,
                pre_fc_norm_embedding: loader.upload_bf16(&m.pre_fc_norm_embedding, &[h])?,
                pre_fc_norm_hidden: loader.upload_bf16(&m.pre_fc_norm_hidden, &[h])?,
                layers: mtp_layers,
                norm: loader.upload_bf16(&m.norm, &[h])?,
            })
        }
        None => None,
    };
    gpu.synchronize(gpu.default_stream())?;
    Model::new(
        config,
        gpu,
        ModelWeights {
            embed,
            final_norm,
            lm_head,
            mtp,
        },
        decoder,
    )
}
