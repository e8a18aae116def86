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
mod shard;
mod sharded;

use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;

use metrale_config::{LayerType, ModelConfig};
use metrale_gpu_runtime::fp8::FP8_BLOCK_ROW_SHIFT;
use metrale_gpu_runtime::{DType, GpuBackend, StreamHandle};
use metrale_model_layers::layers::MtpHead;
use metrale_model_layers::ops::{BlockScales, Matrix, VocabRows};
use metrale_model_layers::ops_gemm::fp8_scale_bytes;
use metrale_model_layers::weight_map::{
    self, DenseWeight, LayerNames, SafetensorsSource, TensorSlice, WeightLoader, WeightNames,
};
use metrale_model_layers::{Ops, TransformerLayer};

use crate::error::ModelError;
use crate::model::{Model, ModelWeights};
use crate::options::Quantization;

pub use random::{random, random_quantized, random_ranks};
pub use shard::RankShard;

/// Load the checkpoint in `dir` onto `gpu`, its projection weights as stored.
pub fn load(dir: &Path, gpu: Arc<dyn GpuBackend>) -> Result<Model, ModelError> {
    load_quantized(dir, gpu, Quantization::AsStored)
}

/// The checkpoint loader, and under [`Quantization::Fp8`] the launchers that quantize the bf16
/// projection weights it loads.
pub(crate) struct Loader<'a> {
    weights: WeightLoader<'a>,
    quantize: Option<Ops>,
    /// The tensor-parallel rank whose shard is loaded; `None`: the whole model.
    shard: Option<RankShard>,
}

impl<'a> Deref for Loader<'a> {
    type Target = WeightLoader<'a>;
    fn deref(&self) -> &WeightLoader<'a> {
        &self.weights
    }
}

impl Loader<'_> {
    /// A projection weight (see [`Loader::linears`]).
    pub(crate) fn linear(&self, name: &str, shape: &[usize]) -> Result<DenseWeight, ModelError> {
        self.linears(&[(name, shape)])
    }

    /// Projection weights concatenated along dim 0: block FP8 where the checkpoint stores them
    /// so or the model is quantized at load, else bf16.
    pub(crate) fn linears(&self, parts: &[(&str, &[usize])]) -> Result<DenseWeight, ModelError> {
        if self.quantize.is_some() {
            return Ok(self.weights.upload_linear_concat_fp8(parts)?);
        }
        Ok(self.weights.upload_linear_concat(parts)?)
    }

    /// Whether projection weights `parts` load as block FP8: the model is quantized at load, or
    /// every part is stored so (as the packs store the Gated DeltaNet input projection's q/k/v
    /// and z rows, beside its b and a rows in bf16).
    pub(crate) fn fp8_rows(&self, parts: &[(&str, &[usize])]) -> bool {
        self.quantize.is_some() || parts.iter().all(|(name, _)| self.source.is_fp8(name))
    }

    /// Projection weight `w`, built on the host from several tensors, as the model stores it:
    /// quantized to block FP8 on the device (in 128-row blocks of `w`) where it is bf16 and the
    /// model is quantized at load.
    pub(crate) fn as_configured(&self, w: DenseWeight) -> Result<DenseWeight, ModelError> {
        match &self.quantize {
            Some(ops) if w.dtype == DType::Bf16 => {
                quantize_fp8(self.weights.gpu, ops, self.weights.stream, w)
            }
            _ => Ok(w),
        }
    }
}

/// bf16 weight `w` quantized to block FP8 on the device (`Ops::quantize_fp8`); `w`'s memory is
/// freed once the quantized copy is written.
pub(crate) fn quantize_fp8(
    gpu: &dyn GpuBackend,
    ops: &Ops,
    s: StreamHandle,
    w: DenseWeight,
) -> Result<DenseWeight, ModelError> {
    let source = w.matrix();
    let (n, k) = source.shape();
    let bytes = gpu.alloc((n as usize * k as usize).max(1))?;
    let scales = BlockScales {
        ptr: gpu.alloc(fp8_scale_bytes(n, k, FP8_BLOCK_ROW_SHIFT).max(4))?,
        row_shift: FP8_BLOCK_ROW_SHIFT,
    };
    let out = Matrix {
        scales: Some(scales),
        ..Matrix::new(bytes, DType::F8E4M3, n, k)
    };
    ops.quantize_fp8(s, out, source)?;
    gpu.synchronize(s)?;
    gpu.free(w.ptr)?;
    Ok(DenseWeight {
        ptr: bytes,
        dtype: DType::F8E4M3,
        scales: Some(scales),
        ..w
    })
}

/// Load the checkpoint in `dir` onto `gpu`, its projection weights stored as `quantization`
/// says.
pub fn load_quantized(
    dir: &Path,
    gpu: Arc<dyn GpuBackend>,
    quantization: Quantization,
) -> Result<Model, ModelError> {
    load_with(dir, gpu, quantization, None)
}

