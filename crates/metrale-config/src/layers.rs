//! Per-layer structure: which mixer each layer uses (`LayerType`), the Gated DeltaNet sizes
//! (`LinearAttentionConfig`) and the sparse-MoE settings (`MoeConfig`), read with transformers'
//! own rules and defaults.

use serde_json::Value;

use crate::error::ConfigError;
use crate::family::{FamilySpec, MoeRule};
use crate::json::Fields;

/// The token mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerType {
    /// Softmax attention over the KV cache (`"full_attention"`).
    FullAttention,
    /// Gated DeltaNet, a recurrent linear attention (`"linear_attention"`).
    LinearAttention,
}

impl LayerType {
    /// The name transformers uses in `layer_types`.
    pub fn name(self) -> &'static str {
        match self {
            LayerType::FullAttention => "full_attention",
            LayerType::LinearAttention => "linear_attention",
        }
    }
}

/// Sizes of the Gated DeltaNet (linear attention) layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearAttentionConfig {
    /// Query/key heads (`linear_num_key_heads`).
    pub num_key_heads: usize,
    /// Value heads (`linear_num_value_heads`); a multiple of `num_key_heads`.
    pub num_value_heads: usize,
    /// Query/key head size (`linear_key_head_dim`).
    pub key_head_dim: usize,
    /// Value head size (`linear_value_head_dim`).
    pub value_head_dim: usize,
    /// Causal depthwise convolution width (`linear_conv_kernel_dim`).
    pub conv_kernel_dim: usize,
}

impl LinearAttentionConfig {
    /// `num_key_heads * key_head_dim`.
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }

    /// `num_value_heads * value_head_dim`.
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }

    /// Channels of the short convolution: q, k and v, `2 * key_dim + value_dim`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// Sparse mixture-of-experts settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeConfig {
    /// Routed experts per MoE layer.
    pub num_experts: usize,
    /// Experts each token is routed to (top-k).
    pub num_experts_per_tok: usize,
    /// Intermediate size of one routed expert.
    pub moe_intermediate_size: usize,
    /// Intermediate size of the always-on shared expert (gated by `shared_expert_gate`).
    pub shared_expert_intermediate_size: usize,
    /// Whether the top-k routing probabilities are renormalised to sum to one.
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is MoE (1: every layer).
    pub decoder_sparse_step: usize,
    /// Layers forced to a dense MLP.
    pub mlp_only_layers: Vec<usize>,
}

