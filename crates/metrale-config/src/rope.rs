//! Rotary position embedding settings (`RopeConfig`), read from either layout transformers
//! accepts, and `RopeConfig::inv_freq`, the inverse frequencies transformers computes for them.
//!
//! Layouts, with transformers 5's precedence (`convert_rope_params_to_dict`):
//! - the dict is `rope_scaling` when present and not null (older layout), else `rope_parameters`
//!   (transformers 5 layout), else empty;
//! - `rope_type` (or the older `type`) in the dict, default `"default"`;
//! - `rope_theta` from the dict, else top level, else 10000;
//! - `partial_rotary_factor` from the dict, else top level, else the family default (0.25 for
//!   the hybrids, 1.0 otherwise); `rotary_dim = int(head_dim * partial_rotary_factor)`;
//! - llama3's and yarn's `original_max_position_embeddings`: a top-level field of that name wins,
//!   then the dict's, then `max_position_embeddings` (`standardize_rope_params`).
//!
//! Rope types: `default`, `linear`, `llama3` and `yarn` (`_compute_yarn_parameters`, with the
//! cos/sin scale transformers calls `attention_scaling`). `dynamic` and `longrope` choose their
//! frequencies from the length of each forward pass, which a KV cache cannot follow (keys cached
//! at one length keep their rotation at the next), so they are refused, as is any other type.

use crate::error::ConfigError;
use crate::json::Fields;

/// How the inverse frequencies are rescaled for long context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `rope_type: "default"`: plain RoPE.
    None,
    /// `rope_type: "llama3"`: low frequencies divided by `factor`, high ones kept, a smooth
    /// interpolation between.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f32,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f32,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f32,
        /// The pretraining context length.
        original_max_position_embeddings: usize,
    },
    /// `rope_type: "linear"`: every frequency divided by `factor` (position interpolation).
    Linear {
        /// Divisor of every frequency.
        factor: f32,
    },
    /// `rope_type: "yarn"`: frequency `i` (of `rotary_dim / 2`) is kept below the correction
    /// range, divided by `factor` above it, and blended linearly in `i` inside it; the range
    /// runs from the dimension whose wavelength fits `beta_fast` times into the pretraining
    /// context to the one that fits `beta_slow` times. Cos and sin are multiplied by
    /// `attention_factor`.
    Yarn {
        /// Divisor of the low frequencies: the context extension.
        factor: f64,
        /// The pretraining context length.
        original_max_position_embeddings: usize,
        /// Rotations over the pretraining context at the high-frequency end of the range.
        beta_fast: f64,
        /// Rotations over the pretraining context at the low-frequency end of the range.
        beta_slow: f64,
        /// Whether the range's ends are rounded outwards to whole dimensions.
        truncate: bool,
        /// Scale of cos and sin (transformers' `attention_scaling`): the config's
        /// `attention_factor`, else `0.1 ln(factor) + 1` (or the ratio of two such terms with
        /// `mscale` and `mscale_all_dim`), 1 for `factor <= 1`.
        attention_factor: f64,
    },
}

/// Rotary embedding settings of the full-attention layers.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// The base (`rope_theta`), as the config writes it.
    pub theta: f64,
    /// Fraction of `head_dim` that is rotated.
    pub partial_rotary_factor: f32,
    /// Rotated channels per head: `int(head_dim * partial_rotary_factor)`, even.
    pub rotary_dim: usize,
    /// Long-context rescaling.
    pub scaling: RopeScaling,
    /// Multimodal RoPE: frequency bands for the temporal/height/width positions (they sum to
    /// `rotary_dim / 2`). For text-only input the three positions are equal and MRoPE is plain
    /// RoPE.
    pub mrope_section: Option<Vec<usize>>,
    /// Whether the MRoPE bands are interleaved rather than contiguous.
    pub mrope_interleaved: bool,
}

