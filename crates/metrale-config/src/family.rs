//! The supported model families and one table of facts and defaults per family, taken from the
//! family's `configuration_*.py` and `modeling_*.py` in transformers 5.24.
//!
//! Invariant: every `model_type` accepted by `ModelConfig` appears exactly once in
//! [`MODEL_TYPES`], and its defaults are the transformers dataclass defaults of that type.

/// An architecture family this engine implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// Qwen3 dense (`qwen3`): RMSNorm'd q/k per head, SwiGLU MLP.
    Qwen3,
    /// Llama (`llama`), including Llama 3.x rope scaling.
    Llama,
    /// Qwen3.5 dense (`qwen3_5_text`, wrapper `qwen3_5`): Gated DeltaNet + gated attention.
    Qwen35,
    /// Qwen3-Next (`qwen3_next`): Gated DeltaNet + gated attention, sparse MoE with shared expert.
    Qwen3Next,
    /// Qwen3.5 MoE (`qwen3_5_moe_text`, wrapper `qwen3_5_moe`): like Qwen3.5, every MLP sparse.
    Qwen35Moe,
}

impl ModelFamily {
    /// The family's name in logs and messages (its text `model_type`'s family: `qwen3_5`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ModelFamily::Qwen3 => "qwen3",
            ModelFamily::Llama => "llama",
            ModelFamily::Qwen35 => "qwen3_5",
            ModelFamily::Qwen3Next => "qwen3_next",
            ModelFamily::Qwen35Moe => "qwen3_5_moe",
        }
    }

    /// Whether the family interleaves Gated DeltaNet (linear attention) with full attention.
    pub fn is_hybrid(self) -> bool {
        matches!(
            self,
            ModelFamily::Qwen35 | ModelFamily::Qwen3Next | ModelFamily::Qwen35Moe
        )
    }
}

impl std::fmt::Display for ModelFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How an RMSNorm applies its weight after normalising `x`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NormConvention {
    /// `x * w` (weights initialised to ones): Llama, Qwen3, and the gated norm inside every
    /// Gated DeltaNet block (`linear_attn.norm`).
    Standard,
    /// `x * (1 + w)` (weights initialised to zeros): the decoder norms, q/k norms, final norm
    /// and MTP norms of Qwen3.5, Qwen3.5-MoE and Qwen3-Next (`Qwen3_5RMSNorm`,
    /// `Qwen3NextRMSNorm`).
    ZeroCentred,
}

/// Defaults of the Gated DeltaNet fields of a hybrid family.
#[derive(Debug)]
pub(crate) struct LinearDefaults {
    pub num_key_heads: usize,
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel_dim: usize,
    /// `full_attention_interval` when `layer_types` is absent.
    pub full_attention_interval: usize,
}

/// Which layers of a family have a sparse-MoE MLP, and the MoE defaults.
#[derive(Debug)]
pub(crate) enum MoeRule {
    /// Every MLP is dense.
    Dense,
    /// Every layer is MoE; `decoder_sparse_step` and `mlp_only_layers` do not exist and
    /// top-k probabilities are always renormalised (`Qwen3_5MoeTopKRouter`).
    EveryLayer(MoeDefaults),
    /// Layer `i` is MoE when `i` is not in `mlp_only_layers`, `num_experts > 0` and
    /// `(i + 1) % decoder_sparse_step == 0` (`Qwen3NextDecoderLayer`); `norm_topk_prob` is read.
    SparseStep(MoeDefaults),
}

/// Defaults of the MoE fields.
#[derive(Debug)]
pub(crate) struct MoeDefaults {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
}

/// How `head_dim` defaults.
#[derive(Debug)]
pub(crate) enum HeadDimDefault {
    /// A fixed number (Qwen3: 128, hybrids: 256).
    Fixed(usize),
    /// `hidden_size / num_attention_heads` (Llama).
    HiddenOverHeads,
}

/// How `num_key_value_heads` defaults when absent.
#[derive(Debug)]
pub(crate) enum KvHeadsDefault {
    /// A fixed number.
    Fixed(usize),
    /// Equal to `num_attention_heads`.
    SameAsHeads,
}

