//! `ChatMessage` and `ChatOptions`: what a chat template renders, and how.
//!
//! A message carries the fields Hugging Face chat templates read (`role`, `content`, and for
//! tool use and reasoning models `tool_calls`, `tool_call_id`, `reasoning_content`, `name`);
//! any other field travels in `extra` and reaches the template under its own name. Both types
//! are `#[non_exhaustive]`: build them with the constructors and setters.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One message of a conversation, as the template sees it (serialized to an object whose keys
/// are the field names, `extra`'s keys beside them; an absent optional field is absent from
/// the object).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ... as the template expects.
    pub role: String,
    /// The message's text ("" when it has none, e.g. an assistant turn of tool calls only).
    #[serde(default)]
    pub content: String,
    /// An assistant turn's tool calls, as the template reads them (OpenAI's
    /// `[{"id", "type": "function", "function": {"name", "arguments"}}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    /// A tool result's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant turn's reasoning, which reasoning templates (Qwen3's) render apart from
    /// its content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The author's name (a tool's, for tool results).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Any other field, passed to the template as it is.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ChatMessage {
    /// A message of `role` with `content`, no other field.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            reasoning_content: None,
            name: None,
            extra: Map::new(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("assistant", content)
    }

    /// Set `tool_calls`.
    pub fn tool_calls(mut self, calls: Vec<Value>) -> Self {
        self.tool_calls = Some(calls);
        self
    }

    /// Set `tool_call_id`.
    pub fn tool_call_id(mut self, id: impl Into<String>) -> Self {
        self.tool_call_id = Some(id.into());
        self
    }

    /// Set `reasoning_content`.
    pub fn reasoning_content(mut self, reasoning: impl Into<String>) -> Self {
        self.reasoning_content = Some(reasoning.into());
        self
    }

    /// Set `name`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Add a field the template reads under `key`.
    pub fn extra(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.extra.insert(key.into(), value.into());
        self
    }
}

/// How a template renders: the variables besides `messages` and the special tokens.
///
/// ```
/// use metrale::chat::ChatOptions;
///
/// let options = ChatOptions::default().kwarg("enable_thinking", false);
/// assert!(options.add_generation_prompt);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ChatOptions {
    /// End the prompt with the opening of the assistant's reply. Default true.
    pub add_generation_prompt: bool,
    /// Further template variables (transformers' `chat_template_kwargs`, e.g.
    /// `enable_thinking`, or `tools` for templates that list them). `messages`,
    /// `add_generation_prompt`, `bos_token` and `eos_token` are set by the renderer and win
    /// over a variable of the same name here. Default none.
    pub kwargs: Map<String, Value>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            add_generation_prompt: true,
            kwargs: Map::new(),
        }
    }
}

impl ChatOptions {
    /// Set `add_generation_prompt`.
    pub fn add_generation_prompt(mut self, on: bool) -> Self {
        self.add_generation_prompt = on;
        self
    }

    /// Set `kwargs`.
    pub fn kwargs(mut self, kwargs: Map<String, Value>) -> Self {
        self.kwargs = kwargs;
        self
    }

    /// Add one template variable.
    pub fn kwarg(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.kwargs.insert(key.into(), value.into());
        self
    }
}
