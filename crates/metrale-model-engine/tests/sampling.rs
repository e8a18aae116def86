//! The device sampler through the scheduler, on the CPU backend: each generated token is what
//! the penalties, logit bias and min_tokens make of the step's logits (recomputed here from the
//! returned raw logits, as transformers and vLLM define them); logprobs are the log_softmax of
//! those logits; a seed reproduces a sampled request and its tokens do not depend on the
//! requests beside it; sequences with such sampling never draft.

#![allow(clippy::unwrap_used)]

mod support;

use metrale_model_engine::ModelOptions;
use metrale_model_engine::generate::{GenerateParams, Generation};
use metrale_model_engine::sampling::SamplingParams;

use support::{load_plain, params, request, run};

const FIXTURE: &str = "qwen3-tiny";

fn prompt(i: usize) -> Vec<u32> {
    (0..(5 + 3 * i))
        .map(|t| ((t * 37 + i * 11) % 200) as u32 + 3)
        .collect()
}

/// `x` under the penalties of a sequence whose context so far is `prompt` + `out`, then `bias`.
fn transformed(x: &[f32], p: &SamplingParams, prompt: &[u32], out: &[u32]) -> Vec<f32> {
    let mut y = x.to_vec();
    for (t, v) in y.iter_mut().enumerate() {
        let t = t as u32;
        let count = out.iter().filter(|&&o| o == t).count() as f32;
        if count > 0.0 || prompt.contains(&t) {
            *v = if *v < 0.0 {
                *v * p.repetition_penalty
            } else {
                *v / p.repetition_penalty
            };
        }
        if count > 0.0 {
            *v -= p.frequency_penalty * count;
            *v -= p.presence_penalty;
        }
    }
    for &(t, b) in &p.logit_bias {
        y[t as usize] += b;
    }
    y
}

fn first_max(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let s: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
    x.iter().map(|&v| v as f64 - m - s.ln()).collect()
}

#[test]
fn greedy_tokens_follow_the_penalties_and_bias_and_logprobs_are_the_raw_log_softmax() {
    let mut s = load_plain(FIXTURE, ModelOptions::default().max_decode_seqs(4));
    let q = prompt(2);
    let plain = run(&mut s, &q, &params(12, SamplingParams::default()));
    let cases = [
        SamplingParams::default().repetition_penalty(1.8),
        SamplingParams::default()
            .frequency_penalty(1.5)
            .presence_penalty(0.7),
        SamplingParams::default()
            .repetition_penalty(1.3)
            .presence_penalty(-0.5)
            .logit_bias(vec![(plain.token_ids[3], -8.0), (7, 2.5)]),
    ];
    let mut moved = 0;
    for p in cases {
        let p = p.top_logprobs(5);
        let g = run(&mut s, &q, &params(12, p.clone()));
        let logits = g.logits.as_ref().unwrap();
        let lps = g.logprobs.as_ref().unwrap();
        for (i, (&tok, row)) in g.token_ids.iter().zip(logits).enumerate() {
            let want = first_max(&transformed(row, &p, &q, &g.token_ids[..i]));
            assert_eq!(tok, want, "step {i} under {p:?}");
            let lp = log_softmax(row);
            assert_eq!(lps[i].token, tok);
            assert!((lps[i].logprob as f64 - lp[tok as usize]).abs() < 1e-4);
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let ids: Vec<u32> = lps[i].top.iter().map(|t| t.0).collect();
            let want: Vec<u32> = order[..5].iter().map(|&t| t as u32).collect();
            assert_eq!(ids, want, "top ids at step {i}");
        }
        moved += usize::from(g.token_ids != plain.token_ids);
    }
    assert!(
        moved >= 2,
        "the penalties changed only {moved} of 3 outputs"
    );
}

#[test]
fn min_tokens_holds_back_the_stop_tokens() {
    let mut s = load_plain(FIXTURE, ModelOptions::default());
    let q = prompt(1);
    let plain = run(&mut s, &q, &params(8, SamplingParams::default()));
    let stop = plain.token_ids[0];
    let mut p = params(8, SamplingParams::default());
    p.stop_token_ids = vec![stop];
    assert_eq!(run(&mut s, &q, &p).token_ids, vec![stop], "stops at once");
    p.sampling = SamplingParams::default().min_tokens(4);
    let g = run(&mut s, &q, &p);
    assert!(g.token_ids.len() >= 4, "{:?}", g.token_ids);
    assert!(!g.token_ids[..3].contains(&stop));
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams::default()
        .temperature(0.9)
        .top_k(40)
        .top_p(0.9)
        .min_p(0.02)
        .repetition_penalty(1.1)
        .frequency_penalty(0.3)
        .logprobs(true)
        .seed(seed)
}

fn batch(
    s: &mut metrale_model_engine::Scheduler,
    ps: &[(Vec<u32>, GenerateParams)],
) -> Vec<Generation> {
    let reqs = ps.iter().map(|(q, p)| request(q, p)).collect();
    s.run(reqs, &mut |_, _| std::ops::ControlFlow::Continue(()))
        .unwrap()
}