/// One family's facts and transformers defaults.
#[derive(Debug)]
pub(crate) struct FamilySpec {
    pub family: ModelFamily,
    /// The `model_type` of the text model (`text_config.model_type` inside a wrapper).
    pub text_model_type: &'static str,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// `None`: the family has no `intermediate_size` field (every MLP is MoE).
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: KvHeadsDefault,
    pub head_dim: HeadDimDefault,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    /// Default `partial_rotary_factor` (the hybrids set 0.25 in `__post_init__`).
    pub partial_rotary_factor: f64,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub norm: NormConvention,
    /// `q_proj` yields `[q | gate]` per head and the attention output is multiplied by
    /// `sigmoid(gate)`.
    pub attn_output_gate: bool,
    /// `Some` for the hybrids.
    pub linear: Option<LinearDefaults>,
    pub moe: MoeRule,
    /// `llama` checks `hidden_size % num_attention_heads == 0` (`validate_architecture`).
    pub hidden_divisible_by_heads: bool,
}

const HYBRID_LINEAR: LinearDefaults = LinearDefaults {
    num_key_heads: 16,
    num_value_heads: 32,
    key_head_dim: 128,
    value_head_dim: 128,
    conv_kernel_dim: 4,
    full_attention_interval: 4,
};

/// `Qwen3Config`.
pub(crate) const QWEN3: FamilySpec = FamilySpec {
    family: ModelFamily::Qwen3,
    text_model_type: "qwen3",
    vocab_size: 151936,
    hidden_size: 4096,
    intermediate_size: Some(22016),
    num_hidden_layers: 32,
    num_attention_heads: 32,
    num_key_value_heads: KvHeadsDefault::Fixed(32),
    head_dim: HeadDimDefault::Fixed(128),
    max_position_embeddings: 32768,
    rms_norm_eps: 1e-6,
    partial_rotary_factor: 1.0,
    bos_token_id: None,
    eos_token_id: None,
    norm: NormConvention::Standard,
    attn_output_gate: false,
    linear: None,
    moe: MoeRule::Dense,
    hidden_divisible_by_heads: false,
};

/// `LlamaConfig`.
pub(crate) const LLAMA: FamilySpec = FamilySpec {
    family: ModelFamily::Llama,
    text_model_type: "llama",
    vocab_size: 32000,
    hidden_size: 4096,
    intermediate_size: Some(11008),
    num_hidden_layers: 32,
    num_attention_heads: 32,
    num_key_value_heads: KvHeadsDefault::SameAsHeads,
    head_dim: HeadDimDefault::HiddenOverHeads,
    max_position_embeddings: 2048,
    rms_norm_eps: 1e-6,
    partial_rotary_factor: 1.0,
    bos_token_id: Some(1),
    eos_token_id: Some(2),
    norm: NormConvention::Standard,
    attn_output_gate: false,
    linear: None,
    moe: MoeRule::Dense,
    hidden_divisible_by_heads: true,
};

/// `Qwen3_5TextConfig`.
pub(crate) const QWEN35: FamilySpec = FamilySpec {
    family: ModelFamily::Qwen35,
    text_model_type: "qwen3_5_text",
    vocab_size: 248320,
    hidden_size: 4096,
    intermediate_size: Some(12288),
    num_hidden_layers: 32,
    num_attention_heads: 16,
    num_key_value_heads: KvHeadsDefault::Fixed(4),
    head_dim: HeadDimDefault::Fixed(256),
    max_position_embeddings: 32768,
    rms_norm_eps: 1e-6,
    partial_rotary_factor: 0.25,
    bos_token_id: None,
    eos_token_id: None,
    norm: NormConvention::ZeroCentred,
    attn_output_gate: true,
    linear: Some(HYBRID_LINEAR),
    moe: MoeRule::Dense,
    hidden_divisible_by_heads: false,
};

