//! Requests of several choices through the library: a handle's events name their choice and end
//! each choice with `ChoiceFinished` before the one `Finished`, whose output holds every choice;
//! cancelling stops every choice; `best_of` below `n` is refused naming the field; and chat
//! choices are each read apart (a forced tool call gives every choice its own valid call, and a
//! call id of its own). On the CPU backend, the tiny dense fixture and the tiny Qwen3 with the
//! real vocabulary.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeMap;

use metrale::chat::{ChatEvent, ChatMessage, ChatRequest, Tool, ToolChoice};
use metrale::{
    Engine, EngineError, EngineOptions, FinishReason, GenerateEvent, GenerateRequest, ModelOptions,
    Prompt, RequestError, SamplingParams,
};
use metrale_testkit::checkpoint;
use serde_json::json;
use support::fixtures_dir;

fn tiny() -> Engine {
    let options = EngineOptions::default().model(
        ModelOptions::default()
            .max_decode_seqs(8)
            .max_batch_tokens(32),
    );
    Engine::load(fixtures_dir().join("qwen3-tiny"), options).unwrap()
}

fn sampled(n: usize, max_new_tokens: usize, seed: u64) -> GenerateRequest {
    GenerateRequest::new(Prompt::TokenIds(vec![5, 17, 3, 250, 9, 41]))
        .max_new_tokens(max_new_tokens)
        .ignore_eos(true)
        .sampling(SamplingParams::default().temperature(1.0).seed(seed).n(n))
}

#[test]
fn a_handle_streams_each_choice_and_ends_with_every_choice_in_index_order() {
    let engine = tiny();
    let mut streamed: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
    let mut ended: BTreeMap<usize, FinishReason> = BTreeMap::new();
    let mut output = None;
    for ev in engine.submit(sampled(3, 7, 21)).unwrap() {
        assert!(output.is_none(), "an event after Finished");
        match ev.unwrap() {
            GenerateEvent::Token(t) => {
                assert!(t.choice < 3, "{t:?}");
                assert!(
                    !ended.contains_key(&t.choice),
                    "a token after its choice ended"
                );
                streamed.entry(t.choice).or_default().push(t.token_id);
            }
            GenerateEvent::ChoiceFinished {
                choice,
                finish_reason,
            } => assert!(ended.insert(choice, finish_reason).is_none(), "ended twice"),
            GenerateEvent::Finished { output: o } => output = Some(o),
            _ => {}
        }
    }
    let output = output.expect("Finished");
    assert_eq!(output.completion_tokens(), 21);
    let choices = output.into_choices();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c.index, i);
        assert_eq!(c.token_ids.len(), 7);
        assert_eq!(c.finish_reason, FinishReason::Length);
        assert_eq!(streamed[&i], c.token_ids, "choice {i}: streamed = output");
        assert_eq!(ended[&i], FinishReason::Length);
        assert!(c.other_choices.is_empty());
        assert!(c.cumulative_logprob.is_some_and(|l| l < 0.0), "{c:?}");
    }
    assert_ne!(choices[0].token_ids, choices[1].token_ids);
    assert_ne!(choices[1].token_ids, choices[2].token_ids);
    // One choice reads as it always has: no other choices, index 0.
    let one = engine.generate(&sampled(1, 7, 21)).unwrap();
    assert_eq!((one.index, one.other_choices.len()), (0, 0));
    assert_eq!(
        one.token_ids, choices[0].token_ids,
        "choice 0 is the request's seed"
    );
}

#[test]
fn cancelling_stops_every_choice() {
    let engine = tiny();
    let mut handle = engine.submit(sampled(4, 400, 3)).unwrap();
    let mut tokens = 0;
    let output = loop {
        match handle.next().unwrap().unwrap() {
            GenerateEvent::Token(_) => {
                tokens += 1;
                if tokens == 8 {
                    handle.cancel();
                }
            }
            GenerateEvent::Finished { output } => break output,
            _ => {}
        }
    };
    for c in output.into_choices() {
        assert_eq!(
            c.finish_reason,
            FinishReason::Cancelled,
            "choice {}",
            c.index
        );
        assert!(c.token_ids.len() < 400, "choice {}", c.index);
    }
    // Nothing of the request is left running (the metrics are recorded right after the step
    // that sent the output).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let m = loop {
        let m = engine.metrics();
        if m.requests.finished == 1 || std::time::Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert_eq!((m.requests.running, m.requests.finished), (0, 1), "{m:?}");
    assert_eq!(m.cache.kv_blocks_used, 0);

    // Cancelled before its prompt is computed (choices not yet forked): every choice still
    // ends, empty.
    let engine = std::sync::Arc::new(engine);
    let prompt: Vec<u32> = (0..480).map(|i| 1 + (i * 7) % 500).collect();
    for _ in 0..3 {
        let req = GenerateRequest::new(Prompt::TokenIds(prompt.clone()))
            .max_new_tokens(8)
            .sampling(SamplingParams::default().temperature(1.0).n(3));
        let handle = engine.submit(req).unwrap();
        handle.cancel();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // The receiver gone (the test failed already) leaves nothing to report.
            let _ = tx.send(handle.wait());
        });
        let out = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the cancelled request finishes")
            .unwrap();
        let choices = out.into_choices();
        assert_eq!(choices.len(), 3);
        assert!(
            choices
                .iter()
                .all(|c| c.finish_reason == FinishReason::Cancelled)
        );
    }
}

