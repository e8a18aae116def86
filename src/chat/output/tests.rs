//! A corpus of Qwen3 (JSON calls) and Qwen3.5 (XML calls) answers, each parsed whole and split
//! at every character boundary (and in three pieces around every marker), against what a client
//! must see: the text events merged, and each call's argument fragments concatenated.

use serde_json::json;

use super::*;

/// Consecutive text events of one kind merged, and consecutive argument fragments of one call
/// concatenated: what a client assembles from a stream.
fn merged(events: Vec<OutputEvent>) -> Vec<OutputEvent> {
    let mut out: Vec<OutputEvent> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(OutputEvent::Reasoning(a)), OutputEvent::Reasoning(b))
            | (Some(OutputEvent::Content(a)), OutputEvent::Content(b)) => a.push_str(&b),
            (
                Some(OutputEvent::ToolCallArguments {
                    index: i,
                    arguments: a,
                }),
                OutputEvent::ToolCallArguments {
                    index: j,
                    arguments: b,
                },
            ) if *i == j => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

fn parse(parser: &OutputParser, pieces: &[&str]) -> Vec<OutputEvent> {
    let mut p = parser.clone();
    let mut events = Vec::new();
    for piece in pieces {
        events.extend(p.push(piece));
    }
    events.extend(p.finish());
    merged(events)
}

/// `answer` parsed whole equals `want` (its parts in order), and so does every split of it.
fn check(parser: &OutputParser, answer: &str, want: &[Vec<OutputEvent>]) {
    let want = &want.concat()[..];
    assert_eq!(parse(parser, &[answer]), want, "whole: {answer:?}");
    let cuts: Vec<usize> = (0..=answer.len())
        .filter(|&i| answer.is_char_boundary(i))
        .collect();
    for &i in &cuts {
        let got = parse(parser, &[&answer[..i], &answer[i..]]);
        assert_eq!(got, want, "split at {i}: {answer:?}");
    }
    for (a, &i) in cuts.iter().enumerate() {
        for &j in &cuts[a..] {
            let got = parse(parser, &[&answer[..i], &answer[i..j], &answer[j..]]);
            assert_eq!(got, want, "split at {i} and {j}: {answer:?}");
        }
    }
    // One character at a time.
    let chars: Vec<String> = answer.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(parse(parser, &pieces), want, "by character: {answer:?}");
}

fn reasoning(s: &str) -> Vec<OutputEvent> {
    vec![OutputEvent::Reasoning(s.into())]
}

fn content(s: &str) -> Vec<OutputEvent> {
    vec![OutputEvent::Content(s.into())]
}

/// A call's events: its start, then its arguments' text.
fn call(index: usize, name: &str, arguments: &str) -> Vec<OutputEvent> {
    vec![
        OutputEvent::ToolCallStart {
            index,
            name: name.into(),
        },
        OutputEvent::ToolCallArguments {
            index,
            arguments: arguments.into(),
        },
    ]
}

/// A call's events with its arguments as `serde_json` writes `value` (XML calls, and JSON
/// calls read whole).
fn call_of(index: usize, name: &str, value: serde_json::Value) -> Vec<OutputEvent> {
    call(index, name, &value.to_string())
}

fn weather_tools() -> Vec<ToolSpec> {
    vec![ToolSpec {
        name: "get_weather".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array"},
                "zip": {"type": "string"},
            },
        }),
    }]
}

