//! Logprobs of completions and chat completions, whole and streamed, in the OpenAI shapes.

use super::*;

/// The logprob entries of a completion's legacy `logprobs` (whole or the chunks of a stream):
/// `(token text, logprob, top map)` each.
fn legacy_entries(lp: &Value) -> Vec<(String, f64, Value)> {
    let n = lp["tokens"].as_array().unwrap().len();
    (0..n)
        .map(|i| {
            (
                lp["tokens"][i].as_str().unwrap().to_string(),
                lp["token_logprobs"][i].as_f64().unwrap(),
                lp["top_logprobs"][i].clone(),
            )
        })
        .collect()
}

#[test]
fn completions_report_logprobs_whole_and_streamed_and_sampling_fields_apply() {
    let server = start();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                      "ignore_eos": true, "logprobs": 3});
    let whole = post(&server, "/v1/completions", &body).json();
    let choice = &whole["choices"][0];
    let ids = token_ids(&choice["token_ids"]);
    let lp = &choice["logprobs"];
    let entries = legacy_entries(lp);
    assert_eq!(entries.len(), ids.len());
    let offsets: Vec<u64> = (lp["text_offset"].as_array().unwrap().iter())
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    for (i, (token, logprob, top)) in entries.iter().enumerate() {
        assert!(*logprob <= 0.0, "{lp}");
        let top = top.as_object().unwrap();
        // Up to 3 (byte tokens that are not whole characters all read U+FFFD and share a key).
        assert!((1..=3).contains(&top.len()), "{lp}");
        // Greedy: the chosen token is the most likely one, so it leads its top map.
        if !token.contains('\u{FFFD}') {
            assert_eq!(
                top[token.as_str()].as_f64(),
                Some(*logprob),
                "step {i}: {lp}"
            );
            let best = (top.values().map(|v| v.as_f64().unwrap())).fold(f64::MIN, f64::max);
            assert_eq!(best, *logprob, "step {i}: {lp}");
        }
        if i + 1 < offsets.len() {
            assert_eq!(offsets[i + 1] - offsets[i], token.chars().count() as u64);
        }
    }
    // Streamed: the same entries, chunk by chunk, offsets continuing.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let reply = post(&server, "/v1/completions", &streamed);
    let mut got = Vec::new();
    let mut stream_offsets = Vec::new();
    for e in reply.events().iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        let lp = &v["choices"][0]["logprobs"];
        if lp.is_object() {
            got.extend(legacy_entries(lp));
            stream_offsets.extend(
                lp["text_offset"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|o| o.as_u64().unwrap()),
            );
        }
    }
    assert_eq!(got, entries);
    assert_eq!(stream_offsets, offsets);
    // Without `logprobs` there are none; a bias of -100 on the first greedy token moves it.
    let plain = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "Once upon a time",
        "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
    )
    .json();
    assert!(plain["choices"][0]["logprobs"].is_null());
    assert_eq!(token_ids(&plain["choices"][0]["token_ids"]), ids);
    let biased = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "Once upon a time",
        "max_tokens": 8, "temperature": 0, "ignore_eos": true,
        "logit_bias": {ids[0].to_string(): -100}}),
    )
    .json();
    assert_ne!(token_ids(&biased["choices"][0]["token_ids"])[0], ids[0]);
}

#[test]
fn chat_completions_report_logprobs_in_the_chat_shape() {
    let template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let dir = chat_checkpoint(template);
    let server = start_with(dir.path(), options());
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2});
    let whole = post(&server, "/v1/chat/completions", &body).json();
    let choice = &whole["choices"][0];
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), token_ids(&choice["token_ids"]).len());
    for c in content {
        let token = c["token"].as_str().unwrap();
        let bytes: Vec<u8> = (c["bytes"].as_array().unwrap().iter())
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(bytes, token.as_bytes());
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(
            top[0]["logprob"], c["logprob"],
            "greedy: the chosen token leads"
        );
        assert!(top[0]["logprob"].as_f64().unwrap() >= top[1]["logprob"].as_f64().unwrap());
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let reply = post(&server, "/v1/chat/completions", &streamed);
    let mut got = Vec::new();
    for e in reply.events().iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(c) = v["choices"][0]["logprobs"]["content"].as_array() {
            got.extend(c.iter().cloned());
        }
    }
    assert_eq!(&got, content);
}
