//! `ModelConfig`: a checkpoint's `config.json` (and `generation_config.json`) as typed, validated
//! values, with transformers 5.24's defaults for every absent field.
//!
//! Invariants of a `ModelConfig` returned by this module:
//! - every size is positive, `num_attention_heads % num_key_value_heads == 0`,
//!   `layer_types.len() == num_hidden_layers`, `rope.rotary_dim` is even and `<= head_dim`;
//! - `linear` is `Some` exactly for the hybrid families, and then some layer may be
//!   `LinearAttention`; no layer is `LinearAttention` otherwise;
//! - `intermediate_size > 0` whenever some layer has a dense MLP;
//! - every `eos_token_id` the files give (config.json's, generation_config.json's) is below
//!   `vocab_size`;
//! - features the engine does not model (biases, non-SiLU MLPs, sliding windows, other rope
//!   types) were refused, never silently ignored.

use std::path::Path;

use serde_json::Value;

use crate::error::ConfigError;
use crate::family::{
    self, FamilySpec, HeadDimDefault, KvHeadsDefault, ModelFamily, NormConvention,
};
use crate::generation::{GenerationDefaults, parse_generation_defaults};
use crate::json::Fields;
use crate::layers::{
    LayerType, LinearAttentionConfig, MoeConfig, count, parse_layer_types, parse_linear, parse_moe,
    positive,
};
use crate::quantization::{WeightQuantization, parse_kv_cache, parse_quantization};
use crate::rope::{RopeConfig, parse_rope};

/// A model's architecture and generation ids, read from its checkpoint directory.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The architecture family.
    pub family: ModelFamily,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Decoder layers (the MTP head's layers not included).
    pub num_hidden_layers: usize,
    /// Dense MLP intermediate size; 0 when the family has no dense MLP (Qwen3.5-MoE) and the
    /// config gives none.
    pub intermediate_size: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// How the decoder, q/k, final and MTP norms apply their weights. The gated norm inside
    /// Gated DeltaNet is always [`NormConvention::Standard`] (see [`ModelConfig::gdn_norm`]).
    pub norm: NormConvention,
    /// The mixer of each decoder layer.
    pub layer_types: Vec<LayerType>,
    /// The full-attention layers: heads, head size, output gate, rotary embedding.
    pub attention: AttentionConfig,
    /// Gated DeltaNet sizes (hybrid families).
    pub linear: Option<LinearAttentionConfig>,
    /// Sparse-MoE settings (Qwen3-Next, Qwen3.5-MoE).
    pub moe: Option<MoeConfig>,
    /// Layers of the multi-token-prediction head the config declares (`mtp_num_hidden_layers`,
    /// else `num_nextn_predict_layers`); 0 when absent.
    pub mtp_num_layers: usize,
    /// The vocabulary: its size, the special ids, whether the LM head is the embedding.
    pub tokens: TokenConfig,
    /// What the checkpoint declares besides the text model's architecture.
    pub checkpoint: CheckpointInfo,
}

/// The full-attention layers' settings.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionConfig {
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Size of one attention head.
    pub head_dim: usize,
    /// Gated attention: `q_proj` yields `[q | gate]` per head (`2 * head_dim` rows per head)
    /// and the attention output is multiplied by `sigmoid(gate)` before `o_proj`.
    pub attn_output_gate: bool,
    /// Rotary embedding.
    pub rope: RopeConfig,
    /// Longest context the model was configured for.
    pub max_position_embeddings: usize,
}

/// The vocabulary's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenConfig {
    /// Rows of the embedding and of the LM head.
    pub vocab_size: usize,
    /// The LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// End-of-sequence ids: config.json's first, then generation_config.json's, deduplicated.
    pub eos_token_ids: Vec<u32>,
    /// Beginning-of-sequence id.
    pub bos_token_id: Option<u32>,
}

/// What a checkpoint declares besides its text model's architecture.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointInfo {
    /// The top-level `model_type` of `config.json` (`qwen3_5` for a multimodal wrapper).
    pub model_type: String,
    /// A multimodal wrapper that carries a `vision_config` (the vision tower is not run here).
    pub has_vision: bool,
    /// The checkpoint's declared dtype (`dtype`, or the older `torch_dtype`).
    pub torch_dtype: Option<String>,
    /// The sampling settings `generation_config.json` recommends (empty without the file).
    pub generation: GenerationDefaults,
    /// How the projection weights are quantized (`quantization_config`), if they are.
    pub quantization: Option<WeightQuantization>,
    /// The checkpoint asks for an FP8 (e4m3) KV cache: `quantization_config.kv_cache_scheme`
    /// of 8-bit floats (compressed-tensors) or `kv_cache_quant_algo` `FP8`.
    pub kv_cache_fp8: bool,
}

