//! `GenerationDefaults`: the sampling settings a checkpoint recommends in its
//! `generation_config.json` (Qwen's model cards ship temperature, top-p and top-k there), which
//! a server applies to a request that leaves them out.

use crate::error::ConfigError;
use crate::json::Fields;

/// The sampling fields of a `generation_config.json`; each `None` where the file does not set
/// it (absent or `null`).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct GenerationDefaults {
    /// `temperature`, >= 0.
    pub temperature: Option<f32>,
    /// `top_p`, in (0, 1].
    pub top_p: Option<f32>,
    /// `top_k`; 0 keeps every token.
    pub top_k: Option<usize>,
    /// `min_p`, in [0, 1].
    pub min_p: Option<f32>,
    /// `repetition_penalty`, > 0 (1 is none).
    pub repetition_penalty: Option<f32>,
}

impl GenerationDefaults {
    /// Whether the file sets no sampling field.
    pub fn is_empty(&self) -> bool {
        *self == GenerationDefaults::default()
    }
}

/// The sampling fields of `root`, each checked against its range.
pub(crate) fn parse_generation_defaults(
    root: &Fields<'_>,
) -> Result<GenerationDefaults, ConfigError> {
    let number = |key: &str, ok: fn(f64) -> bool, expected: &str| match root.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && ok(x) => Ok(Some(x as f32)),
            _ => Err(root.invalid(key, expected, v)),
        },
    };
    let top_k = match root.get("top_k") {
        None | Some(serde_json::Value::Null) => None,
        Some(_) => root.opt_usize("top_k")?,
    };
    Ok(GenerationDefaults {
        temperature: number("temperature", |x| x >= 0.0, "a number >= 0")?,
        top_p: number("top_p", |x| x > 0.0 && x <= 1.0, "a number in (0, 1]")?,
        top_k,
        min_p: number("min_p", |x| (0.0..=1.0).contains(&x), "a number in [0, 1]")?,
        repetition_penalty: number("repetition_penalty", |x| x > 0.0, "a number > 0")?,
    })
}
