//! `n` and `best_of` on the OpenAI endpoints, as a vLLM client sees them: `n` choices over a
//! long prompt prefill it once (`metrale_prefill_tokens_total` rises by its length, not `n`
//! times it), come back with indices `0..n`, differ from each other when sampled, reproduce with
//! a seed, and each is the solo run of its choice seed; greedy choices are identical; streamed
//! choices carry their index and each ends with its own finish chunk, before one usage chunk and
//! `[DONE]`; `best_of` returns the `n` of highest cumulative logprob, best first, and is refused
//! with `stream`; out-of-range counts (and more choices than the engine runs at once) get a 400
//! naming the field.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeMap;

use metrale::{EngineOptions, GenerateRequest, ModelOptions, Prompt, SamplingParams, choice_seed};
use metrale_testkit::Rng;
use serde_json::{Value, json};
use support::*;

/// The tiny model with room for a ~1,000-token prompt and several choices.
fn long_options() -> EngineOptions {
    EngineOptions::default().model(
        ModelOptions::default()
            .max_batch_tokens(256)
            .max_decode_seqs(8)
            .max_seq_len(1200),
    )
}

/// `len` token ids drawn from the tiny vocabulary, EOS (0) left out.
fn long_prompt(len: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..len)
        .map(|_| 1 + (rng.next_u64() % 511) as u32)
        .collect()
}

fn metric(server: &Server, name: &str) -> f64 {
    let reply = http(server.addr, "GET", "/metrics", None);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let samples = parse_prometheus(&reply.body);
    samples.iter().find(|(n, _)| n == name).unwrap().1
}

/// Each choice's token ids, by index, checking the indices are `0..n` in order.
fn choices_of(v: &Value) -> Vec<Vec<u32>> {
    let choices = v["choices"].as_array().unwrap();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
    }
    choices.iter().map(|c| token_ids(&c["token_ids"])).collect()
}

#[test]
fn n_choices_prefill_the_prompt_once_and_each_is_the_solo_run_of_its_seed() {
    let server = start_with(&tiny(), long_options());
    let prompt = long_prompt(1000, 1);
    let body = json!({"prompt": prompt, "n": 4, "max_tokens": 8, "temperature": 1.0,
        "seed": 5, "ignore_eos": true});
    let prefilled = metric(&server, "metrale_prefill_tokens_total");
    let generated = metric(&server, "metrale_generation_tokens_total");
    let reply = post(&server, "/v1/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    wait_idle(&server.engine, 1);
    assert_eq!(
        metric(&server, "metrale_prefill_tokens_total") - prefilled,
        1000.0,
        "the prompt is prefilled once for its 4 choices"
    );
    assert_eq!(
        metric(&server, "metrale_generation_tokens_total") - generated,
        32.0
    );
    let v = reply.json();
    let choices = choices_of(&v);
    assert_eq!(choices.len(), 4);
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 1000, "completion_tokens": 32, "total_tokens": 1032})
    );
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c.len(), 8, "choice {i}");
        assert_eq!(v["choices"][i]["finish_reason"], "length");
        for later in &choices[i + 1..] {
            assert_ne!(c, later, "sampled choices differ");
        }
    }
    // A seed reproduces every choice.
    let again = post(&server, "/v1/completions", &body).json();
    assert_eq!(choices_of(&again), choices);
    // Choice c is the request of one choice seeded `choice_seed(seed, c)`: its siblings change
    // nothing in it.
    for (c, tokens) in choices.iter().enumerate() {
        let solo = GenerateRequest::new(Prompt::TokenIds(prompt.clone()))
            .max_new_tokens(8)
            .ignore_eos(true)
            .sampling(
                SamplingParams::default()
                    .temperature(1.0)
                    .seed(choice_seed(5, c)),
            );
        let out = server.engine.generate(&solo).unwrap();
        assert_eq!(&out.token_ids, tokens, "choice {c}");
        assert_eq!(
            v["choices"][c]["text"].as_str(),
            out.text.as_deref(),
            "choice {c}"
        );
    }
}