impl ModelConfig {
    /// The architecture file of a checkpoint directory.
    pub const CONFIG_FILE: &'static str = "config.json";
    /// The optional generation defaults of a checkpoint directory.
    pub const GENERATION_CONFIG_FILE: &'static str = "generation_config.json";

    /// Read `dir/config.json` and, if present, merge `dir/generation_config.json`.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig, ConfigError> {
        let path = dir.join(Self::CONFIG_FILE);
        let text = read(&path)?;
        let mut config = ModelConfig::from_json_str(&text, &path)?;
        let generation = dir.join(Self::GENERATION_CONFIG_FILE);
        if generation.is_file() {
            config.apply_generation_config(&read(&generation)?, &generation)?;
        }
        Ok(config)
    }

    /// Parse the text of a `config.json`; `path_for_errors` is named in every error.
    pub fn from_json_str(text: &str, path_for_errors: &Path) -> Result<ModelConfig, ConfigError> {
        let value = parse_json(text, path_for_errors)?;
        parse_config(&Fields::root(&value, path_for_errors)?)
    }

    /// Merge the text of a `generation_config.json`: its `eos_token_id` (an id or a list, each
    /// inside the vocabulary) is appended to the config's, skipping duplicates, its
    /// `bos_token_id` fills a missing one, and its sampling fields become `checkpoint.generation`.
    pub fn apply_generation_config(
        &mut self,
        text: &str,
        path_for_errors: &Path,
    ) -> Result<(), ConfigError> {
        let value = parse_json(text, path_for_errors)?;
        let root = Fields::root(&value, path_for_errors)?;
        let tokens = &mut self.tokens;
        let mut eos = std::mem::take(&mut tokens.eos_token_ids);
        eos.extend(root.token_ids_below("eos_token_id", tokens.vocab_size)?);
        tokens.eos_token_ids = dedup_in_order(eos);
        if tokens.bos_token_id.is_none() {
            tokens.bos_token_id = root.token_ids("bos_token_id")?.first().copied();
        }
        self.checkpoint.generation = parse_generation_defaults(&root)?;
        Ok(())
    }

    /// Whether decoder layer `layer` has a sparse-MoE MLP (else a dense one).
    pub fn layer_is_moe(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.layer_is_moe(layer))
    }

    /// The convention of the gated RMSNorm inside Gated DeltaNet (`linear_attn.norm`): `x * w`
    /// in every family (`Qwen3NextRMSNormGated`, `Qwen3_5RMSNormGated`).
    pub fn gdn_norm(&self) -> NormConvention {
        NormConvention::Standard
    }

    /// Decoder layers of the given kind.
    pub fn num_layers_of(&self, kind: LayerType) -> usize {
        self.layer_types.iter().filter(|&&t| t == kind).count()
    }
}

