//! One tool call's body as it streams (the text between `<tool_call>` and `</tool_call>`): its
//! head, once it names the function, starts the call; its arguments follow as fragments.
//! - JSON (`{"name": "f", "arguments": {...}}`): once the text up to the arguments object's `{`
//!   is read, the call starts, and the object's text streams as the model wrote it, up to its
//!   matching `}` (strings and escapes followed, so braces inside strings do not count). The
//!   rest of the body is not read. A body of another shape (arguments as a JSON string, no
//!   arguments, the name after them) waits for `</tool_call>` and is parsed whole; the
//!   arguments are then one fragment, the object re-serialized.
//! - XML (`<function=f><parameter=p>value</parameter>...</function>`): the call starts at
//!   `<function=f>`; each parameter gives `{"p":value` (then `,"p":value`), typed by the declared
//!   schema, and `</function>` (or the body's end, or text that is no parameter) gives the
//!   closing `}`, so the arguments are always a JSON object.
//!
//! Every decision is taken on text known to be in the body (the caller holds back a possible
//! start of `</tool_call>`), so the fragments of any split of an answer concatenate to those of
//! the whole answer. A call that has started stays a call; its arguments are what the model
//! wrote, even when the answer ends inside them (as OpenAI's, they may then not parse).

use serde_json::{Map, Value};

use super::{OutputEvent, ToolCallFormat, ToolSpec};

/// Where the reading of a call's body is.
#[derive(Debug, Clone, Default)]
pub(super) enum CallState {
    /// The call has not started: its head is not complete yet.
    #[default]
    Head,
    /// The body has no streamable head: it is parsed whole at its end.
    Whole,
    /// The JSON arguments object is streaming.
    JsonArguments(JsonScan),
    /// The XML parameters of a call of `function` are being read; `given` of them so far.
    XmlParameters { function: String, given: usize },
    /// The arguments are complete; the rest of the body is not read.
    Skip,
}

/// What the parser knows of the call: its format, the declared tools, the call's index.
pub(super) struct CallCtx<'a> {
    pub format: ToolCallFormat,
    pub tools: &'a [ToolSpec],
    pub index: usize,
}

impl CallState {
    /// Read `body`, text known to be in the call's body from where the last read stopped
    /// (all the rest of it when `complete`): the bytes used, or `None` when the body, complete,
    /// is no call (its text goes back to the content).
    pub fn read(
        &mut self,
        body: &str,
        complete: bool,
        ctx: &CallCtx<'_>,
        events: &mut Vec<OutputEvent>,
    ) -> Option<usize> {
        let mut used = 0;
        loop {
            let rest = &body[used..];
            match self {
                CallState::Head => {
                    let head = match ctx.format {
                        ToolCallFormat::Json => json_head(rest),
                        ToolCallFormat::Xml => xml_head(rest),
                    };
                    match head {
                        Head::Call { name, at } => {
                            *self = match ctx.format {
                                ToolCallFormat::Json => {
                                    CallState::JsonArguments(JsonScan::default())
                                }
                                ToolCallFormat::Xml => CallState::XmlParameters {
                                    function: name.clone(),
                                    given: 0,
                                },
                            };
                            events.push(OutputEvent::ToolCallStart {
                                index: ctx.index,
                                name,
                            });
                            used += at;
                        }
                        Head::More if !complete => return Some(used),
                        Head::More | Head::No => *self = CallState::Whole,
                    }
                }
                CallState::Whole => {
                    if !complete {
                        return Some(used);
                    }
                    let (name, arguments) = parse_whole(ctx.format, rest)?;
                    events.push(OutputEvent::ToolCallStart {
                        index: ctx.index,
                        name,
                    });
                    push_fragment(events, ctx.index, arguments);
                    *self = CallState::Skip;
                }
                CallState::JsonArguments(scan) => {
                    let (n, done) = scan.feed(rest);
                    push_fragment(events, ctx.index, rest[..n].to_string());
                    used += n;
                    if !done {
                        return Some(used);
                    }
                    *self = CallState::Skip;
                }
                CallState::XmlParameters { function, given } => {
                    let (n, closed) =
                        xml_parameters(rest, complete, (function, given), ctx, events);
                    used += n;
                    if !closed {
                        return Some(used);
                    }
                    *self = CallState::Skip;
                }
                CallState::Skip => return Some(body.len()),
            }
        }
    }
}

