//! `ChatRequest`: a conversation with the tools it may call; `ChatOutput` and `ChatEvent`: the
//! answer read apart into reasoning, content and `ToolCall`s, whole or as it streams.
//!
//! [`Engine::submit_chat`](crate::Engine::submit_chat) renders the messages and tools through
//! the checkpoint's chat template (tools as `[{"type": "function", "function": {name,
//! description, parameters}}]`, as transformers and vLLM pass them), generates with the
//! request's [`GenerateRequest`] settings, and parses the answer with an [`OutputParser`] in the
//! checkpoint's tool-call format. `ToolChoice::Required` and `ToolChoice::Function` constrain
//! the answer to calls of the declared functions (see `grammar`).

use serde_json::{Map, Value, json};

use super::message::{ChatMessage, ChatOptions};
use super::output::{OutputEvent, OutputParser, ToolCallFormat, ToolSpec};
use crate::request::{GenerateOutput, GenerateRequest};
use metrale_model_engine::generate::FinishReason;

/// A function the model may call. Build with [`Tool::function`] and the setters.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Tool {
    /// The function's name.
    pub name: String,
    /// What it does, for the model. Default none.
    pub description: Option<String>,
    /// Its parameters' JSON schema (`{"type": "object", "properties": {...}}`). Default
    /// `{"type": "object", "properties": {}}`.
    pub parameters: Value,
}

impl Tool {
    /// A function `name` taking no parameters; set them with [`Tool::parameters`].
    pub fn function(name: impl Into<String>) -> Tool {
        Tool {
            name: name.into(),
            description: None,
            parameters: json!({"type": "object", "properties": {}}),
        }
    }

    /// Set `description`.
    pub fn description(mut self, d: impl Into<String>) -> Self {
        self.description = Some(d.into());
        self
    }

    /// Set `parameters`.
    pub fn parameters(mut self, schema: Value) -> Self {
        self.parameters = schema;
        self
    }

    /// The tool as a chat template reads it (OpenAI's function tool).
    pub fn to_template_value(&self) -> Value {
        let mut f = Map::new();
        f.insert("name".into(), Value::String(self.name.clone()));
        if let Some(d) = &self.description {
            f.insert("description".into(), Value::String(d.clone()));
        }
        f.insert("parameters".into(), self.parameters.clone());
        json!({"type": "function", "function": f})
    }
}

/// Whether and which tools the model must call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolChoice {
    /// The model decides (tools rendered, calls parsed). The default.
    #[default]
    Auto,
    /// No calls: the tools are not rendered and the answer is not searched for calls.
    None,
    /// At least one call of a declared function (the answer is constrained to calls).
    Required,
    /// Exactly one call of this function (the answer is constrained to it).
    Function(String),
}

/// How the answer's tool calls are read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolCallParser {
    /// The format the checkpoint's chat template teaches ([`ToolCallFormat::of_template`]);
    /// none when it teaches none. The default.
    #[default]
    Auto,
    /// `<tool_call>{json}</tool_call>` (Qwen3).
    Qwen3Json,
    /// `<tool_call><function=...>` (Qwen3.5, Qwen3-Coder).
    Qwen3Xml,
    /// Calls are not parsed: they stay in the content.
    None,
}

/// How the answer's reasoning is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReasoningParser {
    /// `<think>...</think>` where the template writes think blocks (its text names
    /// `<think>`), none otherwise. The default.
    #[default]
    Auto,
    /// `<think>...</think>` (Qwen3, Qwen3.5).
    Qwen3,
    /// No reasoning is split off: its text stays in the content.
    None,
}

