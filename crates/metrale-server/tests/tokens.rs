//! `/tokenize` and `/detokenize` against the engine's own tokenizer and chat template, and the
//! sampling a request that leaves fields out gets: the checkpoint's `generation_config.json`
//! first (`min_p` and `repetition_penalty` too), OpenAI's defaults with
//! `GenerationConfig::Ignore`, a fresh seed each time.

#![allow(clippy::unwrap_used)]

mod support;

use metrale::chat::{ChatMessage, ChatOptions};
use metrale::{GenerateRequest, Prompt, SamplingParams};
use metrale_server::GenerationConfig;
use serde_json::{Value, json};
use support::*;

#[test]
fn tokenize_gives_the_ids_generation_feeds_and_detokenize_inverts_it() {
    let template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let dir = chat_checkpoint(template);
    let server = start_with(dir.path(), options());
    let engine = &server.engine;

    let text = "the quick brown fox";
    let reply = post(
        &server,
        "/tokenize",
        &json!({"prompt": text, "return_token_strs": true}),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    let v = reply.json();
    let tokens = token_ids(&v["tokens"]);
    assert_eq!(tokens, engine.encode(text).unwrap());
    assert_eq!(v["count"], tokens.len());
    assert_eq!(v["max_model_len"], engine.max_context());
    let pieces = v["token_strs"].as_array().unwrap();
    assert_eq!(pieces.len(), tokens.len());
    assert!(pieces.iter().all(|p| !p.as_str().unwrap().is_empty()));
    // What /tokenize counts is what a completion is fed.
    let body = json!({"prompt": text, "max_tokens": 1, "temperature": 0});
    let done = post(&server, "/v1/completions", &body).json();
    assert_eq!(done["usage"]["prompt_tokens"], tokens.len());
    let back = post(&server, "/detokenize", &json!({"tokens": tokens})).json();
    assert_eq!(back["prompt"], text);

    // Messages go through the chat template, with the generation prompt unless turned off.
    let messages = json!([{"role": "user", "content": "hi"}]);
    let chat = [ChatMessage::user("hi")];
    for (add, body) in [
        (true, json!({"messages": messages})),
        (
            false,
            json!({"messages": messages, "add_generation_prompt": false}),
        ),
    ] {
        let options = ChatOptions::default().add_generation_prompt(add);
        let rendered = engine.apply_chat_template(&chat, &options).unwrap();
        let reply = post(&server, "/tokenize", &body);
        assert_eq!(reply.status, 200, "{}", reply.body);
        let tokens = token_ids(&reply.json()["tokens"]);
        assert_eq!(tokens, engine.encode(&rendered).unwrap(), "{body}");
        // Special tokens are kept: the template's markers come back as written.
        let back = post(&server, "/detokenize", &json!({"tokens": tokens})).json();
        assert_eq!(back["prompt"], rendered.as_str());
    }
    let body = json!({"messages": messages, "max_tokens": 1, "temperature": 0});
    let done = post(&server, "/v1/chat/completions", &body).json();
    let rendered = engine
        .apply_chat_template(&chat, &ChatOptions::default())
        .unwrap();
    assert_eq!(
        done["usage"]["prompt_tokens"],
        engine.encode(&rendered).unwrap().len()
    );

    // Bad bodies: a 400 naming the field, and the server goes on.
    let vocab = 1 << 20;
    for (body, param) in [
        (json!({"prompt": "a", "messages": messages}), "prompt"),
        (json!({}), "prompt"),
        (json!({"prompt": 5}), "prompt"),
        (json!({"prompt": "a", "add_special": true}), ""),
        (json!({"tokens": [1, vocab]}), "tokens"),
        (json!({"tokens": [1, -2]}), "tokens[1]"),
    ] {
        let path = if body.get("tokens").is_some() {
            "/detokenize"
        } else {
            "/tokenize"
        };
        let reply = post(&server, path, &body);
        assert_eq!(reply.status, 400, "{path} {body}: {}", reply.body);
        let error = &reply.json()["error"];
        if !param.is_empty() {
            assert_eq!(error["param"], param, "{path} {body}: {error}");
        }
    }
    let other = json!({"model": "nope", "prompt": "a"});
    assert_eq!(post(&server, "/tokenize", &other).status, 404);
    assert_eq!(
        post(&server, "/tokenize", &json!({"prompt": "a"})).status,
        200
    );
}

/// A copy of the tiny checkpoint whose generation_config.json recommends sampling.
fn recommending_checkpoint() -> tempfile::TempDir {
    checkpoint_recommending(
        json!({"eos_token_id": 0, "temperature": 0.7, "top_k": 5, "top_p": 0.9}),
    )
}

/// A copy of the tiny checkpoint with `generation` as its generation_config.json.
fn checkpoint_recommending(generation: Value) -> tempfile::TempDir {
    let dir = chat_checkpoint("{{ messages[0].content }}");
    std::fs::write(
        dir.path().join("generation_config.json"),
        generation.to_string(),
    )
    .unwrap();
    dir
}

#[test]
fn omitted_sampling_fields_take_the_checkpoints_recommendation_then_openais() {
    let dir = recommending_checkpoint();
    let prompt = [3u32, 1, 4, 1, 5];
    let run = |server: &Server, extra: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 32, "seed": 7, "ignore_eos": true});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let reply = post(server, "/v1/completions", &body);
        assert_eq!(reply.status, 200, "{}", reply.body);
        token_ids(&reply.json()["choices"][0]["token_ids"])
    };
    let engine_run = |server: &Server, sampling: SamplingParams| {
        let request = GenerateRequest::new(Prompt::TokenIds(prompt.to_vec()))
            .max_new_tokens(32)
            .ignore_eos(true)
            .sampling(sampling.seed(7));
        server.engine.generate(&request).unwrap().token_ids
    };
    let recommended = SamplingParams::default()
        .temperature(0.7)
        .top_k(5)
        .top_p(0.9);
    let openai = SamplingParams::default().temperature(1.0);

    let auto = start_from(dir.path(), options(), GenerationConfig::Auto);
    assert_eq!(auto.engine.sampling_defaults(), recommended);
    assert_eq!(
        run(&auto, json!({})),
        engine_run(&auto, recommended.clone())
    );
    // A field the request sets wins; the others stay the checkpoint's.
    assert_eq!(
        run(&auto, json!({"top_k": -1})),
        engine_run(&auto, recommended.clone().top_k(0))
    );
    let greedy = engine_run(&auto, SamplingParams::greedy());
    assert_eq!(run(&auto, json!({"temperature": 0})), greedy);

    let ignore = start_from(dir.path(), options(), GenerationConfig::Ignore);
    assert_eq!(run(&ignore, json!({})), engine_run(&ignore, openai.clone()));
    assert_ne!(
        engine_run(&ignore, openai),
        engine_run(&ignore, recommended),
        "the two defaults must sample differently for this test to mean anything"
    );
}

