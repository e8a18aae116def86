//! `Tensor`: what an edge of a circuit carries, named after the fixed step buffer (or state
//! pool) that holds it, with the one format and shape every edge of that tensor has.
//!
//! This is the table an executor binds addresses by: each circuit value names its tensor, and
//! a tensor is one buffer of the step (an activation or an uploaded input) or one pool of
//! per-sequence state. Invariant: the formats and shapes here are the ones the engine's
//! `StepBuffers`, `PagedKvCache` and SSM state pool document.

use crate::op::Format;
use crate::shape::{Dim, Extent, Shape};

use Dim::*;

/// What kind of memory a tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorKind {
    /// Uploaded by the host before the step (ids, positions, slots, block tables).
    Input,
    /// Written and read within the step.
    Activation,
    /// Per-sequence state in a pool that outlives the step; its shape is one slot's (one
    /// token's for the KV cache, one sequence's for the SSM pools).
    State,
}

/// See the module header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tensor {
    /// Token id of each row.
    TokenIds,
    /// Position of each row.
    Positions,
    /// KV-cache slot of each row (`u32::MAX`: padding).
    SlotMapping,
    /// Block-table row of each row.
    RowSeq,
    /// The block tables.
    BlockTables,
    /// First row of each step sequence, then `rows`.
    SeqStart,
    /// SSM state slot of each step sequence (`u32::MAX`: padding).
    SeqSlot,
    /// A verify step's SSM slot that keeps the state after each row (`u32::MAX`: none).
    RowSlot,
    /// Which rows get logits.
    LogitRows,
    /// A draft step's hidden rows (f32): the final-norm rows of the step before that the MTP
    /// head reads, gathered and widened before the step (`MtpStep::hidden_rows`).
    MtpHidden,
    /// The draft step's normed embeddings: the first half of `mtp.cat_src`.
    MtpNormedEmbedding,
    /// The draft step's normed hidden rows: the second half of `mtp.cat_src`, right after the
    /// normed embeddings at the step's row count.
    MtpNormedHidden,
    /// Which `mtp.cat_src` row each half-row of `mtp.cat` takes: `[0, n, 1, n + 1, ...]`.
    MtpCatIds,
    /// `[normed embedding | normed hidden]` per row, `fc`'s input.
    MtpCat,
    /// The residual stream (f32).
    Residual,
    /// The current norm's output.
    Normed,
    /// A sub-layer's output, added to the residual by the next norm.
    Delta,
    /// Attention's qkv projection (normalised and rotated in place).
    Qkv,
    /// Attention's output before `o`.
    AttnOut,
    /// The dense FFN's `[gate | up]`.
    GateUp,
    /// The dense FFN's `silu(gate) * up`.
    Act,
    /// The gathered final-norm rows.
    LogitsIn,
    /// Logits (f32).
    Logits,
    /// Greedy tokens.
    Sampled,
    /// K cache of one attention layer, as the attention kernels compute on it (bf16); the
    /// pool stores it as the instance's [`KvFormat`](crate::KvFormat) says.
    KCache,
    /// V cache of one attention layer (as [`Tensor::KCache`]).
    VCache,
    /// GDN input projection `[q | k | v | z | b | a]` per row (a block-FP8 layer's buffer holds
    /// the q|k|v|z rows first and the b|a rows after them).
    GdnProj,
    /// GDN causal conv + SiLU of the q|k|v channels.
    GdnConv,
    /// GDN L2-normalised q (scaled) and k.
    GdnQk,
    /// GDN β then g per value head.
    GdnGates,
    /// GDN delta rule output.
    GdnCore,
    /// GDN gated norm output, `gdn_out`'s input.
    GdnNormed,
    /// GDN conv window of one layer.
    ConvState,
    /// GDN recurrent state of one layer.
    RecurrentState,
    /// MoE router logits.
    MoeRouterLogits,
    /// MoE chosen experts per row.
    MoeTopkIds,
    /// MoE routing weights of the chosen experts.
    MoeTopkWeights,
    /// MoE per-pair `[gate | up]`.
    MoeExpertGateUp,
    /// MoE per-pair activation.
    MoeExpertAct,
    /// MoE per-pair expert output.
    MoeExpertOut,
    /// Shared expert `[gate | up]`.
    MoeSharedGateUp,
    /// Shared expert activation.
    MoeSharedAct,
    /// Shared expert output.
    MoeSharedOut,
    /// Shared expert gate logit.
    MoeSharedGate,
}

