use super::*;

fn logits() -> Vec<f32> {
    vec![0.5, 2.0, -1.0, 1.9, 0.0, 2.0, -3.0, 1.0]
}

#[test]
fn the_setters_set_their_field() {
    let p = SamplingParams::greedy()
        .temperature(0.7)
        .top_k(5)
        .top_p(0.9)
        .seed(42);
    let want = SamplingParams {
        temperature: 0.7,
        top_k: 5,
        top_p: 0.9,
        seed: Some(42),
        ..Default::default()
    };
    assert_eq!(p, want);
    let q = SamplingParams::greedy()
        .min_p(0.1)
        .repetition_penalty(1.2)
        .presence_penalty(0.5)
        .frequency_penalty(-0.5)
        .logit_bias(vec![(3, 1.5)])
        .min_tokens(2)
        .logprobs(true)
        .top_logprobs(4);
    let want = SamplingParams {
        min_p: 0.1,
        repetition_penalty: 1.2,
        presence_penalty: 0.5,
        frequency_penalty: -0.5,
        logit_bias: vec![(3, 1.5)],
        min_tokens: 2,
        logprobs: true,
        top_logprobs: 4,
        ..Default::default()
    };
    assert_eq!(q, want);
    assert_eq!(SamplingParams::greedy(), SamplingParams::default());
}

#[test]
fn greedy_takes_the_first_maximum() {
    assert_eq!(Sampler::new(SamplingParams::default()).sample(&logits()), 1);
    assert_eq!(argmax(&[f32::NAN, 1.0, 3.0, 3.0]), 2);
}

#[test]
fn same_seed_same_tokens_other_seed_other_tokens() {
    let p = SamplingParams {
        temperature: 1.5,
        seed: Some(7),
        ..Default::default()
    };
    let run = |p: SamplingParams| {
        let mut s = Sampler::new(p);
        (0..64).map(|_| s.sample(&logits())).collect::<Vec<_>>()
    };
    assert_eq!(run(p.clone()), run(p.clone()));
    assert_ne!(run(p.clone()), run(SamplingParams { seed: Some(8), ..p }));
}

#[test]
fn top_k_and_top_p_restrict_the_support() {
    let mut s = Sampler::new(SamplingParams {
        temperature: 5.0,
        top_k: 3,
        seed: Some(1),
        ..Default::default()
    });
    for _ in 0..200 {
        assert!([1, 5, 3].contains(&s.sample(&logits())), "top-3 only");
    }
    let mut s = Sampler::new(SamplingParams {
        temperature: 1.0,
        top_p: 0.3,
        seed: Some(1),
        ..Default::default()
    });
    for _ in 0..200 {
        assert!(
            [1, 5].contains(&s.sample(&logits())),
            "the nucleus holds the two maxima"
        );
    }
}

#[test]
fn sampling_follows_the_distribution() {
    let l = [0.0f32, (3.0f32).ln()];
    let mut s = Sampler::new(SamplingParams {
        temperature: 1.0,
        seed: Some(3),
        ..Default::default()
    });
    let ones = (0..20000).filter(|_| s.sample(&l) == 1).count() as f64 / 20000.0;
    assert!((ones - 0.75).abs() < 0.015, "P(1) = {ones}, expected 0.75");
}

#[test]
fn a_wide_nucleus_is_ranked_past_the_first_candidates() {
    // Equal logits rank by index, so top_p 0.5 of 1000 keeps exactly tokens 0..500: more
    // than the first 64 candidates the nucleus search ranks.
    let logits = vec![0.25f32; 1000];
    let mut s = Sampler::new(SamplingParams {
        temperature: 1.0,
        top_p: 0.5,
        seed: Some(7),
        ..Default::default()
    });
    let draws: Vec<u32> = (0..4000).map(|_| s.sample(&logits)).collect();
    assert!(
        draws.iter().all(|&t| t < 500),
        "a token outside the nucleus"
    );
    let distinct: std::collections::BTreeSet<u32> = draws.into_iter().collect();
    assert!(distinct.len() > 400, "only {} tokens drawn", distinct.len());
}

