//! Chat templates: a checkpoint's Jinja template turning a conversation into a prompt, rendered
//! with minijinja as transformers' `apply_chat_template` renders it with Jinja2.
//!
//! The template is `chat_template` in `tokenizer_config.json` (a string, or a list of
//! `{name, template}` of which `default` is taken), else the file `chat_template.jinja`. It is
//! rendered with `messages`, `add_generation_prompt`, `bos_token` and `eos_token` (from
//! `tokenizer_config.json`, a string or `{"content": ...}`) and [`ChatOptions::kwargs`]; with
//! Jinja2's `trim_blocks` and `lstrip_blocks` as transformers sets them, Python's string and dict
//! methods (`strip`, `startswith`, `items`, ...) and `raise_exception`.
//!
//! [`Engine::load`](crate::Engine::load) loads the checkpoint's template once;
//! [`Engine::apply_chat_template`](crate::Engine::apply_chat_template) renders it, and
//! [`Engine::submit_chat`](crate::Engine::submit_chat) renders a [`ChatRequest`] (messages and
//! tools), generates, and reads the answer apart ([`ChatEvent`], [`ChatOutput`]).
//!
//! ```no_run
//! use metrale::chat::{ChatMessage, ChatOptions};
//! use metrale::{Engine, EngineOptions, GenerateRequest};
//!
//! let engine = Engine::load("path/to/Qwen3-0.6B", EngineOptions::default())?;
//! let messages = [ChatMessage::system("Be brief."), ChatMessage::user("Name a colour.")];
//! let prompt = engine.apply_chat_template(&messages, &ChatOptions::default())?;
//! let out = engine.generate(&GenerateRequest::new(prompt).max_new_tokens(32))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Invariant: a template that does not compile is refused when it is loaded; a template that
//! fails on some messages (`raise_exception` included) fails that rendering alone.

mod grammar;
mod handle;
mod message;
mod output;
mod request;

use std::path::{Path, PathBuf};

use minijinja::value::Serde;
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value};

pub(crate) use grammar::tool_call_grammar;
pub use handle::ChatHandle;
pub use message::{ChatMessage, ChatOptions};
pub use output::{OutputEvent, OutputParser, ToolCallFormat, ToolSpec};
pub(crate) use request::{AnswerReader, tool_format};
pub use request::{
    ChatDelta, ChatEvent, ChatOutput, ChatRequest, ReasoningParser, Tool, ToolCall, ToolCallDelta,
    ToolCallParser, ToolChoice,
};

/// The name the template is registered under in its environment.
const NAME: &str = "chat_template";

/// What went wrong loading or rendering a chat template. More kinds may come: matches keep a
/// wildcard arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatTemplateError {
    /// The checkpoint has no chat template.
    #[error(
        "the checkpoint has no chat template (no `chat_template` in its tokenizer_config.json, \
         no chat_template.jinja)"
    )]
    NoTemplate,
    /// A file could not be read.
    #[error("{path}: cannot read it: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` does not say what a template needs.
    #[error("{path}: {problem}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the field.
        problem: String,
    },
    /// The template's source does not compile.
    #[error("{origin}: the chat template does not compile: {message}")]
    Compile {
        /// Where the template came from (a file, or `the given template`).
        origin: String,
        /// The compiler's message, with the line.
        message: String,
    },
    /// There are no messages to render.
    #[error("there are no messages to render")]
    NoMessages,
    /// The template failed on these messages (an undefined variable, a type error, its own
    /// `raise_exception`).
    #[error("the chat template cannot render these messages: {message}")]
    Render {
        /// Where the template came from.
        origin: String,
        /// What failed, in the template's words.
        message: String,
    },
}

/// A compiled chat template with its special tokens; see the module header.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    source: String,
    /// Where the template came from, for messages.
    origin: String,
}

impl ChatTemplate {
    /// Compile a template from its source, with empty `bos_token` and `eos_token` (set them with
    /// [`ChatTemplate::bos_token`] and [`ChatTemplate::eos_token`]).
    pub fn new(source: impl Into<String>) -> Result<ChatTemplate, ChatTemplateError> {
        ChatTemplate::compile(source.into(), "the given template".into())
    }

    /// Set the text of `bos_token`.
    pub fn bos_token(mut self, token: impl Into<String>) -> Self {
        self.bos_token = token.into();
        self
    }

