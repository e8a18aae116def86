//! Bad requests: each gets its 4xx OpenAI-style JSON error, and the server keeps serving.

use super::*;

#[test]
fn bad_requests_get_4xx_json_errors_and_the_server_keeps_serving() {
    let server = start();
    let good = json!({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0});
    let long: Vec<u32> = (0..600).map(|i| i % 512).collect();
    // (method, path, body, status, param or code it must name)
    let cases: Vec<(&str, &str, Option<String>, u16, &str)> = vec![
        (
            "POST",
            "/v1/completions",
            Some("{\"prompt\": [1, 2".into()),
            400,
            "JSON",
        ),
        (
            "POST",
            "/v1/completions",
            Some("[1, 2]".into()),
            400,
            "JSON",
        ),
        ("POST", "/v1/completions", Some("{}".into()), 400, "prompt"),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": ""}).to_string()),
            400,
            "prompt",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": [1, 99999]}).to_string()),
            400,
            "prompt",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": [1, -3]}).to_string()),
            400,
            "prompt",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": long}).to_string()),
            400,
            "context_length_exceeded",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "temperature": -1}).to_string()),
            400,
            "temperature",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "top_p": 2}).to_string()),
            400,
            "top_p",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "top_k": -5}).to_string()),
            400,
            "top_k",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "max_tokens": -1}).to_string()),
            400,
            "max_tokens",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "max_tokens": "many"}).to_string()),
            400,
            "max_tokens",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "stop": [""]}).to_string()),
            400,
            "stop",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "n": 0}).to_string()),
            400,
            "n",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "logprobs": 21}).to_string()),
            400,
            "logprobs",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "top_logprobs": 2}).to_string()),
            400,
            "top_logprobs",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "presence_penalty": 2.5}).to_string()),
            400,
            "presence_penalty",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "logit_bias": {"99999999": 1}}).to_string()),
            400,
            "logit_bias",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "min_tokens": 2, "stop_token_ids": [7, 99999]}).to_string()),
            400,
            "stop_token_ids",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "repetition_penalty": 0}).to_string()),
            400,
            "repetition_penalty",
        ),
        (
            "POST",
            "/v1/completions",
            Some(json!({"prompt": "a", "model": "gpt-4"}).to_string()),
            404,
            "model_not_found",
        ),
        (
            "POST",
            "/v1/chat/completions",
            Some(json!({"messages": "hi"}).to_string()),
            400,
            "messages",
        ),
        ("GET", "/v1/completions", None, 405, "method_not_allowed"),
        ("GET", "/v1/nothing", None, 404, "not_found"),
        ("GET", "/v1/models/gpt-4", None, 404, "model_not_found"),
    ];
    // Each case is followed by one good request: only those reach the engine.
    let good_requests = cases.len() as u64;
    for (method, path, body, status, names) in cases {
        let reply = http(server.addr, method, path, body.as_deref());
        let what = format!("{method} {path} {body:?}");
        assert_eq!(reply.status, status, "{what}: {}", reply.body);
        let err = &reply.json()["error"];
        for field in ["message", "type"] {
            assert!(err[field].is_string(), "{what}: {err}");
        }
        assert!(
            err.get("param").is_some() && err.get("code").is_some(),
            "{what}: {err}"
        );
        assert!(
            err["param"] == names
                || err["code"] == names
                || err["message"].as_str().unwrap().contains(names),
            "{what}: {err} does not name {names}"
        );
        let ok = post(&server, "/v1/completions", &good);
        assert_eq!(ok.status, 200, "after {what}: {}", ok.body);
    }
    let m = wait_idle(&server.engine, good_requests);
    assert_eq!(
        (m.requests.finished, m.requests.failed),
        (good_requests, 0),
        "only the good requests reached the engine"
    );

    // A full queue is 429 with Retry-After.
    let full = start_with(&tiny(), options().max_queued_requests(0));
    let reply = post(&full, "/v1/completions", &good);
    assert_eq!(reply.status, 429, "{}", reply.body);
    assert_eq!(reply.json()["error"]["code"], "queue_full");
    assert_eq!(reply.header("retry-after"), Some("1"));
}
