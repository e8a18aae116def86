//! `Fixed`: the device addresses a program is compiled against, other than weights: the step
//! buffers (activations and the metadata the host uploads before each step), each layer's
//! KV cache or SSM state pools, and the MTP draft head's ([`DraftFixed`]: its buffers and the
//! KV pools of its layer).
//!
//! Invariants:
//! - Every address here is fixed after boot (the model's `BufferArena`, `PagedKvCache` and
//!   `SsmStatePool` never move), so a compiled program, and a graph captured from it, stays
//!   valid for the model's life.
//! - Each circuit tensor maps to exactly one buffer ([`Fixed::tensor`]), the one the legacy
//!   forward uses for it. The draft step's `mtp.normed_embedding` and `mtp.normed_hidden` are
//!   the two halves of `mtp.cat_src`: both map to its start, and the emitter places the second
//!   half right after the first at the plan's row count, as `launch_mtp` does.

use metrale_circuit::{Block, Tensor};
use metrale_gpu_runtime::DevicePtr;

use super::error::CircuitExecError;
use crate::layer::{KvBinding, SsmBinding, StepBuffers};

/// One decoder layer's state pools.
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerPools {
    /// Its KV cache, when it is a full-attention layer.
    pub kv: Option<KvBinding>,
    /// Its SSM state, when it is a Gated DeltaNet layer.
    pub ssm: Option<SsmBinding>,
}

/// The MTP draft head's fixed buffers (the engine's `MtpBuffers`) and its layers' KV pools.
#[derive(Debug, Clone, Default)]
pub struct DraftFixed {
    /// f32 `[R, H]`: the hidden rows a draft step reads, gathered before the step.
    pub hidden: DevicePtr,
    /// bf16 `[2R, H]`: the normed embeddings (rows `0..n`), then the normed hidden rows.
    pub cat_src: DevicePtr,
    /// u32 `[2R]`: `[0, n, 1, n + 1, ...]`, uploaded before the step.
    pub cat_ids: DevicePtr,
    /// bf16 `[R, 2H]`: `fc`'s input.
    pub cat: DevicePtr,
    /// Each head layer's pools (a KV cache of its own), in order.
    pub pools: Vec<LayerPools>,
}

/// See the module header.
#[derive(Debug, Clone)]
pub struct Fixed {
    /// The step buffers.
    pub buffers: StepBuffers,
    /// Each decoder layer's pools, in layer order.
    pub pools: Vec<LayerPools>,
    /// The MTP draft head's; `None` without a head that drafts.
    pub draft: Option<DraftFixed>,
}

impl Fixed {
    /// The address of `tensor` as read or written in `block`; a NULL buffer or a missing pool
    /// is an error naming the tensor.
    pub fn tensor(&self, tensor: Tensor, block: Block) -> Result<DevicePtr, CircuitExecError> {
        let b = &self.buffers;
        let pools = self.pools(block);
        let draft = self.draft.clone().unwrap_or_default();
        let ptr = match tensor {
            Tensor::TokenIds => b.meta.token_ids,
            Tensor::Positions => b.meta.positions,
            Tensor::SlotMapping => b.meta.slot_mapping,
            Tensor::RowSeq => b.meta.row_seq,
            Tensor::BlockTables => b.meta.block_tables,
            Tensor::SeqStart => b.meta.seq_start,
            Tensor::SeqSlot => b.meta.seq_slot,
            Tensor::RowSlot => b.meta.row_slot,
            Tensor::LogitRows => b.meta.logit_rows,
            Tensor::MtpHidden => draft.hidden,
            Tensor::MtpNormedEmbedding | Tensor::MtpNormedHidden => draft.cat_src,
            Tensor::MtpCatIds => draft.cat_ids,
            Tensor::MtpCat => draft.cat,
            Tensor::Residual => b.acts.residual,
            Tensor::Normed => b.acts.normed,
            Tensor::Delta => b.acts.delta,
            Tensor::Qkv => b.acts.qkv,
            Tensor::AttnOut => b.acts.attn_out,
            Tensor::GateUp => b.acts.gate_up,
            Tensor::Act => b.acts.act,
            Tensor::LogitsIn => b.head.logits_in,
            Tensor::Logits => b.head.logits,
            Tensor::Sampled => b.head.sampled,
            Tensor::KCache => pools.kv.map_or(DevicePtr::NULL, |kv| kv.k),
            Tensor::VCache => pools.kv.map_or(DevicePtr::NULL, |kv| kv.v),
            Tensor::GdnProj => b.gdn.proj,
            Tensor::GdnConv => b.gdn.conv,
            Tensor::GdnQk => b.gdn.qk,
            Tensor::GdnGates => b.gdn.gates,
            Tensor::GdnCore => b.gdn.core,
            Tensor::GdnNormed => b.gdn.normed,
            Tensor::ConvState => pools.ssm.map_or(DevicePtr::NULL, |s| s.conv),
            Tensor::RecurrentState => pools.ssm.map_or(DevicePtr::NULL, |s| s.recurrent),
            Tensor::MoeRouterLogits => b.moe.router_logits,
            Tensor::MoeTopkIds => b.moe.topk_ids,
            Tensor::MoeTopkWeights => b.moe.topk_weights,
            Tensor::MoeExpertGateUp => b.moe.expert_gate_up,
            Tensor::MoeExpertAct => b.moe.expert_act,
            Tensor::MoeExpertOut => b.moe.expert_out,
            Tensor::MoeSharedGateUp => b.moe.shared_gate_up,
            Tensor::MoeSharedAct => b.moe.shared_act,
            Tensor::MoeSharedOut => b.moe.shared_out,
            Tensor::MoeSharedGate => b.moe.shared_gate,
        };
        if ptr.is_null() {
            return Err(CircuitExecError::NoBuffer {
                block,
                tensor: tensor.name(),
            });
        }
        Ok(ptr)
    }

    /// The pools of `block`: a decoder layer's, or a draft head layer's; none elsewhere.
    pub fn pools(&self, block: Block) -> LayerPools {
        let pools = match block {
            Block::Layer(i) => self.pools.get(i),
            Block::DraftLayer(i) => self.draft.as_ref().and_then(|d| d.pools.get(i)),
            Block::Embed | Block::Head | Block::Draft => None,
        };
        pools.copied().unwrap_or_default()
    }
}
