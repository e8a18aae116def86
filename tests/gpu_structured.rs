//! Structured output and forced tool calls on the CUDA backend (GPU machine only), on the tiny
//! random-weight Qwen3 with the real vocabulary. Constrained rows are masked on the device (the
//! sampler's mask input, uploaded after the step's forward is launched), with decode graphs and
//! eagerly: 32 JSON-schema requests submitted at once all answer JSON under their schema, a
//! greedy constrained answer is the masked argmax of its own logits token for token, the
//! unconstrained requests beside them are bitwise their solo runs, and a named tool choice gives
//! a valid call whose arguments stream in fragments.

#![allow(clippy::unwrap_used)]
#![cfg(feature = "cuda")]

use metrale::bench_internals::MaskBench;
use metrale::chat::{ChatEvent, ChatMessage, ChatRequest, Tool, ToolChoice};
use metrale::{
    Backend, Constraint, Engine, EngineOptions, GenerateRequest, ModelOptions, SamplingParams,
};
use metrale_testkit::checkpoint::{self, IM_END, QWEN3_VOCAB, masked_argmax};
use serde_json::{Value, json};

fn engine(decode_graphs: bool) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    checkpoint::write_qwen3_chat(dir.path(), 7).unwrap();
    let options = EngineOptions::default().backend(Backend::cuda(0)).model(
        ModelOptions::default()
            .max_decode_seqs(40)
            .max_seq_len(Some(1024))
            .decode_graphs(decode_graphs),
    );
    let engine = Engine::load(dir.path(), options).unwrap();
    (dir, engine)
}

fn schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green"]}},
        "required": ["name", "age", "colour"], "additionalProperties": false})
}

#[test]
fn constrained_rows_are_masked_on_the_device_beside_unchanged_rows_on_cuda() {
    for graphs in [true, false] {
        let (_dir, engine) = engine(graphs);
        let constraint = Constraint::JsonSchema(schema());
        let free = |i: u64| {
            let sampling = match i % 2 {
                0 => SamplingParams::default(),
                _ => SamplingParams::default().temperature(0.9).seed(i),
            };
            GenerateRequest::new(format!("Plain text {i}:"))
                .max_new_tokens(24)
                .sampling(sampling)
        };
        let alone: Vec<Vec<u32>> = (0..4)
            .map(|i| engine.generate(&free(i)).unwrap().token_ids)
            .collect();
        let greedy = GenerateRequest::new("JSON, greedy:")
            .max_new_tokens(96)
            .return_logits(true)
            .constraint(constraint.clone());
        let greedy = engine.submit(greedy).unwrap();
        let sampled: Vec<_> = (0..32u64)
            .map(|i| {
                let req = GenerateRequest::new(format!("JSON {i}:"))
                    .max_new_tokens(96)
                    .sampling(SamplingParams::default().temperature(1.0).seed(i))
                    .constraint(constraint.clone());
                engine.submit(req).unwrap()
            })
            .collect();
        let beside: Vec<_> = (0..4).map(|i| engine.submit(free(i)).unwrap()).collect();
        for h in sampled {
            let text = h.wait().unwrap().text.unwrap();
            let v: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{graphs}: {text:?}: {e}"));
            assert!(v["name"].as_str().unwrap().chars().count() <= 6, "{v}");
            assert!((0.0..=120.0).contains(&v["age"].as_f64().unwrap()), "{v}");
            assert!(
                ["red", "green"].contains(&v["colour"].as_str().unwrap()),
                "{v}"
            );
        }
        for (i, (h, want)) in beside.into_iter().zip(alone).enumerate() {
            assert_eq!(
                h.wait().unwrap().token_ids,
                want,
                "graphs {graphs}: unconstrained request {i} is unchanged"
            );
        }
        // The greedy answer against the grammar replayed on the host over its own logits.
        let out = greedy.wait().unwrap();
        let json = checkpoint::qwen3_tokenizer_json().unwrap();
        let mut grammar = MaskBench::new(&constraint, &json, QWEN3_VOCAB, IM_END).unwrap();
        let logits = out.logits.as_ref().unwrap();
        assert_eq!(logits.len(), out.token_ids.len());
        let mut differs = false;
        for (t, (&token, row)) in out.token_ids.iter().zip(logits).enumerate() {
            let want = masked_argmax(row, Some(grammar.mask().unwrap()));
            assert_eq!(token, want, "graphs {graphs}: token {t} of {:?}", out.text);
            differs |= masked_argmax(row, None) != want;
            assert!(grammar.accept(token));
        }
        assert!(differs, "graphs {graphs}: the mask changed some pick");
        serde_json::from_str::<Value>(&out.text.unwrap()).unwrap();
    }
}

#[test]
fn a_named_tool_choice_gives_a_valid_call_streamed_in_fragments_on_cuda() {
    let (_dir, engine) = engine(true);
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
    let (mut arguments, mut fragments) = (String::new(), 0);
    for ev in engine.submit_chat(req).unwrap() {
        if let ChatEvent::Delta(d) = ev.unwrap() {
            for piece in d.tool_calls {
                fragments += usize::from(!piece.arguments.is_empty());
                arguments.push_str(&piece.arguments);
            }
        }
    }
    assert!(fragments > 1, "{fragments} fragments");
    assert_eq!(
        arguments, out.tool_calls[0].arguments,
        "greedy: the same call"
    );
}