/// `ids` without repeats, each kept at its first position.
fn dedup_in_order(ids: Vec<u32>) -> Vec<u32> {
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    out
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn parse_json(text: &str, path: &Path) -> Result<Value, ConfigError> {
    serde_json::from_str(text).map_err(|e| {
        let full = e.to_string();
        let location = format!(" at line {} column {}", e.line(), e.column());
        let message = full.strip_suffix(&location).unwrap_or(&full).to_string();
        ConfigError::Json {
            path: path.to_path_buf(),
            line: e.line(),
            column: e.column(),
            message,
        }
    })
}

fn parse_config(root: &Fields<'_>) -> Result<ModelConfig, ConfigError> {
    let model_type = root
        .opt_str("model_type")?
        .ok_or_else(|| root.missing("model_type"))?;
    let entry = family::lookup(model_type).ok_or_else(|| ConfigError::UnsupportedModelType {
        path: root.path().to_path_buf(),
        found: model_type.to_string(),
        supported: family::supported_model_types(),
    })?;
    let spec = entry.spec;
    let text = if entry.wrapper {
        let text = root
            .object("text_config")?
            .ok_or_else(|| root.missing("text_config"))?;
        if let Some(inner) = text.opt_str("model_type")?
            && inner != spec.text_model_type
        {
            let expected = format!(
                "\"{}\" inside a `{model_type}` config",
                spec.text_model_type
            );
            return Err(text.invalid("model_type", &expected, &Value::from(inner)));
        }
        text
    } else {
        root.clone()
    };
    refuse_unmodelled(&text, spec)?;

    let hidden_size = positive(&text, "hidden_size", spec.hidden_size)?;
    let num_hidden_layers = count(&text, "num_hidden_layers", spec.num_hidden_layers)?;
    let eps = text.opt_f64("rms_norm_eps")?.unwrap_or(spec.rms_norm_eps);
    let rms_norm_eps = eps as f32;
    if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
        return Err(text.invalid(
            "rms_norm_eps",
            "a finite positive number",
            &Value::from(eps),
        ));
    }
    let mtp_key = match text.opt_usize("mtp_num_hidden_layers")? {
        Some(_) => "mtp_num_hidden_layers",
        None => "num_nextn_predict_layers",
    };
    let mtp_num_layers = match text.usize_or(mtp_key, 0)? {
        0 => 0,
        _ => count(&text, mtp_key, 0)?,
    };
    let config = ModelConfig {
        family: spec.family,
        hidden_size,
        num_hidden_layers,
        intermediate_size: text
            .usize_or("intermediate_size", spec.intermediate_size.unwrap_or(0))?,
        rms_norm_eps,
        norm: spec.norm,
        layer_types: parse_layer_types(&text, spec, num_hidden_layers)?,
        attention: parse_attention(&text, spec, hidden_size)?,
        linear: parse_linear(&text, spec)?,
        moe: parse_moe(&text, spec)?,
        mtp_num_layers,
        tokens: parse_tokens(root, &text, spec, entry.wrapper)?,
        checkpoint: CheckpointInfo {
            model_type: model_type.to_string(),
            has_vision: entry.wrapper && root.has("vision_config"),
            torch_dtype: parse_dtype(root, &text)?,
            generation: GenerationDefaults::default(),
            quantization: parse_quantization(root)?,
            kv_cache_fp8: parse_kv_cache(root)?,
        },
    };
    validate(&config, &text, spec)?;
    Ok(config)
}

/// The full-attention settings of the text model `text`.
fn parse_attention(
    text: &Fields<'_>,
    spec: &FamilySpec,
    hidden_size: usize,
) -> Result<AttentionConfig, ConfigError> {
    let num_attention_heads = positive(text, "num_attention_heads", spec.num_attention_heads)?;
    let num_key_value_heads = match (
        &spec.num_key_value_heads,
        text.is_null("num_key_value_heads"),
    ) {
        (_, true) | (KvHeadsDefault::SameAsHeads, false) => {
            positive(text, "num_key_value_heads", num_attention_heads)?
        }
        (KvHeadsDefault::Fixed(n), false) => positive(text, "num_key_value_heads", *n)?,
    };
    let head_dim = match (&spec.head_dim, text.opt_usize("head_dim")?) {
        (_, Some(_)) => positive(text, "head_dim", 0)?,
        (HeadDimDefault::Fixed(n), None) if !text.is_null("head_dim") => *n,
        _ => hidden_size / num_attention_heads,
    };
    if head_dim == 0 {
        let found = Value::from(hidden_size);
        return Err(text.invalid("hidden_size", "at least num_attention_heads", &found));
    }
    let max_position_embeddings = positive(
        text,
        "max_position_embeddings",
        spec.max_position_embeddings,
    )?;
    Ok(AttentionConfig {
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        attn_output_gate: spec.attn_output_gate,
        rope: parse_rope(
            text,
            head_dim,
            max_position_embeddings,
            spec.partial_rotary_factor,
        )?,
        max_position_embeddings,
    })
}

