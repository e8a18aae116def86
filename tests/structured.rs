//! Structured output and tool calls on a tiny random-weight Qwen3 with the real Qwen3 vocabulary,
//! tokenizer and chat template (`metrale_testkit::checkpoint`): JSON-schema answers are valid
//! under their schema however the random model would have wandered, alone and 32 at a time;
//! required and named tool choices always give calls of the declared functions whose arguments
//! follow their schemas, whole and streamed (the arguments in fragments); a greedy constrained
//! answer is the masked argmax of its logits, token for token, and the unconstrained requests
//! beside it are bitwise their solo runs; a bad schema is refused; tools rendered through a
//! `ChatRequest` are the template's rendering of them, as transformers gives it. The serving
//! ladder's constrained run (`metrale bench --serve --constrained`) compiles its schema through
//! the same path: its request decodes every step and writes the start of a valid value.

#![allow(clippy::unwrap_used)]

use metrale::bench_internals::MaskBench;
use metrale::chat::{
    ChatEvent, ChatMessage, ChatOptions, ChatRequest, Tool, ToolCallParser, ToolChoice,
};
use metrale::{
    Constraint, Engine, EngineError, EngineOptions, GenerateRequest, ModelOptions, RequestError,
    SamplingParams,
};
use metrale_testkit::checkpoint::{IM_END, QWEN3_VOCAB, masked_argmax};
use metrale_testkit::{Rng, checkpoint};
use serde_json::{Value, json};

fn engine() -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    checkpoint::write_qwen3_chat(dir.path(), 7).unwrap();
    let options = EngineOptions::default().model(
        ModelOptions::default()
            .max_decode_seqs(32)
            .max_seq_len(Some(1024)),
    );
    let engine = Engine::load(dir.path(), options).unwrap();
    (dir, engine)
}

/// Whether `v` is valid under `schema`, for the keywords these tests use (`type`, `enum`,
/// `const`, `properties`, `required`, `additionalProperties: false`, `items`, `minItems`,
/// `maxItems`, `minimum`, `maximum`, `maxLength`); the reason when it is not.
fn check(schema: &Value, v: &Value, at: &str) -> Result<(), String> {
    let fail = |what: &str| Err(format!("{at}: {what} ({v})"));
    if let Some(options) = schema.get("enum").and_then(Value::as_array)
        && !options.contains(v)
    {
        return fail("not in the enum");
    }
    if let Some(c) = schema.get("const")
        && c != v
    {
        return fail("not the const");
    }
    let n = |k: &str| schema.get(k).and_then(Value::as_f64);
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => {
            let Some(o) = v.as_object() else {
                return fail("not an object");
            };
            let props = schema.get("properties").and_then(Value::as_object);
            for r in (schema.get("required").and_then(Value::as_array))
                .into_iter()
                .flatten()
            {
                if !o.contains_key(r.as_str().unwrap()) {
                    return fail(&format!("misses {r}"));
                }
            }
            for (k, x) in o {
                match props.and_then(|p| p.get(k)) {
                    Some(s) => check(s, x, &format!("{at}.{k}"))?,
                    None if schema.get("additionalProperties") == Some(&json!(false)) => {
                        return fail(&format!("has {k}"));
                    }
                    None => {}
                }
            }
        }
        Some("array") => {
            let Some(items) = v.as_array() else {
                return fail("not an array");
            };
            if n("minItems").is_some_and(|m| (items.len() as f64) < m)
                || n("maxItems").is_some_and(|m| (items.len() as f64) > m)
            {
                return fail("item count");
            }
            for (i, x) in items.iter().enumerate() {
                check(&schema["items"], x, &format!("{at}[{i}]"))?;
            }
        }
        Some("string") => {
            let Some(s) = v.as_str() else {
                return fail("not a string");
            };
            if n("maxLength").is_some_and(|m| s.chars().count() as f64 > m) {
                return fail("too long");
            }
        }
        Some(kind @ ("integer" | "number")) => {
            let Some(x) = v.as_f64() else {
                return fail("not a number");
            };
            // JSON Schema's integers are the numbers without a fraction (`1.0` is one).
            if kind == "integer" && x.fract() != 0.0 {
                return fail("not an integer");
            }
            if n("minimum").is_some_and(|m| x < m) || n("maximum").is_some_and(|m| x > m) {
                return fail("out of range");
            }
        }
        Some("boolean") if !v.is_boolean() => return fail("not a boolean"),
        _ => {}
    }
    Ok(())
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"}},
            "required": ["color", "ok"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                     "minItems": 1, "maxItems": 3}},
            "required": ["tags"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
            "point": {"type": "object", "properties": {
                "x": {"type": "integer", "minimum": -10, "maximum": 10},
                "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x", "y"], "additionalProperties": false},
            "level": {"enum": [1, 2.5, -3]}},
            "required": ["point", "level"], "additionalProperties": false}),
    ]
}