#[test]
fn greedy_choices_are_identical() {
    let server = start();
    let body = json!({"prompt": [3, 1, 4, 1, 5], "n": 2, "max_tokens": 12, "temperature": 0,
        "ignore_eos": true});
    let v = post(&server, "/v1/completions", &body).json();
    let choices = choices_of(&v);
    let alone = server
        .engine
        .generate(&greedy(Prompt::TokenIds(vec![3, 1, 4, 1, 5]), 12).ignore_eos(true))
        .unwrap();
    assert_eq!(choices, vec![alone.token_ids.clone(), alone.token_ids]);
    assert_eq!(v["usage"]["completion_tokens"], 24);
}

/// A streamed choice: its token ids, its text (or chat content) and its finish reason.
type Streamed = (Vec<u32>, String, String);

/// The chunks of a stream of `n` choices, by index: token ids, text (or chat content), finish
/// reason; and the usage chunk. Checks that every chunk holds one choice, that each choice
/// has exactly one finish chunk after which it sends nothing, and that the usage chunk and
/// `[DONE]` come last.
fn streamed_choices(reply: &Reply, chat: bool) -> (BTreeMap<usize, Streamed>, Value) {
    assert_eq!(reply.status, 200, "{}", reply.body);
    let events = reply.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut out: BTreeMap<usize, (Vec<u32>, String, Option<String>)> = BTreeMap::new();
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        assert!(usage.is_none(), "a chunk after the usage chunk: {e}");
        let v: Value = serde_json::from_str(e).unwrap();
        let choices = v["choices"].as_array().unwrap();
        if choices.is_empty() {
            usage = Some(v["usage"].clone());
            continue;
        }
        assert_eq!(choices.len(), 1, "one choice per chunk: {e}");
        let c = &choices[0];
        let entry = out
            .entry(c["index"].as_u64().unwrap() as usize)
            .or_default();
        assert!(entry.2.is_none(), "a chunk after its choice's finish: {e}");
        entry.0.extend(token_ids(&c["token_ids"]));
        let piece = if chat {
            c["delta"]["content"].as_str()
        } else {
            c["text"].as_str()
        };
        entry.1 += piece.unwrap_or("");
        entry.2 = c["finish_reason"].as_str().map(str::to_string);
    }
    let out = (out.into_iter())
        .map(|(i, (ids, text, finish))| (i, (ids, text, finish.expect("a finish chunk"))))
        .collect();
    (out, usage.expect("a usage chunk"))
}

#[test]
fn streamed_choices_carry_their_index_and_end_one_by_one_with_their_logprobs() {
    let server = start();
    let body = json!({"prompt": [7, 7, 2, 9], "n": 3, "max_tokens": 10, "temperature": 1.0,
        "seed": 13, "ignore_eos": true, "logprobs": 2});
    let whole = post(&server, "/v1/completions", &body).json();
    let choices = choices_of(&whole);
    for (i, c) in whole["choices"].as_array().unwrap().iter().enumerate() {
        let lp = &c["logprobs"];
        assert_eq!(
            lp["token_logprobs"].as_array().unwrap().len(),
            choices[i].len()
        );
        assert_eq!(lp["text_offset"][0], 0, "each choice's offsets start at 0");
    }
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    streaming["stream_options"] = json!({"include_usage": true});
    let reply = post(&server, "/v1/completions", &streaming);
    let (streamed, usage) = streamed_choices(&reply, false);
    assert_eq!(streamed.len(), 3);
    for (i, (ids, text, finish)) in &streamed {
        assert_eq!(ids, &choices[*i], "choice {i}");
        assert_eq!(Some(text.as_str()), whole["choices"][i]["text"].as_str());
        assert_eq!(finish, "length");
    }
    assert_eq!(usage, whole["usage"]);
    assert_eq!(usage["completion_tokens"], 30);
}

#[test]
fn chat_choices_are_read_apart_each_whole_and_streamed() {
    let template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let dir = chat_checkpoint(template);
    let server = start_with(dir.path(), options());
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "n": 2,
        "max_tokens": 9, "temperature": 1.0, "seed": 3, "ignore_eos": true});
    let whole = post(&server, "/v1/chat/completions", &body).json();
    let choices = choices_of(&whole);
    assert_ne!(choices[0], choices[1]);
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    streaming["stream_options"] = json!({"include_usage": true});
    let reply = post(&server, "/v1/chat/completions", &streaming);
    // Every choice opens with the assistant's role.
    let roles: Vec<u64> = (reply.events().iter())
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter(|v| v["choices"][0]["delta"]["role"] == "assistant")
        .map(|v| v["choices"][0]["index"].as_u64().unwrap())
        .collect();
    assert_eq!(roles, vec![0, 1]);
    let (streamed, usage) = streamed_choices(&reply, true);
    for (i, (ids, content, finish)) in &streamed {
        let c = &whole["choices"][i];
        assert_eq!(ids, &choices[*i], "choice {i}");
        assert_eq!(Some(content.as_str()), c["message"]["content"].as_str());
        assert_eq!(finish, "length");
    }
    assert_eq!(usage, whole["usage"]);
}

