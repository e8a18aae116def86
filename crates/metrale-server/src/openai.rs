//! The OpenAI request body of `/v1/completions` and `/v1/chat/completions` (the responses and
//! stream chunks sent back are in `response`).
//!
//! Both endpoints read one `GenerationBody` (every field optional) and check their own required
//! field (`prompt` or `messages`); a field the engine cannot honour (`echo`, `suffix`) is refused
//! with a 400 that names it rather than ignored. `n` (1 to 64 choices, the prompt computed
//! once) is read on both; `best_of` (generate that many, at least `n`, and return the `n` of
//! highest cumulative logprob, best first) on completions only, and not with `stream`. `tools`, `tool_choice` and
//! `parallel_tool_calls` (chat only) and `response_format` (`text`, `json_object`,
//! `json_schema`) are read into the library's types here. Fields this server adds beside
//! OpenAI's, as vLLM has them: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
//! `ignore_eos` and `stop_token_ids` in requests, `token_ids` in every choice and chunk.

use metrale::Constraint;
use metrale::chat::{Tool, ToolChoice};
use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;

/// A request body of either generation endpoint.
#[derive(Debug, Default, Deserialize)]
pub struct GenerationBody {
    /// The model asked for; must be the served one when given.
    pub model: Option<String>,
    /// `/v1/completions`: a string, a token-id array, or a one-element array of either.
    pub prompt: Option<Value>,
    /// `/v1/chat/completions`: `[{"role", "content"}, ...]`.
    pub messages: Option<Vec<Value>>,
    /// Most tokens to generate.
    pub max_tokens: Option<usize>,
    /// The chat API's newer name for `max_tokens`.
    pub max_completion_tokens: Option<usize>,
    /// Sampling temperature (OpenAI's default 1; 0 is greedy).
    pub temperature: Option<f32>,
    /// Nucleus threshold in (0, 1].
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens; 0 or -1 keep all.
    pub top_k: Option<i64>,
    /// Sampler seed; without one each request draws its own.
    pub seed: Option<i64>,
    /// A stop string or a list of them.
    pub stop: Option<Value>,
    /// Token ids that end generation (kept in the output), inside the vocabulary.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Do not stop at the model's EOS tokens.
    pub ignore_eos: Option<bool>,
    /// Send server-sent events.
    pub stream: Option<bool>,
    /// `{"include_usage": true}`: a last chunk with the token counts.
    pub stream_options: Option<StreamOptions>,
    /// Chat: extra variables for the chat template (e.g. `{"enable_thinking": false}`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Completions: the number of top logprobs per token (0 to 20; 0 reports the chosen
    /// token's alone). Chat: `true` to report each token's logprob.
    pub logprobs: Option<Value>,
    /// Chat: the number of top logprobs per token (0 to 20; needs `logprobs: true`).
    pub top_logprobs: Option<u64>,
    /// Subtracted once from the logit of each token already generated, in [-2, 2].
    pub presence_penalty: Option<f32>,
    /// Subtracted per occurrence from the logit of each generated token, in [-2, 2].
    pub frequency_penalty: Option<f32>,
    /// Divides positive (multiplies negative) logits of prompt and generated tokens; > 0.
    pub repetition_penalty: Option<f32>,
    /// `{"token id": bias}`, biases in [-100, 100].
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Keep tokens at least `min_p` times as likely as the most likely one, in [0, 1].
    pub min_p: Option<f32>,
    /// No EOS or stop token before this many tokens.
    pub min_tokens: Option<usize>,
    /// Chat: OpenAI function tools, `[{"type": "function", "function": {name, description,
    /// parameters}}]`.
    pub tools: Option<Vec<Value>>,
    /// Chat: `auto`, `none`, `required` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    /// Chat: several calls in one answer (default true).
    pub parallel_tool_calls: Option<bool>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema,
    /// strict}}`.
    pub response_format: Option<Value>,
    /// Choices to return, 1 to 64.
    pub n: Option<u64>,
    /// Completions: choices to generate (at least `n`), of which the `n` with the highest
    /// cumulative logprob are returned; not with `stream`.
    pub best_of: Option<u64>,
    // Refused unless at their defaults.
    echo: Option<bool>,
    suffix: Option<String>,
}

/// A request body: a JSON object read as `T`; anything else gets a 400 naming the field.
pub fn parse_object<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    if !value.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object", None));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        ApiError::invalid(format!("`{path}`: {}", e.into_inner()), Some(&path))
    })
}