/// `Qwen3NextConfig`.
pub(crate) const QWEN3_NEXT: FamilySpec = FamilySpec {
    family: ModelFamily::Qwen3Next,
    text_model_type: "qwen3_next",
    vocab_size: 151936,
    hidden_size: 2048,
    intermediate_size: Some(5632),
    num_hidden_layers: 48,
    num_attention_heads: 16,
    num_key_value_heads: KvHeadsDefault::Fixed(2),
    head_dim: HeadDimDefault::Fixed(256),
    max_position_embeddings: 32768,
    rms_norm_eps: 1e-6,
    partial_rotary_factor: 0.25,
    bos_token_id: None,
    eos_token_id: None,
    norm: NormConvention::ZeroCentred,
    attn_output_gate: true,
    linear: Some(HYBRID_LINEAR),
    moe: MoeRule::SparseStep(MoeDefaults {
        num_experts: 512,
        num_experts_per_tok: 10,
        moe_intermediate_size: 512,
        shared_expert_intermediate_size: 512,
    }),
    hidden_divisible_by_heads: false,
};

/// `Qwen3_5MoeTextConfig`.
pub(crate) const QWEN35_MOE: FamilySpec = FamilySpec {
    family: ModelFamily::Qwen35Moe,
    text_model_type: "qwen3_5_moe_text",
    vocab_size: 248320,
    hidden_size: 2048,
    intermediate_size: None,
    num_hidden_layers: 40,
    num_attention_heads: 16,
    num_key_value_heads: KvHeadsDefault::Fixed(2),
    head_dim: HeadDimDefault::Fixed(256),
    max_position_embeddings: 32768,
    rms_norm_eps: 1e-6,
    partial_rotary_factor: 0.25,
    bos_token_id: None,
    eos_token_id: None,
    norm: NormConvention::ZeroCentred,
    attn_output_gate: true,
    linear: Some(HYBRID_LINEAR),
    moe: MoeRule::EveryLayer(MoeDefaults {
        num_experts: 256,
        num_experts_per_tok: 8,
        moe_intermediate_size: 512,
        shared_expert_intermediate_size: 512,
    }),
    hidden_divisible_by_heads: false,
};

/// A supported top-level `model_type`.
#[derive(Debug)]
pub(crate) struct ModelType {
    pub name: &'static str,
    pub spec: &'static FamilySpec,
    /// A multimodal wrapper: the text model's fields live under `text_config`.
    pub wrapper: bool,
}

/// Every supported top-level `model_type`.
pub(crate) const MODEL_TYPES: &[ModelType] = &[
    ModelType {
        name: "qwen3",
        spec: &QWEN3,
        wrapper: false,
    },
    ModelType {
        name: "llama",
        spec: &LLAMA,
        wrapper: false,
    },
    ModelType {
        name: "qwen3_5_text",
        spec: &QWEN35,
        wrapper: false,
    },
    ModelType {
        name: "qwen3_5",
        spec: &QWEN35,
        wrapper: true,
    },
    ModelType {
        name: "qwen3_next",
        spec: &QWEN3_NEXT,
        wrapper: false,
    },
    ModelType {
        name: "qwen3_5_moe_text",
        spec: &QWEN35_MOE,
        wrapper: false,
    },
    ModelType {
        name: "qwen3_5_moe",
        spec: &QWEN35_MOE,
        wrapper: true,
    },
];

/// The names of every supported `model_type`, in [`MODEL_TYPES`] order.
pub fn supported_model_types() -> Vec<&'static str> {
    MODEL_TYPES.iter().map(|t| t.name).collect()
}

/// The entry for `name`, if supported.
pub(crate) fn lookup(name: &str) -> Option<&'static ModelType> {
    MODEL_TYPES.iter().find(|t| t.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_type_is_listed_once_and_wrappers_point_at_their_text_type() {
        let names = supported_model_types();
        let mut dedup = names.clone();
        dedup.sort_unstable();
        dedup.dedup();
        assert_eq!(dedup.len(), names.len());
        for t in MODEL_TYPES {
            if t.wrapper {
                assert_eq!(format!("{}_text", t.name), t.spec.text_model_type);
            } else {
                assert_eq!(t.name, t.spec.text_model_type);
            }
        }
    }

    #[test]
    fn hybrids_are_zero_centred_and_gated() {
        for t in MODEL_TYPES {
            let hybrid = t.spec.family.is_hybrid();
            assert_eq!(hybrid, t.spec.linear.is_some(), "{}", t.name);
            assert_eq!(hybrid, t.spec.attn_output_gate, "{}", t.name);
            assert_eq!(
                hybrid,
                t.spec.norm == NormConvention::ZeroCentred,
                "{}",
                t.name
            );
        }
    }
}
