//! Tools, reasoning and structured output over HTTP, on a tiny random-weight Qwen3 with the real
//! Qwen3 tokenizer and chat template: the JSON and server-sent-event shapes of tool calls
//! (`message.tool_calls`, `finish_reason: "tool_calls"`, `delta.tool_calls` head then
//! argument fragments), answers valid under a `json_schema` response format, and the 400s naming the
//! field at fault (a bad schema, a tool choice naming an undeclared function, a required call
//! without tools, a malformed tool).

#![allow(clippy::unwrap_used)]

mod support;

use metrale::{EngineOptions, ModelOptions};
use serde_json::{Value, json};
use support::{post, start_with};

fn server() -> (tempfile::TempDir, support::Server) {
    let dir = tempfile::tempdir().unwrap();
    metrale_testkit::checkpoint::write_qwen3_chat(dir.path(), 11).unwrap();
    let options = EngineOptions::default().model(
        ModelOptions::default()
            .max_decode_seqs(8)
            .max_seq_len(Some(1024)),
    );
    let server = start_with(dir.path(), options);
    (dir, server)
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
         "parameters": {"type": "object", "properties": {
             "city": {"type": "string", "maxLength": 8},
             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "pick",
         "parameters": {"type": "object", "properties": {"choice": {"enum": ["a", "b"]}},
             "required": ["choice"]}}}
    ])
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 96,
        "temperature": 1.0,
        "seed": 5,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The arguments of a call of `name` parse and hold the declared required fields.
fn check_arguments(name: &str, arguments: &str) {
    let args: Value = serde_json::from_str(arguments).unwrap();
    match name {
        "get_weather" => {
            assert!(
                args["city"].as_str().unwrap().chars().count() <= 8,
                "{args}"
            );
            let days = args["days"].as_f64().unwrap();
            assert!((1.0..=7.0).contains(&days) && days.fract() == 0.0, "{args}");
        }
        "pick" => assert!(
            ["a", "b"].contains(&args["choice"].as_str().unwrap()),
            "{args}"
        ),
        other => panic!("an undeclared function {other}"),
    }
}

