//! `Model`: a checkpoint's weights on a backend and the launches of one step through them, and
//! nothing else. It holds no per-step or per-sequence state: the step's buffers, graphs and
//! forward choice belong to the `StepRunner`, the caches to the `CacheManager`; every launch
//! here reads the buffers and pools it is handed.
//!
//! Invariants:
//! - The launches of a step depend only on its `StepShape` (row, sequence and logit-row counts),
//!   never on the data at the buffers' addresses, so they can be captured and replayed.
//! - A row's result depends only on its token, position and sequence cache, never on the other
//!   rows of the step.

mod mtp;

use std::sync::Arc;

use metrale_cache::KvScales;
use metrale_config::ModelConfig;
use metrale_gpu_runtime::{DType, GpuBackend, StreamHandle};
use metrale_model_layers::circuit_exec::LayerPools;
use metrale_model_layers::circuit_exec::{CircuitBindings, LinearRole, WeightSlot};
use metrale_model_layers::layers::MtpHead;
use metrale_model_layers::ops::{Matrix, VocabRows};
use metrale_model_layers::ops_gemm::fp8_weight_takes_map;
use metrale_model_layers::weight_map::DenseWeight;
use metrale_model_layers::{LayerCtx, ModelDims, Ops, StepBuffers, StepShape, TransformerLayer};

use crate::error::ModelError;

pub use mtp::MtpBuffers;

/// The model's non-layer weights.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// `[vocab, hidden]`; a tensor-parallel rank's `[vocab / N, hidden]`, its slice of the
    /// vocabulary (`embed_rows`).
    pub embed: DenseWeight,
    /// The vocabulary rows `embed` holds: all of them, or a rank's slice.
    pub embed_rows: VocabRows,
    /// `[hidden]`.
    pub final_norm: DenseWeight,
    /// `[vocab, hidden]` (the embedding when tied); a tensor-parallel rank's slice of the
    /// vocabulary, the same rows as `embed`'s.
    pub lm_head: DenseWeight,
    /// The multi-token-prediction head, when the checkpoint ships one (the drafter of
    /// speculative decoding).
    pub mtp: Option<MtpHead>,
    /// Each KV layer's FP8 KV scales (the attention layers in order, then the MTP head's), as
    /// the checkpoint gives them; an FP8 KV cache reads them, a bf16 one ignores them. Layers
    /// past the list (a checkpoint without scales) use 1.0.
    pub kv_scales: Vec<KvScales>,
}

/// Where a model's layers keep their cache: for each layer, its KV layer index when it is an
/// attention layer and its SSM layer index when it is a Gated DeltaNet layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheLayers {
    /// Per layer: its KV-cache layer.
    pub kv: Vec<Option<usize>>,
    /// Per layer: its SSM-pool layer.
    pub ssm: Vec<Option<usize>>,
    /// Attention layers (KV layers of the model; a draft head's follow).
    pub num_kv: usize,
    /// Gated DeltaNet layers.
    pub num_ssm: usize,
}

/// See the module header.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    dims: ModelDims,
    gpu: Arc<dyn GpuBackend>,
    ops: Ops,
    stream: StreamHandle,
    weights: ModelWeights,
    layers: Vec<Box<dyn TransformerLayer>>,
    cache_layers: CacheLayers,
}

impl Model {
    /// A model of `config` from its loaded weights and layers, launching on `gpu`'s default
    /// stream.
    pub fn new(
        config: ModelConfig,
        gpu: Arc<dyn GpuBackend>,
        weights: ModelWeights,
        layers: Vec<Box<dyn TransformerLayer>>,
    ) -> Result<Model, ModelError> {
        Model::new_shard(config, gpu, weights, layers, 1)
    }