/// Append `text` to the call's arguments: merged into the last event when that is a fragment
/// of the same call.
fn push_fragment(events: &mut Vec<OutputEvent>, index: usize, text: String) {
    if text.is_empty() {
        return;
    }
    match events.last_mut() {
        Some(OutputEvent::ToolCallArguments {
            index: i,
            arguments,
        }) if *i == index => arguments.push_str(&text),
        _ => events.push(OutputEvent::ToolCallArguments {
            index,
            arguments: text,
        }),
    }
}

/// What the start of a body says.
enum Head {
    /// The call of `name`; its arguments start at byte `at`.
    Call { name: String, at: usize },
    /// It may still become a call head.
    More,
    /// It cannot.
    No,
}

/// The JSON head `{"name": "<name>", "arguments": ` up to the `{` of the arguments object.
fn json_head(body: &str) -> Head {
    const PARTS: [&str; 8] = ["{", "\"name\"", ":", "", ",", "\"arguments\"", ":", "{"];
    let (mut at, mut name) = (0, String::new());
    for (k, part) in PARTS.iter().enumerate() {
        at += body[at..].len() - body[at..].trim_start_matches(is_json_space).len();
        let rest = &body[at..];
        if rest.is_empty() {
            return Head::More;
        }
        if part.is_empty() {
            match json_string(rest) {
                Some(Some((s, n))) => {
                    name = s;
                    at += n;
                }
                Some(None) => return Head::No,
                None => return Head::More,
            }
        } else if rest.starts_with(part) {
            if k == PARTS.len() - 1 {
                return Head::Call { name, at };
            }
            at += part.len();
        } else if part.starts_with(rest) {
            return Head::More;
        } else {
            return Head::No;
        }
    }
    Head::No
}

fn is_json_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
}

/// The JSON string literal `text` starts with, decoded, and its length; `Some(None)` when it
/// is none; `None` when it is not closed yet.
fn json_string(text: &str) -> Option<Option<(String, usize)>> {
    if !text.starts_with('"') {
        return Some(None);
    }
    let mut escape = false;
    for (i, b) in text.bytes().enumerate().skip(1) {
        match b {
            _ if escape => escape = false,
            b'\\' => escape = true,
            b'"' => return Some(serde_json::from_str(&text[..=i]).ok().map(|s| (s, i + 1))),
            _ => {}
        }
    }
    None
}

/// The XML head `<function=NAME>`.
fn xml_head(body: &str) -> Head {
    const OPEN: &str = "<function=";
    let rest = body.trim_start();
    let skipped = body.len() - rest.len();
    if rest.is_empty() || (rest.len() < OPEN.len() && OPEN.starts_with(rest)) {
        return Head::More;
    }
    let Some(after) = rest.strip_prefix(OPEN) else {
        return Head::No;
    };
    match after.find('>') {
        Some(close) => Head::Call {
            name: after[..close].trim().to_string(),
            at: skipped + OPEN.len() + close + 1,
        },
        None => Head::More,
    }
}

/// Brace depth through a JSON text, strings and escapes followed.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct JsonScan {
    depth: u32,
    in_string: bool,
    escape: bool,
}