/// A chat request: messages, tools, how to render and read them, and how to generate. Build
/// with [`ChatRequest::new`] and the setters:
///
/// ```
/// use metrale::chat::{ChatMessage, ChatRequest, Tool, ToolChoice};
///
/// let weather = Tool::function("get_weather").parameters(serde_json::json!({
///     "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]
/// }));
/// let request = ChatRequest::new(vec![ChatMessage::user("Weather in Paris?")])
///     .tools(vec![weather])
///     .tool_choice(ToolChoice::Required);
/// assert_eq!(request.tools.len(), 1);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ChatRequest {
    /// The conversation (assistant `tool_calls` with `arguments` as a JSON string or object,
    /// `tool` results).
    pub messages: Vec<ChatMessage>,
    /// Functions the model may call. Default none.
    pub tools: Vec<Tool>,
    /// Default [`ToolChoice::Auto`].
    pub tool_choice: ToolChoice,
    /// With a required or named choice, allow several calls in one answer. Default true.
    pub parallel_tool_calls: bool,
    /// Template variables (`enable_thinking`, ...). Default none.
    pub options: ChatOptions,
    /// Generation: `max_new_tokens`, sampling, stops, and a `constraint` for the answer's text
    /// (a response format); its prompt is replaced by the rendered conversation. Default
    /// `GenerateRequest::new("")` with `max_new_tokens` 16.
    pub generation: GenerateRequest,
    /// Default [`ToolCallParser::Auto`].
    pub tool_call_parser: ToolCallParser,
    /// Default [`ReasoningParser::Auto`].
    pub reasoning_parser: ReasoningParser,
}

impl ChatRequest {
    /// A request for `messages`, every other field at its default.
    pub fn new(messages: Vec<ChatMessage>) -> ChatRequest {
        ChatRequest {
            messages,
            tools: Vec::new(),
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: true,
            options: ChatOptions::default(),
            generation: GenerateRequest::new(""),
            tool_call_parser: ToolCallParser::Auto,
            reasoning_parser: ReasoningParser::Auto,
        }
    }

    /// Set `tools`.
    pub fn tools(mut self, tools: Vec<Tool>) -> Self {
        self.tools = tools;
        self
    }

    /// Set `tool_choice`.
    pub fn tool_choice(mut self, choice: ToolChoice) -> Self {
        self.tool_choice = choice;
        self
    }

    /// Set `parallel_tool_calls`.
    pub fn parallel_tool_calls(mut self, on: bool) -> Self {
        self.parallel_tool_calls = on;
        self
    }

    /// Set `options`.
    pub fn options(mut self, options: ChatOptions) -> Self {
        self.options = options;
        self
    }

    /// Set `generation`.
    pub fn generation(mut self, generation: GenerateRequest) -> Self {
        self.generation = generation;
        self
    }

    /// Set `tool_call_parser`.
    pub fn tool_call_parser(mut self, parser: ToolCallParser) -> Self {
        self.tool_call_parser = parser;
        self
    }

    /// Set `reasoning_parser`.
    pub fn reasoning_parser(mut self, parser: ReasoningParser) -> Self {
        self.reasoning_parser = parser;
        self
    }
}

/// A tool call the model made.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ToolCall {
    /// Its position among the answer's calls.
    pub index: usize,
    /// `call_` and 24 random letters and digits.
    pub id: String,
    /// The function.
    pub name: String,
    /// Its arguments, a JSON object's text.
    pub arguments: String,
}

/// A chat answer read apart.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ChatOutput {
    /// The reasoning (the think block's text); `None` when there was none.
    pub reasoning: Option<String>,
    /// The answer's text without reasoning or calls.
    pub content: String,
    /// The calls, in order.
    pub tool_calls: Vec<ToolCall>,
    /// The generation underneath: tokens, raw text, finish reason (this choice's; its
    /// `other_choices` are read apart in this output's `other_choices`).
    pub output: GenerateOutput,
    /// Choices `1..n` of a request of `n` choices, each read apart, in index order; empty for
    /// one choice.
    pub other_choices: Vec<ChatOutput>,
}

