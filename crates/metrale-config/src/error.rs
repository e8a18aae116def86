//! `ConfigError`: everything reading a checkpoint's `config.json` or `generation_config.json` can
//! fail with. Every variant names the file; the field-level ones name the field by its dotted
//! path inside the file (`text_config.hidden_size`, `rope_parameters.factor`).

use std::path::PathBuf;

/// An error from reading or interpreting a checkpoint's configuration files.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid JSON.
    #[error("{}:{line}:{column}: invalid JSON: {message}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// The parser's message.
        message: String,
    },
    /// A field that has no default is absent (or `null`).
    #[error("{}: missing field `{field}`", path.display())]
    MissingField {
        /// The file.
        path: PathBuf,
        /// Dotted path of the field.
        field: String,
    },
    /// A field holds a value of the wrong type or outside its valid range.
    #[error("{}: field `{field}`: expected {expected}, found {found}", path.display())]
    InvalidField {
        /// The file.
        path: PathBuf,
        /// Dotted path of the field.
        field: String,
        /// What the field must hold.
        expected: String,
        /// What it holds (JSON text, shortened).
        found: String,
    },
    /// `model_type` names an architecture this engine does not implement.
    #[error(
        "{}: model_type `{found}` is not supported (supported: {})",
        path.display(),
        supported.join(", ")
    )]
    UnsupportedModelType {
        /// The file.
        path: PathBuf,
        /// The `model_type` found.
        found: String,
        /// Every supported `model_type`.
        supported: Vec<&'static str>,
    },
    /// A valid setting of a feature the engine does not model (it would compute something else).
    #[error("{}: field `{field}` = {value} is not supported: {why}", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// Dotted path of the field.
        field: String,
        /// Its value (JSON text, shortened).
        value: String,
        /// Why it is refused, and what is supported instead.
        why: String,
    },
}
