//! The vocabulary a circuit is written in: the operations of a step ([`Op`]), the
//! projection roles of [`Op::Linear`] ([`LinearRole`]), the kinds a layer can be ([`LayerKind`],
//! [`FfnKind`]) and the block of the step a node belongs to ([`Block`]).
//!
//! An op says what is computed, never how: which kernels run it is the business of the rules
//! (`rules.rs`). Every op has one stable text name (its `Display`), which the plan text and so
//! the plan digest are made of; renaming one changes every digest.

use std::fmt;

/// How an RMSNorm applies its weight after normalising `x`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NormWeight {
    /// `x * w`: Llama, Qwen3.
    Plain,
    /// `x * (1 + w)`, weights stored centred on zero: the decoder, q/k and final norms of
    /// Qwen3.5, Qwen3.5-MoE and Qwen3-Next.
    ZeroCentred,
}

/// Which norm of the step an RMSNorm is: whose weight it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NormRole {
    /// A layer's input norm (`input_layernorm`), before its mixer.
    Input,
    /// A layer's post-mixer norm (`post_attention_layernorm`), before its FFN.
    Post,
    /// The model's final norm, before the head.
    Final,
    /// The MTP head's norm of the next token's embedding (`pre_fc_norm_embedding`).
    DraftEmbedding,
    /// The MTP head's norm of the hidden row it reads (`pre_fc_norm_hidden`).
    DraftHidden,
    /// The MTP head's norm after its layer (`mtp.norm`), before the shared LM head.
    DraftFinal,
}

impl NormRole {
    /// The role's text name.
    pub fn name(self) -> &'static str {
        match self {
            NormRole::Input => "input",
            NormRole::Post => "post",
            NormRole::Final => "final",
            NormRole::DraftEmbedding => "draft_embedding",
            NormRole::DraftHidden => "draft_hidden",
            NormRole::DraftFinal => "draft_final",
        }
    }
}

/// Which projection of a layer (or of the head) a [`Op::Linear`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinearRole {
    /// Attention's fused `[q (with gates) ; k ; v]` projection.
    Qkv,
    /// Attention's output projection.
    O,
    /// The dense FFN's fused `[gate ; up]` projection.
    GateUp,
    /// The dense FFN's down projection.
    Down,
    /// Gated DeltaNet's input projection `[q | k | v | z | b | a]` (under block FP8 two GEMMs:
    /// the FP8 q|k|v|z rows, then the bf16 b|a rows).
    GdnInProj,
    /// Gated DeltaNet's output projection.
    GdnOut,
    /// The MoE router (f32 logits).
    Router,
    /// The routed experts' `[gate ; up]`, one per (row, choice) pair.
    ExpertGateUp,
    /// The routed experts' down projection (f32 out, one per pair).
    ExpertDown,
    /// The shared expert's `[gate ; up]`.
    SharedGateUp,
    /// The shared expert's down projection.
    SharedDown,
    /// The shared expert's scalar gate (f32 logit per row).
    SharedGate,
    /// The vocabulary projection (f32 logits).
    LmHead,
    /// The MTP head's `fc`: `[normed embedding | normed hidden]` to the (f32) residual stream.
    Fc,
}

impl LinearRole {
    /// Every role, in declaration order.
    pub const ALL: [LinearRole; 14] = [
        LinearRole::Qkv,
        LinearRole::O,
        LinearRole::GateUp,
        LinearRole::Down,
        LinearRole::GdnInProj,
        LinearRole::GdnOut,
        LinearRole::Router,
        LinearRole::ExpertGateUp,
        LinearRole::ExpertDown,
        LinearRole::SharedGateUp,
        LinearRole::SharedDown,
        LinearRole::SharedGate,
        LinearRole::LmHead,
        LinearRole::Fc,
    ];