impl MoeConfig {
    /// Whether decoder layer `layer` has a sparse-MoE MLP (else a dense one):
    /// `layer ∉ mlp_only_layers && (layer + 1) % decoder_sparse_step == 0`.
    pub fn layer_is_moe(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

/// The layer kinds: `layer_types` if given, else (hybrids) every `full_attention_interval`-th
/// layer is full attention (`(i + 1) % interval == 0`), else (dense families) all full.
pub(crate) fn parse_layer_types(
    fields: &Fields<'_>,
    spec: &FamilySpec,
    num_hidden_layers: usize,
) -> Result<Vec<LayerType>, ConfigError> {
    if let Some(names) = fields.opt_str_list("layer_types")? {
        let allowed = if spec.linear.is_some() {
            "\"full_attention\" or \"linear_attention\""
        } else {
            "\"full_attention\""
        };
        return names
            .iter()
            .enumerate()
            .map(|(i, &name)| match name {
                "full_attention" => Ok(LayerType::FullAttention),
                "linear_attention" if spec.linear.is_some() => Ok(LayerType::LinearAttention),
                "sliding_attention" => Err(fields.unsupported(
                    "layer_types",
                    &Value::from(name),
                    &format!("layer {i}: sliding-window attention is not modelled"),
                )),
                other => Err(fields.invalid(
                    "layer_types",
                    &format!("{allowed} for layer {i}"),
                    &Value::from(other),
                )),
            })
            .collect();
    }
    let Some(linear) = &spec.linear else {
        return Ok(vec![LayerType::FullAttention; num_hidden_layers]);
    };
    let interval = fields.usize_or("full_attention_interval", linear.full_attention_interval)?;
    if interval == 0 {
        return Err(fields.invalid(
            "full_attention_interval",
            "a positive integer",
            &Value::from(0),
        ));
    }
    Ok((0..num_hidden_layers)
        .map(|i| {
            if (i + 1).is_multiple_of(interval) {
                LayerType::FullAttention
            } else {
                LayerType::LinearAttention
            }
        })
        .collect())
}

/// The Gated DeltaNet sizes of a hybrid family; `None` for the others.
pub(crate) fn parse_linear(
    fields: &Fields<'_>,
    spec: &FamilySpec,
) -> Result<Option<LinearAttentionConfig>, ConfigError> {
    let Some(d) = &spec.linear else {
        return Ok(None);
    };
    let config = LinearAttentionConfig {
        num_key_heads: positive(fields, "linear_num_key_heads", d.num_key_heads)?,
        num_value_heads: positive(fields, "linear_num_value_heads", d.num_value_heads)?,
        key_head_dim: positive(fields, "linear_key_head_dim", d.key_head_dim)?,
        value_head_dim: positive(fields, "linear_value_head_dim", d.value_head_dim)?,
        conv_kernel_dim: positive(fields, "linear_conv_kernel_dim", d.conv_kernel_dim)?,
    };
    if !config.num_value_heads.is_multiple_of(config.num_key_heads) {
        let expected = format!(
            "a multiple of linear_num_key_heads ({})",
            config.num_key_heads
        );
        let found = Value::from(config.num_value_heads);
        return Err(fields.invalid("linear_num_value_heads", &expected, &found));
    }
    Ok(Some(config))
}

/// The MoE settings of a sparse family; `None` for dense families and for Qwen3-Next with
/// `num_experts: 0` (every MLP dense).
pub(crate) fn parse_moe(
    fields: &Fields<'_>,
    spec: &FamilySpec,
) -> Result<Option<MoeConfig>, ConfigError> {
    let (d, every_layer) = match &spec.moe {
        MoeRule::Dense => return Ok(None),
        MoeRule::EveryLayer(d) => (d, true),
        MoeRule::SparseStep(d) => (d, false),
    };
    if fields.usize_or("num_experts", d.num_experts)? == 0 {
        if every_layer {
            return Err(fields.invalid("num_experts", "a positive integer", &Value::from(0)));
        }
        return Ok(None);
    }
    let num_experts = count(fields, "num_experts", d.num_experts)?;
    let top_k = fields.usize_or("num_experts_per_tok", d.num_experts_per_tok)?;
    if top_k == 0 || top_k > num_experts {
        let expected = format!("an integer in 1..={num_experts} (num_experts)");
        return Err(fields.invalid("num_experts_per_tok", &expected, &Value::from(top_k)));
    }
    let moe_intermediate_size = positive(fields, "moe_intermediate_size", d.moe_intermediate_size)?;
    let shared_expert_intermediate_size = positive(
        fields,
        "shared_expert_intermediate_size",
        d.shared_expert_intermediate_size,
    )?;
    let (norm_topk_prob, decoder_sparse_step, mlp_only_layers) = if every_layer {
        (true, 1, Vec::new())
    } else {
        (
            fields.bool_or("norm_topk_prob", true)?,
            positive(fields, "decoder_sparse_step", 1)?,
            fields
                .opt_usize_list("mlp_only_layers")?
                .unwrap_or_default(),
        )
    };
    Ok(Some(MoeConfig {
        num_experts,
        num_experts_per_tok: top_k,
        moe_intermediate_size,
        shared_expert_intermediate_size,
        norm_topk_prob,
        decoder_sparse_step,
        mlp_only_layers,
    }))
}

/// The most layers (decoder or multi-token-prediction) and the most experts a config may
/// declare: far past any released model (Qwen3 MoE has 128 experts, the deepest Qwen3 94
/// layers), so a mistyped count is refused by name instead of sizing the per-layer and
/// per-expert records the load builds before any weight is read.
pub const MAX_CONFIG_COUNT: usize = 1 << 12;

/// A count field (layers, experts): a positive integer of at most [`MAX_CONFIG_COUNT`], or `default`
/// when absent.
pub(crate) fn count(fields: &Fields<'_>, key: &str, default: usize) -> Result<usize, ConfigError> {
    let n = positive(fields, key, default)?;
    if n > MAX_CONFIG_COUNT {
        let expected = format!("a positive integer of at most {MAX_CONFIG_COUNT}");
        return Err(fields.invalid(key, &expected, &Value::from(n)));
    }
    Ok(n)
}

/// A positive integer field, or `default` when absent.
pub(crate) fn positive(
    fields: &Fields<'_>,
    key: &str,
    default: usize,
) -> Result<usize, ConfigError> {
    let n = fields.usize_or(key, default)?;
    if n == 0 {
        return Err(fields.invalid(key, "a positive integer", &Value::from(0)));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::{QWEN3, QWEN3_NEXT, QWEN35};
    use serde_json::json;
    use std::path::Path;

    fn types(value: Value, spec: &FamilySpec, n: usize) -> Result<Vec<LayerType>, ConfigError> {
        parse_layer_types(&Fields::root(&value, Path::new("c.json"))?, spec, n)
    }

    #[test]
    fn interval_rule_matches_transformers() {
        // transformers: "linear_attention" if bool((i + 1) % interval) else "full_attention".
        let t = types(json!({"full_attention_interval": 3}), &QWEN35, 7).unwrap();
        use LayerType::{FullAttention as F, LinearAttention as L};
        assert_eq!(t, vec![L, L, F, L, L, F, L]);
        let t = types(json!({}), &QWEN35, 8).unwrap();
        assert_eq!(t, vec![L, L, L, F, L, L, L, F]);
        assert_eq!(types(json!({}), &QWEN3, 3).unwrap(), vec![F, F, F]);
    }

    #[test]
    fn explicit_layer_types_win_and_are_checked() {
        let value = json!({"layer_types": ["full_attention", "linear_attention"]});
        let t = types(value.clone(), &QWEN35, 2).unwrap();
        assert_eq!(
            t,
            vec![LayerType::FullAttention, LayerType::LinearAttention]
        );
        let err = types(value, &QWEN3, 2).unwrap_err();
        assert!(err.to_string().contains("layer 1"), "{err}");
        let err = types(json!({"layer_types": ["sliding_attention"]}), &QWEN3, 1).unwrap_err();
        assert!(matches!(err, ConfigError::Unsupported { .. }), "{err}");
    }

    #[test]
    fn qwen3_next_moe_layers_follow_step_and_mlp_only_layers() {
        let value = json!({"decoder_sparse_step": 2, "mlp_only_layers": [3], "num_experts": 4,
                           "num_experts_per_tok": 2});
        let moe = parse_moe(
            &Fields::root(&value, Path::new("c.json")).unwrap(),
            &QWEN3_NEXT,
        )
        .unwrap()
        .unwrap();
        let moe_layers: Vec<usize> = (0..8).filter(|&i| moe.layer_is_moe(i)).collect();
        assert_eq!(moe_layers, vec![1, 5, 7]);
    }

    #[test]
    fn an_expert_count_past_the_bound_is_named() {
        let moe = |n: usize| {
            let value = json!({"num_experts": n, "num_experts_per_tok": 2});
            parse_moe(
                &Fields::root(&value, Path::new("c.json")).unwrap(),
                &QWEN3_NEXT,
            )
        };
        assert_eq!(
            moe(MAX_CONFIG_COUNT).unwrap().unwrap().num_experts,
            MAX_CONFIG_COUNT
        );
        let err = moe(MAX_CONFIG_COUNT + 1).unwrap_err().to_string();
        assert!(
            err.contains("c.json") && err.contains("num_experts"),
            "{err}"
        );
    }

    #[test]
    fn value_heads_must_be_a_multiple_of_key_heads() {
        let value = json!({"linear_num_key_heads": 3, "linear_num_value_heads": 4});
        let err =
            parse_linear(&Fields::root(&value, Path::new("c.json")).unwrap(), &QWEN35).unwrap_err();
        assert!(err.to_string().contains("linear_num_value_heads"), "{err}");
    }
}
