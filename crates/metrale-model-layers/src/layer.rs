//! The contract between the model and its layers: `TransformerLayer`, the per-step context a
//! layer runs in (`LayerCtx`), the step's fixed buffers (`StepBuffers`) and the model's dimensions
//! (`ModelDims`).
//!
//! Invariants:
//! - A step is a set of rows (tokens), each with a position and a sequence (a block-table row);
//!   prefill chunks and decode are the same step with different rows.
//! - The residual stream is f32 in `StepBuffers::residual`; each layer leaves its last output in
//!   `delta`, which the next layer's input norm (or the final norm) adds to the residual.
//! - Rows of one sequence are contiguous and in position order; `row_seq` and `seq_start`
//!   describe the same partition. A padding row is a sequence of its own whose SSM slot is
//!   `u32::MAX` (and whose KV slot is `u32::MAX`).

use metrale_cache::{KvDtype, KvScales};
use metrale_config::{ModelConfig, NormConvention};
use metrale_gpu_runtime::{DevicePtr, GpuResult, StreamHandle};

use crate::circuit_exec::CircuitBindings;
use crate::ops::{KvStore, Matrix, Norm, Ops, QkNormRope};

/// The dimensions every layer of a model shares, derived once from its config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelDims {
    /// Hidden size.
    pub hidden: u32,
    /// Query heads.
    pub num_q_heads: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Rotated dims per head.
    pub rotary_dim: u32,
    /// Factor on the rotary embedding's cos and sin (`RopeConfig::attention_scaling`: YaRN's
    /// attention factor, exactly 1 otherwise).
    pub rope_attention_scaling: f32,
    /// Attention output gate after each query head (`[q | gate]`).
    pub attn_gated: bool,
    /// Dense FFN width.
    pub ffn: u32,
    /// Vocabulary.
    pub vocab: u32,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Zero-centred norm weights (`1 + w`).
    pub unit_offset: bool,
    /// Tensor-parallel ranks the model is sharded over (1: the whole model). Above 1 the head
    /// counts and FFN width above are one rank's, `vocab` stays the whole vocabulary, and each
    /// row-parallel projection ends with an all-reduce ([`LayerCtx::row_parallel`]).
    pub tp_size: u32,
}

impl ModelDims {
    /// Dimensions of `config`.
    pub fn from_config(config: &ModelConfig) -> ModelDims {
        ModelDims {
            hidden: config.hidden_size as u32,
            num_q_heads: config.attention.num_attention_heads as u32,
            num_kv_heads: config.attention.num_key_value_heads as u32,
            head_dim: config.attention.head_dim as u32,
            rotary_dim: config.attention.rope.rotary_dim as u32,
            rope_attention_scaling: config.attention.rope.attention_scaling(),
            attn_gated: config.attention.attn_output_gate,
            ffn: config.intermediate_size as u32,
            vocab: config.tokens.vocab_size as u32,
            eps: config.rms_norm_eps,
            unit_offset: config.norm == NormConvention::ZeroCentred,
            tp_size: 1,
        }
    }

    /// Elements from one query head to the next in the projection output.
    pub fn q_head_stride(&self) -> u32 {
        if self.attn_gated {
            2 * self.head_dim
        } else {
            self.head_dim
        }
    }

    /// Width of the fused q (with gates), k, v projection output.
    pub fn qkv_width(&self) -> u32 {
        self.num_q_heads * self.q_head_stride() + 2 * self.num_kv_heads * self.head_dim
    }

    /// Element offset of the first key head in a projection row.
    pub fn k_offset(&self) -> u32 {
        self.num_q_heads * self.q_head_stride()
    }

    /// Element offset of the first value head in a projection row.
    pub fn v_offset(&self) -> u32 {
        self.k_offset() + self.num_kv_heads * self.head_dim
    }

    /// Width of the attention output (`o_proj` input).
    pub fn attn_out_width(&self) -> u32 {
        self.num_q_heads * self.head_dim
    }

    /// The model's RMSNorm with weight `w` (its epsilon and weight convention).
    pub fn norm(&self, w: DevicePtr) -> Norm {
        Norm {
            w,
            eps: self.eps,
            unit_offset: self.unit_offset,
        }
    }

