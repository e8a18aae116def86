//! A corpus of Qwen3 (JSON calls) and Qwen3.5 (XML calls) answers, each parsed whole and split
//! at every character boundary (and in three pieces around every marker), against what a client
//! must see.

use serde_json::json;

use super::*;

/// Consecutive text events of one kind merged: what a client assembles from a stream.
fn merged(events: Vec<OutputEvent>) -> Vec<OutputEvent> {
    let mut out: Vec<OutputEvent> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(OutputEvent::Reasoning(a)), OutputEvent::Reasoning(b))
            | (Some(OutputEvent::Content(a)), OutputEvent::Content(b)) => a.push_str(&b),
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

/// `answer` parsed whole equals `want`, and so does every split of it.
fn check(parser: &OutputParser, answer: &str, want: &[OutputEvent]) {
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

fn reasoning(s: &str) -> OutputEvent {
    OutputEvent::Reasoning(s.into())
}

fn content(s: &str) -> OutputEvent {
    OutputEvent::Content(s.into())
}

fn call(index: usize, name: &str, arguments: serde_json::Value) -> OutputEvent {
    OutputEvent::ToolCall {
        index,
        name: name.into(),
        arguments: arguments.to_string(),
    }
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
            call(0, "get_weather", json!({"city": "Paris", "days": 2})),
        ],
    );
    let two = "Checking both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}\n</tool_call>";
    check(
        &p,
        two,
        &[
            content("Checking both.\n"),
            call(0, "get_weather", json!({"city": "Paris"})),
            content("\n"),
            call(1, "get_weather", json!({"city": "Rome"})),
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
            call(0, "get_weather", json!({})),
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
fn malformed_or_unclosed_calls_come_back_as_content() {
    let p = OutputParser::new(ToolCallFormat::Json, weather_tools(), false);
    let bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
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
            call(
                0,
                "get_weather",
                json!({"city": "San Francisco", "days": 3, "metric": true, "hours": [9, 12], "zip": "94103"}),
            ),
            content("\n"),
            // A value that is not of its declared type stays text; newlines inside are kept.
            call(
                1,
                "get_weather",
                json!({"city": "Line one\nline two", "days": "soon"}),
            ),
        ],
    );
    // An undeclared function's parameters are text.
    let other =
        "<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>";
    check(&p, other, &[call(0, "other", json!({"n": "5"}))]);
    let broken =
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>";
    check(&p, broken, &[content(broken)]);
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
            OutputEvent::Reasoning("\nhm\n".into()),
            OutputEvent::Content(
                "\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>".into(),
            ),
        ],
    );
    let neither = no_calls.reasoning(false);
    check(&neither, answer, &[OutputEvent::Content(answer.into())]);
}
