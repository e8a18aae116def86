//! Typed access to one JSON object of a config file, producing `ConfigError`s that name the file
//! and the field's dotted path (`text_config.rope_parameters.rope_theta`).
//!
//! Convention: `null` reads like an absent field (so the transformers default applies), except
//! through [`Fields::is_null`], for the few fields where transformers gives `null` a meaning of
//! its own.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::ConfigError;

/// Longest JSON text quoted in an error message.
const MAX_QUOTED: usize = 80;

/// A JSON value as short text for error messages.
pub(crate) fn quote(value: &Value) -> String {
    let text = value.to_string();
    if text.len() <= MAX_QUOTED {
        return text;
    }
    let mut cut = MAX_QUOTED;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}...", &text[..cut])
}

/// One JSON object of a config file, with the dotted prefix of its fields.
#[derive(Debug, Clone)]
pub(crate) struct Fields<'a> {
    map: &'a Map<String, Value>,
    prefix: String,
    path: &'a Path,
}

impl<'a> Fields<'a> {
    /// The top-level object of `path`'s JSON, or an error if the root is not an object.
    pub(crate) fn root(value: &'a Value, path: &'a Path) -> Result<Fields<'a>, ConfigError> {
        match value {
            Value::Object(map) => Ok(Fields {
                map,
                prefix: String::new(),
                path,
            }),
            other => Err(ConfigError::InvalidField {
                path: path.to_path_buf(),
                field: "(root)".to_string(),
                expected: "a JSON object".to_string(),
                found: quote(other),
            }),
        }
    }

    /// The file these fields come from.
    pub(crate) fn path(&self) -> &'a Path {
        self.path
    }

    /// The dotted path of `key` in this object.
    pub(crate) fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The value of `key`; `None` when absent or `null`.
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// Whether `key` is present with the value `null`.
    pub(crate) fn is_null(&self, key: &str) -> bool {
        self.map.get(key).is_some_and(Value::is_null)
    }

    /// Whether `key` is present and not `null`.
    pub(crate) fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// An `InvalidField` error for `key`.
    pub(crate) fn invalid(&self, key: &str, expected: &str, found: &Value) -> ConfigError {
        ConfigError::InvalidField {
            path: self.path.to_path_buf(),
            field: self.name(key),
            expected: expected.to_string(),
            found: quote(found),
        }
    }

    /// A `MissingField` error for `key`.
    pub(crate) fn missing(&self, key: &str) -> ConfigError {
        ConfigError::MissingField {
            path: self.path.to_path_buf(),
            field: self.name(key),
        }
    }

    /// An `Unsupported` error for `key`.
    pub(crate) fn unsupported(&self, key: &str, value: &Value, why: &str) -> ConfigError {
        ConfigError::Unsupported {
            path: self.path.to_path_buf(),
            field: self.name(key),
            value: quote(value),
            why: why.to_string(),
        }
    }

    /// The nested object under `key` (its fields named `key.field`); `None` when absent or
    /// `null`.
    pub(crate) fn object(&self, key: &str) -> Result<Option<Fields<'a>>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Fields {
                map,
                prefix: format!("{}{key}.", self.prefix),
                path: self.path,
            })),
            Some(other) => Err(self.invalid(key, "a JSON object", other)),
        }
    }

    /// A non-negative integer, if present.
    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.invalid(key, "a non-negative integer", v)),
        }
    }

    /// A non-negative integer, or `default` when absent.
    pub(crate) fn usize_or(&self, key: &str, default: usize) -> Result<usize, ConfigError> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    /// A number, if present.
    pub(crate) fn opt_f64(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.invalid(key, "a number", v)),
        }
    }

    /// A number, or an error naming the field when absent.
    pub(crate) fn req_f64(&self, key: &str) -> Result<f64, ConfigError> {
        self.opt_f64(key)?.ok_or_else(|| self.missing(key))
    }

    /// A boolean, or `default` when absent.
    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.invalid(key, "true or false", v)),
        }
    }

    /// A string, if present.
    pub(crate) fn opt_str(&self, key: &str) -> Result<Option<&'a str>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.invalid(key, "a string", v)),
        }
    }

    /// A list of non-negative integers, if present.
    pub(crate) fn opt_usize_list(&self, key: &str) -> Result<Option<Vec<usize>>, ConfigError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let expected = "a list of non-negative integers";
        let items = v.as_array().ok_or_else(|| self.invalid(key, expected, v))?;
        items
            .iter()
            .map(|item| {
                item.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.invalid(key, expected, v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// A list of strings, if present.
    pub(crate) fn opt_str_list(&self, key: &str) -> Result<Option<Vec<&'a str>>, ConfigError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let expected = "a list of strings";
        let items = v.as_array().ok_or_else(|| self.invalid(key, expected, v))?;
        items
            .iter()
            .map(|item| item.as_str().ok_or_else(|| self.invalid(key, expected, v)))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// Token ids given as one integer or a list of integers; empty when absent or `null`.
    pub(crate) fn token_ids(&self, key: &str) -> Result<Vec<u32>, ConfigError> {
        let Some(v) = self.get(key) else {
            return Ok(Vec::new());
        };
        let expected = "a token id (a non-negative 32-bit integer) or a list of them";
        let one = |item: &Value| {
            item.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| self.invalid(key, expected, v))
        };
        match v {
            Value::Array(items) => items.iter().map(one).collect(),
            single => Ok(vec![one(single)?]),
        }
    }

    /// [`Fields::token_ids`], each below `vocab` (the model's `vocab_size`).
    pub(crate) fn token_ids_below(&self, key: &str, vocab: usize) -> Result<Vec<u32>, ConfigError> {
        let ids = self.token_ids(key)?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            let expected = format!("token ids below vocab_size ({vocab})");
            return Err(self.invalid(key, &expected, &Value::from(id)));
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nested_fields_name_their_dotted_path() {
        let value = json!({"text_config": {"hidden_size": "big"}});
        let path = Path::new("/ckpt/config.json");
        let root = Fields::root(&value, path).unwrap();
        let text = root.object("text_config").unwrap().unwrap();
        let err = text.opt_usize("hidden_size").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("text_config.hidden_size"), "{msg}");
        assert!(msg.contains("\"big\""), "{msg}");
    }

    #[test]
    fn token_ids_accept_int_list_and_null() {
        let value = json!({"a": 7, "b": [1, 2], "c": null, "d": -1});
        let f = Fields::root(&value, Path::new("c.json")).unwrap();
        assert_eq!(f.token_ids("a").unwrap(), vec![7]);
        assert_eq!(f.token_ids("b").unwrap(), vec![1, 2]);
        assert!(f.token_ids("c").unwrap().is_empty());
        assert!(f.token_ids("missing").unwrap().is_empty());
        assert!(matches!(
            f.token_ids("d"),
            Err(ConfigError::InvalidField { .. })
        ));
    }

    #[test]
    fn long_values_are_shortened_in_messages() {
        let long = Value::String("x".repeat(500));
        let q = quote(&long);
        assert!(q.len() < 100 && q.ends_with("..."), "{q}");
    }
}