#[test]
fn json_schema_answers_are_valid_under_their_schema_alone_and_32_at_once() {
    let (_dir, engine) = engine();
    let schemas = schemas();
    let mut rng = Rng::new(3);
    let request = |i: usize, rng: &mut Rng| {
        let prompt = format!("Reply with JSON number {i}: {}", rng.below(1000));
        GenerateRequest::new(prompt)
            .max_new_tokens(96)
            .sampling(
                SamplingParams::default()
                    .temperature(1.0)
                    .seed(rng.next_u64()),
            )
            .constraint(Constraint::JsonSchema(schemas[i % schemas.len()].clone()))
    };
    // Four alone, then 96 in batches of 32 submitted at once.
    let mut outputs = Vec::new();
    for i in 0..4 {
        outputs.push((i, engine.generate(&request(i, &mut rng)).unwrap()));
    }
    for batch in 0..3 {
        let handles: Vec<_> = (0..32)
            .map(|k| {
                let i = 4 + batch * 32 + k;
                (i, engine.submit(request(i, &mut rng)).unwrap())
            })
            .collect();
        for (i, h) in handles {
            outputs.push((i, h.wait().unwrap()));
        }
    }
    assert_eq!(outputs.len(), 100);
    for (i, out) in outputs {
        let text = out.text.unwrap();
        let value: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("request {i}: {text:?} is not JSON: {e}"));
        let schema = &schemas[i % schemas.len()];
        check(schema, &value, "$").unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(out.finish_reason.as_str(), "stop", "request {i}: {text}");
    }
}

#[test]
fn a_greedy_constrained_answer_is_the_masked_argmax_beside_unchanged_batch_mates() {
    let (_dir, engine) = engine();
    let schema = Constraint::JsonSchema(schemas()[1].clone());
    let constrained = GenerateRequest::new("Reply with JSON:")
        .max_new_tokens(64)
        .return_logits(true)
        .constraint(schema.clone());
    let free = |i: u64| {
        let sampling = match i {
            0 => SamplingParams::default(),
            _ => SamplingParams::default().temperature(0.9).seed(i),
        };
        GenerateRequest::new(format!("Plain text {i}:"))
            .max_new_tokens(20)
            .sampling(sampling)
    };
    let alone: Vec<Vec<u32>> = (0..3)
        .map(|i| engine.generate(&free(i)).unwrap().token_ids)
        .collect();
    let bound = engine.submit(constrained).unwrap();
    let beside: Vec<_> = (0..3).map(|i| engine.submit(free(i)).unwrap()).collect();
    let out = bound.wait().unwrap();
    for (i, (h, want)) in beside.into_iter().zip(alone).enumerate() {
        assert_eq!(
            h.wait().unwrap().token_ids,
            want,
            "request {i} beside a constrained one"
        );
    }
    // The reference: the same grammar replayed on the host over the answer's tokens.
    let json = checkpoint::qwen3_tokenizer_json().unwrap();
    let mut grammar = MaskBench::new(&schema, &json, QWEN3_VOCAB, IM_END).unwrap();
    let logits = out.logits.as_ref().unwrap();
    assert_eq!(logits.len(), out.token_ids.len());
    let mut differs = false;
    for (t, (&token, row)) in out.token_ids.iter().zip(logits).enumerate() {
        let want = masked_argmax(row, Some(grammar.mask().unwrap()));
        assert_eq!(token, want, "token {t} of {:?}", out.text);
        differs |= masked_argmax(row, None) != want;
        assert!(grammar.accept(token));
    }
    assert!(differs, "the mask changed some pick");
    let text = out.text.unwrap();
    let value: Value = serde_json::from_str(&text).unwrap();
    check(&schemas()[1], &value, "$").unwrap();
}

/// `prefix`, the start of a JSON array of strings, closed into a whole value: a partial escape
/// dropped, then an open string, a dangling separator and the array closed.
fn close_string_array(prefix: &str) -> String {
    let mut out = String::new();
    let (mut in_string, mut escape_at, mut hex_left) = (false, None, 0);
    for ch in prefix.chars() {
        if escape_at.is_some() {
            if hex_left > 0 {
                hex_left -= 1;
                if hex_left == 0 {
                    escape_at = None;
                }
            } else if ch == 'u' {
                hex_left = 4;
            } else {
                escape_at = None;
            }
        } else if in_string && ch == '\\' {
            escape_at = Some(out.len());
        } else if ch == '"' {
            in_string = !in_string;
        }
        out.push(ch);
    }
    if let Some(at) = escape_at {
        out.truncate(at);
    }
    if in_string {
        out.push('"');
    }
    let mut closed = out.trim_end_matches([',', ' ']).to_string();
    closed.push(']');
    closed
}