    /// Whether a block-FP8 pack stores this projection in e4m3 (the Qwen layout): every decoder
    /// projection but the router, the shared expert's gate, the MTP head's `fc` and the LM head.
    /// Of the Gated DeltaNet input projection the packs quantize the q/k/v and z rows and keep
    /// the b and a rows in bf16: its FP8 weight is the q|k|v|z rows, and its node also runs the
    /// b|a rows' bf16 GEMM (the rule's last kernel, `gemm::linear`).
    pub fn block_fp8_in_packs(self) -> bool {
        matches!(
            self,
            LinearRole::Qkv
                | LinearRole::O
                | LinearRole::GateUp
                | LinearRole::Down
                | LinearRole::GdnInProj
                | LinearRole::GdnOut
                | LinearRole::ExpertGateUp
                | LinearRole::ExpertDown
                | LinearRole::SharedGateUp
                | LinearRole::SharedDown
        )
    }

    /// The role's text name.
    pub fn name(self) -> &'static str {
        match self {
            LinearRole::Qkv => "qkv",
            LinearRole::O => "o",
            LinearRole::GateUp => "gate_up",
            LinearRole::Down => "down",
            LinearRole::GdnInProj => "gdn_in_proj",
            LinearRole::GdnOut => "gdn_out",
            LinearRole::Router => "router",
            LinearRole::ExpertGateUp => "expert_gate_up",
            LinearRole::ExpertDown => "expert_down",
            LinearRole::SharedGateUp => "shared_gate_up",
            LinearRole::SharedDown => "shared_down",
            LinearRole::SharedGate => "shared_gate",
            LinearRole::LmHead => "lm_head",
            LinearRole::Fc => "fc",
        }
    }
}

impl fmt::Display for LinearRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One operation of a decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// Token ids to embedding rows, written to the (f32) residual stream.
    Embedding,
    /// RMSNorm of the residual stream (the first layer's input norm: nothing to add yet).
    RmsNorm {
        /// Which norm.
        role: NormRole,
        /// How it applies its weight.
        weight: NormWeight,
    },
    /// The residual add fused with the next RMSNorm: `residual += delta`, then
    /// `normed = norm(residual)`. Every norm after the first is this one.
    AddRmsNorm {
        /// Which norm.
        role: NormRole,
        /// How it applies its weight.
        weight: NormWeight,
    },
    /// `residual += delta` alone. No circuit uses it (the engine folds every add into
    /// the next norm) and no table lowers it; it is here for circuits that need it.
    ResidualAdd,
    /// A projection by role.
    Linear(LinearRole),
    /// RoPE on q and k, without per-head norms (Llama).
    Rope,
    /// Per-head RMSNorm of q and k, then RoPE (Qwen3, and the hybrids' attention layers).
    QkNormRope(NormWeight),
    /// Write each row's k and v into its slot of the paged KV cache.
    KvStore,
    /// Decode attention over the paged KV cache; `gated`: q carries an output gate
    /// (`[q | gate]` per head, Qwen3.5 / Qwen3-Next).
    PagedAttention {
        /// The output is multiplied by `sigmoid(gate)`.
        gated: bool,
    },
    /// Gated DeltaNet causal conv + SiLU over each sequence's window, and the window update.
    GdnConv,
    /// [`Op::GdnConv`] of a verify step: the sequences' windows are only read, and the window
    /// after each row goes to the row's own slot (`row_slot`).
    GdnConvVerify,
    /// Gated DeltaNet: L2-normalised q and k, and the gates β and g.
    GdnGates,
    /// Gated DeltaNet: the gated delta rule, one token per sequence, on the recurrent state.
    GdnRecurrence,
    /// [`Op::GdnRecurrence`] of a verify step: each sequence's rows token by token, the state
    /// after each row kept in the row's own slot (`row_slot`), the sequences' only read.
    GdnRecurrenceVerify,
    /// Gated DeltaNet: per-head RMSNorm of the rule's output times `silu(z)` (plain weight).
    GdnGatedNorm,
    /// MoE: softmax top-k of the router logits, with the chosen experts' weights.
    MoeRoute,
    /// MoE: the weighted sum of the chosen experts' outputs, plus the (gated) shared expert.
    MoeCombine,
    /// `silu(gate) * up` over a `[gate | up]` row.
    SiluMul,
    /// Gather the rows whose logits are wanted.
    GatherRows,
    /// The MTP head's concat: each row's normed embedding and normed hidden row, side by side
    /// (a row gather through `mtp.cat_ids`).
    DraftConcat,
    /// The index of each logit row's largest logit (greedy sampling).
    Argmax,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let zc = |w: &NormWeight| match w {
            NormWeight::Plain => "",
            NormWeight::ZeroCentred => "[1+w]",
        };
        match self {
            Op::Embedding => f.write_str("embedding"),
            Op::RmsNorm { role, weight } => write!(f, "rms_norm({}){}", role.name(), zc(weight)),
            Op::AddRmsNorm { role, weight } => {
                write!(f, "add_rms_norm({}){}", role.name(), zc(weight))
            }
            Op::ResidualAdd => f.write_str("residual_add"),
            Op::Linear(role) => write!(f, "linear({role})"),
            Op::Rope => f.write_str("rope"),
            Op::QkNormRope(w) => write!(f, "qk_norm_rope{}", zc(w)),
            Op::KvStore => f.write_str("kv_store"),
            Op::PagedAttention { gated: false } => f.write_str("paged_attention"),
            Op::PagedAttention { gated: true } => f.write_str("paged_attention[gated]"),
            Op::GdnConv => f.write_str("gdn_conv"),
            Op::GdnConvVerify => f.write_str("gdn_conv[verify]"),
            Op::GdnGates => f.write_str("gdn_gates"),
            Op::GdnRecurrence => f.write_str("gdn_recurrence"),
            Op::GdnRecurrenceVerify => f.write_str("gdn_recurrence[verify]"),
            Op::GdnGatedNorm => f.write_str("gdn_gated_norm"),
            Op::MoeRoute => f.write_str("moe_route"),
            Op::MoeCombine => f.write_str("moe_combine"),
            Op::SiluMul => f.write_str("silu_mul"),
            Op::GatherRows => f.write_str("gather_rows"),
            Op::DraftConcat => f.write_str("draft_concat"),
            Op::Argmax => f.write_str("argmax"),
        }
    }
}

