//! Hugging Face `config.json` (and `generation_config.json`) parsed into a typed `ModelConfig`.
//!
//! Supported `model_type`s: `qwen3`, `llama`, `qwen3_5_text`, `qwen3_5` (multimodal wrapper),
//! `qwen3_next`, `qwen3_5_moe_text`, `qwen3_5_moe` (wrapper). Absent fields take the defaults
//! of the matching transformers 5.24 configuration class; settings the engine does not model
//! are refused with a `ConfigError` naming the file and the field.

mod error;
mod family;
mod generation;
mod json;
mod layers;
mod model;
mod quantization;
mod rope;

pub use error::ConfigError;
pub use family::{ModelFamily, NormConvention, supported_model_types};
pub use generation::GenerationDefaults;
pub use layers::{LayerType, LinearAttentionConfig, MAX_CONFIG_COUNT, MoeConfig};
pub use model::{AttentionConfig, CheckpointInfo, ModelConfig, TokenConfig};
pub use quantization::WeightQuantization;
pub use rope::{RopeConfig, RopeScaling};

#[cfg(test)]
mod tests;