/// `stream_options`.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
pub struct StreamOptions {
    /// Send the usage in a last chunk.
    pub include_usage: Option<bool>,
}

impl GenerationBody {
    /// Parse a request body; a malformed one gets a 400 naming the field.
    pub fn parse(bytes: &[u8]) -> Result<GenerationBody, ApiError> {
        let body: GenerationBody = parse_object(bytes)?;
        body.refuse_unsupported()?;
        Ok(body)
    }

    /// Refuse the fields this server cannot honour instead of ignoring them.
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let unsupported = |field: &str, what: &str| {
            Err(ApiError::invalid(
                format!("`{field}` {what} is not supported by this server"),
                Some(field),
            ))
        };
        if self.echo == Some(true) {
            return unsupported("echo", "= true");
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return unsupported("suffix", "(insertion)");
        }
        Ok(())
    }

    /// The logprobs asked for: `None`, or the number of top logprobs per token. Completions
    /// take `logprobs: N`; chat takes `logprobs: true` and `top_logprobs: N`.
    pub fn logprobs(&self, chat: bool) -> Result<Option<usize>, ApiError> {
        let bad =
            |field: &str, m: &str| Err(ApiError::invalid(format!("`{field}` {m}"), Some(field)));
        let top = |n: u64, field: &str| {
            if n > 20 {
                bad(field, "must be at most 20")
            } else {
                Ok(Some(n as usize))
            }
        };
        if chat {
            let on = match &self.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(_) => return bad("logprobs", "must be a boolean in chat completions"),
            };
            return match (on, self.top_logprobs) {
                (false, Some(n)) if n > 0 => bad("top_logprobs", "needs `logprobs: true`"),
                (false, _) => Ok(None),
                (true, n) => top(n.unwrap_or(0), "top_logprobs"),
            };
        }
        if self.top_logprobs.is_some_and(|n| n > 0) {
            return bad(
                "top_logprobs",
                "is a chat field; completions take `logprobs: N`",
            );
        }
        match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => top(n, "logprobs"),
                None => bad("logprobs", "must be an integer from 0 to 20 in completions"),
            },
        }
    }

    /// `logit_bias` as `(token id, bias)` pairs.
    pub fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        map.iter()
            .map(|(k, v)| {
                let id = k.parse::<u32>().map_err(|_| {
                    ApiError::invalid(
                        format!("`logit_bias` key {k:?} is not a token id"),
                        Some("logit_bias"),
                    )
                })?;
                let b = v.as_f64().ok_or_else(|| {
                    ApiError::invalid(
                        format!("`logit_bias[{k}]` = {v} is not a number"),
                        Some("logit_bias"),
                    )
                })?;
                Ok((id, b as f32))
            })
            .collect()
    }

    /// `response_format` as a constraint on the answer; `None` for text.
    pub fn response_format(&self) -> Result<Option<Constraint>, ApiError> {
        let param = Some("response_format");
        let Some(format) = self.response_format.as_ref().filter(|f| !f.is_null()) else {
            return Ok(None);
        };
        match format.get("type").and_then(Value::as_str) {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(Constraint::JsonSchema(
                serde_json::json!({"type": "object"}),
            ))),
            Some("json_schema") => {
                let schema = format
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .filter(|s| s.is_object() || s.is_boolean())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "`response_format.json_schema.schema` must be a JSON schema object",
                            Some("response_format.json_schema.schema"),
                        )
                    })?;
                Ok(Some(Constraint::JsonSchema(schema.clone())))
            }
            _ => Err(ApiError::invalid(
                "`response_format.type` must be `text`, `json_object` or `json_schema`",
                param,
            )),
        }
    }

    /// `tools` as the library's function tools.
    pub fn tools(&self) -> Result<Vec<Tool>, ApiError> {
        let Some(tools) = &self.tools else {
            return Ok(Vec::new());
        };
        tools.iter().enumerate().map(|(i, t)| tool(i, t)).collect()
    }

    /// `tool_choice` (default `auto`); a required or named choice needs `tools`.
    pub fn tool_choice(&self, have_tools: bool) -> Result<ToolChoice, ApiError> {
        let bad = |m: &str| ApiError::invalid(m, Some("tool_choice"));
        let choice = match &self.tool_choice {
            None | Some(Value::Null) => return Ok(ToolChoice::Auto),
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                other => {
                    return Err(bad(&format!(
                        "`tool_choice` = `{other}`: must be `auto`, `none`, `required` or a \
                         named function"
                    )));
                }
            },
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(name) if v.get("type").and_then(Value::as_str) == Some("function") => {
                    ToolChoice::Function(name.to_string())
                }
                _ => {
                    return Err(bad(
                        "`tool_choice` must be a string or {\"type\": \"function\", \
                         \"function\": {\"name\": ...}}",
                    ));
                }
            },
        };
        if !have_tools && matches!(choice, ToolChoice::Required | ToolChoice::Function(_)) {
            return Err(bad("`tool_choice` requires `tools`"));
        }
        Ok(choice)
    }

    /// `stop` as a list of strings.
    pub fn stop_strings(&self) -> Result<Vec<String>, ApiError> {
        let bad =
            || ApiError::invalid("`stop` must be a string or a list of strings", Some("stop"));
        match &self.stop {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string).ok_or_else(bad))
                .collect(),
            Some(_) => Err(bad()),
        }
    }

    /// `n` and `best_of` as counts (each at most 64 is checked with the sampling); `best_of`
    /// is refused on chat and with `stream` unless it is `n` (nothing to rank).
    pub fn choices(&self, chat: bool) -> Result<(usize, Option<usize>), ApiError> {
        let count = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let n = self.n.map_or(1, count);
        let best_of = self.best_of.map(count);
        let bad = |m: &str| Err(ApiError::invalid(format!("`best_of` {m}"), Some("best_of")));
        match best_of {
            Some(b) if b > n && chat => bad("is a /v1/completions field"),
            Some(b) if b > n && self.stream() => bad("cannot be used with `stream`"),
            _ => Ok((n, best_of)),
        }
    }

    /// Whether to stream.
    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Whether a streamed response ends with a usage chunk.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

