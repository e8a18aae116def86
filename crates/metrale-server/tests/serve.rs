//! The server end to end: it runs in-process on 127.0.0.1 (port 0) over the tiny test
//! checkpoint on the CPU, and a minimal HTTP/1.1 client talks to it over loopback.
//!
//! What a user would notice: a completion (text or token ids, greedy or seeded) equal to
//! `Engine::generate` for the same request, alone or beside 7 others; streaming giving the same
//! tokens and text and ending with `[DONE]`; chat through the checkpoint's template; bad
//! requests answered with 4xx OpenAI-style JSON while the server keeps serving; a client that
//! hangs up mid-stream freeing its request; `/metrics` being valid Prometheus text.

#![allow(clippy::unwrap_used)]

mod support;

use std::io::Read;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use metrale::{GenerateRequest, Prompt, SamplingParams};
use metrale_server::{ServerError, ServerOptions};
use serde_json::{Value, json};

use support::*;

#[path = "serve/errors.rs"]
mod errors;
#[path = "serve/logprobs.rs"]
mod logprobs;

#[test]
fn completions_from_text_and_token_ids_equal_engine_generate() {
    let server = start();
    let text = "The quick brown fox jumps over the lazy dog";
    let want = server
        .engine
        .generate(&greedy(Prompt::Text(text.into()), 12).ignore_eos(true))
        .unwrap();
    let reply = post(
        &server,
        "/v1/completions",
        &json!({"model": "qwen3-tiny", "prompt": text, "max_tokens": 12, "temperature": 0, "ignore_eos": true}),
    );
    assert_completion(&reply, &want, "text prompt");

    let ids = vec![5u32, 17, 300, 42, 7, 511];
    let want = server
        .engine
        .generate(&greedy(Prompt::TokenIds(ids.clone()), 10).ignore_eos(true))
        .unwrap();
    let reply = post(
        &server,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 10, "temperature": 0.0, "ignore_eos": true}),
    );
    assert_completion(&reply, &want, "token-id prompt");

    // Seeded sampling with every knob, and stop strings cut from the greedy text.
    let sampling = SamplingParams::default()
        .temperature(0.9)
        .top_k(40)
        .top_p(0.9)
        .seed(1234);
    let want = server
        .engine
        .generate(
            &GenerateRequest::new(Prompt::TokenIds(ids.clone()))
                .max_new_tokens(14)
                .sampling(sampling),
        )
        .unwrap();
    let reply = post(
        &server,
        "/v1/completions",
        &json!({"prompt": [ids], "max_tokens": 14, "temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 1234}),
    );
    assert_completion(&reply, &want, "seeded sampling");

    let full = server
        .engine
        .generate(&greedy(Prompt::Text(text.into()), 16).ignore_eos(true))
        .unwrap();
    let full_text = full.text.unwrap();
    let chars: Vec<char> = full_text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let want = server
        .engine
        .generate(
            &greedy(Prompt::Text(text.into()), 16)
                .ignore_eos(true)
                .stop_strings(vec![stop.clone(), "\u{1F600}".into()]),
        )
        .unwrap();
    assert_eq!(
        want.finish_reason.as_str(),
        "stop",
        "{full_text:?} / {stop:?}"
    );
    let reply = post(
        &server,
        "/v1/completions",
        &json!({"prompt": text, "max_tokens": 16, "temperature": 0, "ignore_eos": true, "stop": [stop, "\u{1F600}"]}),
    );
    assert_completion(&reply, &want, "stop strings");
}

#[test]
fn eight_concurrent_requests_each_get_their_solo_output() {
    let server = start();
    let bodies: Vec<Value> = (0..8u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..3 + 7 * i)
                .map(|t| (t * 37 + i * 101 + 7) % 512)
                .collect();
            let mut body =
                json!({"prompt": prompt, "max_tokens": 6 + 3 * i, "ignore_eos": i % 2 == 0});
            if i % 3 == 0 {
                body["temperature"] = json!(0);
            } else {
                body["temperature"] = json!(0.8);
                body["seed"] = json!(i);
            }
            body
        })
        .collect();
    let solo: Vec<Reply> = bodies
        .iter()
        .map(|b| post(&server, "/v1/completions", b))
        .collect();
    let barrier = Arc::new(Barrier::new(bodies.len()));
    let addr = server.addr;
    let together: Vec<Reply> = std::thread::scope(|s| {
        let threads: Vec<_> = bodies
            .iter()
            .map(|b| {
                let barrier = barrier.clone();
                s.spawn(move || {
                    barrier.wait();
                    http(addr, "POST", "/v1/completions", Some(&b.to_string()))
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for (i, (alone, crowd)) in solo.iter().zip(&together).enumerate() {
        assert_eq!(alone.status, 200, "{}", alone.body);
        assert_eq!(crowd.status, 200, "{}", crowd.body);
        let (a, c) = (alone.json(), crowd.json());
        assert_eq!(a["choices"], c["choices"], "request {i}");
        assert_eq!(a["usage"], c["usage"], "request {i}");
    }
    // The solo outputs are the engine's own.
    let first = &bodies[0];
    let want = server
        .engine
        .generate(&greedy(Prompt::TokenIds(token_ids(&first["prompt"])), 6).ignore_eos(true))
        .unwrap();
    assert_completion(&solo[0], &want, "request 0 against the engine");
}

#[test]
fn streaming_gives_the_same_tokens_and_text_and_ends_with_done() {
    let server = start();
    for body in [
        json!({"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": true}),
        json!({"prompt": [9, 8, 7, 6], "max_tokens": 9, "temperature": 1.1, "seed": 5}),
        json!({"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": true, "stop": ["e"]}),
    ] {
        let whole = post(&server, "/v1/completions", &body).json();
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let reply = post(&server, "/v1/completions", &streamed);
        let (ids, text, finish, usage) = collect_stream(&reply, false);
        let choice = &whole["choices"][0];
        assert_eq!(ids, token_ids(&choice["token_ids"]), "{body}");
        assert_eq!(text, choice["text"].as_str().unwrap(), "{body}");
        assert_eq!(finish, choice["finish_reason"].as_str().unwrap(), "{body}");
        assert_eq!(usage.as_ref(), Some(&whole["usage"]), "{body}");
    }
    let m = wait_idle(&server.engine, 6);
    assert_eq!((m.requests.finished, m.requests.failed), (6, 0));
}

#[test]
fn chat_completions_render_the_template_and_equal_engine_generate() {
    let template = "{{ bos_token }}{% for m in messages %}\n{% if m.role == 'system' and not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}\n<|{{ m.role }}|>{{ m.content | trim }}{{ eos_token }}{% endfor %}\n{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let dir = chat_checkpoint(template);
    let server = start_with(dir.path(), options());
    let messages = json!([
        {"role": "system", "content": "You are terse. "},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour"}]},
    ]);
    let rendered =
        "<s><|system|>You are terse.<|endoftext|><|user|>Name a colour<|endoftext|><|assistant|>";
    let want = server
        .engine
        .generate(&greedy(Prompt::Text(rendered.into()), 10).ignore_eos(true))
        .unwrap();
    let body = json!({"model": dir.path().file_name().unwrap().to_str().unwrap(), "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": true});
    let reply = post(&server, "/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let v = reply.json();
    assert_eq!(v["object"], "chat.completion");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"].as_str(), want.text.as_deref());
    assert_eq!(token_ids(&choice["token_ids"]), want.token_ids);
    assert_eq!(v["usage"]["prompt_tokens"], want.prompt_ids.len());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (ids, text, finish, usage) =
        collect_stream(&post(&server, "/v1/chat/completions", &streamed), true);
    assert_eq!(ids, want.token_ids);
    assert_eq!(Some(text.as_str()), want.text.as_deref());
    assert_eq!(finish, "length");
    assert!(usage.is_none(), "usage only when asked for");

    // The template's own exception is the client's mistake.
    let bad = json!({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "max_tokens": 2});
    let reply = post(&server, "/v1/chat/completions", &bad);
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(
        reply.body.contains("the system message must come first"),
        "{}",
        reply.body
    );

    // Without a template: a clear 400.
    let plain = start();
    let reply = post(
        &plain,
        "/v1/chat/completions",
        &json!({"messages": messages}),
    );
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert_eq!(reply.json()["error"]["code"], "no_chat_template");
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_request() {
    let server = start();
    let max_tokens = 480;
    let body = json!({"prompt": [3, 1, 4, 1, 5], "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut s = send(
        server.addr,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
    );
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    // Read until the first token's chunk has come, then hang up.
    while !String::from_utf8_lossy(&seen).contains("\"token_ids\":[") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"));
    drop(s);
    let m = wait_idle(&server.engine, 1);
    assert_eq!(
        (
            m.requests.running,
            m.requests.queued,
            m.cache.kv_blocks_used
        ),
        (0, 0, 0),
        "{m:?}"
    );
    assert_eq!((m.requests.finished, m.requests.failed), (1, 0), "{m:?}");
    assert!(
        m.steps.tokens_generated < max_tokens as u64,
        "the request ran to the end ({} tokens) instead of being cancelled",
        m.steps.tokens_generated
    );

    // Without streaming too: hanging up while waiting for the whole response cancels it.
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let s = send(
        server.addr,
        "POST",
        "/v1/completions",
        Some(&whole.to_string()),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.engine.metrics().steps.tokens_generated == m.steps.tokens_generated {
        assert!(Instant::now() < deadline, "the request never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(s);
    let m2 = wait_idle(&server.engine, 2);
    assert_eq!(
        (
            m2.requests.running,
            m2.cache.kv_blocks_used,
            m2.requests.failed
        ),
        (0, 0, 0),
        "{m2:?}"
    );
    assert!(
        m2.steps.tokens_generated - m.steps.tokens_generated < max_tokens as u64,
        "the request ran to the end instead of being cancelled: {m2:?}"
    );

    // And the server still serves.
    let reply = post(
        &server,
        "/v1/completions",
        &json!({"prompt": [1], "max_tokens": 2}),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
}

#[test]
fn metrics_and_models_endpoints() {
    let server = start();
    for i in 0..3u32 {
        let reply = post(
            &server,
            "/v1/completions",
            &json!({"prompt": [i + 1, 2], "max_tokens": 4, "ignore_eos": true}),
        );
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    // A 40-token prompt twice: the second is served 2 full blocks (32 tokens) from the prefix
    // cache.
    let long: Vec<u32> = (0..40).map(|t| t * 7 + 3).collect();
    for _ in 0..2 {
        let body = json!({"prompt": long, "max_tokens": 4, "ignore_eos": true});
        let reply = post(&server, "/v1/completions", &body);
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    wait_idle(&server.engine, 5);
    let reply = http(server.addr, "GET", "/metrics", None);
    assert_eq!(reply.status, 200);
    assert!(
        reply
            .header("content-type")
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let samples = parse_prometheus(&reply.body);
    let get = |n: &str| {
        samples
            .iter()
            .find(|(k, _)| k == n)
            .unwrap_or_else(|| panic!("no {n} in\n{}", reply.body))
            .1
    };
    assert_eq!(get("metrale_requests_finished_total"), 5.0);
    assert_eq!(get("metrale_generation_tokens_total"), 20.0);
    assert_eq!(get("metrale_prefix_cache_queries_total"), 86.0);
    assert_eq!(get("metrale_prefix_cache_hits_total"), 32.0);
    assert_eq!(get("metrale_prefix_cache_hit_rate"), 32.0 / 86.0);
    assert_eq!(get("metrale_prefix_cache_lookups_total"), 5.0);
    assert_eq!(get("metrale_prefix_cache_lookup_hits_total"), 1.0);
    assert_eq!(get("metrale_prefill_tokens_total"), 86.0 - 32.0);
    assert!(get("metrale_kv_blocks_cached") >= 2.0);
    assert_eq!(get("metrale_requests_running"), 0.0);
    assert_eq!(get("metrale_kv_blocks_used"), 0.0);
    assert!(get("metrale_kv_blocks_capacity") > 0.0);
    for n in [
        "metrale_requests_queued",
        "metrale_preemptions_total",
        "metrale_ssm_slots_used",
        "metrale_generation_tokens_per_second",
        "metrale_requests_failed_total",
    ] {
        get(n);
    }

    let models = http(server.addr, "GET", "/v1/models", None).json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "qwen3-tiny");
    assert_eq!(
        models["data"][0]["max_model_len"],
        server.engine.max_context()
    );
    let one = http(server.addr, "GET", "/v1/models/qwen3-tiny", None);
    assert_eq!(one.status, 200);
    assert_eq!(http(server.addr, "GET", "/health", None).status, 200);
}

#[test]
fn a_server_bound_from_options_serves_under_its_name_until_told_to_stop() {
    let missing = std::env::temp_dir().join("metrale-no-such-checkpoint");
    match metrale_server::Server::bind(ServerOptions::new(&missing)) {
        Err(e @ ServerError::Load { .. }) => {
            assert!(e.to_string().contains(&*missing.to_string_lossy()), "{e}")
        }
        other => panic!("{other:?}"),
    }

    let options = ServerOptions::new(tiny())
        .port(0)
        .served_model_name("tiny".to_string())
        .engine(options());
    let server = metrale_server::Server::bind(options).unwrap();
    let addr = server.local_addr();
    assert_eq!(server.model_id(), "tiny");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = std::thread::spawn(move || {
        server.run_until(async {
            let _ = stopped.await;
        })
    });
    assert_eq!(
        http(addr, "GET", "/v1/models", None).json()["data"][0]["id"],
        "tiny"
    );
    let body = json!({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": true});
    let reply = http(addr, "POST", "/v1/completions", Some(&body.to_string()));
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(token_ids(&reply.json()["choices"][0]["token_ids"]).len(), 3);
    stop.send(()).unwrap();
    serving.join().unwrap().unwrap();
}
