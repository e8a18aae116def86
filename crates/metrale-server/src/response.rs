//! The OpenAI response shapes: a whole `text_completion` or `chat.completion`, and the chunks
//! of a stream (`Envelope` around the choices), each choice with its `index`, and `Usage`;
//! and the whole responses built from a request's output, one choice per choice it returned
//! (the usage counts the prompt once and the tokens of every choice).

use metrale::chat::{ChatOutput, ToolCall};
use metrale::{Engine, GenerateOutput};
use serde::Serialize;
use serde_json::Value;

use super::logprobs;

/// Where a response goes and what it asked for, besides the output.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    /// `cmpl-N` or `chatcmpl-N`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// The request asked for logprobs.
    pub logprobs: bool,
}

/// A whole `text_completion`: every choice of `output`, in index order.
pub fn completion(
    engine: &Engine,
    head: ResponseHead,
    output: GenerateOutput,
) -> Envelope<CompletionChoice> {
    let usage = Usage::new(output.prompt_ids.len(), output.completion_tokens());
    let choices = (output.into_choices().into_iter())
        .map(|o| CompletionChoice {
            index: o.index,
            logprobs: (o.logprobs.as_deref())
                .filter(|_| head.logprobs)
                .map(|l| logprobs::completion(engine, l, 0)),
            finish_reason: Some(o.finish_reason.as_str()),
            text: o.text.unwrap_or_default(),
            token_ids: o.token_ids,
        })
        .collect();
    Envelope {
        id: head.id,
        object: "text_completion",
        created: head.created,
        model: head.model,
        choices,
        usage: Some(usage),
    }
}

/// The usage of a chat answer: its prompt once, the tokens of every choice.
pub fn chat_usage(out: &ChatOutput) -> Usage {
    let tokens = out.output.token_ids.len()
        + (out.other_choices.iter())
            .map(|c| c.output.token_ids.len())
            .sum::<usize>();
    Usage::new(out.output.prompt_ids.len(), tokens)
}

/// A whole `chat.completion`: every choice of `out`, each read apart, in index order.
pub fn chat(engine: &Engine, head: ResponseHead, out: ChatOutput) -> Envelope<ChatChoice> {
    let usage = chat_usage(&out);
    let choices = (out.into_choices().into_iter())
        .map(|c| {
            let tool_calls: Vec<ToolCallOut> = c.tool_calls.iter().map(call_out).collect();
            let content =
                (tool_calls.is_empty() || !c.content.trim().is_empty()).then(|| c.content.clone());
            ChatChoice {
                index: c.index(),
                logprobs: (c.output.logprobs.as_deref())
                    .filter(|_| head.logprobs)
                    .map(|l| logprobs::chat(engine, l)),
                finish_reason: c.finish_reason(),
                message: ChatMessageOut {
                    role: "assistant",
                    content,
                    reasoning_content: c.reasoning,
                    tool_calls,
                },
                token_ids: c.output.token_ids,
            }
        })
        .collect();
    Envelope {
        id: head.id,
        object: "chat.completion",
        created: head.created,
        model: head.model,
        choices,
        usage: Some(usage),
    }
}

/// A whole tool call in a response.
pub fn call_out(c: &ToolCall) -> ToolCallOut {
    ToolCallOut {
        index: None,
        id: Some(c.id.clone()),
        kind: Some("function"),
        function: FunctionOut {
            name: Some(c.name.clone()),
            arguments: c.arguments.clone(),
        },
    }
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Prompt tokens (once, however many choices share the prompt).
    pub prompt_tokens: usize,
    /// Generated tokens, over every choice returned.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// From the two counts.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// One choice of a `text_completion` (or one chunk of it when streaming).
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    /// The choice's index (0 to n - 1).
    pub index: usize,
    /// The text (a delta when streaming).
    pub text: String,
    /// The tokens' logprobs (the legacy shape), when asked for.
    pub logprobs: Option<Value>,
    /// "stop" or "length"; null in a chunk before the last.
    pub finish_reason: Option<&'static str>,
    /// The generated token ids (the chunk's, when streaming).
    pub token_ids: Vec<u32>,
}

/// A chat message in a response.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessageOut {
    /// "assistant".
    pub role: &'static str,
    /// The answer's text; null when the answer is tool calls alone.
    pub content: Option<String>,
    /// The reasoning, when the answer had some.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The calls, when the answer made some.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// A tool call in a response, or its first chunk in a stream.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallOut {
    /// Its position among the answer's calls (in streamed chunks only, as OpenAI has it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// `call_...`; absent from a stream's later chunks of the call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// "function"; absent from a stream's later chunks of the call.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The function and (a piece of) its arguments, a JSON object's text.
    pub function: FunctionOut,
}

/// A call's function.
#[derive(Debug, Clone, Serialize)]
pub struct FunctionOut {
    /// The function's name; absent from a stream's later chunks of the call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The arguments (a fragment in a stream).
    pub arguments: String,
}

/// One choice of a `chat.completion`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// The choice's index (0 to n - 1).
    pub index: usize,
    /// The reply.
    pub message: ChatMessageOut,
    /// `{content: [...]}`, when asked for.
    pub logprobs: Option<Value>,
    /// "stop", "length" or "tool_calls".
    pub finish_reason: &'static str,
    /// The generated token ids.
    pub token_ids: Vec<u32>,
}

/// A chunk's `delta`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    /// "assistant" in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// Text added.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Reasoning added.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// A call's first chunk (index, id, type, name, empty arguments) or a later one (index,
    /// arguments).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// One choice of a `chat.completion.chunk`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    /// The choice's index (0 to n - 1).
    pub index: usize,
    /// What this chunk adds.
    pub delta: ChatDelta,
    /// The chunk's tokens' logprobs, when asked for.
    pub logprobs: Option<Value>,
    /// Set in the last chunk.
    pub finish_reason: Option<&'static str>,
    /// The chunk's token ids.
    pub token_ids: Vec<u32>,
}

/// A whole response or one streamed chunk: `id`, `object`, `created`, `model`, `choices`, and
/// `usage` where there is one.
#[derive(Debug, Clone, Serialize)]
pub struct Envelope<C> {
    /// `cmpl-N` or `chatcmpl-N`.
    pub id: String,
    /// `text_completion`, `chat.completion` or `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// The choices (empty in a usage-only chunk).
    pub choices: Vec<C>,
    /// Token counts: in a whole response, and in the usage chunk of a stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}