/// Tool `i` of `tools`: `{"type": "function", "function": {"name", "description"?,
/// "parameters"?}}`.
fn tool(i: usize, t: &Value) -> Result<Tool, ApiError> {
    let at = |f: &str| format!("tools[{i}]{f}");
    let bad = |f: &str, m: &str| ApiError::invalid(format!("`{}` {m}", at(f)), Some(&at(f)));
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad(".type", "must be `function`"));
    }
    let f = t
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| bad(".function", "must be an object"))?;
    let name = (f.get("name").and_then(Value::as_str))
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad(".function.name", "must be a non-empty string"))?;
    let mut tool = Tool::function(name);
    match f.get("description") {
        None | Some(Value::Null) => {}
        Some(Value::String(d)) => tool = tool.description(d.clone()),
        Some(_) => return Err(bad(".function.description", "must be a string")),
    }
    match f.get("parameters") {
        None | Some(Value::Null) => {}
        Some(p @ Value::Object(_)) => tool = tool.parameters(p.clone()),
        Some(_) => return Err(bad(".function.parameters", "must be a JSON schema object")),
    }
    Ok(tool)
}

/// A completion prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Text, encoded with the checkpoint's tokenizer.
    Text(String),
    /// Token ids.
    TokenIds(Vec<u32>),
}