/// A decoder layer's token mixer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerKind {
    /// Gated DeltaNet over the SSM state pool (`"linear_attention"`).
    LinearAttention,
    /// Softmax attention over the paged KV cache (`"full_attention"`).
    FullAttention,
}

impl LayerKind {
    /// The name transformers uses in `layer_types`.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::LinearAttention => "linear_attention",
            LayerKind::FullAttention => "full_attention",
        }
    }
}

/// A decoder layer's feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FfnKind {
    /// Dense SwiGLU.
    Dense,
    /// Sparse mixture of experts (with the shared expert the instance's MoE dims describe).
    Moe,
}

impl FfnKind {
    /// The kind's text name.
    pub fn name(self) -> &'static str {
        match self {
            FfnKind::Dense => "dense",
            FfnKind::Moe => "moe",
        }
    }
}

/// One decoder layer's shape: its mixer and its FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerSpec {
    /// The mixer.
    pub kind: LayerKind,
    /// The FFN.
    pub ffn: FfnKind,
}

impl fmt::Display for LayerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind.name(), self.ffn.name())
    }
}

/// The part of the step a node belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Block {
    /// The token embedding, before the first layer.
    Embed,
    /// Decoder layer `i` (0-based), from its input norm to its FFN's output.
    Layer(usize),
    /// The final norm, the logit rows, the LM head and the argmax.
    Head,
    /// The MTP head's own ops in a draft step: its two input norms, the concat, `fc`, and its
    /// final norm.
    Draft,
    /// The MTP head's decoder layer `i` (0-based) in a draft step.
    DraftLayer(usize),
}

impl fmt::Display for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Block::Embed => f.write_str("embed"),
            Block::Layer(i) => write!(f, "layer {i}"),
            Block::Head => f.write_str("head"),
            Block::Draft => f.write_str("draft"),
            Block::DraftLayer(i) => write!(f, "draft layer {i}"),
        }
    }
}

/// The element format of an edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Format {
    /// bfloat16.
    Bf16,
    /// IEEE float32.
    F32,
    /// Unsigned 32-bit integers (ids, positions, slots, indices).
    U32,
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Bf16 => "bf16",
            Format::F32 => "f32",
            Format::U32 => "u32",
        })
    }
}