impl RopeConfig {
    /// The `rotary_dim / 2` inverse frequencies, as transformers computes them in float32:
    /// `1.0 / (base ** (arange(0, dim, 2).float() / dim))`, then the linear, llama3 or yarn
    /// rescaling.
    ///
    /// Numerics: the exponent `2i / dim` and every later step are f32 operations in torch's
    /// order (`a / b` with a Python scalar `a` is `reciprocal(b) * a`; a Python float meeting an
    /// f32 tensor is rounded to f32 first, `rope_theta` in the power included). The power is
    /// computed in f64 from the f32 base and exponent and rounded to f32, i.e. correctly
    /// rounded. Torch's vectorised CPU `pow` (SLEEF `powf_u10`) is within 1 ulp of that but not
    /// always equal: about 1% of entries differ by 1 ulp (e.g. theta 1e6, dim 128, i = 37).
    /// Every other step reproduces torch bit for bit; yarn's correction range is Python
    /// float64 arithmetic on the config's values, as there.
    pub fn inv_freq(&self) -> Vec<f32> {
        let dim = self.rotary_dim as f32;
        let base = f64::from(self.theta as f32);
        let powers = (0..self.rotary_dim / 2).map(|i| {
            let exponent = (2 * i) as f32 / dim;
            base.powf(f64::from(exponent)) as f32
        });
        let plain = powers.clone().map(|power| 1.0f32 / power);
        match &self.scaling {
            RopeScaling::None => plain.collect(),
            RopeScaling::Linear { factor } => plain.map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = *original_max_position_embeddings as f64;
                // Python-side doubles, compared against f32 tensors (cast to f32).
                let low_freq_wavelen = (old / f64::from(*low_freq_factor)) as f32;
                let high_freq_wavelen = (old / f64::from(*high_freq_factor)) as f32;
                let band = (f64::from(*high_freq_factor) - f64::from(*low_freq_factor)) as f32;
                let old = old as f32;
                let two_pi = std::f64::consts::TAU as f32;
                plain
                    .map(|f| {
                        let wavelen = (1.0f32 / f) * two_pi;
                        let kept = if wavelen > low_freq_wavelen {
                            f / factor
                        } else {
                            f
                        };
                        // torch: `~(wavelen < high) * ~(wavelen > low)`; no NaN can occur.
                        let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                        if !medium {
                            return kept;
                        }
                        let smooth = ((1.0f32 / wavelen) * old - low_freq_factor) / band;
                        (1.0f32 - smooth) * kept / factor + smooth * kept
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let (low, high) = yarn_correction_range(
                    self.theta,
                    self.rotary_dim,
                    *original_max_position_embeddings,
                    (*beta_fast, *beta_slow),
                    *truncate,
                );
                // `linear_ramp_factor`: `(arange(dim // 2) - low) / (high - low)`, clamped to
                // [0, 1], the Python scalars rounded to f32.
                let high = if low == high { high + 0.001 } else { high };
                let (low32, span32) = (low as f32, (high - low) as f32);
                let factor32 = *factor as f32;
                powers
                    .enumerate()
                    .map(|(i, power)| {
                        let extrapolation = 1.0f32 / power;
                        let interpolation = 1.0f32 / (factor32 * power);
                        let ramp = ((i as f32 - low32) / span32).clamp(0.0, 1.0);
                        let kept = 1.0f32 - ramp;
                        interpolation * (1.0f32 - kept) + extrapolation * kept
                    })
                    .collect()
            }
        }
    }

    /// The factor cos and sin are multiplied by before rotating (transformers'
    /// `attention_scaling`, rounded to f32 as torch does when it multiplies the f32 tables by
    /// it): yarn's `attention_factor`, exactly 1 for every other rope type.
    pub fn attention_scaling(&self) -> f32 {
        match &self.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor as f32,
            _ => 1.0,
        }
    }
}