    /// `qk_norm_rope`'s parameters over `rows` rows of a qkv buffer laid out by these dims;
    /// `norms`: the q and k norm weights (NULL: none).
    pub fn rope_params(
        &self,
        qkv: DevicePtr,
        norms: (DevicePtr, DevicePtr),
        inv_freq: DevicePtr,
        positions: DevicePtr,
        rows: u32,
    ) -> QkNormRope {
        QkNormRope {
            qkv,
            q_norm: norms.0,
            k_norm: norms.1,
            inv_freq,
            positions,
            rows,
            row_stride: self.qkv_width(),
            num_q_heads: self.num_q_heads,
            q_head_stride: self.q_head_stride(),
            k_offset: self.k_offset(),
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            rotary_dim: self.rotary_dim,
            attention_scaling: self.rope_attention_scaling,
            eps: self.eps,
            unit_offset: self.unit_offset,
        }
    }

    /// `kv_store`'s parameters: the keys and values of `rows` rows of a qkv buffer laid out by
    /// these dims into the cache `kv` (in its format).
    pub fn store_params(
        &self,
        qkv: DevicePtr,
        kv: &KvBinding,
        slot_mapping: DevicePtr,
        rows: u32,
    ) -> KvStore {
        KvStore {
            k_cache: kv.k,
            v_cache: kv.v,
            qkv,
            slot_mapping,
            rows,
            row_stride: self.qkv_width(),
            k_offset: self.k_offset(),
            v_offset: self.v_offset(),
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            num_slots: kv.num_slots,
            kv_fp8: kv.fp8() as u32,
            k_scale: kv.scales.k,
            v_scale: kv.scales.v,
        }
    }
}

/// The shape of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Rows (tokens) in the step, padding included.
    pub rows: u32,
    /// Block-table rows in the step.
    pub num_seqs: u32,
    /// Columns of the block table.
    pub max_blocks: u32,
    /// Rows whose logits are computed.
    pub logit_rows: u32,
    /// A verify step of speculative decoding: the GDN layers run each sequence's rows token by
    /// token, bitwise as decode steps would, and keep the state after every row in that row's
    /// `StepBuffers::row_slot` instead of advancing the sequence's own slot.
    pub verify: bool,
    /// Row groups uploaded to `StepBuffers::att_groups` for `paged_attention_prefill`; 0: every
    /// row attends alone through `paged_attention` (decode and verify steps, which graphs
    /// capture).
    pub att_groups: u32,
    /// Of the row groups, the last ones `paged_attention_prefill` runs through its split kernels
    /// (`ops::attention_prefill_plan`).
    pub att_split: u32,
    /// Of the row groups, the first ones, whose rows are prompt rows attending in the prompt
    /// arithmetic (`paged_attention_prompt`, `ops::attention_step_plan`); the rest run through
    /// `paged_attention_prefill`.
    pub att_prompt: u32,
}

/// The fixed buffers a step reads and writes; allocated once in the model's arena.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepBuffers {
    /// The activations every layer reads and writes.
    pub acts: Activations,
    /// The step's metadata, written by the host before the step (`upload`).
    pub meta: StepMeta,
    /// The LM head's input and output rows.
    pub head: HeadBuffers,
    /// f32 `[rotary_dim / 2]`: RoPE inverse frequencies.
    pub inv_freq: DevicePtr,
    /// The Gated DeltaNet layers' buffers (NULL in a model without them).
    pub gdn: GdnBuffers,
    /// The sparse-MoE layers' buffers (NULL in a model without them).
    pub moe: MoeBuffers,
}

/// The activations of a step's rows.
#[derive(Debug, Clone, Copy, Default)]
pub struct Activations {
    /// f32 `[rows, hidden]`: the residual stream.
    pub residual: DevicePtr,
    /// bf16 `[rows, hidden]`: the current norm's output.
    pub normed: DevicePtr,
    /// bf16 `[rows, hidden]`: a sub-layer's output, added to the residual by the next norm.
    pub delta: DevicePtr,
    /// bf16 `[rows, qkv_width]`.
    pub qkv: DevicePtr,
    /// bf16 `[rows, attn_out_width]`.
    pub attn_out: DevicePtr,
    /// bf16 `[rows, 2 * ffn]`.
    pub gate_up: DevicePtr,
    /// bf16 `[rows, ffn]`.
    pub act: DevicePtr,
    /// f32 `[rows, hidden]`: one rank's partial sums of a row-parallel projection, before the
    /// all-reduce (NULL in a model that is not sharded).
    pub partial: DevicePtr,
}