/// Load one shard per backend of a tensor-parallel group (`gpus[r]` drives rank `r`, and
/// reports it: `GpuBackend::tp_rank`): the checkpoint in `dir` split over `gpus.len()` ranks as
/// `RankShard` describes, each rank reading only its part of each tensor. One backend loads the
/// whole model. Refused with `ModelError::Options` (`tensor_parallel_size`) when the model does
/// not split over that many ranks.
pub fn load_ranks(
    dir: &Path,
    gpus: &[Arc<dyn GpuBackend>],
    quantization: Quantization,
) -> Result<Vec<Model>, ModelError> {
    let Some(shards) = RankShard::of_group(&ModelConfig::from_dir(dir)?, gpus)? else {
        return Ok(vec![load_quantized(dir, gpus[0].clone(), quantization)?]);
    };
    if quantization != Quantization::AsStored {
        return Err(ModelError::Options {
            option: "tensor_parallel_size",
            problem: format!(
                "{} ranks with FP8 quantization at load: tensor-parallel shards are bf16",
                gpus.len()
            ),
        });
    }
    (gpus.iter().zip(shards))
        .map(|(gpu, shard)| load_with(dir, gpu.clone(), quantization, Some(shard)))
        .collect()
}

/// Load the whole checkpoint in `dir`, or rank `shard`'s part of it, onto `gpu`.
fn load_with(
    dir: &Path,
    gpu: Arc<dyn GpuBackend>,
    quantization: Quantization,
    shard: Option<RankShard>,
) -> Result<Model, ModelError> {
    let config = ModelConfig::from_dir(dir)?;
    if config.checkpoint.has_vision {
        tracing::info!(
            "{}: the checkpoint has a vision tower; metrale runs its text model only",
            dir.display()
        );
    }
    let source = SafetensorsSource::open(dir)?;
    let names = WeightNames::detect(&source, &config)?;
    let loader = Loader {
        weights: WeightLoader::new(&source, gpu.as_ref(), gpu.default_stream()),
        quantize: match quantization {
            Quantization::AsStored => None,
            Quantization::Fp8 => Some(Ops::new(gpu.clone())?),
        },
        shard,
    };
    let (h, v) = (config.hidden_size, config.tokens.vocab_size);
    // A tensor-parallel rank holds its slice of the vocabulary: its rows of the embedding and
    // of the LM head (the same rows when tied).
    let vocab_rows = shard.map_or(0..v, |sh| sh.split(v));
    let vocab_slice = |name: &str| -> Result<DenseWeight, ModelError> {
        match shard {
            None => Ok(loader.upload_bf16(name, &[v, h])?),
            Some(_) => {
                let slice = TensorSlice::rows(&[v, h], vec![vocab_rows.clone()]);
                let shape = vec![vocab_rows.len(), h];
                Ok(loader.upload_bf16_slices(&[(name, &[v, h], slice)], shape)?)
            }
        }
    };
    let embed = vocab_slice(&names.embed_tokens())?;
    let embed_rows = VocabRows {
        start: vocab_rows.start as u32,
        vocab: v as u32,
    };
    let final_norm = loader.upload_bf16(&names.final_norm(), &[h])?;
    let lm_head = if config.tokens.tie_word_embeddings {
        embed.clone()
    } else {
        vocab_slice(&names.lm_head())?
    };

    let mut decoder: Vec<Box<dyn TransformerLayer>> = Vec::with_capacity(config.num_hidden_layers);
    // Each attention layer's FP8 KV scales (the model's, then the MTP head's), 1.0 where the
    // checkpoint has none.
    let mut kv_scales = Vec::new();
    let mut found_scales = 0usize;
    let mut read_scales = |n: &LayerNames| -> Result<(), ModelError> {
        let s = weight_map::kv_scales(&source, n)?;
        found_scales += usize::from(s.is_some());
        kv_scales.push(s.unwrap_or_default());
        Ok(())
    };
    for (i, kind) in config.layer_types.iter().enumerate() {
        if *kind == LayerType::FullAttention {
            read_scales(&names.layer(i))?;
        }
        let layer = layers::decoder_layer(
            &loader,
            &config,
            &names.layer(i),
            *kind,
            config.layer_is_moe(i),
        )?;
        decoder.push(Box::new(layer));
    }
    // A tensor-parallel rank's MTP head: its decoder layers sharded as the model's, `fc` and
    // the norms whole (every rank computes the same `fc` output).
    let mtp = match names.mtp() {
        Some(m) => {
            let moe = config.moe.is_some();
            let mut mtp_layers = Vec::with_capacity(m.layers.len());
            for n in &m.layers {
                read_scales(n)?;
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
    if found_scales > 0 {
        tracing::info!(
            "{}: FP8 KV cache scales for {found_scales} of {} attention layers",
            dir.display(),
            kv_scales.len()
        );
    }
    gpu.synchronize(gpu.default_stream())?;
    let weights = ModelWeights {
        embed_rows,
        embed,
        final_norm,
        lm_head,
        mtp,
        kv_scales,
    };
    match shard {
        None => Model::new(config, gpu, weights, decoder),
        Some(sh) => Model::new_shard(sh.config(&config), gpu, weights, decoder, sh.size),
    }
}
