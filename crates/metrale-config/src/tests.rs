//! Whole-file tests of `ModelConfig`: one per family on a realistic `config.json`
//! (`families.rs`) and one per error case (`errors.rs`). The JSON files live in `testdata/`:
//! published configs written from the model cards, and tiny configs written by transformers
//! 5.24's `save_pretrained`.

mod errors;
mod families;

use std::path::Path;

use crate::{ConfigError, ModelConfig};

/// The path named in errors of configs parsed from strings.
const PATH: &str = "/ckpt/config.json";

fn parse(text: &str) -> Result<ModelConfig, ConfigError> {
    ModelConfig::from_json_str(text, Path::new(PATH))
}

/// Parse a `serde_json::Value` built by a test.
fn parse_value(value: &serde_json::Value) -> Result<ModelConfig, ConfigError> {
    parse(&value.to_string())
}
