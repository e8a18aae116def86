//! `WeightNames`: the checkpoint tensor names of a model, from its family's naming table and the
//! layout the checkpoint actually uses (detected from the tensors present).
//!
//! Names follow what transformers 5.24 `save_pretrained` writes (checked on tiny models of every
//! family; see `testdata/*.txt`):
//! - text model under `model.` (causal LM) or `model.language_model.` (multimodal wrappers
//!   `qwen3_5` / `qwen3_5_moe`); `lm_head.weight` at the top level in both, absent when tied;
//! - layer `i` under `{prefix}layers.{i}.`: `input_layernorm`, `post_attention_layernorm`,
//!   `self_attn.{q,k,v,o}_proj` (+ `q_norm`/`k_norm` except Llama), or `linear_attn.*` for
//!   Gated DeltaNet layers (`in_proj_qkv`/`in_proj_z`/`in_proj_b`/`in_proj_a` in Qwen3.5 and
//!   Qwen3.5-MoE, `in_proj_qkvz`/`in_proj_ba` in Qwen3-Next, then `conv1d.weight`, `A_log`,
//!   `dt_bias`, `norm.weight`, `out_proj.weight`);
//! - MLP `mlp.{gate,up,down}_proj`, or sparse MoE `mlp.gate` (router),
//!   `mlp.experts.{e}.{gate,up,down}_proj` (what `save_pretrained` writes) or the fused
//!   `mlp.experts.gate_up_proj` `[E, 2I, H]` / `mlp.experts.down_proj` `[E, H, I]` (transformers'
//!   in-memory layout), `mlp.shared_expert.{gate,up,down}_proj`, `mlp.shared_expert_gate`;
//! - the MTP head at the top level: `mtp.fc` (`[H, 2H]`, input `[norm_e(embed) | norm_h(hidden)]`),
//!   `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.{i}.*` (full-attention
//!   decoder layers), `mtp.norm`. transformers drops these on load; checkpoints carry them.

use metrale_config::{LayerType, ModelConfig, ModelFamily};

use crate::weight_map::error::WeightError;
use crate::weight_map::layer_names::LayerNames;
use crate::weight_map::source::SafetensorsSource;

/// Where a checkpoint keeps the text model's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelPrefix {
    /// `model.` (`*ForCausalLM`).
    CausalLm,
    /// `model.language_model.` (`*ForConditionalGeneration`).
    Multimodal,
}

impl ModelPrefix {
    /// The prefix, with its trailing dot.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelPrefix::CausalLm => "model.",
            ModelPrefix::Multimodal => "model.language_model.",
        }
    }
}

/// How the routed experts of a MoE layer are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `mlp.experts.{e}.{gate,up,down}_proj.weight`, one `[I, H]` / `[H, I]` tensor each.
    PerExpert,
    /// `mlp.experts.gate_up_proj` `[E, 2I, H]` (each expert's gate rows, then its up rows) and
    /// `mlp.experts.down_proj` `[E, H, I]`.
    Fused,
}

/// The naming choices a checkpoint made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointLayout {
    /// Prefix of the text model.
    pub prefix: ModelPrefix,
    /// Expert storage of the decoder's MoE layers.
    pub experts: ExpertLayout,
    /// MTP layers present in the checkpoint (0: no MTP head).
    pub mtp_layers: usize,
    /// Expert storage of the MTP layers' MoE.
    pub mtp_experts: ExpertLayout,
}

/// How a family names its Gated DeltaNet input projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GdnStyle {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (Qwen3.5, Qwen3.5-MoE).
    Split,
    /// `in_proj_qkvz`, `in_proj_ba`, grouped per key head (Qwen3-Next).
    Fused,
}

/// One family's naming table.
#[derive(Debug)]
pub(crate) struct FamilyTable {
    /// `self_attn.q_norm` / `self_attn.k_norm` exist.
    pub(crate) qk_norm: bool,
    /// Gated DeltaNet projections, for hybrid families.
    pub(crate) gdn: Option<GdnStyle>,
}