impl ChatOutput {
    /// OpenAI's finish reason: `tool_calls` when calls were made and generation stopped by
    /// itself, else the generation's (`stop`, `length`, `cancelled`).
    pub fn finish_reason(&self) -> &'static str {
        openai_finish_reason(self.output.finish_reason, !self.tool_calls.is_empty())
    }

    /// Which choice this is (see [`GenerateOutput::index`]).
    pub fn index(&self) -> usize {
        self.output.index
    }

    /// Every choice in index order: this one, then `other_choices`.
    pub fn into_choices(mut self) -> Vec<ChatOutput> {
        let others = std::mem::take(&mut self.other_choices);
        std::iter::once(self).chain(others).collect()
    }
}

/// `tool_calls` for a generation that stopped by itself after making calls, else the reason's
/// own name.
fn openai_finish_reason(reason: FinishReason, made_calls: bool) -> &'static str {
    if made_calls && reason == FinishReason::Stop {
        "tool_calls"
    } else {
        reason.as_str()
    }
}

/// What one generated token adds to the answer, read apart.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct ChatDelta {
    /// The choice it belongs to (0 for a request of one choice).
    pub choice: usize,
    /// The token; `None` for what the end of the answer releases.
    pub token_id: Option<u32>,
    /// The token's logprobs, when the sampling parameters ask for them.
    pub logprobs: Option<crate::TokenLogprobs>,
    /// Reasoning text added.
    pub reasoning: String,
    /// Content text added.
    pub content: String,
    /// What this token adds to tool calls: a call's start (its id and name) and fragments of
    /// its arguments; at most one entry a call.
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A piece of a streamed tool call, in OpenAI's delta shape: the first piece of a call carries
/// its id and name (and arguments, possibly empty), later ones only arguments. A call's
/// arguments are the concatenation of its pieces' `arguments`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ToolCallDelta {
    /// The call's position among the answer's calls.
    pub index: usize,
    /// `call_` and 24 random letters and digits, on the call's first piece.
    pub id: Option<String>,
    /// The function, on the call's first piece.
    pub name: Option<String>,
    /// The next fragment of the arguments' text.
    pub arguments: String,
}

/// What a chat handle yields: deltas in order, then `Finished` once.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ChatEvent {
    /// A token, and what it adds.
    Delta(ChatDelta),
    /// A choice of a request of several ended (all its deltas have been sent).
    ChoiceFinished {
        /// The choice.
        choice: usize,
        /// OpenAI's finish reason, as [`ChatOutput::finish_reason`] gives it.
        finish_reason: &'static str,
    },
    /// The answer is complete (the last event).
    Finished {
        /// All of it.
        output: ChatOutput,
    },
}

/// The answer's reader (one choice's): an [`OutputParser`] and what it has gathered.
#[derive(Debug, Clone)]
pub(crate) struct AnswerReader {
    parser: OutputParser,
    reasoning: Option<String>,
    content: String,
    calls: Vec<ToolCall>,
    ids: u64,
    in_reasoning: bool,
    choice: usize,
}

impl AnswerReader {
    /// A reader for answers after `prompt`, parsed as `request` says under a template whose
    /// source is `template`.
    pub fn new(request: &ChatRequest, template: &str, prompt: &str) -> AnswerReader {
        let format = tool_format(request, template);
        let reasoning = match request.reasoning_parser {
            ReasoningParser::Auto => template.contains("<think>"),
            ReasoningParser::Qwen3 => true,
            _ => false,
        };
        let tools = (request.tools.iter())
            .map(|t| ToolSpec {
                name: t.name.clone(),
                parameters: t.parameters.clone(),
            })
            .collect();
        let in_reasoning = reasoning && prompt.trim_end().ends_with("<think>");
        let parser = OutputParser::new(format.unwrap_or(ToolCallFormat::Json), tools, in_reasoning)
            .tool_calls(format.is_some())
            .reasoning(reasoning);
        AnswerReader {
            parser,
            reasoning: None,
            content: String::new(),
            calls: Vec::new(),
            ids: seed_of(prompt),
            in_reasoning,
            choice: 0,
        }
    }

