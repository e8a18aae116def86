//! The engine as a service: requests submitted concurrently from several threads get exactly
//! their solo outputs; a bad request gets its typed error and the others complete; cancellation
//! (explicit, or by dropping the handle) ends a request with `cancelled` and frees its cache;
//! stop strings cut the text; the async stream yields what the blocking iterator does; a
//! repeated prompt, and a follow-up turn repeating a conversation, are served from the prefix
//! cache, bitwise as without it, and the metrics count the hits.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

mod support;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use metrale::{
    Engine, EngineError, EngineMetrics, EngineOptions, FinishReason, GenerateEvent, GenerateOutput,
    GenerateRequest, ModelOptions, Prompt, RequestError, RequestHandle, SamplingParams,
};
use support::fixtures_dir;

fn engine(fixture: &str, options: EngineOptions) -> Engine {
    Engine::load(fixtures_dir().join(fixture), options).unwrap_or_else(|e| panic!("{fixture}: {e}"))
}

fn options() -> EngineOptions {
    EngineOptions::default().model(
        ModelOptions::default()
            .max_batch_tokens(16)
            .max_decode_seqs(8),
    )
}

/// Request `i` of a varied set: prompts of 1 to 60 tokens, greedy and sampled, some stopping at
/// EOS.
fn request(i: usize, vocab: u32) -> GenerateRequest {
    let len = 1 + (i * 23) % 60;
    let prompt = (0..len)
        .map(|t| ((t * 37 + i * 101 + 7) as u32) % vocab)
        .collect();
    let sampling = match i % 3 {
        0 => SamplingParams::default(),
        1 => SamplingParams::default().temperature(0.8).seed(i as u64),
        _ => SamplingParams::default()
            .temperature(1.2)
            .top_k(30)
            .top_p(0.95)
            .seed(1000 + i as u64),
    };
    GenerateRequest::new(Prompt::TokenIds(prompt))
        .max_new_tokens(8 + (i * 7) % 25)
        .sampling(sampling)
        .ignore_eos(i.is_multiple_of(2))
        .return_logits(true)
}

/// Which error a bad request must get.
type Expected = fn(&RequestError) -> bool;

fn assert_same(got: &GenerateOutput, want: &GenerateOutput, what: &str) {
    assert_eq!(got.token_ids, want.token_ids, "{what}: tokens");
    assert_eq!(
        got.finish_reason, want.finish_reason,
        "{what}: finish reason"
    );
    assert_eq!(got.text, want.text, "{what}: text");
    let (g, w) = (
        got.logits.as_ref().expect("logits"),
        want.logits.as_ref().expect("logits"),
    );
    assert_eq!(g.len(), w.len(), "{what}: logits rows");
    for (step, (x, y)) in g.iter().zip(w).enumerate() {
        assert!(
            x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: logits of step {step} differ"
        );
    }
}