#[test]
fn best_of_returns_the_n_highest_scoring_choices_best_first() {
    let server = start();
    let prompt = [5, 17, 3, 250, 9, 41];
    let run = |seed: u64, extra: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 1.0,
            "seed": seed, "ignore_eos": true});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let reply = post(&server, "/v1/completions", &body);
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()
    };
    // The candidates: `best_of` runs the choices `n = best_of` would, seed for seed. The first
    // seed whose two best candidates are not its first two makes the ranking visible.
    let (seed, all, best) = (0..32)
        .find_map(|seed| {
            let all = run(seed, json!({"n": 5, "logprobs": 0}));
            let mut scored: Vec<(f64, Vec<u32>)> = (all["choices"].as_array().unwrap().iter())
                .map(|c| {
                    let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
                    let score = lps.iter().map(|l| l.as_f64().unwrap()).sum();
                    (score, token_ids(&c["token_ids"]))
                })
                .collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0));
            let best: Vec<Vec<u32>> = scored[..2].iter().map(|(_, t)| t.clone()).collect();
            (best != choices_of(&all)[..2]).then_some((seed, all, best))
        })
        .expect("a seed whose ranking reorders the candidates");
    for extra in [
        json!({"n": 2, "best_of": 5}),
        json!({"n": 2, "best_of": 5, "logprobs": 0}),
    ] {
        let v = run(seed, extra.clone());
        assert_eq!(choices_of(&v), best, "seed {seed}, {extra}");
        assert_eq!(
            v["usage"]["completion_tokens"], 12,
            "the returned choices' tokens"
        );
    }
    // `best_of` = `n` ranks nothing: the choices of `n` alone.
    assert_eq!(
        choices_of(&run(seed, json!({"n": 3, "best_of": 3}))),
        choices_of(&all)[..3].to_vec()
    );
}

#[test]
fn bad_choice_counts_get_a_400_naming_the_field() {
    let dir = chat_checkpoint("{{ messages[0].content }}");
    let server = start_with(dir.path(), options());
    let completion = |extra: Value| {
        let mut body = json!({"prompt": [1, 2], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "x"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    for (path, body, param) in [
        ("/v1/completions", completion(json!({"n": 0})), "n"),
        ("/v1/completions", completion(json!({"n": 65})), "n"),
        ("/v1/completions", completion(json!({"n": -1})), "n"),
        ("/v1/completions", completion(json!({"n": "two"})), "n"),
        (
            "/v1/completions",
            completion(json!({"n": 3, "best_of": 2})),
            "best_of",
        ),
        (
            "/v1/completions",
            completion(json!({"best_of": 65})),
            "best_of",
        ),
        (
            "/v1/completions",
            completion(json!({"best_of": -2})),
            "best_of",
        ),
        (
            "/v1/completions",
            completion(json!({"best_of": 3, "stream": true})),
            "best_of",
        ),
        // More choices than the engine runs at once (`max_decode_seqs` 8) could never start.
        ("/v1/completions", completion(json!({"n": 9})), "n"),
        (
            "/v1/completions",
            completion(json!({"n": 2, "best_of": 9})),
            "best_of",
        ),
        ("/v1/chat/completions", chat(json!({"n": 0})), "n"),
        (
            "/v1/chat/completions",
            chat(json!({"best_of": 2})),
            "best_of",
        ),
    ] {
        let reply = post(&server, path, &body);
        assert_eq!(reply.status, 400, "{path} {body}: {}", reply.body);
        assert_eq!(reply.json()["error"]["param"], param, "{path} {body}");
    }
    // None of them reached the engine, and it still serves.
    assert_eq!(server.engine.metrics().requests.finished, 0);
    let ok = post(&server, "/v1/completions", &completion(json!({"n": 8})));
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.json()["choices"].as_array().unwrap().len(), 8);
}
