//! Reading a chat model's answer apart: its reasoning (`<think>...</think>`), its content, and
//! its tool calls, in the two formats Qwen models write:
//! - [`ToolCallFormat::Json`] (Qwen3, Hermes style):
//!   `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`;
//! - [`ToolCallFormat::Xml`] (Qwen3.5, Qwen3-Coder): `<tool_call>\n<function=f>\n<parameter=p>\n
//!   value\n</parameter>\n</function>\n</tool_call>`, each value typed by the function's
//!   declared parameter schema (a string stays a string; numbers, booleans, objects and arrays
//!   are read as JSON where they parse).
//!
//! [`OutputParser`] takes the answer as it streams, in pieces cut anywhere (inside a marker or a
//! UTF-8 character's bytes never reach it: it takes `&str`), and gives [`OutputEvent`]s. No
//! markup reaches the content or the reasoning: text that may be the start of a marker is held
//! back until the next piece decides it. A tool call starts once its head names the function
//! ([`OutputEvent::ToolCallStart`]), and its arguments follow as they are written, in fragments
//! whose concatenation is the arguments' text ([`OutputEvent::ToolCallArguments`]; `call.rs`
//! says how each format is read), so the events of any split of an answer, merged, are the
//! events of the whole answer.
//!
//! A tool call inside a think block the model never closed still counts (the reasoning ends
//! there). A call body that never names its function (or, in the JSON format, does not parse
//! once closed), or that the answer leaves open before it does, is given back as content,
//! markers included, so nothing the model wrote is lost.

mod call;

use call::{CallCtx, CallState};
use serde_json::Value;

/// How the model writes a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolCallFormat {
    /// `{"name": ..., "arguments": {...}}` between the markers (Qwen3).
    Json,
    /// `<function=NAME><parameter=P>value</parameter>...</function>` between the markers
    /// (Qwen3.5, Qwen3-Coder).
    Xml,
}

impl ToolCallFormat {
    /// The format a chat template teaches its model, from the template's text: the XML form
    /// where it writes `<function=`, the JSON form where it writes `<tool_call>` alone; `None`
    /// for a template without tool calls.
    pub fn of_template(source: &str) -> Option<ToolCallFormat> {
        if source.contains("<function=") {
            Some(ToolCallFormat::Xml)
        } else if source.contains(CALL_OPEN) {
            Some(ToolCallFormat::Json)
        } else {
            None
        }
    }
}

/// A function the request declares: its name and its parameters' JSON schema.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    /// The function's name.
    pub name: String,
    /// Its `parameters` schema (`{"type": "object", "properties": {...}}`), or `Null`.
    pub parameters: Value,
}

/// One piece of a parsed answer.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputEvent {
    /// Text of the reasoning (inside the think block).
    Reasoning(String),
    /// Text of the answer proper.
    Content(String),
    /// A tool call starts: its position among the answer's calls and the function's name.
    ToolCallStart {
        /// 0 for the answer's first call, then 1, ...
        index: usize,
        /// The function.
        name: String,
    },
    /// The next fragment of call `index`'s arguments (a JSON object's text, whole once every
    /// fragment is in).
    ToolCallArguments {
        /// The call.
        index: usize,
        /// The text.
        arguments: String,
    },
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// Where the parser is in the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before anything but whitespace: a `<think>` here opens the reasoning.
    Start,
    Reasoning,
    Content,
    /// Inside `<tool_call>`; the body not yet read is in the buffer.
    Call,
}

/// Splits a streamed answer into reasoning, content and tool calls.
#[derive(Debug, Clone)]
pub struct OutputParser {
    format: ToolCallFormat,
    tools: Vec<ToolSpec>,
    state: State,
    /// Text not yet given: a possible marker's start, or a tool call's body.
    pending: String,
    calls: usize,
    /// The reading of the open call's body.
    call: CallState,
    /// Tool calls are read (else `<tool_call>` is content like any text).
    read_calls: bool,
    /// Think blocks are read (else the answer is all content).
    read_reasoning: bool,
}

impl OutputParser {
    /// A parser for answers in `format`, calling `tools`. `in_reasoning`: the prompt already
    /// opened the think block (templates that end the generation prompt with `<think>\n`), so
    /// the answer starts inside it.
    pub fn new(format: ToolCallFormat, tools: Vec<ToolSpec>, in_reasoning: bool) -> OutputParser {
        OutputParser {
            format,
            tools,
            state: if in_reasoning {
                State::Reasoning
            } else {
                State::Start
            },
            pending: String::new(),
            calls: 0,
            call: CallState::Head,
            read_calls: true,
            read_reasoning: true,
        }
    }

    /// Read tool calls (default) or leave them in the content.
    pub fn tool_calls(mut self, on: bool) -> Self {
        self.read_calls = on;
        self
    }

    /// Read a leading think block as reasoning (default) or leave it in the content.
    pub fn reasoning(mut self, on: bool) -> Self {
        self.read_reasoning = on;
        if !on && self.state == State::Start {
            self.state = State::Content;
        }
        self
    }