    /// A copy of this fresh reader for choice `c`, whose call ids are its own.
    pub fn for_choice(&self, c: usize) -> AnswerReader {
        let mut reader = self.clone();
        reader.choice = c;
        reader.ids = self.ids ^ (c as u64).wrapping_mul(0xA076_1D64_78BD_642F);
        reader
    }

    /// OpenAI's finish reason of this choice's answer, which ended for `reason`.
    pub fn finish_reason(&self, reason: FinishReason) -> &'static str {
        openai_finish_reason(reason, !self.calls.is_empty())
    }

    /// The prompt opened a think block the answer starts in.
    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    /// Read a token's text delta; at the end (`token_id` `None`), what the parser held back.
    pub fn read(&mut self, token_id: Option<u32>, text: &str) -> ChatDelta {
        let events = match token_id {
            Some(_) => self.parser.push(text),
            None => self.parser.finish(),
        };
        let mut delta = ChatDelta {
            choice: self.choice,
            token_id,
            ..ChatDelta::default()
        };
        for e in events {
            match e {
                OutputEvent::Reasoning(t) => {
                    self.reasoning.get_or_insert_with(String::new).push_str(&t);
                    delta.reasoning.push_str(&t);
                }
                OutputEvent::Content(t) => {
                    self.content.push_str(&t);
                    delta.content.push_str(&t);
                }
                OutputEvent::ToolCallStart { index, name } => {
                    let call = ToolCall {
                        index,
                        id: self.call_id(),
                        name,
                        arguments: String::new(),
                    };
                    delta.tool_calls.push(ToolCallDelta {
                        index,
                        id: Some(call.id.clone()),
                        name: Some(call.name.clone()),
                        arguments: String::new(),
                    });
                    self.calls.push(call);
                }
                OutputEvent::ToolCallArguments { index, arguments } => {
                    if let Some(call) = self.calls.iter_mut().rfind(|c| c.index == index) {
                        call.arguments.push_str(&arguments);
                    }
                    match delta.tool_calls.last_mut() {
                        Some(d) if d.index == index => d.arguments.push_str(&arguments),
                        _ => delta.tool_calls.push(ToolCallDelta {
                            index,
                            arguments,
                            ..ToolCallDelta::default()
                        }),
                    }
                }
            }
        }
        delta
    }

    /// The whole answer, with the generation underneath.
    pub fn output(self, output: GenerateOutput) -> ChatOutput {
        ChatOutput {
            reasoning: self.reasoning,
            content: self.content,
            tool_calls: self.calls,
            output,
            other_choices: Vec::new(),
        }
    }

    /// `call_` and 24 letters and digits from a SplitMix64 stream seeded by the prompt through
    /// the process's randomly keyed hasher, so ids differ between calls, requests and runs.
    fn call_id(&mut self) -> String {
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        let mut id = String::from("call_");
        for _ in 0..24 {
            self.ids = self.ids.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.ids;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            id.push(ALPHABET[(z % ALPHABET.len() as u64) as usize] as char);
        }
        id
    }
}

/// The tool-call format a request's answer is read in; `None`: calls are not parsed.
pub(crate) fn tool_format(request: &ChatRequest, template: &str) -> Option<ToolCallFormat> {
    if request.tool_choice == ToolChoice::None || request.tools.is_empty() {
        return None;
    }
    match request.tool_call_parser {
        ToolCallParser::Auto => ToolCallFormat::of_template(template),
        ToolCallParser::Qwen3Json => Some(ToolCallFormat::Json),
        ToolCallParser::Qwen3Xml => Some(ToolCallFormat::Xml),
        _ => None,
    }
}

fn seed_of(prompt: &str) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write(prompt.as_bytes());
    h.finish()
}
