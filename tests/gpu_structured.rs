//! Structured output and forced tool calls on the CUDA backend (GPU machine only), on the tiny
//! random-weight Qwen3 with the real vocabulary: 32 JSON-schema requests submitted at once (rows
//! masked on the host beside unconstrained rows that take the device's argmax) all answer JSON
//! under their schema, the unconstrained ones are unchanged by the constrained ones beside
//! them, and a named tool choice gives a valid call.

#![allow(clippy::unwrap_used)]
#![cfg(feature = "cuda")]

use metrale::chat::{ChatMessage, ChatRequest, Tool, ToolChoice};
use metrale::{
    Backend, Constraint, Engine, EngineOptions, GenerateRequest, ModelOptions, SamplingParams,
};
use metrale_testkit::checkpoint;
use serde_json::{Value, json};

fn engine() -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    checkpoint::write_qwen3_chat(dir.path(), 7).unwrap();
    let options = EngineOptions::default().backend(Backend::cuda(0)).model(
        ModelOptions::default()
            .max_decode_seqs(40)
            .max_seq_len(Some(1024)),
    );
    let engine = Engine::load(dir.path(), options).unwrap();
    (dir, engine)
}

#[test]
fn constrained_rows_beside_argmax_rows_answer_valid_json_on_cuda() {
    let (_dir, engine) = engine();
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green"]}},
        "required": ["name", "age", "colour"], "additionalProperties": false});
    let free = |i: u64| GenerateRequest::new(format!("Plain text {i}:")).max_new_tokens(24);
    let alone: Vec<Vec<u32>> = (0..4)
        .map(|i| engine.generate(&free(i)).unwrap().token_ids)
        .collect();
    let constrained: Vec<_> = (0..32u64)
        .map(|i| {
            let req = GenerateRequest::new(format!("JSON {i}:"))
                .max_new_tokens(96)
                .sampling(SamplingParams::default().temperature(1.0).seed(i))
                .constraint(Constraint::JsonSchema(schema.clone()));
            engine.submit(req).unwrap()
        })
        .collect();
    let beside: Vec<_> = (0..4).map(|i| engine.submit(free(i)).unwrap()).collect();
    for h in constrained {
        let out = h.wait().unwrap();
        let text = out.text.unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["name"].as_str().unwrap().chars().count() <= 6, "{v}");
        assert!((0.0..=120.0).contains(&v["age"].as_f64().unwrap()), "{v}");
        assert!(
            ["red", "green"].contains(&v["colour"].as_str().unwrap()),
            "{v}"
        );
    }
    for (h, want) in beside.into_iter().zip(alone) {
        assert_eq!(
            h.wait().unwrap().token_ids,
            want,
            "an unconstrained row is unchanged"
        );
    }
}

#[test]
fn a_named_tool_choice_gives_a_valid_call_on_cuda() {
    let (_dir, engine) = engine();
    let tool = Tool::function("pick").parameters(json!({"type": "object", "properties": {
        "choice": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["choice", "n"]}));
    let req = ChatRequest::new(vec![ChatMessage::user("Pick one.")])
        .tools(vec![tool])
        .tool_choice(ToolChoice::Function("pick".into()))
        .generation(GenerateRequest::new("").max_new_tokens(64));
    let out = engine.chat(&req).unwrap();
    assert_eq!(out.tool_calls.len(), 1, "{:?}", out.output.text);
    let args: Value = serde_json::from_str(&out.tool_calls[0].arguments).unwrap();
    assert!(
        ["a", "b"].contains(&args["choice"].as_str().unwrap()),
        "{args}"
    );
    assert_eq!(out.finish_reason(), "tool_calls");
}