    /// Take the next piece of the answer; the events it completes.
    pub fn push(&mut self, piece: &str) -> Vec<OutputEvent> {
        self.pending.push_str(piece);
        let mut events = Vec::new();
        while self.step(&mut events, false) {}
        events
    }

    /// The answer has ended: give what is held back (an unclosed call as content).
    pub fn finish(&mut self) -> Vec<OutputEvent> {
        let mut events = Vec::new();
        while self.step(&mut events, true) {}
        events
    }

    /// One move over `pending`; false when it needs more text (or, at the end, has none left).
    fn step(&mut self, events: &mut Vec<OutputEvent>, end: bool) -> bool {
        match self.state {
            State::Start => {
                let rest = self.pending.trim_start();
                if rest.starts_with(THINK_OPEN) {
                    let cut = self.pending.len() - rest.len() + THINK_OPEN.len();
                    self.pending.drain(..cut);
                    self.state = State::Reasoning;
                    true
                } else if !end && THINK_OPEN.starts_with(rest) {
                    // Only whitespace, or the start of `<think>`, so far.
                    false
                } else {
                    self.state = State::Content;
                    true
                }
            }
            State::Reasoning => {
                let markers: &[&str] = if self.read_calls {
                    &[THINK_CLOSE, CALL_OPEN]
                } else {
                    &[THINK_CLOSE]
                };
                self.text_until(events, end, markers, OutputEvent::Reasoning)
            }
            State::Content => {
                let markers: &[&str] = if self.read_calls { &[CALL_OPEN] } else { &[] };
                self.text_until(events, end, markers, OutputEvent::Content)
            }
            State::Call => self.call_step(events, end),
        }
    }

    /// Read what is certain of the open call's body: all of it up to `</tool_call>`, or, before
    /// that marker comes, all but a tail that may start it. At the marker (or the answer's end)
    /// the call ends, or its text goes back to the content when it never was a call.
    fn call_step(&mut self, events: &mut Vec<OutputEvent>, end: bool) -> bool {
        let close = self.pending.find(CALL_CLOSE);
        let complete = close.is_some() || end;
        let certain = match close {
            Some(at) => at,
            None if end => self.pending.len(),
            None => self.pending.len() - held_tail(&self.pending, &[CALL_CLOSE]),
        };
        let ctx = CallCtx {
            format: self.format,
            tools: &self.tools,
            index: self.calls,
        };
        let read = self
            .call
            .read(&self.pending[..certain], complete, &ctx, events);
        if !complete {
            if let Some(used) = read {
                self.pending.drain(..used);
            }
            return false;
        }
        let marker = if close.is_some() { CALL_CLOSE } else { "" };
        if read.is_none() {
            let body = &self.pending[..certain];
            let text = format!("{CALL_OPEN}{body}{marker}");
            push_text(events, text, OutputEvent::Content);
        } else {
            self.calls += 1;
        }
        self.pending.drain(..certain + marker.len());
        self.call = CallState::Head;
        self.state = State::Content;
        close.is_some()
    }

    /// Give `pending`'s text up to the first of `markers` as `kind`, holding back a tail that
    /// may begin one; at a marker, move on: the reasoning's end to content, a call's start to
    /// the call.
    fn text_until(
        &mut self,
        events: &mut Vec<OutputEvent>,
        end: bool,
        markers: &[&str],
        kind: fn(String) -> OutputEvent,
    ) -> bool {
        let found = (markers.iter())
            .filter_map(|m| self.pending.find(m).map(|at| (at, *m)))
            .min();
        if let Some((at, marker)) = found {
            let text: String = self.pending.drain(..at).collect();
            push_text(events, text, kind);
            self.pending.drain(..marker.len());
            self.state = if marker == CALL_OPEN {
                State::Call
            } else {
                State::Content
            };
            return true;
        }
        let keep = if end {
            0
        } else {
            held_tail(&self.pending, markers)
        };
        let text: String = self.pending.drain(..self.pending.len() - keep).collect();
        push_text(events, text, kind);
        false
    }
}

/// Append non-empty `text` as `kind`, merged into the last event when that is of the same kind.
fn push_text(events: &mut Vec<OutputEvent>, text: String, kind: fn(String) -> OutputEvent) {
    if text.is_empty() {
        return;
    }
    match (events.last_mut(), kind(text)) {
        (Some(OutputEvent::Reasoning(a)), OutputEvent::Reasoning(b))
        | (Some(OutputEvent::Content(a)), OutputEvent::Content(b)) => a.push_str(&b),
        (_, event) => events.push(event),
    }
}

/// The length of the longest tail of `text` that is a proper start of one of `markers`.
fn held_tail(text: &str, markers: &[&str]) -> usize {
    let longest = markers.iter().map(|m| m.len()).max().unwrap_or(0);
    (1..=text.len().min(longest.saturating_sub(1)))
        .rev()
        .filter(|&n| text.is_char_boundary(text.len() - n))
        .find(|&n| {
            let tail = &text[text.len() - n..];
            markers.iter().any(|m| m.len() > n && m.starts_with(tail))
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;
