//! `random`: a model of a given shape (dense, or hybrid with Gated DeltaNet layers; dense or
//! sparse-MoE FFNs) with pseudo-random weights filled on the device by `init::fill_uniform_bf16`,
//! for benchmarks (no checkpoint, no host-side weight traffic beyond a few small f32 vectors). A
//! config that declares an MTP head (`mtp_num_hidden_layers`) gets one, as its checkpoint would.
//! `random_ranks` shards such a model over a tensor-parallel group as `load_ranks` shards a
//! checkpoint.

use std::sync::Arc;

use metrale_config::{LayerType, ModelConfig};
use metrale_gpu_runtime::{DType, GpuBackend, GpuBackendExt, StreamHandle};
use metrale_model_layers::layers::{
    Attention, DecoderLayer, Ffn, GatedDeltaNet, GdnShape, Mixer, Mlp, MoeMlp, MtpHead,
    SharedExpert,
};
use metrale_model_layers::ops::VocabRows;
use metrale_model_layers::weight_map::DenseWeight;
use metrale_model_layers::{Ops, TransformerLayer};

use super::RankShard;
use crate::error::ModelError;
use crate::model::{Model, ModelWeights};
use crate::options::Quantization;

/// Fills one weight after another from consecutive seeds.
struct Filler {
    gpu: Arc<dyn GpuBackend>,
    ops: Ops,
    stream: StreamHandle,
    seed: u64,
    /// Norm weights are drawn around this: 1 for `x * w`, 0 for zero-centred `x * (1 + w)`.
    norm_offset: f32,
    /// Quantize the layers' projections to block FP8 after filling them.
    fp8: bool,
}

impl Filler {
    /// A bf16 weight of `shape`, uniform in `offset ± scale`.
    fn weight(
        &mut self,
        shape: &[usize],
        offset: f32,
        scale: f32,
    ) -> Result<DenseWeight, ModelError> {
        let n: usize = shape.iter().product();
        let ptr = self.gpu.alloc(n * 2)?;
        self.seed = self.seed.wrapping_add(1);
        self.ops
            .fill_uniform_bf16(self.stream, ptr, n as u64, self.seed, offset, scale)?;
        Ok(DenseWeight {
            ptr,
            shape: shape.to_vec(),
            dtype: DType::Bf16,
            scales: None,
        })
    }

    /// A projection with `fan_in` inputs: scale `1/sqrt(fan_in)`.
    fn proj(&mut self, shape: &[usize], fan_in: usize) -> Result<DenseWeight, ModelError> {
        self.weight(shape, 0.0, 1.0 / (fan_in as f32).sqrt())
    }

    /// A layer's projection: [`Filler::proj`], quantized to block FP8 when the model is.
    fn linear(&mut self, shape: &[usize], fan_in: usize) -> Result<DenseWeight, ModelError> {
        let w = self.proj(shape, fan_in)?;
        if !self.fp8 {
            return Ok(w);
        }
        super::quantize_fp8(self.gpu.as_ref(), &self.ops, self.stream, w)
    }

    /// A norm weight of `n` channels.
    fn norm(&mut self, n: usize) -> Result<DenseWeight, ModelError> {
        self.weight(&[n], self.norm_offset, 0.1)
    }

    /// A small f32 vector uploaded as is.
    fn small(&mut self, v: Vec<f32>) -> Result<DenseWeight, ModelError> {
        let ptr = self.gpu.alloc_upload(&v, self.stream)?;
        Ok(DenseWeight {
            ptr,
            shape: vec![v.len()],
            dtype: DType::F32,
            scales: None,
        })
    }

    /// A layer's stacked expert weight `[experts, n, k]`: filled as the `[experts * n, k]`
    /// matrix the expert kernels read (quantized so when the model is), then given its shape.
    fn experts(&mut self, [e, n, k]: [usize; 3]) -> Result<DenseWeight, ModelError> {
        let mut w = self.linear(&[e * n, k], k)?;
        w.shape = vec![e, n, k];
        Ok(w)
    }