#[test]
fn entries_merge_penalties_bias_and_bans_sorted() {
    let mut stats = TokenStats::of_prompt(&[9, 4, 9]);
    stats.push(4);
    stats.push(6);
    stats.push(6);
    let p = SamplingParams::greedy()
        .repetition_penalty(1.5)
        .logit_bias(vec![(2, -1.0), (6, 3.0)]);
    let e = stats.entries(&p, &[4]);
    let f = |b: f32| b.to_bits();
    assert_eq!(
        e,
        vec![
            [2, 0, f(-1.0)],
            [4, 1 | SAMPLE_E_PROMPT | SAMPLE_E_BAN, f(0.0)],
            [6, 2, f(3.0)],
            [9, SAMPLE_E_PROMPT, f(0.0)],
        ]
    );
    // Without a repetition penalty the prompt does not count; without any penalty only
    // the bias is left.
    let p = SamplingParams::greedy().presence_penalty(0.5);
    assert_eq!(stats.entries(&p, &[]), vec![[4, 1, f(0.0)], [6, 2, f(0.0)]]);
    let p = SamplingParams::greedy().logit_bias(vec![(5, 2.0)]);
    assert_eq!(stats.entries(&p, &[]), vec![[5, 0, f(2.0)]]);
}

#[test]
fn checkpoint_defaults_set_min_p_and_the_repetition_penalty() {
    let mut d = GenerationDefaults::default();
    (d.min_p, d.repetition_penalty) = (Some(0.05), Some(1.1));
    let p = SamplingParams::greedy().with_checkpoint_defaults(&d);
    assert_eq!((p.min_p, p.repetition_penalty), (0.05, 1.1));
}

#[test]
fn invalid_parameters_are_named() {
    let e = SamplingParams {
        temperature: -1.0,
        ..Default::default()
    }
    .validate()
    .unwrap_err();
    assert_eq!(e.field, "temperature");
    let e = SamplingParams {
        top_p: 0.0,
        ..Default::default()
    }
    .validate()
    .unwrap_err();
    assert_eq!(e.field, "top_p");
    assert!(
        SamplingParams {
            temperature: f32::NAN,
            ..Default::default()
        }
        .validate()
        .is_err()
    );
    let field = |p: SamplingParams| p.validate_for_vocab(100).unwrap_err().field;
    assert_eq!(field(SamplingParams::greedy().n(0)), "n");
    assert_eq!(field(SamplingParams::greedy().n(MAX_CHOICES + 1)), "n");
    assert_eq!(field(SamplingParams::greedy().n(3).best_of(2)), "best_of");
    assert_eq!(
        field(SamplingParams::greedy().best_of(MAX_CHOICES + 1)),
        "best_of"
    );
    let ranked = SamplingParams::greedy().n(2).best_of(5);
    assert!(ranked.validate().is_ok());
    assert_eq!(ranked.choices_generated(), 5);
    assert!(ranked.ranks_choices() && ranked.needs_device_sampler());
    assert!(!SamplingParams::greedy().n(3).best_of(3).ranks_choices());
    assert_eq!(field(SamplingParams::greedy().min_p(-0.1)), "min_p");
    assert_eq!(
        field(SamplingParams::greedy().repetition_penalty(f32::NAN)),
        "repetition_penalty"
    );
    assert_eq!(
        field(SamplingParams::greedy().presence_penalty(3.0)),
        "presence_penalty"
    );
    assert_eq!(
        field(SamplingParams::greedy().frequency_penalty(-2.5)),
        "frequency_penalty"
    );
    assert_eq!(
        field(SamplingParams::greedy().top_logprobs(21)),
        "top_logprobs"
    );
    assert_eq!(
        field(SamplingParams::greedy().logit_bias(vec![(100, 1.0)])),
        "logit_bias"
    );
    assert_eq!(
        field(SamplingParams::greedy().logit_bias(vec![(1, 1.0), (1, 2.0)])),
        "logit_bias"
    );
    assert!(
        SamplingParams::greedy()
            .logit_bias(vec![(99, -100.0)])
            .validate_for_vocab(100)
            .is_ok()
    );
}