#[test]
fn the_serving_ladder_times_a_json_schema_request_beside_plain_ones_and_it_decodes_every_step() {
    use metrale::bench::{self, SchemaCompiler, ServeOptions};
    use metrale::gpu::{CpuBackend, GpuBackend};
    use std::sync::Arc;

    let tokenizer_json = checkpoint::qwen3_tokenizer_json().unwrap();
    let output_tokens = 24;
    let mut o = ServeOptions::new(bench::tiny_qwen3_vocab_for_cpu().unwrap());
    o.concurrency = vec![3];
    o.prompt_tokens = 6;
    o.output_tokens = output_tokens;
    o.copy_bytes = 1 << 16;
    o.constrained = 1;
    o.schemas = Some(Arc::new(SchemaCompiler::new(&tokenizer_json).unwrap()));
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new(Default::default()));
    let report = bench::serve_ladder(gpu, &o).unwrap();
    let p = &report.points[0];
    let c = p.constrained.as_ref().unwrap();
    // Both figures, over the same steps: the constrained request decoded every step the plain
    // run's requests did, to its last token.
    assert!(p.step_ms > 0.0 && c.step_ms > 0.0, "{p:?}");
    assert!(p.constrained_ratio().is_some_and(f64::is_finite));
    // Mixed steps give the first requests tokens while the later ones prefill, so all three
    // decode together for all but the first tokens of the first one.
    assert!(p.full_steps >= output_tokens - 3, "{p:?}");
    assert_eq!((c.full_steps, c.steps), (p.full_steps, p.steps), "{p:?}");
    assert_eq!(c.requests, 1);
    let tokens = &c.outputs[0];
    assert_eq!(tokens.len(), output_tokens);
    let table = report.table();
    assert!(
        table.contains("x plain") && table.contains("minItems"),
        "{table}"
    );

    // Every token is one the schema's grammar takes (replayed on the host, EOS the shape's),
    // and the text is the start of an array of strings.
    let schema: Value = serde_json::from_str(report.schema.as_deref().unwrap()).unwrap();
    assert_eq!(schema["minItems"], json!(output_tokens));
    let constraint = Constraint::JsonSchema(schema);
    let mut grammar = MaskBench::new(&constraint, &tokenizer_json, QWEN3_VOCAB, 0).unwrap();
    for (i, &t) in tokens.iter().enumerate() {
        assert!(grammar.accept(t), "token {i} ({t}) of {tokens:?}");
    }
    let tokenizer: tokenizers::Tokenizer = tokenizer_json.parse().unwrap();
    let text = tokenizer.decode(tokens, false).unwrap();
    assert!(text.starts_with('['), "{text}");
    let value: Value = serde_json::from_str(&close_string_array(&text))
        .unwrap_or_else(|e| panic!("{text:?} is not the start of an array: {e}"));
    let items = value.as_array().unwrap();
    assert!(items.iter().all(Value::is_string), "{text:?}");
}

#[test]
fn a_schema_llguidance_cannot_compile_is_refused_naming_the_problem() {
    let (_dir, engine) = engine();
    let bad = json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}});
    let err = engine
        .generate(&GenerateRequest::new("x").constraint(Constraint::JsonSchema(bad)))
        .unwrap_err();
    assert!(
        matches!(err, EngineError::Request(RequestError::Constraint { .. })),
        "{err}"
    );
    let err = engine
        .generate(&GenerateRequest::new("x").constraint(Constraint::Regex("(".into())))
        .unwrap_err();
    assert!(err.to_string().contains("constraint"), "{err}");
}

fn tools() -> Vec<Tool> {
    vec![
        Tool::function("get_weather")
            .description("The weather in a city.")
            .parameters(json!({"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"]})),
        Tool::function("pick").parameters(json!({"type": "object", "properties": {
            "choice": {"enum": ["a", "b"]}}, "required": ["choice"]})),
    ]
}

fn chat_request(choice: ToolChoice, seed: u64) -> ChatRequest {
    ChatRequest::new(vec![ChatMessage::user("Weather in Paris?")])
        .tools(tools())
        .tool_choice(choice)
        .parallel_tool_calls(false)
        .generation(
            GenerateRequest::new("")
                .max_new_tokens(96)
                .sampling(SamplingParams::default().temperature(1.0).seed(seed)),
        )
}