/// The kind, format and shape every edge of a tensor has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorSpec {
    /// Text name (the buffer's name; `gdn.` / `moe.` for the hybrid buffers).
    pub name: &'static str,
    /// Kind of memory.
    pub kind: TensorKind,
    /// Element format.
    pub format: Format,
    /// Shape.
    pub shape: Shape,
}

const ROWS: Extent = Extent::dim(&[Rows]);
const SEQS: Extent = Extent::dim(&[Seqs]);
const PAIRS: Extent = Extent::dim(&[Rows, TopK]);
const LOGITS: Extent = Extent::dim(&[LogitRows]);

const fn spec(
    name: &'static str,
    kind: TensorKind,
    format: Format,
    shape: &'static [Extent],
) -> TensorSpec {
    TensorSpec {
        name,
        kind,
        format,
        shape: Shape(shape),
    }
}

const fn input(name: &'static str, shape: &'static [Extent]) -> TensorSpec {
    spec(name, TensorKind::Input, Format::U32, shape)
}

const fn act(name: &'static str, format: Format, shape: &'static [Extent]) -> TensorSpec {
    spec(name, TensorKind::Activation, format, shape)
}

const fn state(name: &'static str, format: Format, shape: &'static [Extent]) -> TensorSpec {
    spec(name, TensorKind::State, format, shape)
}