#[test]
fn best_of_below_n_and_out_of_range_counts_are_refused_naming_the_field() {
    let engine = tiny();
    let field = |sampling: SamplingParams| {
        let req = sampled(1, 4, 0).sampling(sampling);
        match engine.submit(req).map(|_| ()) {
            Err(EngineError::Request(RequestError::Sampling(e))) => e.field,
            other => panic!("not refused: {other:?}"),
        }
    };
    assert_eq!(field(SamplingParams::default().n(3).best_of(2)), "best_of");
    assert_eq!(field(SamplingParams::default().best_of(65)), "best_of");
    assert_eq!(field(SamplingParams::default().n(0)), "n");
    assert_eq!(field(SamplingParams::default().n(65)), "n");
    // `best_of` keeps `n` choices, ranked: index 0 scores highest.
    let ranked = sampled(2, 6, 9).sampling(
        SamplingParams::default()
            .temperature(1.0)
            .seed(9)
            .n(2)
            .best_of(6),
    );
    let out = engine.generate(&ranked).unwrap().into_choices();
    assert_eq!(out.len(), 2);
    assert!(out[0].cumulative_logprob >= out[1].cumulative_logprob);
}

#[test]
fn forced_tool_calls_give_every_chat_choice_its_own_valid_call() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint::write_qwen3_chat(dir.path(), 7).unwrap();
    let options = EngineOptions::default().model(
        ModelOptions::default()
            .max_decode_seqs(8)
            .max_seq_len(Some(1024)),
    );
    let engine = Engine::load(dir.path(), options).unwrap();
    let tool = Tool::function("pick").parameters(json!({"type": "object", "properties": {
        "choice": {"enum": ["a", "b", "c"]}}, "required": ["choice"]}));
    let request = ChatRequest::new(vec![ChatMessage::user("Pick one.")])
        .tools(vec![tool])
        .tool_choice(ToolChoice::Required)
        .parallel_tool_calls(false)
        .generation(
            GenerateRequest::new("")
                .max_new_tokens(64)
                .sampling(SamplingParams::default().temperature(1.0).seed(4).n(3)),
        );
    let mut ended = BTreeMap::new();
    let mut calls: BTreeMap<usize, usize> = BTreeMap::new();
    let mut streamed: BTreeMap<usize, String> = BTreeMap::new();
    let mut output = None;
    for ev in engine.submit_chat(request).unwrap() {
        match ev.unwrap() {
            ChatEvent::Delta(d) => {
                assert!(!d.content.contains("tool_call"), "{d:?}");
                // A call streams as its head (id and name) and then fragments of arguments.
                let heads = d.tool_calls.iter().filter(|c| c.id.is_some()).count();
                *calls.entry(d.choice).or_default() += heads;
                for c in &d.tool_calls {
                    streamed.entry(d.choice).or_default().push_str(&c.arguments);
                }
            }
            ChatEvent::ChoiceFinished {
                choice,
                finish_reason,
            } => assert!(ended.insert(choice, finish_reason).is_none()),
            ChatEvent::Finished { output: o } => output = Some(o),
            _ => {}
        }
    }
    let choices = output.unwrap().into_choices();
    assert_eq!(choices.len(), 3);
    let mut ids = Vec::new();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c.index(), i);
        assert_eq!(c.tool_calls.len(), 1, "choice {i}: {:?}", c.output.text);
        let args: serde_json::Value = serde_json::from_str(&c.tool_calls[0].arguments).unwrap();
        assert!(
            ["a", "b", "c"].contains(&args["choice"].as_str().unwrap()),
            "{args}"
        );
        assert_eq!(c.finish_reason(), "tool_calls");
        assert_eq!(ended[&i], "tool_calls");
        assert_eq!(calls[&i], 1, "choice {i}: one call streamed");
        assert_eq!(
            streamed[&i], c.tool_calls[0].arguments,
            "choice {i}: the streamed fragments are the arguments"
        );
        ids.push(c.tool_calls[0].id.clone());
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "each choice's call has its own id");
}
