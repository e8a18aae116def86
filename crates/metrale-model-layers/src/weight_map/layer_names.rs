//! The names of one decoder layer (`LayerNames`) and of its blocks: attention, Gated DeltaNet,
//! dense MLP and sparse MoE, as the family's naming table (in `names.rs`) spells them.

use metrale_config::LayerType;

use crate::weight_map::names::{ExpertLayout, FamilyTable, GdnStyle};

/// Names of a full-attention block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionNames {
    /// `[heads * head_dim, H]`, or `[heads * 2 * head_dim, H]` with gated attention (per head:
    /// `head_dim` query rows, then `head_dim` gate rows).
    pub q_proj: String,
    /// `[kv_heads * head_dim, H]`.
    pub k_proj: String,
    /// `[kv_heads * head_dim, H]`.
    pub v_proj: String,
    /// `[H, heads * head_dim]`.
    pub o_proj: String,
    /// `[head_dim]`, when the family has q/k norms.
    pub q_norm: Option<String>,
    /// `[head_dim]`, when the family has q/k norms.
    pub k_norm: Option<String>,
}

/// Input projections of a Gated DeltaNet block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GdnProjectionNames {
    /// Qwen3.5: `in_proj_qkv` `[2*key_dim + value_dim, H]`, `in_proj_z` `[value_dim, H]`,
    /// `in_proj_b` and `in_proj_a` `[value_heads, H]`.
    Split {
        /// q, k, v rows in that order.
        in_proj_qkv: String,
        /// Output-gate rows.
        in_proj_z: String,
        /// Beta (write strength) rows.
        in_proj_b: String,
        /// Decay (alpha) rows.
        in_proj_a: String,
    },
    /// Qwen3-Next: `in_proj_qkvz` `[2*key_dim + 2*value_dim, H]` and `in_proj_ba`
    /// `[2*value_heads, H]`, both grouped per key head (see `fix_query_key_value_ordering`).
    Fused {
        /// q, k, v, z rows grouped per key head.
        in_proj_qkvz: String,
        /// b, a rows grouped per key head.
        in_proj_ba: String,
    },
}

/// Names of a Gated DeltaNet block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GdnNames {
    /// The input projections.
    pub projections: GdnProjectionNames,
    /// Depthwise causal convolution `[conv_dim, 1, kernel]`.
    pub conv1d: String,
    /// `[value_heads]`, log of the decay rate.
    pub a_log: String,
    /// `[value_heads]`.
    pub dt_bias: String,
    /// Gated RMSNorm `[value_head_dim]` (standard `x * w` convention).
    pub norm: String,
    /// `[H, value_dim]`.
    pub out_proj: String,
}

/// Names of a SwiGLU MLP (dense, shared expert, or one routed expert).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpNames {
    /// `[I, H]`.
    pub gate_proj: String,
    /// `[I, H]`.
    pub up_proj: String,
    /// `[H, I]`.
    pub down_proj: String,
}

/// Names of the routed experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertNames {
    /// One MLP per expert, in expert order.
    PerExpert(Vec<MlpNames>),
    /// All experts in two stacked tensors; see [`ExpertLayout::Fused`].
    Fused {
        /// `[E, 2I, H]`.
        gate_up_proj: String,
        /// `[E, H, I]`.
        down_proj: String,
    },
}

/// Names of a sparse-MoE block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeNames {
    /// Router `[E, H]` (`mlp.gate.weight`).
    pub router: String,
    /// The routed experts.
    pub experts: ExpertNames,
    /// The always-on shared expert.
    pub shared_expert: MlpNames,
    /// Shared-expert gate `[1, H]` (output scaled by its sigmoid).
    pub shared_expert_gate: String,
}

/// The token mixer of a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MixerNames {
    /// Full attention.
    Attention(AttentionNames),
    /// Gated DeltaNet.
    Gdn(GdnNames),
}

/// The MLP of a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FfnNames {
    /// Dense SwiGLU MLP.
    Dense(MlpNames),
    /// Sparse MoE with a shared expert.
    Moe(MoeNames),
}

/// The names of one decoder layer (of the model or of the MTP head).
#[derive(Debug, Clone)]
pub struct LayerNames {
    prefix: String,
    kind: LayerType,
    moe: bool,
    num_experts: usize,
    experts: ExpertLayout,
    table: &'static FamilyTable,
}