#[test]
fn a_seed_reproduces_its_tokens_whatever_the_batch() {
    let mut s = load_plain(FIXTURE, ModelOptions::default().max_decode_seqs(8));
    let ps: Vec<(Vec<u32>, GenerateParams)> = (0..5)
        .map(|i| (prompt(i), params(10 + i, sampled(100 + i as u64))))
        .collect();
    let together = batch(&mut s, &ps);
    for (i, (q, p)) in ps.iter().enumerate() {
        let alone = run(&mut s, q, p);
        assert_eq!(alone.token_ids, together[i].token_ids, "request {i}");
        assert_eq!(alone.logprobs, together[i].logprobs, "request {i}");
    }
    // Another seed draws other tokens; logprobs come with every token.
    let (q, p) = &ps[0];
    let mut other = p.clone();
    other.sampling = sampled(7);
    assert_ne!(run(&mut s, q, &other).token_ids, together[0].token_ids);
    assert_eq!(
        together[0].logprobs.as_ref().unwrap().len(),
        together[0].token_ids.len()
    );
}

#[test]
fn bad_sampling_parameters_are_refused_naming_the_field() {
    let s = load_plain(FIXTURE, ModelOptions::default());
    let vocab = s.runner().model().config().tokens.vocab_size as u32;
    let limits = metrale_model_engine::scheduler::RequestLimits::of(s.runner(), s.cache());
    let field = |p: SamplingParams| match limits.check(&request(&[1, 2], &params(2, p))) {
        Err(metrale_model_engine::scheduler::InvalidRequest::Sampling(e)) => e.field,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        field(SamplingParams::default().top_logprobs(21)),
        "top_logprobs"
    );
    assert_eq!(
        field(SamplingParams::default().logit_bias(vec![(vocab, 1.0)])),
        "logit_bias"
    );
    assert_eq!(
        field(SamplingParams::default().logit_bias(vec![(1, 101.0)])),
        "logit_bias"
    );
    assert_eq!(
        field(SamplingParams::default().presence_penalty(2.5)),
        "presence_penalty"
    );
    assert_eq!(
        field(SamplingParams::default().frequency_penalty(-3.0)),
        "frequency_penalty"
    );
    assert_eq!(
        field(SamplingParams::default().repetition_penalty(0.0)),
        "repetition_penalty"
    );
    assert_eq!(field(SamplingParams::default().min_p(1.5)), "min_p");
}

/// Run `req` to the end; every `Finished` generation by id.
fn finished(
    s: &mut metrale_model_engine::Scheduler,
    req: metrale_model_engine::generate::SeqRequest,
) -> std::collections::BTreeMap<u64, Generation> {
    use metrale_model_engine::scheduler::SeqEvent;
    s.add(req).unwrap();
    let mut out = std::collections::BTreeMap::new();
    while !s.is_idle() {
        for e in s.step().unwrap().events {
            if let SeqEvent::Finished { id, generation } = e {
                out.insert(id.0, generation);
            }
        }
    }
    out
}

#[test]
fn n_choices_compute_the_prompt_once_and_each_is_its_seeded_solo_run() {
    use metrale_model_engine::sampling::choice_seed;
    for fixture in [FIXTURE, "qwen3_5-tiny"] {
        let mut s = load_plain(fixture, ModelOptions::default().max_decode_seqs(8));
        let q: Vec<u32> = (0..37).map(|t| (t * 13 + 5) % 200 + 3).collect();
        let base = sampled(42).logprobs(false).frequency_penalty(0.0);
        let before = s.stats().steps.prefill_tokens;
        let all = finished(&mut s, request(&q, &params(9, base.clone().n(4))));
        let prefilled = s.stats().steps.prefill_tokens - before;
        assert_eq!(
            prefilled,
            q.len() as u64,
            "{fixture}: the prompt is prefilled once"
        );
        assert_eq!(all.len(), 4, "{fixture}");
        let ids: Vec<u64> = all.keys().copied().collect();
        assert_eq!(ids, (ids[0]..ids[0] + 4).collect::<Vec<_>>());
        for (c, g) in all.values().enumerate() {
            assert_eq!(g.token_ids.len(), 9, "{fixture} choice {c}");
            // Choice c is the solo run of its seed (caches released: no prefix hits besides).
            s.clear_prefix_cache();
            let solo = run(
                &mut s,
                &q,
                &params(9, base.clone().seed(choice_seed(42, c))),
            );
            assert_eq!(g.token_ids, solo.token_ids, "{fixture} choice {c}");
            assert_eq!(
                g.logits, solo.logits,
                "{fixture} choice {c}: logits bitwise"
            );
        }
        let distinct: std::collections::BTreeSet<_> = all.values().map(|g| &g.token_ids).collect();
        assert!(
            distinct.len() > 1,
            "{fixture}: the choices all drew the same tokens"
        );
        assert_eq!(
            s.stats().cache.kv_blocks_used,
            0,
            "{fixture}: every block given back"
        );
    }
}