#[test]
fn qwen3_answers_with_thinking_and_json_tool_calls() {
    let p = OutputParser::new(ToolCallFormat::Json, weather_tools(), false);
    check(
        &p,
        "Paris is the capital.",
        &[content("Paris is the capital.")],
    );
    check(
        &p,
        "<think>\nThe user asks.\n</think>\n\nParis.",
        &[reasoning("\nThe user asks.\n"), content("\n\nParis.")],
    );
    // A `<` that starts no marker stays in the text.
    check(
        &p,
        "a < b and <b>bold</b>",
        &[content("a < b and <b>bold</b>")],
    );
    let one = "<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>";
    check(
        &p,
        one,
        &[
            reasoning("\nNeed the weather.\n"),
            content("\n\n"),
            // JSON arguments stream as the model writes them.
            call(0, "get_weather", r#"{"city": "Paris", "days": 2}"#),
        ],
    );
    let two = "Checking both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}\n</tool_call>";
    check(
        &p,
        two,
        &[
            content("Checking both.\n"),
            call(0, "get_weather", r#"{"city": "Paris"}"#),
            content("\n"),
            // Arguments in a JSON string are read once the call is closed, re-serialized.
            call_of(1, "get_weather", json!({"city": "Rome"})),
        ],
    );
}

#[test]
fn a_call_inside_an_unclosed_think_block_still_counts() {
    let p = OutputParser::new(ToolCallFormat::Json, weather_tools(), true);
    let answer = "I should look it up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>";
    check(
        &p,
        answer,
        &[
            reasoning("I should look it up.\n"),
            call(0, "get_weather", "{}"),
        ],
    );
    // The prompt opened the block: the answer's first text is reasoning until `</think>`.
    check(
        &p,
        "hmm</think>Done.",
        &[reasoning("hmm"), content("Done.")],
    );
}

#[test]
fn calls_that_never_name_their_function_come_back_as_content() {
    let p = OutputParser::new(ToolCallFormat::Json, weather_tools(), false);
    let bad = "<tool_call>\n{\"name\": \"get_weather\" \"arguments\": {}}\n</tool_call>";
    check(&p, bad, &[content(bad)]);
    let nameless = "<tool_call>{\"arguments\": {}}</tool_call>";
    check(&p, nameless, &[content(nameless)]);
    let open = "Sure. <tool_call>\n{\"name\": \"get_weather\"";
    check(&p, open, &[content(open)]);
    // An answer that ends on a marker's first characters keeps them.
    check(&p, "the end <tool_c", &[content("the end <tool_c")]);
}

#[test]
fn qwen3_5_xml_calls_take_their_types_from_the_schema() {
    let p = OutputParser::new(ToolCallFormat::Xml, weather_tools(), false);
    let answer = "<think>\nWeather for two cities.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=zip>\n94103\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLine one\nline two\n</parameter>\n<parameter=days>\nsoon\n</parameter>\n</function>\n</tool_call>";
    check(
        &p,
        answer,
        &[
            reasoning("\nWeather for two cities.\n"),
            content("\n\n"),
            call_of(
                0,
                "get_weather",
                json!({"city": "San Francisco", "days": 3, "metric": true, "hours": [9, 12], "zip": "94103"}),
            ),
            content("\n"),
            // A value that is not of its declared type stays text; newlines inside are kept.
            call_of(
                1,
                "get_weather",
                json!({"city": "Line one\nline two", "days": "soon"}),
            ),
        ],
    );
    // An undeclared function's parameters are text.
    let other =
        "<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>";
    check(&p, other, &[call_of(0, "other", json!({"n": "5"}))]);
    // A parameter left open runs to `</function>`; the arguments always close.
    let open =
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>";
    check(
        &p,
        open,
        &[call_of(0, "get_weather", json!({"city": "Paris"}))],
    );
    let cut = "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n<param";
    check(&p, cut, &[call_of(0, "get_weather", json!({"days": 4}))]);
    let bare = "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>";
    check(&p, bare, &[call(0, "get_weather", "{}")]);
    let nameless = "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>";
    check(&p, nameless, &[content(nameless)]);
}

#[test]
fn multibyte_text_is_never_cut() {
    let p = OutputParser::new(ToolCallFormat::Json, Vec::new(), false);
    let answer = "<think>é<ü</think>naïve <tool_cal€";
    check(&p, answer, &[reasoning("é<ü"), content("naïve <tool_cal€")]);
}

#[test]
fn the_format_comes_from_the_template() {
    let qwen3 = r#"{%- if tools %}<tools>{{ tool | tojson }}</tools> ... <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>{%- endif %}"#;
    let qwen3_5 = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(
        ToolCallFormat::of_template(qwen3),
        Some(ToolCallFormat::Json)
    );
    assert_eq!(
        ToolCallFormat::of_template(qwen3_5),
        Some(ToolCallFormat::Xml)
    );
    assert_eq!(ToolCallFormat::of_template("{{ messages }}"), None);
}

#[test]
fn with_calls_or_reasoning_not_read_their_markup_stays_in_the_content() {
    let answer =
        "<think>\nhm\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
    let no_calls = OutputParser::new(ToolCallFormat::Json, Vec::new(), false).tool_calls(false);
    check(
        &no_calls,
        answer,
        &[
            reasoning("\nhm\n"),
            content("\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),
        ],
    );
    let neither = no_calls.reasoning(false);
    check(&neither, answer, &[content(answer)]);
}

#[test]
fn a_started_json_call_stays_a_call_with_the_arguments_the_model_wrote() {
    let p = OutputParser::new(ToolCallFormat::Json, weather_tools(), false);
    // Brackets and markup inside strings, escapes, nesting: the object's text up to its own
    // closing brace; what follows it in the body is not read.
    let args = r#"{"city": "a } b \" { </tool", "hours": [1, {"x": [2]}]}"#;
    let nested = format!(
        "<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {args}, \"x\": 1}}\n</tool_call>ok"
    );
    check(&p, &nested, &[call(0, "get_weather", args), content("ok")]);
    // Arguments that do not parse are still the model's arguments (as OpenAI's may be).
    let bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
    check(&p, bad, &[call(0, "get_weather", r#"{"city": }"#)]);
    // An answer cut inside the arguments (a length stop) leaves them open.
    let cut = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par";
    check(&p, cut, &[call(0, "get_weather", r#"{"city": "Par"#)]);
}

#[test]
fn arguments_stream_before_the_call_closes() {
    for (format, head, body, tail) in [
        (
            ToolCallFormat::Json,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {",
            r#""city": "Paris", "days": 2}"#,
            "}\n</tool_call>",
        ),
        (
            ToolCallFormat::Xml,
            "<tool_call>\n<function=get_weather>\n",
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n",
            "</function>\n</tool_call>",
        ),
    ] {
        let mut p = OutputParser::new(format, weather_tools(), false);
        let mut started = p.push(head).into_iter();
        assert_eq!(
            started.next(),
            Some(OutputEvent::ToolCallStart {
                index: 0,
                name: "get_weather".into()
            }),
            "{format:?}: the call starts once its head names the function"
        );
        let mut streamed = String::new();
        for e in started {
            match e {
                OutputEvent::ToolCallArguments {
                    index: 0,
                    arguments,
                } => streamed.push_str(&arguments),
                e => panic!("{format:?}: {e:?}"),
            }
        }
        let mut fragments = 0;
        for c in body.chars() {
            for e in p.push(&c.to_string()) {
                match e {
                    OutputEvent::ToolCallArguments {
                        index: 0,
                        arguments,
                    } => {
                        streamed.push_str(&arguments);
                        fragments += 1;
                    }
                    e => panic!("{format:?}: {e:?}"),
                }
            }
        }
        assert!(
            fragments >= 2,
            "{format:?}: {fragments} fragments before the call closed"
        );
        let mut rest: Vec<OutputEvent> = p.push(tail);
        rest.extend(p.finish());
        for e in rest {
            match e {
                OutputEvent::ToolCallArguments {
                    index: 0,
                    arguments,
                } => streamed.push_str(&arguments),
                e => panic!("{format:?}: {e:?}"),
            }
        }
        let want = match format {
            ToolCallFormat::Json => format!("{{{body}"),
            _ => json!({"city": "Paris", "days": 2}).to_string(),
        };
        assert_eq!(streamed, want, "{format:?}");
    }
}