const QWEN3_NAMES: FamilyTable = FamilyTable {
    qk_norm: true,
    gdn: None,
};
const LLAMA_NAMES: FamilyTable = FamilyTable {
    qk_norm: false,
    gdn: None,
};
const QWEN35_NAMES: FamilyTable = FamilyTable {
    qk_norm: true,
    gdn: Some(GdnStyle::Split),
};
const QWEN3_NEXT_NAMES: FamilyTable = FamilyTable {
    qk_norm: true,
    gdn: Some(GdnStyle::Fused),
};
const QWEN35_MOE_NAMES: FamilyTable = FamilyTable {
    qk_norm: true,
    gdn: Some(GdnStyle::Split),
};

fn table(family: ModelFamily) -> &'static FamilyTable {
    match family {
        ModelFamily::Qwen3 => &QWEN3_NAMES,
        ModelFamily::Llama => &LLAMA_NAMES,
        ModelFamily::Qwen35 => &QWEN35_NAMES,
        ModelFamily::Qwen3Next => &QWEN3_NEXT_NAMES,
        ModelFamily::Qwen35Moe => &QWEN35_MOE_NAMES,
    }
}

/// Names of the multi-token-prediction head.
#[derive(Debug, Clone)]
pub struct MtpNames {
    /// `mtp.fc.weight` `[H, 2H]`; its input is `[pre_fc_norm_embedding(embed) | pre_fc_norm_hidden(hidden)]`.
    pub fc: String,
    /// `[H]`, applied to the next token's embedding.
    pub pre_fc_norm_embedding: String,
    /// `[H]`, applied to the model's last hidden state.
    pub pre_fc_norm_hidden: String,
    /// Final norm `[H]` before the (shared) LM head.
    pub norm: String,
    /// The head's full-attention decoder layers (`mtp.layers.{i}.`).
    pub layers: Vec<LayerNames>,
}

/// The tensor names of a model; see the module header.
#[derive(Debug, Clone)]
pub struct WeightNames {
    layout: CheckpointLayout,
    table: &'static FamilyTable,
    tie_word_embeddings: bool,
    layer_types: Vec<LayerType>,
    moe_layers: Vec<bool>,
    num_experts: usize,
}

impl WeightNames {
    /// The names of `config`'s model in a checkpoint with `layout`.
    pub fn new(config: &ModelConfig, layout: CheckpointLayout) -> WeightNames {
        WeightNames {
            layout,
            table: table(config.family),
            tie_word_embeddings: config.tokens.tie_word_embeddings,
            layer_types: config.layer_types.clone(),
            moe_layers: (0..config.num_hidden_layers)
                .map(|i| config.layer_is_moe(i))
                .collect(),
            num_experts: config.moe.as_ref().map_or(0, |m| m.num_experts),
        }
    }

    /// The names of `config`'s model, with the layout `source` uses: its prefix (from where the
    /// embedding is), its expert layout (from the first MoE layer) and its MTP layer count.
    pub fn detect(
        source: &SafetensorsSource,
        config: &ModelConfig,
    ) -> Result<WeightNames, WeightError> {
        let prefix = [ModelPrefix::CausalLm, ModelPrefix::Multimodal]
            .into_iter()
            .find(|p| source.contains(&format!("{}embed_tokens.weight", p.as_str())))
            .ok_or_else(|| WeightError::Missing {
                tensor: format!("{}embed_tokens.weight", ModelPrefix::CausalLm.as_str()),
                dir: source.dir().to_path_buf(),
            })?;
        let first_moe = (0..config.num_hidden_layers).find(|&i| config.layer_is_moe(i));
        let experts = match first_moe {
            Some(i) => detect_experts(source, &format!("{}layers.{i}.", prefix.as_str()))?,
            None => ExpertLayout::PerExpert,
        };
        let mtp_layers = if source.contains("mtp.fc.weight") {
            (0..)
                .take_while(|i| source.contains(&format!("mtp.layers.{i}.input_layernorm.weight")))
                .count()
        } else {
            0
        };
        let mtp_experts = if mtp_layers > 0 && config.moe.is_some() {
            detect_experts(source, "mtp.layers.0.")?
        } else {
            experts
        };
        if mtp_layers < config.mtp_num_layers {
            tracing::warn!(
                declared = config.mtp_num_layers,
                present = mtp_layers,
                "the config declares more MTP layers than the checkpoint holds"
            );
        }
        let layout = CheckpointLayout {
            prefix,
            experts,
            mtp_layers,
            mtp_experts,
        };
        Ok(WeightNames::new(config, layout))
    }