/// The vocabulary settings: the text model's, with a wrapper's own ids and tying.
fn parse_tokens(
    root: &Fields<'_>,
    text: &Fields<'_>,
    spec: &FamilySpec,
    wrapper: bool,
) -> Result<TokenConfig, ConfigError> {
    let tie_word_embeddings = if wrapper {
        root.bool_or("tie_word_embeddings", false)?
    } else {
        text.bool_or("tie_word_embeddings", false)?
    };
    // The EOS ids become token ids the sampler bans (`min_tokens`) and structured output's
    // grammars end at: each must be inside the vocabulary.
    let vocab_size = positive(text, "vocab_size", spec.vocab_size)?;
    let mut eos_token_ids: Vec<u32> = if text.has("eos_token_id") || text.is_null("eos_token_id") {
        text.token_ids_below("eos_token_id", vocab_size)?
    } else {
        spec.eos_token_id.into_iter().collect()
    };
    let mut bos_token_id = if text.has("bos_token_id") || text.is_null("bos_token_id") {
        text.token_ids("bos_token_id")?.first().copied()
    } else {
        spec.bos_token_id
    };
    if wrapper {
        eos_token_ids.extend(root.token_ids_below("eos_token_id", vocab_size)?);
        if bos_token_id.is_none() {
            bos_token_id = root.token_ids("bos_token_id")?.first().copied();
        }
    }
    Ok(TokenConfig {
        vocab_size,
        tie_word_embeddings,
        eos_token_ids: dedup_in_order(eos_token_ids),
        bos_token_id,
    })
}

/// The declared dtype (`dtype`, else `torch_dtype`), the wrapper's before the text model's.
fn parse_dtype(root: &Fields<'_>, text: &Fields<'_>) -> Result<Option<String>, ConfigError> {
    let dtype_of = |f: &Fields<'_>| -> Result<Option<String>, ConfigError> {
        Ok(match f.opt_str("dtype")? {
            Some(d) => Some(d.to_string()),
            None => f.opt_str("torch_dtype")?.map(str::to_string),
        })
    };
    match dtype_of(root)? {
        Some(d) => Ok(Some(d)),
        None => dtype_of(text),
    }
}

fn refuse_unmodelled(text: &Fields<'_>, spec: &FamilySpec) -> Result<(), ConfigError> {
    if let Some(act) = text.opt_str("hidden_act")?
        && act != "silu"
    {
        let why = "only SiLU-gated (SwiGLU) MLPs are modelled; expected \"silu\"";
        return Err(text.unsupported("hidden_act", &Value::from(act), why));
    }
    for (key, what) in [
        ("attention_bias", "attention projections"),
        ("mlp_bias", "MLP projections"),
    ] {
        if text.bool_or(key, false)? {
            let why = format!("{what} with biases are not modelled; expected false");
            return Err(text.unsupported(key, &Value::Bool(true), &why));
        }
    }
    if text.bool_or("use_sliding_window", false)?
        && let Some(window) = text.get("sliding_window")
    {
        let why = "use_sliding_window is true: sliding-window attention is not modelled";
        return Err(text.unsupported("sliding_window", window, why));
    }
    if let Some(v) = text.get("attn_output_gate") {
        let gated = v
            .as_bool()
            .ok_or_else(|| text.invalid("attn_output_gate", "true or false", v))?;
        if gated != spec.attn_output_gate {
            let why = format!(
                "the `{}` architecture always has attn_output_gate = {}",
                spec.text_model_type, spec.attn_output_gate
            );
            return Err(text.unsupported("attn_output_gate", v, &why));
        }
    }
    Ok(())
}

/// Cross-field checks; see the module invariants.
fn validate(c: &ModelConfig, text: &Fields<'_>, spec: &FamilySpec) -> Result<(), ConfigError> {
    if !c
        .attention
        .num_attention_heads
        .is_multiple_of(c.attention.num_key_value_heads)
    {
        let expected = format!(
            "a divisor of num_attention_heads ({})",
            c.attention.num_attention_heads
        );
        let found = Value::from(c.attention.num_key_value_heads);
        return Err(text.invalid("num_key_value_heads", &expected, &found));
    }
    if spec.hidden_divisible_by_heads
        && !c
            .hidden_size
            .is_multiple_of(c.attention.num_attention_heads)
    {
        let expected = format!(
            "a multiple of num_attention_heads ({})",
            c.attention.num_attention_heads
        );
        return Err(text.invalid("hidden_size", &expected, &Value::from(c.hidden_size)));
    }
    if c.layer_types.len() != c.num_hidden_layers {
        return Err(ConfigError::InvalidField {
            path: text.path().to_path_buf(),
            field: text.name("layer_types"),
            expected: format!("{} entries (num_hidden_layers)", c.num_hidden_layers),
            found: format!("{} entries", c.layer_types.len()),
        });
    }
    let any_dense = (0..c.num_hidden_layers).any(|i| !c.layer_is_moe(i));
    if any_dense && c.intermediate_size == 0 {
        let found = Value::from(c.intermediate_size);
        return Err(text.invalid("intermediate_size", "a positive integer", &found));
    }
    Ok(())
}