impl Tensor {
    /// The tensor's kind, format and shape.
    pub const fn spec(self) -> TensorSpec {
        use Format::{Bf16, F32, U32};
        match self {
            Tensor::TokenIds => input("token_ids", const { &[ROWS] }),
            Tensor::Positions => input("positions", const { &[ROWS] }),
            Tensor::SlotMapping => input("slot_mapping", const { &[ROWS] }),
            Tensor::RowSeq => input("row_seq", const { &[ROWS] }),
            Tensor::BlockTables => input(
                "block_tables",
                const { &[SEQS, Extent::dim(&[BlocksPerSeq])] },
            ),
            Tensor::SeqStart => input("seq_start", const { &[Extent::plus(&[Seqs], 1)] }),
            Tensor::SeqSlot => input("seq_slot", const { &[SEQS] }),
            Tensor::RowSlot => input("row_slot", const { &[ROWS] }),
            Tensor::LogitRows => input("logit_rows", const { &[LOGITS] }),
            Tensor::MtpHidden => spec(
                "mtp.hidden",
                TensorKind::Input,
                F32,
                const { &[ROWS, Extent::dim(&[Hidden])] },
            ),
            Tensor::MtpNormedEmbedding => act(
                "mtp.normed_embedding",
                Bf16,
                const { &[ROWS, Extent::dim(&[Hidden])] },
            ),
            Tensor::MtpNormedHidden => act(
                "mtp.normed_hidden",
                Bf16,
                const { &[ROWS, Extent::dim(&[Hidden])] },
            ),
            Tensor::MtpCatIds => input("mtp.cat_ids", const { &[Extent::times(2, &[Rows])] }),
            Tensor::MtpCat => act(
                "mtp.cat",
                Bf16,
                const { &[ROWS, Extent::times(2, &[Hidden])] },
            ),
            Tensor::Residual => act("residual", F32, const { &[ROWS, Extent::dim(&[Hidden])] }),
            Tensor::Normed => act("normed", Bf16, const { &[ROWS, Extent::dim(&[Hidden])] }),
            Tensor::Delta => act("delta", Bf16, const { &[ROWS, Extent::dim(&[Hidden])] }),
            Tensor::Qkv => act("qkv", Bf16, const { &[ROWS, Extent::dim(&[QkvWidth])] }),
            Tensor::AttnOut => act(
                "attn_out",
                Bf16,
                const { &[ROWS, Extent::dim(&[AttnOutWidth])] },
            ),
            Tensor::GateUp => act("gate_up", Bf16, const { &[ROWS, Extent::times(2, &[Ffn])] }),
            Tensor::Act => act("act", Bf16, const { &[ROWS, Extent::dim(&[Ffn])] }),
            Tensor::LogitsIn => act(
                "logits_in",
                Bf16,
                const { &[LOGITS, Extent::dim(&[Hidden])] },
            ),
            Tensor::Logits => act("logits", F32, const { &[LOGITS, Extent::dim(&[Vocab])] }),
            Tensor::Sampled => act("sampled", U32, const { &[LOGITS] }),
            Tensor::KCache => state("k_cache", Bf16, const { &[Extent::dim(&[KvWidth])] }),
            Tensor::VCache => state("v_cache", Bf16, const { &[Extent::dim(&[KvWidth])] }),
            Tensor::GdnProj => act(
                "gdn.proj",
                Bf16,
                const { &[ROWS, Extent::dim(&[GdnProjWidth])] },
            ),
            Tensor::GdnConv => act(
                "gdn.conv",
                Bf16,
                const { &[ROWS, Extent::dim(&[GdnConvDim])] },
            ),
            Tensor::GdnQk => act("gdn.qk", F32, const { &[ROWS, Extent::dim(&[GdnQkWidth])] }),
            Tensor::GdnGates => act(
                "gdn.gates",
                F32,
                const { &[ROWS, Extent::times(2, &[GdnVHeads])] },
            ),
            Tensor::GdnCore => act(
                "gdn.core",
                F32,
                const { &[ROWS, Extent::dim(&[GdnValueDim])] },
            ),
            Tensor::GdnNormed => act(
                "gdn.normed",
                Bf16,
                const { &[ROWS, Extent::dim(&[GdnValueDim])] },
            ),
            Tensor::ConvState => state(
                "conv_state",
                F32,
                const { &[Extent::dim(&[ConvWindow]), Extent::dim(&[GdnConvDim])] },
            ),
            Tensor::RecurrentState => state(
                "recurrent_state",
                F32,
                const {
                    &[
                        Extent::dim(&[GdnVHeads]),
                        Extent::dim(&[GdnKHeadDim]),
                        Extent::dim(&[GdnVHeadDim]),
                    ]
                },
            ),
            Tensor::MoeRouterLogits => act(
                "moe.router_logits",
                F32,
                const { &[ROWS, Extent::dim(&[Experts])] },
            ),
            Tensor::MoeTopkIds => act("moe.topk_ids", U32, const { &[ROWS, Extent::dim(&[TopK])] }),
            Tensor::MoeTopkWeights => act(
                "moe.topk_weights",
                F32,
                const { &[ROWS, Extent::dim(&[TopK])] },
            ),
            Tensor::MoeExpertGateUp => act(
                "moe.expert_gate_up",
                Bf16,
                const { &[PAIRS, Extent::times(2, &[ExpertFfn])] },
            ),
            Tensor::MoeExpertAct => act(
                "moe.expert_act",
                Bf16,
                const { &[PAIRS, Extent::dim(&[ExpertFfn])] },
            ),
            Tensor::MoeExpertOut => act(
                "moe.expert_out",
                F32,
                const { &[PAIRS, Extent::dim(&[Hidden])] },
            ),
            Tensor::MoeSharedGateUp => act(
                "moe.shared_gate_up",
                Bf16,
                const { &[ROWS, Extent::times(2, &[SharedFfn])] },
            ),
            Tensor::MoeSharedAct => act(
                "moe.shared_act",
                Bf16,
                const { &[ROWS, Extent::dim(&[SharedFfn])] },
            ),
            Tensor::MoeSharedOut => act(
                "moe.shared_out",
                Bf16,
                const { &[ROWS, Extent::dim(&[Hidden])] },
            ),
            Tensor::MoeSharedGate => act("moe.shared_gate", F32, const { &[ROWS] }),
        }
    }

    /// The tensor's text name.
    pub const fn name(self) -> &'static str {
        self.spec().name
    }
}

impl std::fmt::Display for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