impl LayerNames {
    pub(crate) fn new(
        prefix: String,
        kind: LayerType,
        moe: bool,
        num_experts: usize,
        experts: ExpertLayout,
        table: &'static FamilyTable,
    ) -> LayerNames {
        LayerNames {
            prefix,
            kind,
            moe,
            num_experts,
            experts,
            table,
        }
    }

    fn name(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }

    /// The layer's prefix, e.g. `model.layers.3.`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The layer's mixer kind.
    pub fn kind(&self) -> LayerType {
        self.kind
    }

    /// Whether the layer's MLP is sparse MoE.
    pub fn is_moe(&self) -> bool {
        self.moe
    }

    /// Pre-mixer RMSNorm `[H]`.
    pub fn input_layernorm(&self) -> String {
        self.name("input_layernorm.weight")
    }

    /// Pre-MLP RMSNorm `[H]`.
    pub fn post_attention_layernorm(&self) -> String {
        self.name("post_attention_layernorm.weight")
    }

    /// `self_attn.q_proj.weight`.
    pub fn q_proj(&self) -> String {
        self.name("self_attn.q_proj.weight")
    }

    /// `self_attn.k_proj.weight`.
    pub fn k_proj(&self) -> String {
        self.name("self_attn.k_proj.weight")
    }

    /// `self_attn.v_proj.weight`.
    pub fn v_proj(&self) -> String {
        self.name("self_attn.v_proj.weight")
    }

    /// `self_attn.o_proj.weight`.
    pub fn o_proj(&self) -> String {
        self.name("self_attn.o_proj.weight")
    }

    /// `self_attn.q_norm.weight` (only families with q/k norms have it; see [`Self::attention`]).
    pub fn q_norm(&self) -> String {
        self.name("self_attn.q_norm.weight")
    }

    /// `self_attn.k_norm.weight` (only families with q/k norms have it).
    pub fn k_norm(&self) -> String {
        self.name("self_attn.k_norm.weight")
    }

    /// The names an FP8 KV cache's scales of this attention layer may have, each a pair (K,
    /// V), in the order they are looked for: `self_attn.k_scale` / `v_scale` (the FP8 packs
    /// vLLM reads), `self_attn.k_proj.output_scale` / `v_proj.output_scale` (llm-compressor),
    /// and `self_attn.kv_scale` (one scale for both, older packs).
    pub fn kv_scales(&self) -> [[String; 2]; 3] {
        let both = self.name("self_attn.kv_scale");
        [
            [
                self.name("self_attn.k_scale"),
                self.name("self_attn.v_scale"),
            ],
            [
                self.name("self_attn.k_proj.output_scale"),
                self.name("self_attn.v_proj.output_scale"),
            ],
            [both.clone(), both],
        ]
    }

    /// The full-attention names, q/k norms as the family has them.
    pub fn attention(&self) -> AttentionNames {
        let qk = self.table.qk_norm;
        AttentionNames {
            q_proj: self.q_proj(),
            k_proj: self.k_proj(),
            v_proj: self.v_proj(),
            o_proj: self.o_proj(),
            q_norm: qk.then(|| self.q_norm()),
            k_norm: qk.then(|| self.k_norm()),
        }
    }

    /// The Gated DeltaNet names; `None` for families without linear attention.
    pub fn gdn(&self) -> Option<GdnNames> {
        let l = |s: &str| self.name(&format!("linear_attn.{s}"));
        let projections = match self.table.gdn? {
            GdnStyle::Split => GdnProjectionNames::Split {
                in_proj_qkv: l("in_proj_qkv.weight"),
                in_proj_z: l("in_proj_z.weight"),
                in_proj_b: l("in_proj_b.weight"),
                in_proj_a: l("in_proj_a.weight"),
            },
            GdnStyle::Fused => GdnProjectionNames::Fused {
                in_proj_qkvz: l("in_proj_qkvz.weight"),
                in_proj_ba: l("in_proj_ba.weight"),
            },
        };
        Some(GdnNames {
            projections,
            conv1d: l("conv1d.weight"),
            a_log: l("A_log"),
            dt_bias: l("dt_bias"),
            norm: l("norm.weight"),
            out_proj: l("out_proj.weight"),
        })
    }