    /// One rank's shard of a model split over `tp_size` ranks (1: the whole model): `config`
    /// is the shard's (its heads and widths, the whole vocabulary), `weights.lm_head` its slice
    /// of the vocabulary, and `gpu` the backend driving that rank of the group.
    pub fn new_shard(
        config: ModelConfig,
        gpu: Arc<dyn GpuBackend>,
        weights: ModelWeights,
        layers: Vec<Box<dyn TransformerLayer>>,
        tp_size: usize,
    ) -> Result<Model, ModelError> {
        if gpu.tp_rank().size != tp_size.max(1) {
            return Err(ModelError::Options {
                option: "tensor_parallel_size",
                problem: format!(
                    "a model of {tp_size} shard(s) on a backend in a group of {}",
                    gpu.tp_rank().size
                ),
            });
        }
        let ops = Ops::new(gpu.clone())?;
        let mut cache_layers = CacheLayers::default();
        for l in &layers {
            let kv = l.uses_kv_cache().then_some(cache_layers.num_kv);
            let ssm = l.uses_ssm_state().then_some(cache_layers.num_ssm);
            cache_layers.num_kv += usize::from(kv.is_some());
            cache_layers.num_ssm += usize::from(ssm.is_some());
            cache_layers.kv.push(kv);
            cache_layers.ssm.push(ssm);
        }
        Ok(Model {
            dims: ModelDims {
                tp_size: tp_size.max(1) as u32,
                ..ModelDims::from_config(&config)
            },
            stream: gpu.default_stream(),
            config,
            gpu,
            ops,
            weights,
            layers,
            cache_layers,
        })
    }

    /// The config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Tensor-parallel ranks this model is a shard of (1: the whole model).
    pub fn tp_size(&self) -> usize {
        self.dims.tp_size as usize
    }

    /// The dimensions every layer shares.
    pub fn dims(&self) -> &ModelDims {
        &self.dims
    }

    /// The backend.
    pub fn gpu(&self) -> &Arc<dyn GpuBackend> {
        &self.gpu
    }

    /// The launchers.
    pub fn ops(&self) -> &Ops {
        &self.ops
    }

    /// The stream every step and cache copy of this model runs on.
    pub fn stream(&self) -> StreamHandle {
        self.stream
    }

    /// The non-layer weights.
    pub fn weights(&self) -> &ModelWeights {
        &self.weights
    }

    /// The decoder layers, in order.
    pub fn layers(&self) -> &[Box<dyn TransformerLayer>] {
        &self.layers
    }

    /// Which layers keep KV and which SSM state.
    pub fn cache_layers(&self) -> &CacheLayers {
        &self.cache_layers
    }

    /// KV layer `k`'s FP8 KV scales (1.0 each where the checkpoint has none).
    pub fn kv_scales(&self, k: usize) -> KvScales {
        self.weights.kv_scales.get(k).copied().unwrap_or_default()
    }

    /// The multi-token-prediction head's weights, when the checkpoint has them.
    pub fn mtp_head(&self) -> Option<&MtpHead> {
        self.weights.mtp.as_ref()
    }

    /// Elements of the largest block-FP8 weight that `Ops::linear` runs (the layers' and the MTP
    /// head's projections) and the tensor-map kernels cannot read (`fp8_weight_takes_map` of its
    /// input width). Prefill-sized projections of such a weight dequantize it into scratch memory
    /// of this size (`Ops::set_fp8_scratch`) and run the bf16 kernels; every other FP8 projection
    /// runs `linear_tma_fp8` at those sizes. 0 when there is none, as on every official pack's
    /// shape. The stacked experts are left out: their projections (`expert_linear_fp8`) convert the
    /// weight as they read it at every row count.
    pub fn largest_unmapped_fp8_weight(&self) -> usize {
        let head = self
            .mtp_head()
            .map(|h| h.layers.as_slice())
            .unwrap_or_default();
        let bound = (self.layers.iter().map(|l| l.circuit_layer(&self.dims)))
            .chain(head.iter().map(|l| l.circuit_layer(&self.dims)));
        let stacked = |slot: &WeightSlot| {
            matches!(
                slot,
                WeightSlot::Linear(LinearRole::ExpertGateUp | LinearRole::ExpertDown)
            )
        };
        bound
            .flatten()
            .flat_map(|l| l.weights.into_iter())
            .filter(|(slot, w)| !stacked(slot) && w.weight().dtype == DType::F8E4M3)
            .filter_map(|(_, w)| {
                let shape = w.shape();
                let k = shape.last().map_or(0, |&k| k as u32);
                (!fp8_weight_takes_map(k)).then(|| shape.iter().product::<usize>())
            })
            .max()
            .unwrap_or(0)
    }