/// A step's metadata: which rows, at which positions, of which sequences, in which slots.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepMeta {
    /// u32 `[rows]`: token ids.
    pub token_ids: DevicePtr,
    /// u32 `[rows]`: positions.
    pub positions: DevicePtr,
    /// u32 `[rows]`: block-table row of each row.
    pub row_seq: DevicePtr,
    /// u32 `[rows, 2]`: the row groups of the prefill attention (`ops::attention_row_groups`),
    /// `StepShape::att_groups` of them.
    pub att_groups: DevicePtr,
    /// u32 `[rows]`: cache slot of each row (`u32::MAX` for padding).
    pub slot_mapping: DevicePtr,
    /// u32 `[num_seqs, max_blocks]`.
    pub block_tables: DevicePtr,
    /// u32 `[logit_rows]`: which rows get logits.
    pub logit_rows: DevicePtr,
    /// u32 `[max_seqs + 1]`: the first row of each step sequence (the row order of `row_seq`),
    /// then `rows`. Read by the per-sequence kernels (GDN).
    pub seq_start: DevicePtr,
    /// u32 `[max_seqs]`: the SSM state slot of each step sequence (`u32::MAX`: a padding
    /// sequence, which reads zero state and writes none).
    pub seq_slot: DevicePtr,
    /// u32 `[rows]`: in a verify step, the SSM slot that keeps the state after each row
    /// (`u32::MAX`: none); unread otherwise.
    pub row_slot: DevicePtr,
}

/// The LM head's buffers.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeadBuffers {
    /// bf16 `[logit_rows, hidden]`: the gathered final-norm rows.
    pub logits_in: DevicePtr,
    /// f32 `[logit_rows, vocab]`.
    pub logits: DevicePtr,
    /// f32 `[logit_rows, vocab / N]`: a tensor-parallel rank's slice of the logits before they
    /// are gathered (NULL in a model that is not sharded).
    pub logits_local: DevicePtr,
    /// u32 `[logit_rows]`: greedy tokens.
    pub sampled: DevicePtr,
}

/// The per-step buffers of the GDN layers, for `R` = max rows and the GDN shape (`Hk` key heads
/// of `Dk`, `Hv` value heads of `Dv`, `conv_dim = 2*Hk*Dk + Hv*Dv`); see
/// `layers::GdnShape` for the widths.
#[derive(Debug, Clone, Copy, Default)]
pub struct GdnBuffers {
    /// bf16, `R * (conv_dim + Hv*Dv + 2*Hv)` elements: the input projection, `[q|k|v|z|b|a]`
    /// per row, fused or as q|k|v|z rows then b|a rows (`ops_hybrid::GdnProjLayout`).
    pub proj: DevicePtr,
    /// bf16 `[R, conv_dim]`: the causal conv + SiLU of the q|k|v channels.
    pub conv: DevicePtr,
    /// f32 `[R, 2*Hk*Dk]`: L2-normalised q (times `1/√Dk`) and k.
    pub qk: DevicePtr,
    /// f32 `[R, 2*Hv]`: β then g per value head.
    pub gates: DevicePtr,
    /// f32 `[R, Hv*Dv]`: the gated delta rule's output.
    pub core: DevicePtr,
    /// bf16 `[R, Hv*Dv]`: the gated RMSNorm's output, `out_proj`'s input.
    pub normed: DevicePtr,
}

/// The per-step buffers of the sparse-MoE layers, for `R` = max rows, `E` experts, top-k `K`,
/// expert width `F`, shared-expert width `Fs`, hidden `H`. Pair `p = row * K + choice`.
#[derive(Debug, Clone, Copy, Default)]
pub struct MoeBuffers {
    /// f32 `[R, E]`: router logits.
    pub router_logits: DevicePtr,
    /// u32 `[R, K]`: the chosen experts, by descending probability.
    pub topk_ids: DevicePtr,
    /// f32 `[R, K]`: their routing weights.
    pub topk_weights: DevicePtr,
    /// bf16 `[R*K, 2F]`: each pair's expert gate|up projection.
    pub expert_gate_up: DevicePtr,
    /// bf16 `[R*K, F]`: `silu(gate) * up` per pair.
    pub expert_act: DevicePtr,
    /// f32 `[R*K, H]`: each pair's expert output.
    pub expert_out: DevicePtr,
    /// bf16 `[R, 2*Fs]`: the shared expert's gate|up projection.
    pub shared_gate_up: DevicePtr,
    /// bf16 `[R, Fs]`: the shared expert's activation.
    pub shared_act: DevicePtr,
    /// bf16 `[R, H]`: the shared expert's output.
    pub shared_out: DevicePtr,
    /// f32 `[R]`: the shared expert's gate logit.
    pub shared_gate: DevicePtr,
}

