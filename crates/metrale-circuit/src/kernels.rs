//! Every kernel a rule names, in one place: rename a kernel here and every table follows.
//!
//! The first group is what the engine launches today (`metrale-model-layers` `ops.rs`,
//! `kernel_table!`); the reference rules use only these. The second group are fused kernels the
//! `Differs` / `BitIdentical` rules name; a backend may not have them yet, and a plan uses such a
//! rule only when the caller's [`KernelSet`](crate::KernelSet) lists all its kernels.

use crate::rules::Kernel;

/// `embed::embedding_gather`: token ids to embedding rows (f32 residual).
pub const EMBEDDING_GATHER: Kernel = Kernel::new("embed", "embedding_gather");
/// `embed::gather_rows`: the rows that get logits.
pub const GATHER_ROWS: Kernel = Kernel::new("embed", "gather_rows");
/// `norm::rms_norm` (plain or `1 + w` by its `unit_offset` argument).
pub const RMS_NORM: Kernel = Kernel::new("norm", "rms_norm");
/// `norm::add_rms_norm`: residual add, then RMSNorm.
pub const ADD_RMS_NORM: Kernel = Kernel::new("norm", "add_rms_norm");
/// `rope::qk_norm_rope`: per-head q/k RMSNorm (none with NULL weights), then RoPE, in place.
pub const QK_NORM_ROPE: Kernel = Kernel::new("rope", "qk_norm_rope");
/// `cache::kv_store`.
pub const KV_STORE: Kernel = Kernel::new("cache", "kv_store");
/// `attention::paged_attention` (gated or not by its `gated` argument).
pub const PAGED_ATTENTION: Kernel = Kernel::new("attention", "paged_attention");
/// `gemm::linear`: bf16 out.
pub const LINEAR: Kernel = Kernel::new("gemm", "linear");
/// `gemm::linear_f32out`: f32 out (LM head, MoE router, shared-expert gate).
pub const LINEAR_F32OUT: Kernel = Kernel::new("gemm", "linear_f32out");
/// `activation::silu_mul`.
pub const SILU_MUL: Kernel = Kernel::new("activation", "silu_mul");
/// `sampling::argmax`.
pub const ARGMAX: Kernel = Kernel::new("sampling", "argmax");
/// `gdn::causal_conv1d`: causal conv + SiLU over each sequence's window.
pub const GDN_CAUSAL_CONV1D: Kernel = Kernel::new("gdn", "causal_conv1d");
/// `gdn::conv_state_update`: advance each sequence's conv window.
pub const GDN_CONV_STATE_UPDATE: Kernel = Kernel::new("gdn", "conv_state_update");
/// `gdn::conv_state_verify`: a verify step's conv windows, each row's kept in its row slot.
pub const GDN_CONV_STATE_VERIFY: Kernel = Kernel::new("gdn", "conv_state_verify");
/// `gdn::gated_delta_verify`: the delta rule of a verify step, each row's state kept in its
/// row slot.
pub const GDN_VERIFY: Kernel = Kernel::new("gdn", "gated_delta_verify");
/// `gdn::gdn_prepare`: L2-normalised q, k and the gates.
pub const GDN_PREPARE: Kernel = Kernel::new("gdn", "gdn_prepare");
/// `gdn::gated_delta_recurrent`: the delta rule, one token per sequence.
pub const GDN_RECURRENT: Kernel = Kernel::new("gdn", "gated_delta_recurrent");
/// `gdn::gated_rms_norm`: the gated output norm.
pub const GDN_GATED_RMS_NORM: Kernel = Kernel::new("gdn", "gated_rms_norm");
/// `moe::topk_route`.
pub const MOE_TOPK_ROUTE: Kernel = Kernel::new("moe", "topk_route");
/// `moe::expert_linear`: per-pair expert projection, bf16 out.
pub const MOE_EXPERT_LINEAR: Kernel = Kernel::new("moe", "expert_linear");
/// `moe::expert_linear_f32out`: per-pair expert projection, f32 out.
pub const MOE_EXPERT_LINEAR_F32OUT: Kernel = Kernel::new("moe", "expert_linear_f32out");
/// `moe::moe_combine`.
pub const MOE_COMBINE: Kernel = Kernel::new("moe", "moe_combine");

/// `rope::qk_norm_rope_kv_store` (fused, proposed): q/k norm + RoPE and the cache store in one
/// launch, the same arithmetic.
pub const QK_NORM_ROPE_KV_STORE: Kernel = Kernel::new("rope", "qk_norm_rope_kv_store");
/// `gemm::linear_swiglu` (fused): the `[gate ; up]` projection writing `silu(gate) * up` of its
/// columns, each rounded to bf16 first as `linear` writes them (byte for byte the two launches).
/// The executor lowers to it only at the narrow decode widths (up to 8 rows).
pub const LINEAR_SWIGLU: Kernel = Kernel::new("gemm", "linear_swiglu");
/// `gdn::gdn_decode_step` (fused, proposed): conv, gates and the recurrent rule of one token
/// per sequence in one launch.
pub const GDN_DECODE_STEP: Kernel = Kernel::new("gdn", "gdn_decode_step");
/// `moe::expert_linear_silu_f32out` (fused, proposed): the experts' down projection applying
/// `silu(gate) * up` on load.
pub const MOE_EXPERT_LINEAR_SILU_F32OUT: Kernel = Kernel::new("moe", "expert_linear_silu_f32out");