    /// The launches of one step through `ops` (the model's launchers, or recording ones): embed,
    /// every layer over its `pools`, the final norm, and the LM head on the logit rows.
    pub fn launch_step(
        &self,
        ops: &Ops,
        buf: &StepBuffers,
        pools: &[LayerPools],
        shape: StepShape,
    ) -> Result<(), ModelError> {
        let (s, d) = (self.stream, &self.dims);
        let residual = Matrix::f32(buf.acts.residual, shape.rows, d.hidden);
        let (embed, rows) = (self.weights.embed.matrix(), self.weights.embed_rows);
        ops.embedding_gather(s, residual, embed, buf.meta.token_ids, rows)?;
        if d.tp_size > 1 {
            // Vocabulary-parallel: the one rank holding a token's row wrote it, the others
            // zeros, so the sum is that row exactly.
            ops.all_reduce_sum(s, residual, residual)?;
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let p = pools.get(i).cloned().unwrap_or_default();
            layer.forward(&LayerCtx {
                ops,
                stream: s,
                buf,
                shape,
                dims: d,
                kv: p.kv,
                ssm: p.ssm,
                first: i == 0,
            })?;
        }
        let (delta, normed) = (
            Matrix::bf16(buf.acts.delta, shape.rows, d.hidden),
            Matrix::bf16(buf.acts.normed, shape.rows, d.hidden),
        );
        let norm = d.norm(self.weights.final_norm.ptr);
        ops.add_rms_norm(s, residual, delta, normed, &norm)?;
        self.launch_lm_head(ops, buf, shape)
    }

    /// The LM head on the step's logit rows of `normed`.
    pub(crate) fn launch_lm_head(
        &self,
        ops: &Ops,
        buf: &StepBuffers,
        shape: StepShape,
    ) -> Result<(), ModelError> {
        let (s, d) = (self.stream, &self.dims);
        if shape.logit_rows > 0 {
            let logits_in = Matrix::bf16(buf.head.logits_in, shape.logit_rows, d.hidden);
            let normed = Matrix::bf16(buf.acts.normed, shape.rows, d.hidden);
            ops.gather_rows(s, logits_in, normed, buf.meta.logit_rows)?;
            let logits = Matrix::f32(buf.head.logits, shape.logit_rows, d.vocab);
            let head = self.weights.lm_head.matrix();
            if d.tp_size <= 1 {
                ops.linear_f32out(s, logits, logits_in, head)?;
            } else {
                // Vocabulary-parallel: this rank's slice of every row, then the whole rows
                // gathered on every rank.
                let local = Matrix::f32(buf.head.logits_local, shape.logit_rows, head.rows);
                ops.linear_f32out(s, local, logits_in, head)?;
                ops.all_gather_cols(s, logits, local)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use metrale_gpu_runtime::CpuBackend;

    use super::*;
    use crate::Quantization;

    #[test]
    fn fp8_scratch_is_only_for_weights_the_tensor_map_kernels_cannot_read() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let fp8 = |config| {
            crate::factory::random_quantized(config, gpu.clone(), 1, Quantization::Fp8).unwrap()
        };
        // Every projection's input a multiple of 16 (the expert stacks too): no scratch.
        let moe = fp8(crate::bench::tiny_moe_for_cpu().unwrap());
        assert_eq!(moe.largest_unmapped_fp8_weight(), 0);
        // An FFN of 120: the down projection's rows (120 bytes) are off the map's stride, and
        // prefill-sized launches of it need its bf16 image.
        let mut config = crate::bench::tiny_for_cpu().unwrap();
        config.intermediate_size = 120;
        let hidden = config.hidden_size;
        assert_eq!(fp8(config).largest_unmapped_fp8_weight(), hidden * 120);
    }
}
