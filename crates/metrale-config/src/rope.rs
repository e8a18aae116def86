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
//! - llama3's `original_max_position_embeddings`: a top-level field of that name wins, then the
//!   dict's, then `max_position_embeddings` (`standardize_rope_params`).

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
}

/// Rotary embedding settings of the full-attention layers.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// The base (`rope_theta`).
    pub theta: f32,
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
    /// `1.0 / (base ** (arange(0, dim, 2).float() / dim))`, then the linear or llama3 rescaling.
    ///
    /// Numerics: the exponent `2i / dim` and every later step are f32 operations in torch's
    /// order (`a / b` with a Python scalar `a` is `reciprocal(b) * a`). The power is computed in
    /// f64 from the f32 base and exponent and rounded to f32, i.e. correctly rounded. Torch's
    /// vectorised CPU `pow` (SLEEF `powf_u10`) is within 1 ulp of that but not always equal:
    /// about 1% of entries differ by 1 ulp (e.g. theta 1e6, dim 128, i = 37). Every other step
    /// reproduces torch bit for bit.
    pub fn inv_freq(&self) -> Vec<f32> {
        let dim = self.rotary_dim as f32;
        let base = f64::from(self.theta);
        let plain = (0..self.rotary_dim / 2).map(|i| {
            let exponent = (2 * i) as f32 / dim;
            let power = base.powf(f64::from(exponent)) as f32;
            1.0f32 / power
        });
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
        }
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
        Some((v, from)) => positive_f32(&from, "rope_theta", v)?,
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
            let original = match fields.opt_usize("original_max_position_embeddings")? {
                Some(n) => n,
                None => d.usize_or("original_max_position_embeddings", max_position_embeddings)?,
            };
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            }
        }
        (Some((other, key)), Some(d)) => {
            let value = serde_json::Value::from(other);
            return Err(d.unsupported(
                key,
                &value,
                "supported rope types: default, linear, llama3",
            ));
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
