//! `ChatTemplate`: the checkpoint's chat template, rendered with minijinja as transformers'
//! `apply_chat_template` renders it with Jinja2.
//!
//! The template is `chat_template` in `tokenizer_config.json` (a string, or a list of
//! `{name, template}` of which `default` is taken), else the file `chat_template.jinja`. It is
//! rendered with `messages`, `add_generation_prompt = true`, `bos_token` and `eos_token` (from
//! `tokenizer_config.json`, a string or `{"content": ...}`), and the request's
//! `chat_template_kwargs`; with Jinja2's `trim_blocks` and `lstrip_blocks` as transformers sets
//! them, Python's string and dict methods (`strip`, `startswith`, `items`, ...) and
//! `raise_exception`.
//!
//! Invariant: a template that does not compile is refused when the server starts; a template
//! that fails on a request's messages (`raise_exception` included) fails that request alone,
//! with a 400.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use minijinja::value::Serde;
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value};

use super::error::ApiError;

const NAME: &str = "chat_template";

/// See the module header.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Where the template came from, for messages.
    source: PathBuf,
}

impl ChatTemplate {
    /// The chat template of the checkpoint in `dir`; `None` when it has none.
    pub fn load(dir: &Path) -> Result<Option<ChatTemplate>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Map<String, Value> = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("reading {}", config_path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{}: not a JSON object", config_path.display()))?
        } else {
            Map::new()
        };
        let jinja_path = dir.join("chat_template.jinja");
        let (source, path) = match config.get("chat_template") {
            Some(t) => (template_of(t, &config_path)?, config_path.clone()),
            None if jinja_path.exists() => (
                std::fs::read_to_string(&jinja_path)
                    .with_context(|| format!("reading {}", jinja_path.display()))?,
                jinja_path,
            ),
            None => return Ok(None),
        };
        let token = |key: &str| -> Result<String> {
            match config.get(key) {
                None | Some(Value::Null) => Ok(String::new()),
                Some(Value::String(s)) => Ok(s.clone()),
                Some(Value::Object(o)) => match o.get("content") {
                    Some(Value::String(s)) => Ok(s.clone()),
                    _ => bail!("{}: `{key}.content` is not a string", config_path.display()),
                },
                Some(_) => bail!(
                    "{}: `{key}` is neither a string nor an object",
                    config_path.display()
                ),
            }
        };
        ChatTemplate::new(source, token("bos_token")?, token("eos_token")?, path).map(Some)
    }

    /// A template from its source.
    pub fn new(
        source: String,
        bos_token: String,
        eos_token: String,
        origin: PathBuf,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .context("building the template syntax")?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<(), Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_template_owned(NAME, source).map_err(|e| {
            anyhow::anyhow!(
                "{}: the chat template does not compile: {e:#}",
                origin.display()
            )
        })?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            source: origin,
        })
    }

    /// The prompt for `messages` (OpenAI's, checked here), ready for the model's reply.
    pub fn render(
        &self,
        messages: &[Value],
        kwargs: Option<&Map<String, Value>>,
    ) -> Result<String, ApiError> {
        let messages = normalize_messages(messages)?;
        let template = self.env.get_template(NAME).map_err(|e| {
            ApiError::internal(format!(
                "{}: the chat template is gone: {e}",
                self.source.display()
            ))
        })?;
        let mut context = kwargs.cloned().unwrap_or_default();
        context.insert("messages".into(), Value::Array(messages));
        context.insert("add_generation_prompt".into(), Value::Bool(true));
        context.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        context.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        template
            .render(minijinja::Value::from(Serde(&context)))
            .map_err(|e| {
                let detail = e.detail().map_or_else(|| e.to_string(), str::to_string);
                ApiError::invalid(
                    format!("the chat template cannot render these messages: {detail}"),
                    Some("messages"),
                )
            })
    }
}