/// Yarn's correction range `(low, high)` over the dimension index (`find_correction_range` in
/// float64): where the wavelength fits `beta_fast` and `beta_slow` times into the pretraining
/// context of `original` positions, rounded outwards with `truncate`, clipped to
/// `[0, rotary_dim - 1]`.
fn yarn_correction_range(
    theta: f64,
    rotary_dim: usize,
    original: usize,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> (f64, f64) {
    let dim = rotary_dim as f64;
    let original = original as f64;
    let correction_dim = |rotations: f64| {
        (dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    (low.max(0.0), high.min(dim - 1.0))
}

/// Yarn's default `attention_factor` (`get_mscale`): `0.1 * mscale * ln(factor) + 1`, 1 when
/// `factor <= 1`.
fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

/// Read the rope settings of one (text) config object.
pub(crate) fn parse_rope(
    fields: &Fields<'_>,
    head_dim: usize,
    max_position_embeddings: usize,
    default_partial_rotary_factor: f64,
) -> Result<RopeConfig, ConfigError> {
    let dict_key = if fields.has("rope_scaling") {
        "rope_scaling"
    } else {
        "rope_parameters"
    };
    let dict = fields.object(dict_key)?;
    if let Some(d) = &dict {
        for layer_type in ["full_attention", "linear_attention", "sliding_attention"] {
            if let Some(v) = d.get(layer_type) {
                return Err(d.unsupported(
                    layer_type,
                    v,
                    "rope parameters nested per layer type are not modelled; give one flat dict",
                ));
            }
        }
    }

    let theta = match dict_or_top(dict.as_ref(), fields, "rope_theta")? {
        Some((v, from)) => {
            positive_f32(&from, "rope_theta", v)?;
            v
        }
        None => 10_000.0,
    };
    let (partial, partial_from) = match dict_or_top(dict.as_ref(), fields, "partial_rotary_factor")?
    {
        Some((v, from)) => (v, Some(from)),
        None => (default_partial_rotary_factor, None),
    };
    let rotary_dim = (head_dim as f64 * partial) as usize;
    if !(partial > 0.0 && partial <= 1.0) || rotary_dim < 2 || !rotary_dim.is_multiple_of(2) {
        let from = partial_from.unwrap_or_else(|| fields.clone());
        let found = serde_json::Value::from(partial);
        let expected = format!(
            "a factor in (0, 1] giving an even rotary dimension >= 2 of head_dim {head_dim}"
        );
        return Err(from.invalid("partial_rotary_factor", &expected, &found));
    }

    let rope_type = match &dict {
        Some(d) => match d.opt_str("rope_type")? {
            Some(t) => Some((t, "rope_type")),
            None => d.opt_str("type")?.map(|t| (t, "type")),
        },
        None => None,
    };
    let scaling = match (rope_type, &dict) {
        (None, _) | (Some(("default", _)), _) => RopeScaling::None,
        (Some(("linear", _)), Some(d)) => RopeScaling::Linear {
            factor: positive_f32(d, "factor", d.req_f64("factor")?)?,
        },
        (Some(("llama3", _)), Some(d)) => {
            let factor = positive_f32(d, "factor", d.req_f64("factor")?)?;
            let low = positive_f32(d, "low_freq_factor", d.req_f64("low_freq_factor")?)?;
            let high_value = d.req_f64("high_freq_factor")?;
            let high = positive_f32(d, "high_freq_factor", high_value)?;
            if high <= low {
                let expected = format!("a number greater than low_freq_factor ({low})");
                let found = serde_json::Value::from(high_value);
                return Err(d.invalid("high_freq_factor", &expected, &found));
            }
            let original = original_context(fields, d, max_position_embeddings)?;
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            }
        }
        (Some(("yarn", _)), Some(d)) => parse_yarn(fields, d, max_position_embeddings)?,
        (Some((other, key)), Some(d)) => {
            let why = match other {
                "dynamic" => {
                    "dynamic NTK rescales the frequencies from the length of each forward pass \
                     once it passes max_position_embeddings, so keys already in the KV cache \
                     would keep rotations that a full recompute changes; supported rope types: "
                }
                "longrope" => {
                    "longrope picks its short or long factors by the length of each forward \
                     pass, so keys already in the KV cache would keep rotations that a full \
                     recompute changes; supported rope types: "
                }
                _ => "supported rope types: ",
            };
            let value = serde_json::Value::from(other);
            return Err(d.unsupported(key, &value, &format!("{why}{SUPPORTED_ROPE_TYPES}")));
        }
        (Some(_), None) => RopeScaling::None,
    };

    let (mrope_section, mrope_interleaved) = match &dict {
        Some(d) => (
            d.opt_usize_list("mrope_section")?,
            d.bool_or("mrope_interleaved", false)?,
        ),
        None => (None, false),
    };
    if let (Some(section), Some(d)) = (&mrope_section, &dict) {
        let sum: usize = section.iter().sum();
        if sum != rotary_dim / 2 {
            let expected = format!("bands summing to rotary_dim / 2 = {}", rotary_dim / 2);
            let found = serde_json::Value::from(section.clone());
            return Err(d.invalid("mrope_section", &expected, &found));
        }
    }

    Ok(RopeConfig {
        theta,
        partial_rotary_factor: partial as f32,
        rotary_dim,
        scaling,
        mrope_section,
        mrope_interleaved,
    })
}

/// The rope types `parse_rope` reads, for error messages.
const SUPPORTED_ROPE_TYPES: &str = "default, linear, llama3, yarn";

/// The pretraining context of llama3 and yarn: a top-level `original_max_position_embeddings`
/// wins, then the dict's, then `max_position_embeddings`.
fn original_context(
    fields: &Fields<'_>,
    dict: &Fields<'_>,
    max_position_embeddings: usize,
) -> Result<usize, ConfigError> {
    match fields.opt_usize("original_max_position_embeddings")? {
        Some(n) => Ok(n),
        None => dict.usize_or("original_max_position_embeddings", max_position_embeddings),
    }
}

/// Yarn's settings from the rope dict `d` (transformers' `_compute_yarn_parameters`): `factor`
/// is required, `null` meaning `max_position_embeddings / original_max_position_embeddings`;
/// `beta_fast` and `beta_slow` default to 32 and 1 (also when 0, as Python's `or` has it);
/// `attention_factor` defaults to `get_mscale(factor, mscale) / get_mscale(factor,
/// mscale_all_dim)` when both are set and non-zero, else `get_mscale(factor)`; `truncate`
/// defaults to true, and `null` is false.
fn parse_yarn(
    fields: &Fields<'_>,
    d: &Fields<'_>,
    max_position_embeddings: usize,
) -> Result<RopeScaling, ConfigError> {
    let original = original_context(fields, d, max_position_embeddings)?;
    if original == 0 {
        let (from, key) = if fields.has("original_max_position_embeddings") {
            (fields, "original_max_position_embeddings")
        } else if d.has("original_max_position_embeddings") {
            (d, "original_max_position_embeddings")
        } else {
            (fields, "max_position_embeddings")
        };
        return Err(from.invalid(key, "a positive integer", &serde_json::Value::from(0)));
    }
    let factor = if d.is_null("factor") {
        max_position_embeddings as f64 / original as f64
    } else {
        let value = d.req_f64("factor")?;
        positive_f32(d, "factor", value)?;
        value
    };
    let nonzero = |key: &str| -> Result<Option<f64>, ConfigError> {
        Ok(d.opt_f64(key)?.filter(|&v| v != 0.0))
    };
    let beta = |key: &str, default: f64| -> Result<f64, ConfigError> {
        let value = nonzero(key)?.unwrap_or(default);
        positive_f32(d, key, value)?;
        Ok(value)
    };
    let beta_fast = beta("beta_fast", 32.0)?;
    let beta_slow = beta("beta_slow", 1.0)?;
    let attention_factor = match d.opt_f64("attention_factor")? {
        Some(value) => {
            positive_f32(d, "attention_factor", value)?;
            value
        }
        None => match (nonzero("mscale")?, nonzero("mscale_all_dim")?) {
            (Some(mscale), Some(all_dim)) => {
                yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
            }
            _ => yarn_mscale(factor, 1.0),
        },
    };
    if !(attention_factor.is_finite() && attention_factor > 0.0) {
        let found = serde_json::Value::from(attention_factor);
        return Err(d.invalid(
            "mscale",
            "mscale and mscale_all_dim giving a finite positive attention factor",
            &found,
        ));
    }
    let truncate = !d.is_null("truncate") && d.bool_or("truncate", true)?;
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast,
        beta_slow,
        truncate,
        attention_factor,
    })
}

/// A number from the rope dict if there, else from the top level, with the object it came from.
fn dict_or_top<'a>(
    dict: Option<&Fields<'a>>,
    top: &Fields<'a>,
    key: &str,
) -> Result<Option<(f64, Fields<'a>)>, ConfigError> {
    if let Some(d) = dict
        && let Some(v) = d.opt_f64(key)?
    {
        return Ok(Some((v, d.clone())));
    }
    Ok(top.opt_f64(key)?.map(|v| (v, top.clone())))
}

/// `value` as f32 if finite and positive, else an `InvalidField` naming `key` in `from`.
fn positive_f32(from: &Fields<'_>, key: &str, value: f64) -> Result<f32, ConfigError> {
    let narrowed = value as f32;
    if value > 0.0 && narrowed.is_finite() && narrowed > 0.0 {
        Ok(narrowed)
    } else {
        Err(from.invalid(
            key,
            "a finite positive number",
            &serde_json::Value::from(value),
        ))
    }
}

#[cfg(test)]
mod tests;