    /// A sparse-MoE FFN of `c`'s shape: a bf16 router (random routing, as a trained router's
    /// spreads the batch's tokens), the experts, and the gated shared expert where there is one.
    fn moe(&mut self, c: &ModelConfig) -> Result<MoeMlp, ModelError> {
        let (shape, m) = super::layers::moe_settings(c)?;
        let (h, e, f, fs) = (
            c.hidden_size,
            m.num_experts,
            m.moe_intermediate_size,
            m.shared_expert_intermediate_size,
        );
        let shared = if fs > 0 {
            Some(SharedExpert {
                gate_up: self.linear(&[2 * fs, h], h)?,
                down: self.linear(&[h, fs], fs)?,
                gate: Some(self.proj(&[1, h], h)?),
                ffn: fs as u32,
            })
        } else {
            None
        };
        Ok(MoeMlp {
            router: self.proj(&[e, h], h)?,
            experts_gate_up: self.experts([e, 2 * f, h])?,
            experts_down: self.experts([e, h, f])?,
            shared,
            shape,
        })
    }

    /// One decoder layer of `kind` with a dense FFN, or a sparse-MoE one (`moe`).
    fn decoder_layer(
        &mut self,
        c: &ModelConfig,
        kind: LayerType,
        moe: bool,
    ) -> Result<DecoderLayer, ModelError> {
        let (h, hq, hkv, d, f) = (
            c.hidden_size,
            c.attention.num_attention_heads,
            c.attention.num_key_value_heads,
            c.attention.head_dim,
            c.intermediate_size,
        );
        let q_rows = if c.attention.attn_output_gate {
            2 * hq * d
        } else {
            hq * d
        };
        let mixer = match (kind, GdnShape::from_config(c)) {
            (LayerType::FullAttention, _) => Mixer::Attention(Attention {
                qkv: self.linear(&[q_rows + 2 * hkv * d, h], h)?,
                q_norm: Some(self.norm(d)?),
                k_norm: Some(self.norm(d)?),
                o_proj: self.linear(&[h, hq * d], hq * d)?,
            }),
            (LayerType::LinearAttention, Some(shape)) => {
                let hd = shape.heads;
                let (vh, dv) = (hd.num_v_heads as usize, hd.v_head_dim as usize);
                // Under FP8 as a pack loads: the q/k/v and z rows block FP8, the b and a rows
                // bf16 beside them; else one fused bf16 projection.
                let (in_proj, in_proj_ba) = if self.fp8 {
                    let qkvz = (hd.conv_dim() + hd.value_dim()) as usize;
                    (
                        self.linear(&[qkvz, h], h)?,
                        Some(self.proj(&[2 * vh, h], h)?),
                    )
                } else {
                    (self.proj(&[hd.proj_width() as usize, h], h)?, None)
                };
                Mixer::GatedDeltaNet(GatedDeltaNet {
                    in_proj,
                    in_proj_ba,
                    conv1d: self.weight(
                        &[hd.conv_dim() as usize, 1, shape.conv_kernel as usize],
                        0.0,
                        0.5,
                    )?,
                    a_log: self
                        .small((0..vh).map(|i| (1.0 + i as f32 / vh as f32).ln()).collect())?,
                    dt_bias: self.small(vec![0.5; vh])?,
                    norm: self.weight(&[dv], 1.0, 0.1)?,
                    out_proj: self.linear(&[h, vh * dv], vh * dv)?,
                    shape,
                })
            }
            (LayerType::LinearAttention, None) => {
                return Err(ModelError::Unsupported(
                    "linear-attention layers without linear-attention settings".into(),
                ));
            }
        };
        let ffn = if moe {
            Ffn::Moe(Box::new(self.moe(c)?))
        } else {
            Ffn::Dense(Mlp {
                gate_up: self.linear(&[2 * f, h], h)?,
                down: self.linear(&[h, f], f)?,
                ffn: f as u32,
            })
        };
        Ok(DecoderLayer {
            input_norm: self.norm(h)?,
            post_norm: self.norm(h)?,
            mixer,
            ffn,
        })
    }
}

/// A model of `config`'s shape with weights drawn from `seed`: norm weights near 1 (near 0 for
/// the zero-centred convention), projections uniform with scale `1/sqrt(fan_in)`, each FFN dense
/// or sparse-MoE as `config` says. With `config.mtp_num_layers > 0` it has an MTP head of that
/// many full-attention layers (run when the runner's `speculative` is `Mtp`).
pub fn random(
    config: ModelConfig,
    gpu: Arc<dyn GpuBackend>,
    seed: u64,
) -> Result<Model, ModelError> {
    random_quantized(config, gpu, seed, Quantization::AsStored)
}