/// A call's function is declared and its arguments follow the function's schema.
fn check_call(name: &str, arguments: &str, want: Option<&str>) {
    let tools = tools();
    let tool = tools.iter().find(|t| t.name == name).unwrap();
    if let Some(w) = want {
        assert_eq!(name, w);
    }
    let args: Value = serde_json::from_str(arguments).unwrap();
    check(&tool.parameters, &args, name).unwrap();
}

#[test]
fn required_and_named_tool_choices_always_give_valid_calls_whole_and_streamed() {
    let (_dir, engine) = engine();
    for seed in 0..6 {
        let (choice, want) = match seed % 3 {
            0 => (ToolChoice::Required, None),
            1 => (ToolChoice::Function("pick".into()), Some("pick")),
            _ => (
                ToolChoice::Function("get_weather".into()),
                Some("get_weather"),
            ),
        };
        let out = engine.chat(&chat_request(choice.clone(), seed)).unwrap();
        assert_eq!(out.tool_calls.len(), 1, "{:?}", out.output.text);
        let call = &out.tool_calls[0];
        check_call(&call.name, &call.arguments, want);
        assert!(
            call.id.starts_with("call_") && call.id.len() == 29,
            "{}",
            call.id
        );
        assert_eq!(out.finish_reason(), "tool_calls");
        assert_eq!(out.content.trim(), "", "markup never reaches the content");
        // Streamed: the same call comes as a head (id and name) in one delta, then its
        // arguments in fragments over later deltas; the content deltas carry no markup.
        let (mut name, mut arguments, mut fragments) = (None, String::new(), 0);
        let mut content = String::new();
        for ev in engine.submit_chat(chat_request(choice, seed)).unwrap() {
            match ev.unwrap() {
                ChatEvent::Delta(d) => {
                    content.push_str(&d.content);
                    for piece in d.tool_calls {
                        assert_eq!(piece.index, 0);
                        if let Some(n) = piece.name {
                            assert!(name.is_none(), "one head per call");
                            assert!(piece.id.unwrap().starts_with("call_"));
                            name = Some(n);
                        } else {
                            assert!(name.is_some(), "the head comes first");
                        }
                        fragments += usize::from(!piece.arguments.is_empty());
                        arguments.push_str(&piece.arguments);
                    }
                }
                ChatEvent::Finished { output } => assert_eq!(output.tool_calls.len(), 1),
                _ => {}
            }
        }
        assert!(fragments > 1, "the arguments stream: {fragments} fragments");
        assert_eq!(
            (name.as_ref(), &arguments),
            (Some(&call.name), &call.arguments),
            "the same seed gives the same call"
        );
        assert!(!content.contains("tool_call"), "{content}");
    }
}

#[test]
fn a_tool_choice_naming_an_undeclared_function_is_refused() {
    let (_dir, engine) = engine();
    let req = chat_request(ToolChoice::Function("nope".into()), 0);
    let err = engine.submit_chat(req).unwrap_err();
    assert!(
        matches!(err, EngineError::Request(RequestError::ToolChoice { .. })),
        "{err}"
    );
    let req = chat_request(ToolChoice::Required, 0).tools(Vec::new());
    assert!(engine.submit_chat(req).is_err());
}

/// `rendered.json`'s first case through a `ChatRequest`: the prompt's tokens are those of
/// transformers' rendering.
#[test]
fn tools_with_auto_render_as_transformers_does() {
    let (_dir, engine) = engine();
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(checkpoint::qwen3_chat_fixture().join("rendered.json")).unwrap(),
    )
    .unwrap();
    let case = &cases[0];
    assert_eq!(case["name"], "tools_first_turn");
    let tools: Vec<Tool> = (case["tools"].as_array().unwrap().iter())
        .map(|t| {
            let f = &t["function"];
            Tool::function(f["name"].as_str().unwrap())
                .description(f["description"].as_str().unwrap())
                .parameters(f["parameters"].clone())
        })
        .collect();
    let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
    let req = ChatRequest::new(messages)
        .tools(tools)
        .options(ChatOptions::default())
        .tool_call_parser(ToolCallParser::Auto)
        .generation(GenerateRequest::new("").max_new_tokens(1));
    let out = engine.chat(&req).unwrap();
    let want = engine.encode(case["rendered"].as_str().unwrap()).unwrap();
    assert_eq!(out.output.prompt_ids, want);
}
