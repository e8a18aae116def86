//! Sampling with speculative decoding draws from the distribution plain sampling draws from,
//! on a real model (the Qwen3.5 fixture, CPU backend): the first two generated tokens' joint
//! distribution, estimated over 1200 seeded runs, is within a total-variation distance of 0.06
//! of the exact one computed from the model's logits (temperature 2, top-k 2: 4 outcomes; the
//! sampling noise is about 0.02). The drafter proposes the model's most likely second token or its
//! second most likely in turn, so drafts are kept and rejected both, often; a sampler that always kept drafts, or drew a
//! rejected draft again, would be off by 0.2 or more. (The unit tests of `speculative::accept`
//! check the rule itself over 200k draws.) The same holds through the scheduler, whose verify
//! steps batch many requests, each with its own sampler.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::ops::ControlFlow;

use metrale_model_engine::options::{ModelOptions, Speculative};
use metrale_model_engine::sampling::{Sampler, SamplingParams};
use metrale_model_engine::scheduler::{SeqEvent, SeqRequest};
use metrale_model_engine::speculative::{DraftInput, Drafter, GateOptions};
use metrale_model_engine::{ModelError, Scheduler, StepRunner};
use support::*;

const RUNS: u64 = 1200;
const TOLERANCE: f64 = 0.06;

/// Proposes, after the first token `x1`, the model's most likely `x2` on even calls and its
/// second most likely on odd ones: drafts the model keeps most of the time, and drafts it
/// mostly rejects.
struct Guess {
    ranked: HashMap<u32, [u32; 2]>,
    calls: usize,
}

impl Drafter for Guess {
    fn draft(
        &mut self,
        _runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError> {
        // Alternate per draft made (take-ins that draft nothing do not count).
        Ok(inputs
            .iter()
            .map(
                |inp| match (inp.generated, self.ranked.get(&inp.generated[0])) {
                    ([_], Some(r)) if inp.num_drafts > 0 => {
                        self.calls += 1;
                        vec![r[self.calls % 2]; inp.num_drafts]
                    }
                    _ => Vec::new(),
                },
            )
            .collect())
    }
}

/// The exact joint distribution of the first two tokens, and the drafter for `prompt`.
struct Case {
    sampling: SamplingParams,
    prompt: Vec<u32>,
    exact: HashMap<(u32, u32), f64>,
    ranked: HashMap<u32, [u32; 2]>,
}

fn case() -> Case {
    let sampling = SamplingParams::default().temperature(2.0).top_k(2);
    let mut plain = load_plain("qwen3_5-tiny", ModelOptions::default());
    let prompt: Vec<u32> = (0..16).map(|t| (t * 41 + 5) % 250 + 1).collect();
    let dist = Sampler::new(sampling.clone());
    let first = run(&mut plain, &prompt, &greedy(1))
        .logits
        .unwrap()
        .remove(0);
    let p1 = dist.distribution(&first);
    // Exact: p(x1) p(x2 | x1), and the drafter's guesses for x2.
    let (mut exact, mut ranked) = (HashMap::new(), HashMap::new());
    for &(x1, q1) in &p1 {
        let longer: Vec<u32> = prompt.iter().copied().chain([x1]).collect();
        let next = run(&mut plain, &longer, &greedy(1))
            .logits
            .unwrap()
            .remove(0);
        let p2 = dist.distribution(&next);
        ranked.insert(x1, [p2[0].0, p2[1].0]);
        for &(x2, q2) in &p2 {
            exact.insert((x1, x2), q1 * q2);
        }
    }
    Case {
        sampling,
        prompt,
        exact,
        ranked,
    }
}

/// The total variation between the seen pairs and the exact distribution, and the pairs seen
/// outside its support.
fn check(
    exact: &HashMap<(u32, u32), f64>,
    seen: &HashMap<(u32, u32), usize>,
    kept: usize,
    rejected: usize,
) {
    let mut tv = 0.0;
    for (key, &q) in exact {
        let got = seen.get(key).copied().unwrap_or(0) as f64 / RUNS as f64;
        tv += (got - q).abs();
    }
    let outside: usize = seen
        .iter()
        .filter(|(k, _)| !exact.contains_key(k))
        .map(|(_, n)| n)
        .sum();
    tv = 0.5 * (tv + outside as f64 / RUNS as f64);
    eprintln!(
        "speculative sampling: TV {tv:.4} over {} outcomes, {kept} drafts kept, {rejected} rejected",
        exact.len()
    );
    assert_eq!(outside, 0, "a token outside the top-k");
    assert!(tv < TOLERANCE, "total variation {tv:.4} >= {TOLERANCE}");
    assert!(
        kept > RUNS as usize / 5 && rejected > RUNS as usize / 5,
        "both branches: {kept} kept, {rejected} rejected"
    );
}

/// The Qwen3.5 fixture built for one draft, drafting with `drafter` at every decode step.
fn spec_model(drafter: Guess) -> Scheduler {
    let mut s = load_plain(
        "qwen3_5-tiny",
        ModelOptions::default()
            .speculative(Speculative::External)
            .num_draft_tokens(1),
    );
    s.set_drafter(Some(Box::new(drafter))).unwrap();
    let spec = s.speculation().unwrap();
    spec.set_gate(GateOptions::default().enabled(false));
    s
}

#[test]
fn speculative_sampling_follows_the_plain_distribution() {
    let Case {
        sampling,
        prompt,
        exact,
        ranked,
    } = case();

    let mut model = spec_model(Guess { ranked, calls: 0 });
    let mut seen: HashMap<(u32, u32), usize> = HashMap::new();
    for seed in 0..RUNS {
        let p = params(3, sampling.clone().seed(seed));
        let out = model
            .run(vec![request(&prompt, &p)], &mut |_, _| {
                ControlFlow::Continue(())
            })
            .unwrap();
        let t = &out[0].token_ids;
        *seen.entry((t[0], t[1])).or_default() += 1;
    }
    let stats = model.speculation().unwrap().stats();
    check(
        &exact,
        &seen,
        stats.accepted(),
        stats.drafted() - stats.accepted(),
    );
}

#[test]
fn speculative_sampling_through_the_scheduler_follows_the_plain_distribution() {
    let Case {
        sampling,
        prompt,
        exact,
        ranked,
    } = case();
    let mut sched = spec_model(Guess { ranked, calls: 0 });
    let mut ids = HashMap::new();
    for seed in 0..RUNS {
        let req = SeqRequest {
            prompt: prompt.clone(),
            params: params(3, sampling.clone().seed(seed)),
            ignore_eos: true,
        };
        ids.insert(sched.add(req).unwrap(), seed);
    }
    let mut seen: HashMap<(u32, u32), usize> = HashMap::new();
    while !sched.is_idle() {
        for e in sched.step().unwrap().events {
            if let SeqEvent::Finished { generation, .. } = e {
                let t = &generation.token_ids;
                *seen.entry((t[0], t[1])).or_default() += 1;
            }
        }
    }
    let stats = sched.stats().speculation.unwrap();
    let (kept, drafted) = (stats.accepted(), stats.drafted());
    check(&exact, &seen, kept, drafted - kept);
}