/// Read `prompt`: a string, a token-id array, or a one-element array holding either.
pub fn parse_prompt(value: Option<&Value>) -> Result<PromptInput, ApiError> {
    let invalid = |m: String| ApiError::invalid(m, Some("prompt"));
    match value {
        None | Some(Value::Null) => Err(invalid("`prompt` is required".into())),
        Some(Value::String(s)) => Ok(PromptInput::Text(s.clone())),
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| {
                        invalid(format!(
                            "prompt[{i}] = {v} is not a token id (0 <= id < 2^32)"
                        ))
                    })
            })
            .collect::<Result<Vec<u32>, ApiError>>()
            .map(PromptInput::TokenIds),
        Some(Value::Array(items)) if items.len() == 1 => parse_prompt(items.first()),
        Some(Value::Array(_)) => Err(invalid(
            "several prompts in one request are not supported; send one request per prompt".into(),
        )),
        Some(other) => Err(invalid(format!(
            "`prompt` must be a string or an array of token ids, not {other}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_is_text_token_ids_or_one_of_either_in_a_list() {
        let p = |v: Value| parse_prompt(Some(&v));
        assert_eq!(
            p(serde_json::json!("hi")),
            Ok(PromptInput::Text("hi".into()))
        );
        assert_eq!(
            p(serde_json::json!([1, 2])),
            Ok(PromptInput::TokenIds(vec![1, 2]))
        );
        assert_eq!(
            p(serde_json::json!([[3]])),
            Ok(PromptInput::TokenIds(vec![3]))
        );
        assert_eq!(
            p(serde_json::json!(["x"])),
            Ok(PromptInput::Text("x".into()))
        );
        for bad in [
            serde_json::json!([1, -2]),
            serde_json::json!([1.5]),
            serde_json::json!(["a", "b"]),
            serde_json::json!({"a": 1}),
            Value::Null,
        ] {
            let e = p(bad.clone()).expect_err(&bad.to_string());
            assert_eq!(e.param.as_deref(), Some("prompt"), "{bad}");
        }
    }

    #[test]
    fn a_bad_field_is_named_and_unsupported_ones_are_refused() {
        let e = GenerationBody::parse(br#"{"prompt": "a", "max_tokens": -1}"#)
            .expect_err("negative max_tokens");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = GenerationBody::parse(b"{\"prompt\": ").expect_err("truncated");
        assert!(e.message.contains("not valid JSON"), "{e}");
        let e = GenerationBody::parse(br#"{"prompt": "a", "n": -2}"#).expect_err("n");
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = GenerationBody::parse(br#"{"prompt": "a", "echo": true}"#).expect_err("echo");
        assert_eq!(e.param.as_deref(), Some("echo"));
        let e = GenerationBody::parse(br#"{"prompt": "a", "stop": 3}"#)
            .and_then(|b| b.stop_strings())
            .expect_err("stop");
        assert_eq!(e.param.as_deref(), Some("stop"));
        let ok = GenerationBody::parse(
            br#"{"prompt": "a", "n": 1, "logprobs": null, "presence_penalty": 0, "stop": ["x", "y"], "user": "u"}"#,
        )
        .expect("defaults are accepted");
        assert_eq!(ok.stop_strings().expect("stop"), vec!["x", "y"]);
        assert_eq!(ok.logprobs(false).expect("none"), None);
    }

    #[test]
    fn n_and_best_of_are_read_and_best_of_is_refused_where_it_cannot_rank() {
        let body = |s: &str| GenerationBody::parse(s.as_bytes()).expect("parses");
        assert_eq!(body(r#"{}"#).choices(false).ok(), Some((1, None)));
        let b = body(r#"{"n": 2, "best_of": 5}"#);
        assert_eq!(b.choices(false).ok(), Some((2, Some(5))));
        let e = b.choices(true).expect_err("chat");
        assert_eq!(e.param.as_deref(), Some("best_of"));
        let e = body(r#"{"n": 2, "best_of": 5, "stream": true}"#)
            .choices(false)
            .expect_err("stream");
        assert_eq!(e.param.as_deref(), Some("best_of"));
        let same = body(r#"{"n": 3, "best_of": 3, "stream": true}"#);
        assert_eq!(same.choices(false).ok(), Some((3, Some(3))));
    }

    #[test]
    fn logprobs_and_logit_bias_are_read_per_endpoint() {
        let body = |s: &str| GenerationBody::parse(s.as_bytes()).expect("parses");
        assert_eq!(
            body(r#"{"logprobs": 3}"#).logprobs(false).ok(),
            Some(Some(3))
        );
        assert_eq!(
            body(r#"{"logprobs": 0}"#).logprobs(false).ok(),
            Some(Some(0))
        );
        let e = body(r#"{"logprobs": 21}"#).logprobs(false).expect_err("21");
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        let chat = body(r#"{"logprobs": true, "top_logprobs": 4}"#);
        assert_eq!(chat.logprobs(true).ok(), Some(Some(4)));
        let e = body(r#"{"top_logprobs": 4}"#)
            .logprobs(true)
            .expect_err("no logprobs");
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = body(r#"{"logprobs": true, "top_logprobs": 30}"#)
            .logprobs(true)
            .expect_err("30");
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = body(r#"{"logprobs": 2}"#)
            .logprobs(true)
            .expect_err("an integer in chat");
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        let bias = body(r#"{"logit_bias": {"7": -100, "12": 2.5}}"#)
            .logit_bias()
            .expect("bias");
        assert_eq!(bias.len(), 2);
        assert!(bias.contains(&(7, -100.0)) && bias.contains(&(12, 2.5)));
        let e = body(r#"{"logit_bias": {"x": 1}}"#)
            .logit_bias()
            .expect_err("key");
        assert_eq!(e.param.as_deref(), Some("logit_bias"));
    }
}