impl JsonScan {
    /// Follow `text`: the bytes that belong to the value (up to its closing bracket) and
    /// whether it is complete.
    fn feed(&mut self, text: &str) -> (usize, bool) {
        for (i, b) in text.bytes().enumerate() {
            if self.in_string {
                match b {
                    _ if self.escape => self.escape = false,
                    b'\\' => self.escape = true,
                    b'"' => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return (i + 1, true);
                    }
                }
                _ => {}
            }
        }
        (text.len(), false)
    }
}

/// Read the XML parameters at the start of `text` (all of the rest of the body when
/// `complete`) of a call of `function`, giving their fragments: the bytes used and whether the
/// arguments closed.
fn xml_parameters(
    text: &str,
    complete: bool,
    (function, given): (&str, &mut usize),
    ctx: &CallCtx<'_>,
    events: &mut Vec<OutputEvent>,
) -> (usize, bool) {
    const OPEN: &str = "<parameter=";
    const CLOSE: &str = "</parameter>";
    const END: &str = "</function>";
    let properties = (ctx.tools.iter())
        .find(|t| t.name == function)
        .and_then(|t| t.parameters.get("properties"));
    let mut used = 0;
    let close = |events: &mut Vec<OutputEvent>, given: usize| {
        let text = if given == 0 { "{}" } else { "}" };
        push_fragment(events, ctx.index, text.into());
    };
    loop {
        let rest = text[used..].trim_start();
        let at = text.len() - rest.len();
        if let Some(after) = rest.strip_prefix(OPEN)
            && let Some(gt) = after.find('>')
        {
            let key = after[..gt].trim();
            let value = &after[gt + 1..];
            let (raw, next) = match value.find(CLOSE) {
                Some(e) => (
                    &value[..e],
                    Some(at + OPEN.len() + gt + 1 + e + CLOSE.len()),
                ),
                // The body ends inside the value: it runs to the end (or `</function>`).
                None if complete => {
                    let v = value.trim_end();
                    (v.strip_suffix(END).unwrap_or(v), None)
                }
                None => return (used, false),
            };
            let raw = raw.strip_prefix('\n').unwrap_or(raw);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            let declared = properties
                .and_then(|p| p.get(key))
                .and_then(|p| p.get("type"));
            let lead = if *given == 0 { "{" } else { "," };
            let fragment = format!("{lead}{}:{}", Value::from(key), typed_value(raw, declared));
            push_fragment(events, ctx.index, fragment);
            *given += 1;
            match next {
                Some(n) => used = n,
                None => {
                    close(events, *given);
                    return (text.len(), true);
                }
            }
            continue;
        }
        let unsure = rest.is_empty()
            || rest.starts_with(OPEN)
            || (rest.len() < OPEN.len() && OPEN.starts_with(rest))
            || (rest.len() < END.len() && END.starts_with(rest));
        if unsure && !complete {
            return (used, false);
        }
        // `</function>`, the body's end, or text that is no parameter: the arguments are done.
        close(events, *given);
        return (text.len(), true);
    }
}

/// `raw` as the declared type: a string stays text; other types are read as JSON where they
/// parse (text otherwise); with no declared type, text.
fn typed_value(raw: &str, declared: Option<&Value>) -> Value {
    let text = || Value::String(raw.to_string());
    let Some(kind) = declared.and_then(Value::as_str) else {
        return text();
    };
    if kind == "string" {
        return text();
    }
    serde_json::from_str::<Value>(raw.trim())
        .ok()
        .filter(|v| !v.is_string())
        .unwrap_or_else(text)
}

/// A body with no streamable head, whole: the JSON call's name and its arguments object
/// re-serialized (`arguments` an object, a JSON string holding one, or absent); `None` when it
/// is no call.
fn parse_whole(format: ToolCallFormat, body: &str) -> Option<(String, String)> {
    if format != ToolCallFormat::Json {
        return None;
    }
    let value: Value = serde_json::from_str(body.trim()).ok()?;
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str(s).ok()?,
        Some(v) => v.clone(),
    };
    arguments.is_object().then(|| (name, arguments.to_string()))
}