/// Poll the metrics until `done` holds (the scheduler thread records them right after it sends
/// the last event of a step).
fn metrics_until(engine: &Engine, done: impl Fn(&EngineMetrics) -> bool) -> EngineMetrics {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let m = engine.metrics();
        if done(&m) || Instant::now() > deadline {
            return m;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn the_engine_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Engine>();
    fn check_send<T: Send>() {}
    check_send::<RequestHandle>();
}

#[test]
fn concurrent_submits_from_several_threads_get_their_solo_outputs() {
    let solo_engine = engine("qwen3-tiny", options());
    let vocab = solo_engine.config().tokens.vocab_size as u32;
    let requests: Vec<GenerateRequest> = (0..16).map(|i| request(i, vocab)).collect();
    let solo: Vec<GenerateOutput> = requests
        .iter()
        .map(|r| solo_engine.generate(r).expect("solo"))
        .collect();
    let solo_steps = solo_engine.metrics().steps.steps;

    let shared = Arc::new(engine("qwen3-tiny", options()));
    let barrier = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (engine, barrier) = (shared.clone(), barrier.clone());
            let mine: Vec<(usize, GenerateRequest)> = requests
                .iter()
                .cloned()
                .enumerate()
                .filter(|(i, _)| i % 4 == t)
                .collect();
            std::thread::spawn(move || {
                barrier.wait();
                let handles: Vec<(usize, RequestHandle)> = mine
                    .into_iter()
                    .map(|(i, r)| (i, engine.submit(r).expect("valid")))
                    .collect();
                handles
                    .into_iter()
                    .map(|(i, h)| (i, h.wait().expect("finishes")))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut seen = 0;
    for t in threads {
        for (i, out) in t.join().expect("thread") {
            assert_same(&out, &solo[i], &format!("request {i}"));
            seen += 1;
        }
    }
    assert_eq!(seen, requests.len());
    let m = metrics_until(&shared, |m| m.requests.finished == requests.len() as u64);
    assert!(
        m.steps.steps < solo_steps,
        "{} steps together, {solo_steps} alone: the requests were never batched",
        m.steps.steps
    );
    let total: usize = solo.iter().map(|o| o.token_ids.len()).sum();
    assert_eq!(m.steps.tokens_generated, total as u64);
    assert_eq!(
        (
            m.requests.running,
            m.requests.queued,
            m.cache.kv_blocks_used
        ),
        (0, 0, 0)
    );
}

#[test]
fn a_repeated_prompt_is_served_from_the_prefix_cache_and_the_metrics_count_it() {
    // Hits, of the 100-token prompt: 6 blocks of 16 (dense); up to the SSM snapshot at 64
    // (hybrid).
    for (fixture, hit) in [("qwen3-tiny", 96u64), ("qwen3_5-tiny", 64)] {
        let warm = engine(fixture, options());
        let cold = engine(
            fixture,
            options().model(options().model.prefix_caching(false)),
        );
        let vocab = warm.config().tokens.vocab_size as u32;
        let prompt: Vec<u32> = (0..100u32).map(|t| (t * 53 + 11) % vocab).collect();
        let req = GenerateRequest::new(Prompt::TokenIds(prompt))
            .max_new_tokens(6)
            .ignore_eos(true)
            .return_logits(true);
        let want = cold.generate(&req).expect("cold");
        for run in 0..2 {
            let got = warm.generate(&req).expect("warm");
            assert_same(&got, &want, &format!("{fixture}, run {run}"));
        }
        let m = metrics_until(&warm, |m| {
            m.requests.finished == 2 && m.requests.running == 0
        });
        assert_eq!(
            (m.steps.prefix.queries, m.steps.prefix.hits),
            (2, 1),
            "{fixture}"
        );
        assert_eq!(
            (m.steps.prefix.query_tokens, m.steps.prefix.hit_tokens),
            (200, hit)
        );
        assert_eq!(m.prefix_hit_rate, hit as f64 / 200.0);
        assert_eq!(
            m.steps.prefill_tokens,
            200 - hit,
            "{fixture}: the hit skips prefill"
        );
        assert!(
            m.cache.kv_blocks_cached >= 6 && m.cache.kv_blocks_used == 0,
            "{m:?}"
        );
        if fixture == "qwen3_5-tiny" {
            assert!(
                m.cache.snapshots.used >= 1 && m.cache.snapshots.total == 16,
                "{m:?}"
            );
        }
        let c = metrics_until(&cold, |m| {
            m.requests.finished == 1 && m.requests.running == 0
        });
        assert_eq!(
            (
                c.steps.prefix.queries,
                c.steps.prefix.hit_tokens,
                c.prefix_hit_rate
            ),
            (0, 0, 0.0)
        );
        assert_eq!((c.steps.prefill_tokens, c.cache.kv_blocks_cached), (100, 0));
    }
}

#[test]
fn a_follow_up_turn_is_served_from_the_prefix_cache_and_the_metrics_count_it() {
    // Turn 1: 70 prompt tokens answered with 30, 99 of them fed (6 full blocks). Turn 2 repeats
    // them and adds 9 (109 tokens). Hits: the 6 blocks, the answer's included (dense; the
    // prompt's alone are 4); up to the prompt's SSM snapshot at 64 (hybrid). Cached after
    // turn 2: its 114 fed tokens' 7 blocks (dense); the two prompts' 4 and 6 blocks, shared
    // (hybrid).
    for (fixture, hit, cached) in [("qwen3-tiny", 96u64, 7), ("qwen3_5-tiny", 64, 6)] {
        let warm = engine(fixture, options());
        let cold = engine(
            fixture,
            options().model(options().model.prefix_caching(false)),
        );
        let vocab = warm.config().tokens.vocab_size as u32;
        let turn = |prompt: &[u32], n: usize| {
            GenerateRequest::new(Prompt::TokenIds(prompt.to_vec()))
                .max_new_tokens(n)
                .ignore_eos(true)
                .return_logits(true)
        };
        let mut prompt: Vec<u32> = (0..70u32).map(|t| (t * 29 + 5) % vocab).collect();
        for (k, n) in [30, 6].into_iter().enumerate() {
            let got = warm.generate(&turn(&prompt, n)).expect("warm");
            let want = cold.generate(&turn(&prompt, n)).expect("cold");
            assert_same(&got, &want, &format!("{fixture}, turn {k}"));
            prompt.extend(&got.token_ids);
            prompt.extend((0..9u32).map(|t| (t * 13 + 3) % vocab));
        }
        let m = metrics_until(&warm, |m| {
            m.requests.finished == 2 && m.requests.running == 0
        });
        assert_eq!(
            (m.steps.prefix.queries, m.steps.prefix.hits),
            (2, 1),
            "{fixture}"
        );
        assert_eq!(
            (m.steps.prefix.query_tokens, m.steps.prefix.hit_tokens),
            (70 + 109, hit),
            "{fixture}"
        );
        assert_eq!(m.steps.prefill_tokens, 70 + 109 - hit, "{fixture}");
        assert_eq!(
            (m.cache.kv_blocks_used, m.cache.kv_blocks_cached),
            (0, cached),
            "{fixture}"
        );
    }
}

#[test]
fn a_bad_request_among_good_ones_gets_its_error_and_the_others_complete() {
    let options = options().model(options().model.max_seq_len(64));
    let solo_engine = engine("qwen3-tiny", options.clone());
    let e = engine("qwen3-tiny", options);
    let vocab = e.config().tokens.vocab_size as u32;
    let good: Vec<GenerateRequest> = (0..6).map(|i| request(i, vocab)).collect();
    let mut handles = Vec::new();
    let bad: Vec<(GenerateRequest, Expected)> = vec![
        (GenerateRequest::new(Prompt::TokenIds(vec![])), |e| {
            matches!(e, RequestError::EmptyPrompt)
        }),
        (GenerateRequest::new(Prompt::TokenIds(vec![3; 65])), |e| {
            matches!(e, RequestError::PromptTooLong { len: 65, max: 64 })
        }),
        (
            GenerateRequest::new(Prompt::TokenIds(vec![1, 2, vocab + 5])),
            |e| matches!(e, RequestError::TokenOutOfVocab { index: 2, .. }),
        ),
        (
            GenerateRequest::new(Prompt::TokenIds(vec![1]))
                .sampling(SamplingParams::default().temperature(f32::NAN)),
            |e| matches!(e, RequestError::Sampling(s) if s.field == "temperature"),
        ),
        (
            GenerateRequest::new(Prompt::TokenIds(vec![1]))
                .stop_strings(vec!["ok".into(), String::new()]),
            |e| matches!(e, RequestError::EmptyStopString { index: 1 }),
        ),
    ];
    for (i, (g, (b, want))) in good.iter().zip(&bad).enumerate() {
        handles.push((i, e.submit(g.clone()).expect("a good request is accepted")));
        match e.submit(b.clone()) {
            Err(EngineError::Request(err)) => {
                assert!(want(&err), "unexpected error {err:?} for {b:?}")
            }
            other => panic!("{b:?} gave {other:?}"),
        }
    }
    handles.push((5, e.submit(good[5].clone()).expect("accepted")));
    for (i, h) in handles {
        assert_same(
            &h.wait().expect("a good request completes"),
            &solo_engine.generate(&good[i]).expect("solo"),
            &format!("request {i}"),
        );
    }
}

#[test]
fn cancel_stops_a_request_and_frees_its_cache_and_state() {
    // The hybrid fixture: cancellation must free the SSM slot as well as the KV blocks.
    let e = engine("qwen3_5-tiny", options());
    let long = GenerateRequest::new(Prompt::TokenIds((1..40).collect()))
        .max_new_tokens(400)
        .ignore_eos(true);
    let mut h = e.submit(long.clone()).expect("valid");
    let other = e.submit(request(3, 200)).expect("valid");
    let mut tokens = Vec::new();
    while tokens.len() < 5 {
        match h.next().expect("an event").expect("no error") {
            GenerateEvent::Token(t) => tokens.push(t.token_id),
            GenerateEvent::Finished { .. } => panic!("finished before it was cancelled"),
            other => panic!("unexpected {other:?}"),
        }
    }
    let busy = e.metrics();
    assert!(
        busy.cache.kv_blocks_used > 0 && busy.cache.ssm_slots_used > 0,
        "{busy:?}"
    );
    h.cancel();
    let out = h
        .wait()
        .expect("a cancelled request still yields its output");
    assert_eq!(out.finish_reason, FinishReason::Cancelled);
    assert!(
        out.token_ids.len() >= 5 && out.token_ids.len() < 400,
        "{} tokens",
        out.token_ids.len()
    );
    assert!(out.token_ids.starts_with(&tokens));
    let solo = engine("qwen3_5-tiny", options())
        .generate(&long.clone().max_new_tokens(out.token_ids.len()))
        .expect("solo");
    assert_eq!(
        out.token_ids, solo.token_ids,
        "the tokens before the cancellation are the solo ones"
    );
    other.wait().expect("the other request is not disturbed");

    // Dropping a handle cancels its request too.
    let dropped = e.submit(long).expect("valid");
    std::thread::sleep(Duration::from_millis(20));
    drop(dropped);
    let m = metrics_until(&e, |m| m.requests.finished == 3 && m.requests.running == 0);
    assert_eq!(
        (m.requests.finished, m.requests.running, m.requests.queued),
        (3, 0, 0),
        "{m:?}"
    );
    assert_eq!(
        (m.cache.kv_blocks_used, m.cache.ssm_slots_used),
        (0, 0),
        "every block and slot is free: {m:?}"
    );
    assert!(
        m.cache.kv_blocks_total > 0 && m.cache.ssm_slots_total == 8,
        "{m:?}"
    );
}

#[test]
fn generate_stream_stops_right_after_the_token_that_breaks() {
    let e = engine("qwen3-tiny", options());
    let req = GenerateRequest::new(Prompt::TokenIds(vec![5, 6, 7]))
        .max_new_tokens(50)
        .ignore_eos(true)
        .return_logits(true);
    let mut seen = 0;
    let out = e
        .generate_stream(&req, |_, _| {
            seen += 1;
            if seen == 4 {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            }
        })
        .expect("generate");
    assert_eq!(
        (out.token_ids.len(), out.finish_reason),
        (4, FinishReason::Cancelled)
    );
    assert_eq!(out.logits.as_ref().map(Vec::len), Some(4));
    let full = e.generate(&req).expect("generate");
    assert_eq!(out.token_ids, full.token_ids[..4]);
}

#[test]
fn a_stop_string_cuts_the_text_and_the_deltas_add_up() {
    let e = engine("qwen3-tiny", options());
    let req = GenerateRequest::new(Prompt::Text("hello world".into()))
        .max_new_tokens(40)
        .ignore_eos(true);
    let full = e.generate(&req).expect("generate");
    let text = full.text.clone().expect("the fixture has a tokenizer");
    // A stop string from the middle of the text: three characters starting a third of the way.
    let chars: Vec<char> = text.chars().collect();
    assert!(
        chars.len() >= 9,
        "the fixture's text is too short to cut: {text:?}"
    );
    let stop: String = chars[chars.len() / 3..chars.len() / 3 + 3].iter().collect();
    let cut = &text[..text.find(&stop).expect("present")];

    let mut h = e
        .submit(req.clone().stop_strings(vec![stop.clone()]))
        .expect("valid");
    let (mut deltas, mut out) = (String::new(), None);
    for ev in &mut h {
        match ev.expect("no error") {
            GenerateEvent::Token(t) => deltas.push_str(&t.text_delta.expect("text")),
            GenerateEvent::Finished { output } => out = Some(output),
            other => panic!("unexpected {other:?}"),
        }
    }
    let out = out.expect("finished");
    assert_eq!(out.finish_reason, FinishReason::Stop);
    assert_eq!(
        out.text.as_deref(),
        Some(cut),
        "the text stops before {stop:?}"
    );
    assert_eq!(deltas, cut, "the deltas never show the stop string");
    assert!(
        full.token_ids.starts_with(&out.token_ids) && out.token_ids.len() < full.token_ids.len()
    );

    // Without a stop string the deltas add up to the whole text.
    let deltas: String = e
        .submit(req)
        .expect("valid")
        .filter_map(|ev| match ev.expect("no error") {
            GenerateEvent::Token(t) => t.text_delta,
            _ => None,
        })
        .collect();
    assert_eq!(deltas, text);
}

#[test]
fn the_queue_limit_refuses_requests_with_queue_full() {
    let e = engine(
        "qwen3-tiny",
        options()
            .model(options().model.max_decode_seqs(1))
            .max_queued_requests(2),
    );
    let req = GenerateRequest::new(Prompt::TokenIds(vec![1, 2, 3]))
        .max_new_tokens(60)
        .ignore_eos(true);
    let mut accepted = Vec::new();
    let mut refused = 0;
    for _ in 0..10 {
        match e.submit(req.clone()) {
            Ok(h) => accepted.push(h),
            Err(EngineError::QueueFull { max: 2 }) => refused += 1,
            Err(other) => panic!("{other}"),
        }
    }
    // One runs and two wait at most, while the first needs 60 steps to finish.
    assert!(
        accepted.len() <= 3 && refused >= 7,
        "{} accepted, {refused} refused",
        accepted.len()
    );
    let first = accepted.remove(0).wait().expect("completes");
    for h in accepted {
        assert_eq!(h.wait().expect("completes").token_ids, first.token_ids);
    }
}

/// A minimal executor: poll the future on this thread, parking between wake-ups.
fn block_on<F: Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            Poll::Pending => std::thread::park(),
        }
    }
}

/// The next item of a stream, as a future.
struct Next<'a>(&'a mut RequestHandle);

impl Future for Next<'_> {
    type Output = Option<metrale::EventResult>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        futures_core::Stream::poll_next(Pin::new(&mut *self.0), cx)
    }
}

#[test]
fn the_async_stream_yields_what_the_iterator_does() {
    let e = engine("qwen3-tiny", options());
    let req = GenerateRequest::new(Prompt::Text("the stream".into()))
        .max_new_tokens(24)
        .ignore_eos(true)
        .return_logits(true);
    let iterated: Vec<GenerateEvent> = e
        .submit(req.clone())
        .expect("valid")
        .map(|ev| ev.expect("no error"))
        .collect();
    let mut handle = e.submit(req).expect("valid");
    let streamed = block_on(async {
        let mut events = Vec::new();
        while let Some(ev) = Next(&mut handle).await {
            events.push(ev.expect("no error"));
        }
        events
    });
    assert_eq!(iterated.len(), 25, "24 tokens and the output");
    assert!(matches!(
        iterated.last(),
        Some(GenerateEvent::Finished { .. })
    ));
    assert_eq!(streamed, iterated);
}