/// One attention layer's cache, as a step sees it.
#[derive(Debug, Clone, Copy)]
pub struct KvBinding {
    /// K pool.
    pub k: DevicePtr,
    /// V pool.
    pub v: DevicePtr,
    /// Tokens per block.
    pub block_size: u32,
    /// Slots per pool.
    pub num_slots: u32,
    /// The pools' element format.
    pub dtype: KvDtype,
    /// The layer's FP8 scales (with `KvDtype::Fp8`).
    pub scales: KvScales,
}

impl KvBinding {
    /// `kv_fp8` as the kernels take it.
    pub fn fp8(&self) -> bool {
        self.dtype == KvDtype::Fp8
    }
}

/// One GDN layer's SSM state, as a step sees it (an `SsmStatePool` layer, strides in f32
/// elements: `conv_slot_bytes / 4`, `recurrent_slot_bytes / 4`).
#[derive(Debug, Clone, Copy)]
pub struct SsmBinding {
    /// Conv windows, f32 `[num_slots, K - 1, conv_dim]`, slot `s` at `s * conv_slot_stride`.
    pub conv: DevicePtr,
    /// Recurrent states, f32 `[num_slots, Hv, Dk, Dv]`, slot `s` at `s * recurrent_slot_stride`.
    pub recurrent: DevicePtr,
    /// f32 elements from one slot's conv window to the next.
    pub conv_slot_stride: u32,
    /// f32 elements from one slot's recurrent state to the next.
    pub recurrent_slot_stride: u32,
    /// Slots in the pool.
    pub num_slots: u32,
}

/// What a layer runs with during one step.
#[derive(Debug, Clone, Copy)]
pub struct LayerCtx<'a> {
    /// Launchers.
    pub ops: &'a Ops,
    /// Stream of the step.
    pub stream: StreamHandle,
    /// The step's buffers.
    pub buf: &'a StepBuffers,
    /// The step's shape.
    pub shape: StepShape,
    /// The model's dimensions.
    pub dims: &'a ModelDims,
    /// This layer's KV cache, when it is an attention layer.
    pub kv: Option<KvBinding>,
    /// This layer's SSM state, when it is a GDN layer.
    pub ssm: Option<SsmBinding>,
    /// The first layer: its input norm reads the embedding, with no delta to add.
    pub first: bool,
}

impl LayerCtx<'_> {
    /// `delta = x · wᵀ` for a projection whose input features are split over the ranks
    /// (attention's o, the MLP's down, GDN's out): alone, one `linear`; sharded, each rank's
    /// partial sums in f32 into `partial`, then summed over the ranks into `delta`, so the sum
    /// is rounded to bf16 once, as the whole projection rounds it.
    pub fn row_parallel(&self, x: Matrix, w: Matrix) -> GpuResult<()> {
        let (ops, s, rows) = (self.ops, self.stream, self.shape.rows);
        let delta = Matrix::bf16(self.buf.acts.delta, rows, self.dims.hidden);
        if self.dims.tp_size <= 1 {
            return ops.linear(s, delta, x, w);
        }
        let partial = Matrix::f32(self.buf.acts.partial, rows, self.dims.hidden);
        ops.linear_f32out(s, partial, x, w)?;
        ops.all_reduce_sum(s, delta, partial)
    }

    /// Whether this model is a tensor-parallel shard.
    pub fn sharded(&self) -> bool {
        self.dims.tp_size > 1
    }
}

/// A decoder layer. Through its [`CircuitBindings`] supertrait it hands the circuit executor
/// its weights and facts.
pub trait TransformerLayer: CircuitBindings + Send + Sync + std::fmt::Debug {
    /// Run the layer over the step's rows: input norm (fused with the previous delta), mixer,
    /// post norm, FFN; leaves its output in `delta`.
    fn forward(&self, cx: &LayerCtx<'_>) -> GpuResult<()>;

    /// Whether the layer reads a KV cache (full attention).
    fn uses_kv_cache(&self) -> bool;

    /// Whether the layer keeps SSM state (a Gated DeltaNet mixer) and needs `LayerCtx::ssm`.
    fn uses_ssm_state(&self) -> bool {
        false
    }
}