    /// The layout these names follow.
    pub fn layout(&self) -> &CheckpointLayout {
        &self.layout
    }

    /// Token embedding `[V, H]`.
    pub fn embed_tokens(&self) -> String {
        format!("{}embed_tokens.weight", self.layout.prefix.as_str())
    }

    /// Final RMSNorm `[H]`.
    pub fn final_norm(&self) -> String {
        format!("{}norm.weight", self.layout.prefix.as_str())
    }

    /// LM head `[V, H]`: `lm_head.weight`, or the embedding when tied.
    pub fn lm_head(&self) -> String {
        if self.tie_word_embeddings {
            self.embed_tokens()
        } else {
            "lm_head.weight".to_string()
        }
    }

    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// The names of decoder layer `layer`. Past the last layer the names are those of a dense
    /// full-attention layer (absent from the checkpoint, so loading them reports `Missing`).
    pub fn layer(&self, layer: usize) -> LayerNames {
        let kind = self
            .layer_types
            .get(layer)
            .copied()
            .unwrap_or(LayerType::FullAttention);
        LayerNames::new(
            format!("{}layers.{layer}.", self.layout.prefix.as_str()),
            kind,
            self.moe_layers.get(layer).copied().unwrap_or(false),
            self.num_experts,
            self.layout.experts,
            self.table,
        )
    }

    /// The MTP head's names, when the checkpoint has one.
    pub fn mtp(&self) -> Option<MtpNames> {
        if self.layout.mtp_layers == 0 {
            return None;
        }
        let layers = (0..self.layout.mtp_layers)
            .map(|i| {
                LayerNames::new(
                    format!("mtp.layers.{i}."),
                    LayerType::FullAttention,
                    self.num_experts > 0,
                    self.num_experts,
                    self.layout.mtp_experts,
                    self.table,
                )
            })
            .collect();
        Some(MtpNames {
            fc: "mtp.fc.weight".to_string(),
            pre_fc_norm_embedding: "mtp.pre_fc_norm_embedding.weight".to_string(),
            pre_fc_norm_hidden: "mtp.pre_fc_norm_hidden.weight".to_string(),
            norm: "mtp.norm.weight".to_string(),
            layers,
        })
    }

    /// Every tensor name the model reads (the LM head once when tied).
    pub fn all(&self) -> Vec<String> {
        let mut out = vec![self.embed_tokens(), self.final_norm()];
        if !self.tie_word_embeddings {
            out.push(self.lm_head());
        }
        for i in 0..self.num_layers() {
            out.extend(self.layer(i).all());
        }
        if let Some(mtp) = self.mtp() {
            out.extend([
                mtp.fc,
                mtp.pre_fc_norm_embedding,
                mtp.pre_fc_norm_hidden,
                mtp.norm,
            ]);
            for layer in &mtp.layers {
                out.extend(layer.all());
            }
        }
        out
    }
}

/// The expert layout of the MoE layer under `layer_prefix`.
fn detect_experts(
    source: &SafetensorsSource,
    layer_prefix: &str,
) -> Result<ExpertLayout, WeightError> {
    if source.contains(&format!("{layer_prefix}mlp.experts.gate_up_proj")) {
        return Ok(ExpertLayout::Fused);
    }
    let per_expert = format!("{layer_prefix}mlp.experts.0.gate_proj.weight");
    if source.contains(&per_expert) {
        return Ok(ExpertLayout::PerExpert);
    }
    Err(WeightError::Missing {
        tensor: per_expert,
        dir: source.dir().to_path_buf(),
    })
}

#[cfg(test)]
mod tests;