    /// The mixer this layer has: Gated DeltaNet for a linear-attention layer of a hybrid
    /// family, full attention otherwise.
    pub fn mixer(&self) -> MixerNames {
        match (self.kind, self.gdn()) {
            (LayerType::LinearAttention, Some(gdn)) => MixerNames::Gdn(gdn),
            _ => MixerNames::Attention(self.attention()),
        }
    }

    /// `mlp.gate_proj.weight` of a dense layer.
    pub fn mlp_gate_proj(&self) -> String {
        self.name("mlp.gate_proj.weight")
    }

    /// `mlp.up_proj.weight` of a dense layer.
    pub fn mlp_up_proj(&self) -> String {
        self.name("mlp.up_proj.weight")
    }

    /// `mlp.down_proj.weight` of a dense layer.
    pub fn mlp_down_proj(&self) -> String {
        self.name("mlp.down_proj.weight")
    }

    /// The dense MLP names.
    pub fn dense_mlp(&self) -> MlpNames {
        MlpNames {
            gate_proj: self.mlp_gate_proj(),
            up_proj: self.mlp_up_proj(),
            down_proj: self.mlp_down_proj(),
        }
    }

    /// The sparse-MoE names, experts in the checkpoint's layout.
    pub fn moe(&self) -> MoeNames {
        let experts = match self.experts {
            ExpertLayout::PerExpert => ExpertNames::PerExpert(
                (0..self.num_experts)
                    .map(|e| mlp_names(&self.name(&format!("mlp.experts.{e}."))))
                    .collect(),
            ),
            ExpertLayout::Fused => ExpertNames::Fused {
                gate_up_proj: self.name("mlp.experts.gate_up_proj"),
                down_proj: self.name("mlp.experts.down_proj"),
            },
        };
        MoeNames {
            router: self.name("mlp.gate.weight"),
            experts,
            shared_expert: mlp_names(&self.name("mlp.shared_expert.")),
            shared_expert_gate: self.name("mlp.shared_expert_gate.weight"),
        }
    }

    /// The MLP this layer has.
    pub fn ffn(&self) -> FfnNames {
        if self.moe {
            FfnNames::Moe(self.moe())
        } else {
            FfnNames::Dense(self.dense_mlp())
        }
    }

    /// Every tensor name of this layer.
    pub fn all(&self) -> Vec<String> {
        let mut out = vec![self.input_layernorm(), self.post_attention_layernorm()];
        match self.mixer() {
            MixerNames::Attention(a) => {
                out.extend([a.q_proj, a.k_proj, a.v_proj, a.o_proj]);
                out.extend(a.q_norm.into_iter().chain(a.k_norm));
            }
            MixerNames::Gdn(g) => {
                match g.projections {
                    GdnProjectionNames::Split {
                        in_proj_qkv,
                        in_proj_z,
                        in_proj_b,
                        in_proj_a,
                    } => {
                        out.extend([in_proj_qkv, in_proj_z, in_proj_b, in_proj_a]);
                    }
                    GdnProjectionNames::Fused {
                        in_proj_qkvz,
                        in_proj_ba,
                    } => {
                        out.extend([in_proj_qkvz, in_proj_ba]);
                    }
                }
                out.extend([g.conv1d, g.a_log, g.dt_bias, g.norm, g.out_proj]);
            }
        }
        match self.ffn() {
            FfnNames::Dense(m) => out.extend(mlp_list(m)),
            FfnNames::Moe(m) => {
                out.push(m.router);
                match m.experts {
                    ExpertNames::PerExpert(list) => out.extend(list.into_iter().flat_map(mlp_list)),
                    ExpertNames::Fused {
                        gate_up_proj,
                        down_proj,
                    } => out.extend([gate_up_proj, down_proj]),
                }
                out.extend(mlp_list(m.shared_expert));
                out.push(m.shared_expert_gate);
            }
        }
        out
    }
}

fn mlp_names(prefix: &str) -> MlpNames {
    MlpNames {
        gate_proj: format!("{prefix}gate_proj.weight"),
        up_proj: format!("{prefix}up_proj.weight"),
        down_proj: format!("{prefix}down_proj.weight"),
    }
}

fn mlp_list(m: MlpNames) -> [String; 3] {
    [m.gate_proj, m.up_proj, m.down_proj]
}