#[test]
fn a_named_tool_choice_gives_one_call_in_openai_s_shape_whole_and_streamed() {
    let (_dir, server) = server();
    for name in ["get_weather", "pick"] {
        let choice = json!({"type": "function", "function": {"name": name}});
        let reply = post(
            &server,
            "/v1/chat/completions",
            &chat(json!({"tools": tools(), "tool_choice": choice})),
        );
        assert_eq!(reply.status, 200, "{}", reply.body);
        let v = reply.json();
        let choice0 = &v["choices"][0];
        assert_eq!(choice0["finish_reason"], "tool_calls", "{v}");
        let message = &choice0["message"];
        assert_eq!(message["role"], "assistant");
        assert!(message["content"].is_null(), "{message}");
        let calls = message["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{message}");
        let call = &calls[0];
        assert!(call["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], name);
        let arguments = call["function"]["arguments"].as_str().unwrap();
        check_arguments(name, arguments);

        // Streamed: a head chunk with id, type and name and empty arguments, then the
        // arguments in fragments; the same call (same seed); no markup in the content.
        let body = chat(
            json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": name}}, "stream": true}),
        );
        let reply = post(&server, "/v1/chat/completions", &body);
        assert_eq!(reply.status, 200);
        let events = reply.events();
        assert_eq!(events.last().unwrap(), "[DONE]");
        let (mut content, mut pieces, mut finish) = (String::new(), Vec::new(), None);
        for e in &events[..events.len() - 1] {
            let v: Value = serde_json::from_str(e).unwrap();
            assert_eq!(v["object"], "chat.completion.chunk");
            let c = &v["choices"][0];
            content += c["delta"]["content"].as_str().unwrap_or("");
            if let Some(calls) = c["delta"]["tool_calls"].as_array() {
                pieces.extend(calls.iter().cloned());
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
        assert_eq!(finish.as_deref(), Some("tool_calls"));
        assert!(!content.contains("tool_call"), "{content:?}");
        assert!(
            pieces.len() > 2,
            "the arguments come in fragments: {pieces:?}"
        );
        let (head, rest) = (&pieces[0], &pieces[1..]);
        assert_eq!(head["index"], 0);
        assert_eq!(head["type"], "function");
        assert!(head["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(head["function"]["name"], name);
        assert_eq!(head["function"]["arguments"], "");
        let mut streamed = String::new();
        for piece in rest {
            assert_eq!(piece["index"], 0);
            assert!(piece.get("id").is_none() && piece["function"].get("name").is_none());
            streamed += piece["function"]["arguments"].as_str().unwrap();
        }
        assert_eq!(streamed, arguments, "the fragments make the arguments");
    }
}

#[test]
fn required_tool_choice_always_calls_a_declared_function() {
    let (_dir, server) = server();
    for seed in 0..4 {
        let body = chat(
            json!({"tools": tools(), "tool_choice": "required", "seed": seed, "parallel_tool_calls": false}),
        );
        let v = post(&server, "/v1/chat/completions", &body).json();
        let calls = v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(calls.len(), 1, "{v}");
        let f = &calls[0]["function"];
        check_arguments(
            f["name"].as_str().unwrap(),
            f["arguments"].as_str().unwrap(),
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    }
}

#[test]
fn a_json_schema_response_format_gives_json_under_the_schema() {
    let (_dir, server) = server();
    let schema = json!({"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer", "score"], "additionalProperties": false});
    let format = json!({"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": true}});
    for seed in 0..3 {
        let v = post(
            &server,
            "/v1/chat/completions",
            &chat(json!({"response_format": format, "seed": seed})),
        )
        .json();
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        let answer: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(
            ["yes", "no"].contains(&answer["answer"].as_str().unwrap()),
            "{answer}"
        );
        assert!(answer["score"].as_f64().unwrap() <= 9.0, "{answer}");
        assert_eq!(answer.as_object().unwrap().len(), 2, "{answer}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    // json_object on the completions endpoint too.
    let v = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "JSON:", "max_tokens": 64, "seed": 1,
        "response_format": {"type": "json_object"}}),
    )
    .json();
    let text = v["choices"][0]["text"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Value>(text).unwrap().is_object(),
            "{text}"
        );
    } else {
        assert!(text.starts_with('{'), "{text}");
    }
}

#[test]
fn tool_and_format_mistakes_are_400s_naming_the_field() {
    let (_dir, server) = server();
    let bad_schema = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}});
    let undeclared = json!({"type": "function", "function": {"name": "nope"}});
    let uncompilable = json!([{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}]);
    let cases = [
        (json!({"response_format": bad_schema}), "response_format"),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"tools": tools(), "tool_choice": undeclared}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": tools(), "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"description": "no name"}}]}),
            "tools[0].function.name",
        ),
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
        (
            json!({"tools": uncompilable, "tool_choice": "required"}),
            "tools",
        ),
        (
            json!({"tools": tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
    ];
    for (extra, param) in cases {
        let reply = post(&server, "/v1/chat/completions", &chat(extra.clone()));
        assert_eq!(reply.status, 400, "{extra}: {}", reply.body);
        let e = reply.json();
        assert_eq!(e["error"]["param"], param, "{extra}: {e}");
    }
    let reply = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "a", "tools": tools()}),
    );
    assert_eq!(reply.json()["error"]["param"], "tools");
    // Tools with `none` are accepted: the answer is text.
    let reply = post(
        &server,
        "/v1/chat/completions",
        &chat(json!({"tools": tools(), "tool_choice": "none", "max_tokens": 4})),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        reply.json()["choices"][0]["message"]
            .get("tool_calls")
            .is_none()
    );
}

#[test]
fn history_with_tool_calls_and_results_is_accepted_with_string_arguments() {
    let (_dir, server) = server();
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]);
    let body = chat(
        json!({"messages": messages, "tools": tools(), "max_tokens": 4,
        "chat_template_kwargs": {"enable_thinking": false}}),
    );
    let reply = post(&server, "/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let v = reply.json();
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    // The arguments were rendered as an object: the rendered prompt holds them once, unquoted.
    let rendered = server
        .engine
        .apply_chat_template(
            &serde_json::from_value::<Vec<metrale::chat::ChatMessage>>(json!([
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]))
            .unwrap(),
            &metrale::chat::ChatOptions::default()
                .kwarg("tools", tools())
                .kwarg("enable_thinking", false),
        )
        .unwrap();
    assert!(
        rendered.contains(r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}"#),
        "{rendered}"
    );
    assert_eq!(
        prompt_tokens as usize,
        server.engine.encode(&rendered).unwrap().len()
    );
}