/// `chat_template` of `tokenizer_config.json`: a string, or a list of named templates.
fn template_of(value: &Value, path: &Path) -> Result<String> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Array(list) => {
            let named = |want: &str| {
                list.iter().find_map(|t| {
                    (t.get("name")?.as_str()? == want)
                        .then(|| t.get("template")?.as_str().map(str::to_string))
                        .flatten()
                })
            };
            named("default").with_context(|| {
                format!(
                    "{}: `chat_template` has no template named `default`",
                    path.display()
                )
            })
        }
        _ => bail!(
            "{}: `chat_template` is neither a string nor a list",
            path.display()
        ),
    }
}

/// Check each message (an object with a string `role`) and make its `content` a string: text
/// parts (`[{"type": "text", "text": ...}]`) are joined, a null content becomes "".
fn normalize_messages(messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("`messages` is empty", Some("messages")));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let field = |f: &str| format!("messages[{i}].{f}");
            let Some(obj) = m.as_object() else {
                return Err(ApiError::invalid(
                    format!("messages[{i}] is not an object"),
                    Some(&format!("messages[{i}]")),
                ));
            };
            if !obj.get("role").is_some_and(Value::is_string) {
                let f = field("role");
                return Err(ApiError::invalid(format!("`{f}` must be a string"), Some(&f)));
            }
            let content = match obj.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for (j, part) in parts.iter().enumerate() {
                        let f = field(&format!("content[{j}]"));
                        match (part.get("type").and_then(Value::as_str), part.get("text")) {
                            (Some("text"), Some(Value::String(t))) => text.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    format!("`{f}` must be a text part, {{\"type\": \"text\", \"text\": ...}}"),
                                    Some(&f),
                                ));
                            }
                        }
                    }
                    text
                }
                Some(_) => {
                    let f = field("content");
                    return Err(ApiError::invalid(
                        format!("`{f}` must be a string or a list of text parts"),
                        Some(&f),
                    ));
                }
            };
            let mut obj = obj.clone();
            obj.insert("content".into(), Value::String(content));
            Ok(Value::Object(obj))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(source.into(), "<s>".into(), "</s>".into(), "test".into())
            .expect("compiles")
    }

    #[test]
    fn renders_like_jinja2_with_trimmed_blocks_and_python_methods() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'system' %}\n[{{ m.content.strip() }}]\n  {% else %}\n<{{ m.role }}>{{ m.content }}{{ eos_token }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}<assistant>{% endif %}",
        );
        let out = t
            .render(
                &[
                    json!({"role": "system", "content": "  be brief "}),
                    json!({"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}),
                ],
                None,
            )
            .expect("renders");
        assert_eq!(out, "<s>[be brief]\n<user>hi there</s>\n<assistant>");
    }

    #[test]
    fn raise_exception_and_bad_messages_are_request_errors() {
        let t = template(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok{{ flag }}",
        );
        let e = t
            .render(&[json!({"role": "assistant", "content": "x"})], None)
            .expect_err("raises");
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert!(e.message.contains("first must be user"), "{e}");
        let kwargs = json!({"flag": 7});
        assert_eq!(
            t.render(&[json!({"role": "user"})], kwargs.as_object())
                .expect("null content is allowed"),
            "ok7"
        );
        for bad in [
            json!("user"),
            json!({"content": "x"}),
            json!({"role": "user", "content": 3}),
        ] {
            let e = t
                .render(std::slice::from_ref(&bad), None)
                .expect_err("bad message");
            assert!(
                e.param.is_some_and(|p| p.starts_with("messages[0]")),
                "{bad}"
            );
        }
        assert!(t.render(&[], None).is_err());
    }

    #[test]
    fn a_template_that_does_not_compile_is_refused_at_load() {
        let e = ChatTemplate::new(
            "{% for %}".into(),
            String::new(),
            String::new(),
            "x.json".into(),
        )
        .expect_err("syntax error");
        assert!(format!("{e:#}").contains("x.json"), "{e:#}");
    }
}