/// [`random`], the layers' projections stored as `quantization` says (`Fp8`: filled in bf16,
/// then quantized on the device with the packs' recipe, the experts included; the embedding, the
/// LM head, the routers, the Gated DeltaNet input projection and the MTP head's input
/// projection stay bf16, as a pack loads them).
pub fn random_quantized(
    config: ModelConfig,
    gpu: Arc<dyn GpuBackend>,
    seed: u64,
    quantization: Quantization,
) -> Result<Model, ModelError> {
    build(config, gpu, seed, quantization, None)
}

/// A bf16 model of `config`'s shape with random weights, sharded over the backends of a
/// tensor-parallel group (`gpus[r]` drives rank `r`), each rank holding what `RankShard` says a
/// loaded checkpoint's rank holds (its heads and widths, its rows of the vocabulary) and filled
/// on its own device: the benchmark's sharded models. One backend gives the whole model.
/// Refused as `load_ranks` refuses a shape that does not split.
pub fn random_ranks(
    config: &ModelConfig,
    gpus: &[Arc<dyn GpuBackend>],
    seed: u64,
) -> Result<Vec<Model>, ModelError> {
    let Some(shards) = RankShard::of_group(config, gpus)? else {
        return Ok(vec![random(config.clone(), gpus[0].clone(), seed)?]);
    };
    (gpus.iter().zip(shards))
        .map(|(gpu, shard)| {
            let (c, gpu) = (config.clone(), gpu.clone());
            build(c, gpu, seed, Quantization::AsStored, Some(shard))
        })
        .collect()
}

/// The whole model of `config`'s shape, or rank `shard`'s part of it, on `gpu`.
fn build(
    config: ModelConfig,
    gpu: Arc<dyn GpuBackend>,
    seed: u64,
    quantization: Quantization,
    shard: Option<RankShard>,
) -> Result<Model, ModelError> {
    let norm_offset = if config.norm == metrale_config::NormConvention::ZeroCentred {
        0.0
    } else {
        1.0
    };
    let s = gpu.default_stream();
    let mut fill = Filler {
        ops: Ops::new(gpu.clone())?,
        gpu: gpu.clone(),
        stream: s,
        seed,
        norm_offset,
        fp8: quantization == Quantization::Fp8,
    };
    let (h, v) = (config.hidden_size, config.tokens.vocab_size);
    // A rank's layers are the shard config's (its heads and widths) and its rows of the
    // vocabulary, as `load_ranks` gives them.
    let layer_config = shard.map_or_else(|| config.clone(), |sh| sh.config(&config));
    let vocab_rows = shard.map_or(0..v, |sh| sh.split(v));
    let embed = fill.weight(&[vocab_rows.len(), h], 0.0, 1.0)?;
    let final_norm = fill.norm(h)?;
    let lm_head = if config.tokens.tie_word_embeddings {
        embed.clone()
    } else {
        fill.proj(&[vocab_rows.len(), h], h)?
    };
    let mut layers: Vec<Box<dyn TransformerLayer>> = Vec::with_capacity(config.num_hidden_layers);
    for (i, &kind) in config.layer_types.iter().enumerate() {
        let moe = config.layer_is_moe(i);
        layers.push(Box::new(fill.decoder_layer(&layer_config, kind, moe)?));
    }
    let mtp = if config.mtp_num_layers > 0 {
        let mut head_layers = Vec::with_capacity(config.mtp_num_layers);
        for _ in 0..config.mtp_num_layers {
            let moe = config.moe.is_some();
            head_layers.push(fill.decoder_layer(&layer_config, LayerType::FullAttention, moe)?);
        }
        Some(MtpHead {
            fc: fill.proj(&[h, 2 * h], 2 * h)?,
            pre_fc_norm_embedding: fill.norm(h)?,
            pre_fc_norm_hidden: fill.norm(h)?,
            layers: head_layers,
            norm: fill.norm(h)?,
        })
    } else {
        None
    };
    gpu.synchronize(s)?;
    let embed_rows = VocabRows {
        start: vocab_rows.start as u32,
        vocab: v as u32,
    };
    let weights = ModelWeights {
        embed_rows,
        embed,
        final_norm,
        lm_head,
        mtp,
        kv_scales: Vec::new(),
    };
    match shard {
        None => Model::new(config, gpu, weights, layers),
        Some(sh) => Model::new_shard(layer_config, gpu, weights, layers, sh.size),
    }
}
