//! Hugging Face `config.json` (and `generation_config.json`) parsed into a typed `ModelConfig`.
