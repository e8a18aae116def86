//! `quantization_config` of `config.json`: the FP8 weight packs the engine loads, and a typed
//! refusal (`ConfigError::Unsupported`, naming the field) of every other scheme, so a checkpoint
//! whose weights mean something else never loads as if they were plain.
//!
//! Accepted:
//! - `quant_method: "fp8"` (the Qwen and DeepSeek packs): `fmt` `"e4m3"` (or absent),
//!   `activation_scheme` `"dynamic"` (or absent), `weight_block_size` `[128, 128]` or absent
//!   (a scale per tensor); weights `W.weight` in F8_E4M3 with `W.weight_scale_inv`.
//! - `quant_method: "compressed-tensors"` (llm-compressor) with every config group's `weights`
//!   8-bit `float`, strategy `tensor`, `channel` or `block` of `[128, 128]`, and input
//!   activations dynamic or absent; weights `W.weight` with `W.weight_scale`.
//!
//! KV cache: `kv_cache_scheme` (compressed-tensors: `num_bits` 8, `type` `float`) or
//! `kv_cache_quant_algo` `"FP8"` in `quantization_config` ask for an FP8 (e4m3) KV cache,
//! whose per-layer scales the loader reads (`self_attn.k_scale` / `v_scale` and the names
//! other packs use); any other KV scheme is refused, naming the field.
//!
//! Weights without a scale stay as stored (embeddings, norms, the LM head, routers, and
//! whatever `modules_to_not_convert` / `ignore` names); the loader decides per tensor by its
//! dtype, so these lists need no reading here.

use serde_json::Value;

use crate::error::ConfigError;
use crate::json::Fields;

/// How a checkpoint's projection weights are quantized.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WeightQuantization {
    /// FP8 e4m3 weights with f32 / bf16 scales (per 128 x 128 block, per channel or per
    /// tensor); activations stay bf16 here.
    Fp8 {
        /// `quant_method` as the config spells it (`fp8` or `compressed-tensors`).
        method: String,
    },
}

/// The FP8 block size every accepted pack uses.
const BLOCK: [usize; 2] = [128, 128];

/// The quantization `root` declares, if any (see the module header).
pub(crate) fn parse_quantization(
    root: &Fields<'_>,
) -> Result<Option<WeightQuantization>, ConfigError> {
    let Some(q) = root.object("quantization_config")? else {
        return Ok(None);
    };
    let method = q
        .opt_str("quant_method")?
        .ok_or_else(|| q.missing("quant_method"))?;
    match method {
        "fp8" => fp8_pack(&q)?,
        "compressed-tensors" => compressed_tensors(&q)?,
        other => {
            let why = "only FP8 packs (`fp8`, or `compressed-tensors` with 8-bit float weights) \
                       are supported";
            return Err(q.unsupported("quant_method", &Value::from(other), why));
        }
    }
    Ok(Some(WeightQuantization::Fp8 {
        method: method.to_string(),
    }))
}

/// Whether `root`'s `quantization_config` asks for an FP8 KV cache (see the module header).
pub(crate) fn parse_kv_cache(root: &Fields<'_>) -> Result<bool, ConfigError> {
    let Some(q) = root.object("quantization_config")? else {
        return Ok(false);
    };
    let mut fp8 = false;
    if let Some(scheme) = q.object("kv_cache_scheme")? {
        let bits = scheme.opt_usize("num_bits")?;
        let kind = scheme.opt_str("type")?;
        if bits != Some(8) || kind != Some("float") {
            let why = "only an 8-bit float (FP8 e4m3) KV cache is supported";
            let found = scheme.get("num_bits").cloned().unwrap_or(Value::Null);
            return Err(scheme.unsupported("num_bits", &found, why));
        }
        fp8 = true;
    }
    if let Some(algo) = q.opt_str("kv_cache_quant_algo")? {
        if !algo.eq_ignore_ascii_case("fp8") {
            let why = "only an FP8 KV cache is supported";
            return Err(q.unsupported("kv_cache_quant_algo", &Value::from(algo), why));
        }
        fp8 = true;
    }
    Ok(fp8)
}

fn fp8_pack(q: &Fields<'_>) -> Result<(), ConfigError> {
    if let Some(fmt) = q.opt_str("fmt")?
        && fmt != "e4m3"
    {
        let why = "only e4m3 FP8 weights are supported";
        return Err(q.unsupported("fmt", &Value::from(fmt), why));
    }
    dynamic_activations(q, "activation_scheme")?;
    if let Some(block) = q.opt_usize_list("weight_block_size")?
        && block != BLOCK
    {
        let why = "only 128 x 128 weight blocks are supported";
        let found = Value::from(block);
        return Err(q.unsupported("weight_block_size", &found, why));
    }
    Ok(())
}

/// Refuse static activation scales: their tensors would scale inputs, which is not modelled.
fn dynamic_activations(q: &Fields<'_>, key: &str) -> Result<(), ConfigError> {
    if let Some(scheme) = q.opt_str(key)?
        && scheme != "dynamic"
    {
        let why = "only dynamic activation scaling is supported (activations stay bf16)";
        return Err(q.unsupported(key, &Value::from(scheme), why));
    }
    Ok(())
}

fn compressed_tensors(q: &Fields<'_>) -> Result<(), ConfigError> {
    let groups = q
        .object("config_groups")?
        .ok_or_else(|| q.missing("config_groups"))?;
    let Some(Value::Object(map)) = q.get("config_groups") else {
        return Err(q.missing("config_groups"));
    };
    for name in map.keys() {
        let group = groups.object(name)?.ok_or_else(|| groups.missing(name))?;
        let weights = group
            .object("weights")?
            .ok_or_else(|| group.missing("weights"))?;
        let bits = weights.opt_usize("num_bits")?;
        let kind = weights.opt_str("type")?;
        if bits != Some(8) || kind != Some("float") {
            let why = "only 8-bit float (FP8) weights are supported";
            let found = weights.get("num_bits").cloned().unwrap_or(Value::Null);
            return Err(weights.unsupported("num_bits", &found, why));
        }
        match weights.opt_str("strategy")? {
            Some("tensor" | "channel") | None => {}
            Some("block") => {
                if weights.opt_usize_list("block_structure")?.as_deref() != Some(&BLOCK[..]) {
                    let why = "only 128 x 128 weight blocks are supported";
                    let found = weights
                        .get("block_structure")
                        .cloned()
                        .unwrap_or(Value::Null);
                    return Err(weights.unsupported("block_structure", &found, why));
                }
            }
            Some(other) => {
                let why = "only tensor, channel and 128 x 128 block scales are supported";
                return Err(weights.unsupported("strategy", &Value::from(other), why));
            }
        }
        if let Some(inputs) = group.object("input_activations")?
            && !inputs.bool_or("dynamic", false)?
        {
            let why = "only dynamic activation scaling is supported (activations stay bf16)";
            return Err(inputs.unsupported("dynamic", &Value::Bool(false), why));
        }
    }
    Ok(())
}