#[test]
fn the_checkpoints_min_p_and_repetition_penalty_apply_unless_the_request_or_none_overrides() {
    let generation = json!({"eos_token_id": 0, "temperature": 1.0, "min_p": 0.2,
        "repetition_penalty": 1.8});
    let dir = checkpoint_recommending(generation);
    let prompt = [9u32, 8, 7, 9, 8, 7];
    let run = |server: &Server, extra: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 24, "seed": 3, "ignore_eos": true});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let reply = post(server, "/v1/completions", &body);
        assert_eq!(reply.status, 200, "{}", reply.body);
        token_ids(&reply.json()["choices"][0]["token_ids"])
    };
    let engine_run = |server: &Server, sampling: SamplingParams| {
        let request = GenerateRequest::new(Prompt::TokenIds(prompt.to_vec()))
            .max_new_tokens(24)
            .ignore_eos(true)
            .sampling(sampling.seed(3));
        server.engine.generate(&request).unwrap().token_ids
    };
    let openai = SamplingParams::default().temperature(1.0);
    let recommended = openai.clone().min_p(0.2).repetition_penalty(1.8);

    let auto = start_from(dir.path(), options(), GenerationConfig::Auto);
    assert_eq!(
        auto.engine.sampling_defaults(),
        SamplingParams::greedy()
            .temperature(1.0)
            .min_p(0.2)
            .repetition_penalty(1.8)
    );
    let with_both = run(&auto, json!({}));
    assert_eq!(with_both, engine_run(&auto, recommended.clone()));
    // Each on its own makes a difference here, so neither can be silently dropped.
    let without_penalty = engine_run(&auto, openai.clone().min_p(0.2));
    let without_min_p = engine_run(&auto, openai.clone().repetition_penalty(1.8));
    assert_ne!(with_both, without_penalty, "repetition_penalty must matter");
    assert_ne!(with_both, without_min_p, "min_p must matter");
    // The request's fields win, one at a time.
    assert_eq!(
        run(&auto, json!({"repetition_penalty": 1.0})),
        without_penalty
    );
    assert_eq!(run(&auto, json!({"min_p": 0.0})), without_min_p);
    // `--generation-config none`: OpenAI's defaults, the file unread.
    let ignore = start_from(dir.path(), options(), GenerationConfig::Ignore);
    assert_eq!(run(&ignore, json!({})), engine_run(&ignore, openai));
    assert_ne!(run(&ignore, json!({})), with_both);
}

#[test]
fn requests_without_a_seed_sample_differently_and_a_seed_reproduces() {
    let server = start();
    let body =
        json!({"prompt": [1, 2, 3], "max_tokens": 16, "temperature": 1.0, "ignore_eos": true});
    let sample = |body: &Value| {
        let reply = post(&server, "/v1/completions", body);
        assert_eq!(reply.status, 200, "{}", reply.body);
        token_ids(&reply.json()["choices"][0]["token_ids"])
    };
    assert_ne!(sample(&body), sample(&body), "no seed: a fresh one each");
    let mut seeded = body.clone();
    seeded["seed"] = json!(11);
    assert_eq!(sample(&seeded), sample(&seeded));
    // The library draws a fresh seed the same way.
    let request = GenerateRequest::new(Prompt::TokenIds(vec![1, 2, 3]))
        .max_new_tokens(16)
        .ignore_eos(true)
        .sampling(SamplingParams::default().temperature(1.0));
    let a = server.engine.generate(&request).unwrap().token_ids;
    let b = server.engine.generate(&request).unwrap().token_ids;
    assert_ne!(a, b, "no seed: a fresh one each");
}