    /// Set the text of `eos_token`.
    pub fn eos_token(mut self, token: impl Into<String>) -> Self {
        self.eos_token = token.into();
        self
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The text of `bos_token` the template is rendered with.
    pub fn bos(&self) -> &str {
        &self.bos_token
    }

    /// The text of `eos_token` the template is rendered with.
    pub fn eos(&self) -> &str {
        &self.eos_token
    }

    /// The chat template of the checkpoint in `dir`; `None` when it has none.
    pub fn load(dir: impl AsRef<Path>) -> Result<Option<ChatTemplate>, ChatTemplateError> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config = read_config(&config_path)?;
        let jinja_path = dir.join("chat_template.jinja");
        let (source, origin) = match config.get("chat_template") {
            Some(t) => (template_of(t, &config_path)?, config_path.clone()),
            None if jinja_path.exists() => (read(&jinja_path)?, jinja_path),
            None => return Ok(None),
        };
        let token = |key: &str| special_token(&config, key, &config_path);
        let (bos_token, eos_token) = (token("bos_token")?, token("eos_token")?);
        let template = ChatTemplate::compile(source, origin.display().to_string())?;
        Ok(Some(template.bos_token(bos_token).eos_token(eos_token)))
    }

    fn compile(source: String, origin: String) -> Result<ChatTemplate, ChatTemplateError> {
        let compile_error = |message: String| ChatTemplateError::Compile {
            origin: origin.clone(),
            message,
        };
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| compile_error(format!("{e:#}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<(), Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_template_owned(NAME, source.clone())
            .map_err(|e| compile_error(format!("{e:#}")))?;
        Ok(ChatTemplate {
            env,
            bos_token: String::new(),
            eos_token: String::new(),
            source,
            origin,
        })
    }

    /// The prompt for `messages`, rendered with `options` (with the default options, ready for
    /// the model's reply).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<String, ChatTemplateError> {
        if messages.is_empty() {
            return Err(ChatTemplateError::NoMessages);
        }
        let render_error = |message: String| ChatTemplateError::Render {
            origin: self.origin.clone(),
            message,
        };
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| render_error(e.to_string()))?;
        let mut messages =
            serde_json::to_value(messages).map_err(|e| render_error(e.to_string()))?;
        arguments_as_objects(&mut messages);
        let mut context = options.kwargs.clone();
        context.insert("messages".into(), messages);
        context.insert(
            "add_generation_prompt".into(),
            Value::Bool(options.add_generation_prompt),
        );
        context.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        context.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        template
            .render(minijinja::Value::from(Serde(&context)))
            .map_err(|e| render_error(e.detail().map_or_else(|| e.to_string(), str::to_string)))
    }
}

/// Tool calls' `arguments` given as a JSON object's text (OpenAI's form) become the object, as
/// vLLM passes them: templates `tojson` the arguments or iterate over them.
fn arguments_as_objects(messages: &mut Value) {
    let calls = (messages.as_array_mut().into_iter().flatten())
        .filter_map(|m| m.get_mut("tool_calls")?.as_array_mut())
        .flatten();
    for call in calls {
        let Some(args) = call
            .get_mut("function")
            .and_then(|f| f.get_mut("arguments"))
        else {
            continue;
        };
        if let Some(object) = (args.as_str())
            .and_then(|s| serde_json::from_str::<Value>(s).ok())
            .filter(Value::is_object)
        {
            *args = object;
        }
    }
}

fn read(path: &Path) -> Result<String, ChatTemplateError> {
    std::fs::read_to_string(path).map_err(|source| ChatTemplateError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// `tokenizer_config.json` as an object; empty when there is no such file.
fn read_config(path: &Path) -> Result<Map<String, Value>, ChatTemplateError> {
    if !path.exists() {
        return Ok(Map::new());
    }
    serde_json::from_str(&read(path)?).map_err(|e| ChatTemplateError::Config {
        path: path.to_path_buf(),
        problem: format!("not a JSON object: {e}"),
    })
}

/// `chat_template` of `tokenizer_config.json`: a string, or a list of named templates.
fn template_of(value: &Value, path: &Path) -> Result<String, ChatTemplateError> {
    let problem = |problem: &str| ChatTemplateError::Config {
        path: path.to_path_buf(),
        problem: problem.into(),
    };
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Array(list) => list
            .iter()
            .find_map(|t| {
                (t.get("name")?.as_str()? == "default")
                    .then(|| t.get("template")?.as_str().map(str::to_string))
                    .flatten()
            })
            .ok_or_else(|| problem("`chat_template` has no template named `default`")),
        _ => Err(problem("`chat_template` is neither a string nor a list")),
    }
}

/// A special token's text: `key` of `tokenizer_config.json` as a string or `{"content": ...}`;
/// "" when absent.
fn special_token(
    config: &Map<String, Value>,
    key: &str,
    path: &Path,
) -> Result<String, ChatTemplateError> {
    let problem = |problem: String| ChatTemplateError::Config {
        path: path.to_path_buf(),
        problem,
    };
    match config.get(key) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(problem(format!("`{key}.content` is not a string"))),
        },
        Some(_) => Err(problem(format!(
            "`{key}` is neither a string nor an object"
        ))),
    }
}

#[cfg(test)]
mod tests;
