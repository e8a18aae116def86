//! The scheduling policy on the tiny dense fixture: chunk boundaries, mixed steps (and the
//! alternation of prefill and decode without them) under the token budget, admission by free
//! blocks, and the checks on requests.

use std::path::PathBuf;
use std::sync::Arc;

use metrale_gpu_runtime::CpuBackend;

use super::*;
use crate::options::ModelOptions;
use crate::sampling::SamplingParams;

/// A scheduler over the CPU backend and the fixture `name` (`tests/fixtures/`).
pub(super) fn fixture_scheduler(name: &str, options: ModelOptions) -> Scheduler {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    let model = crate::factory::load(&dir, Arc::new(CpuBackend::default()))
        .unwrap_or_else(|e| panic!("the {name} fixture loads: {e}"));
    Scheduler::new(model, options).expect("the options fit")
}

fn scheduler(options: ModelOptions) -> Scheduler {
    fixture_scheduler("qwen3-tiny", options)
}

/// A greedy request for `prompt`, EOS ignored, no logits kept.
pub(super) fn greedy_request(prompt: Vec<u32>, max_new_tokens: usize) -> SeqRequest {
    SeqRequest {
        prompt,
        params: GenerateParams {
            max_new_tokens,
            sampling: SamplingParams::default(),
            stop_token_ids: Vec::new(),
            return_logits: false,
        },
        ignore_eos: true,
    }
}

fn request(prompt_len: usize, max_new_tokens: usize) -> SeqRequest {
    greedy_request(
        (0..prompt_len).map(|t| (t * 7 % 500) as u32 + 1).collect(),
        max_new_tokens,
    )
}

/// Step until idle, returning every step's kind.
fn drain(s: &mut Scheduler) -> Vec<StepKind> {
    let mut kinds = Vec::new();
    while !s.is_idle() {
        kinds.push(s.step().expect("step").kind);
        assert!(kinds.len() < 10_000, "the scheduler does not finish");
    }
    kinds
}

#[test]
fn a_long_prompt_alternates_with_decode_in_budget_sized_chunks() {
    let mut s = scheduler(
        ModelOptions::default()
            .max_batch_tokens(8)
            .mixed_steps(false),
    );
    let a = s.add(request(3, 40)).expect("valid");
    // A: one prefill chunk, then it decodes alone.
    assert!(
        matches!(s.step().expect("step").kind, StepKind::Prefill { seq, start: 0, rows: 3 } if seq == a)
    );
    assert_eq!(s.step().expect("step").kind, StepKind::Decode { seqs: 1 });
    let b = s.add(request(30, 2)).expect("valid");
    let kinds: Vec<StepKind> = (0..8).map(|_| s.step().expect("step").kind).collect();
    let chunk = |start, rows| StepKind::Prefill {
        seq: b,
        start,
        rows,
    };
    let d1 = StepKind::Decode { seqs: 1 };
    // A decode step ran last, so B's first chunk goes right away; each later chunk would exceed
    // the budget of 8 prefill tokens per decode step, so they alternate.
    assert_eq!(
        kinds,
        vec![
            chunk(0, 8),
            d1,
            chunk(8, 8),
            d1,
            chunk(16, 8),
            d1,
            chunk(24, 6),
            StepKind::Decode { seqs: 2 }
        ]
    );
    drain(&mut s);
    assert_eq!(s.cache().blocks().num_free(), s.cache().blocks().capacity());
}

#[test]
fn short_prompts_share_one_budget_between_decode_steps() {
    let mut s = scheduler(
        ModelOptions::default()
            .max_batch_tokens(8)
            .mixed_steps(false),
    );
    s.add(request(2, 30)).expect("valid");
    s.step().expect("prefill");
    s.step().expect("decode");
    let ids: Vec<SeqId> = [3, 4, 5]
        .into_iter()
        .map(|n| s.add(request(n, 30)).expect("valid"))
        .collect();
    let kinds: Vec<StepKind> = (0..5).map(|_| s.step().expect("step").kind).collect();
    let p = |i: usize, rows| StepKind::Prefill {
        seq: ids[i],
        start: 0,
        rows,
    };
    // 3 + 4 prefill tokens fit the budget of 8; 3 + 4 + 5 does not.
    assert_eq!(
        kinds,
        vec![
            p(0, 3),
            p(1, 4),
            StepKind::Decode { seqs: 3 },
            p(2, 5),
            StepKind::Decode { seqs: 4 }
        ]
    );
}

/// The sequences that got a token in `events`.
fn token_ids(events: &[SeqEvent]) -> Vec<SeqId> {
    (events.iter())
        .filter_map(|e| match e {
            SeqEvent::Token { id, .. } => Some(*id),
            SeqEvent::Finished { .. } => None,
        })
        .collect()
}

#[test]
fn a_long_prompt_shares_every_step_with_the_decoding_sequences() {
    let mut s = scheduler(ModelOptions::default().max_batch_tokens(8));
    let a = s.add(request(3, 40)).expect("valid");
    s.step().expect("A's prefill");
    assert_eq!(s.step().expect("step").kind, StepKind::Decode { seqs: 1 });
    let b = s.add(request(30, 2)).expect("valid");
    let mut kinds = Vec::new();
    for _ in 0..6 {
        let report = s.step().expect("step");
        assert!(
            token_ids(&report.events).contains(&a),
            "A got no token in {:?}",
            report.kind
        );
        kinds.push(report.kind);
    }
    let mixed = |start, rows| StepKind::Mixed {
        seqs: 1,
        seq: b,
        start,
        rows,
    };
    // Each step holds A's row and 8 - 1 rows of B's prompt; the last chunk picks B's first
    // token, and B decodes beside A from then on.
    assert_eq!(
        kinds,
        vec![
            mixed(0, 7),
            mixed(7, 7),
            mixed(14, 7),
            mixed(21, 7),
            mixed(28, 2),
            StepKind::Decode { seqs: 2 }
        ]
    );
    let steps = s.stats().steps;
    assert_eq!(
        (steps.mixed_steps, steps.prefill_steps, steps.prefill_tokens),
        (5, 6, 33)
    );
    assert_eq!(
        steps.steps,
        steps.prefill_steps + steps.decode_steps - steps.mixed_steps
    );
    drain(&mut s);
    assert_eq!(s.cache().blocks().num_free(), s.cache().blocks().capacity());
}

#[test]
fn decoders_past_the_budget_leave_a_prompt_one_row_a_step() {
    // Three decoding sequences and a budget of 2: every step holds the three decode rows and one
    // prompt row (the decode rows alone exceed the budget; the prompt still advances).
    let mut s = scheduler(ModelOptions::default().max_batch_tokens(2));
    let decoders: Vec<SeqId> = (0..3)
        .map(|i| s.add(request(1 + i, 40)).expect("valid"))
        .collect();
    while s.stats().running < 3 || s.running.iter().any(Seq::in_prefill) {
        s.step().expect("step");
    }
    let b = s.add(request(4, 2)).expect("valid");
    for start in 0..4 {
        let report = s.step().expect("step");
        assert_eq!(
            report.kind,
            StepKind::Mixed {
                seqs: 3,
                seq: b,
                start,
                rows: 1
            }
        );
        let got = token_ids(&report.events);
        assert!(decoders.iter().all(|d| got.contains(d)), "{got:?}");
    }
    drain(&mut s);
}

#[test]
fn admission_waits_for_blocks_and_a_decode_slot() {
    // 6 usable blocks of 16 tokens; each request needs 3 (40 prompt tokens plus one).
    let mut s = scheduler(
        ModelOptions::default()
            .num_kv_blocks(Some(7))
            .max_decode_seqs(4),
    );
    for _ in 0..3 {
        s.add(request(40, 2)).expect("valid");
    }
    s.step().expect("step");
    let stats = s.stats();
    assert_eq!((stats.running, stats.waiting), (1, 2));
    // 3 blocks free, but the second request needs 3 plus one of headroom for the first.
    assert_eq!(
        (stats.cache.kv_blocks_used, stats.cache.kv_blocks_total),
        (3, 6)
    );
    drain(&mut s);
    assert_eq!(s.stats().cache.kv_blocks_used, 0);
    assert_eq!(s.stats().steps.tokens_generated, 6);
}

#[test]
fn bad_requests_are_refused_with_what_is_wrong() {
    let mut s = scheduler(ModelOptions::default().max_seq_len(Some(32)));
    assert_eq!(s.add(request(0, 1)), Err(InvalidRequest::EmptyPrompt));
    assert_eq!(
        s.add(request(33, 1)),
        Err(InvalidRequest::PromptTooLong { len: 33, max: 32 })
    );
    let mut r = request(4, 1);
    r.prompt[2] = 512;
    assert_eq!(
        s.add(r),
        Err(InvalidRequest::TokenOutOfVocab {
            index: 2,
            id: 512,
            vocab: 512
        })
    );
    let mut r = request(4, 1);
    r.params.sampling.top_p = 0.0;
    assert!(matches!(s.add(r), Err(InvalidRequest::Sampling(e)) if e.field == "top_p"));
    assert!(s.is_idle(), "nothing was queued");
}

#[test]
fn a_stop_token_outside_the_vocabulary_is_refused_and_the_others_keep_running() {
    // A stop id `min_tokens` holds back becomes an entry of the device sampler's row, which
    // fails the whole decode step on an id past the vocabulary.
    let mut s = scheduler(ModelOptions::default());
    let running = s.add(request(6, 8)).expect("valid");
    s.step().expect("prefill");
    let mut r = request(5, 4);
    r.params.stop_token_ids = vec![3, 512];
    r.params.sampling.min_tokens = 2;
    assert!(matches!(
        s.add(r),
        Err(InvalidRequest::Sampling(e)) if e.field == "stop_token_ids" && e.value == "token 512"
    ));
    let mut finished = Vec::new();
    while !s.is_idle() {
        for e in s.step().expect("step").events {
            if let SeqEvent::Finished { id, generation } = e {
                finished.push((id, generation.token_ids.len()));
            }
        }
    }
    assert_eq!(finished, vec![(running, 8)]);
}

#[test]
fn the_context_is_capped_by_what_the_cache_holds() {
    // 2 usable blocks of 16: a sequence alone can hold 32 tokens, whatever max_seq_len says.
    let mut s = scheduler(ModelOptions::default().num_kv_blocks(Some(3)));
    assert_eq!(RequestLimits::of(s.runner(), s.cache()).max_context, 32);
    let id = s.add(request(20, 100)).expect("valid");
    let mut out = None;
    while !s.is_idle() {
        for e in s.step().expect("step").events {
            if let SeqEvent::Finished { id: f, generation } = e {
                assert_eq!(f, id);
                out = Some(generation);
            }
        }
    }
    let g = out.expect("finished");
    // Positions 0..32 hold 20 prompt and 12 fed-back tokens; the 13th token is the last.
    assert_eq!(
        (g.token_ids.len(), g.finish_reason),
        (13, FinishReason::Length)
    );
}

#[test]
fn finish_releases_a_running_sequence_at_once() {
    let mut s = scheduler(ModelOptions::default());
    let id = s.add(request(10, 50)).expect("valid");
    s.step().expect("prefill");
    s.step().expect("decode");
    let g = s
        .finish(id, FinishReason::Cancelled)
        .expect("release")
        .expect("it was running");
    assert_eq!(
        (g.token_ids.len(), g.finish_reason),
        (2, FinishReason::Cancelled)
    );
    assert!(s.is_idle());
    assert_eq!(s.stats().cache.kv_blocks_used, 0);
    assert_eq!(s.finish(id, FinishReason::Cancelled).expect("no-op"), None);
}

/// A test grammar: step `i` allows only the tokens of `steps[i]`; finished after the last.
#[derive(Debug)]
struct Steps {
    steps: Vec<Vec<u32>>,
    taken: Vec<u32>,
}

impl crate::constraint::TokenConstraint for Steps {
    fn fill_mask(&mut self, mask: &mut [u32]) -> Result<(), crate::constraint::ConstraintError> {
        for &t in &self.steps[self.taken.len()] {
            crate::constraint::allow(mask, t);
        }
        Ok(())
    }

    fn accept(&mut self, token: u32) -> Result<(), crate::constraint::ConstraintError> {
        self.taken.push(token);
        Ok(())
    }

    fn is_finished(&self) -> bool {
        self.taken.len() == self.steps.len()
    }
}

#[test]
fn a_constrained_sequence_picks_only_allowed_tokens_and_stops_when_its_grammar_is_done() {
    let mut rng = metrale_testkit::Rng::new(11);
    let steps: Vec<Vec<u32>> = (0..5)
        .map(|_| (0..3).map(|_| rng.below(500) + 1).collect())
        .collect();
    let mut s = scheduler(ModelOptions::default());
    let free = s.add(request(6, 8)).expect("valid");
    let mut sampled = request(6, 40);
    sampled.params.sampling = SamplingParams::default().temperature(1.0).seed(3);
    let constraint = Steps {
        steps: steps.clone(),
        taken: Vec::new(),
    };
    let bound = (s.add_constrained(sampled, vec![Box::new(constraint)])).expect("valid");
    let mut tokens = std::collections::HashMap::<SeqId, Vec<u32>>::new();
    let mut finished = std::collections::HashMap::new();
    while !s.is_idle() {
        for e in s.step().expect("step").events {
            match e {
                SeqEvent::Token { id, token, .. } => tokens.entry(id).or_default().push(token),
                SeqEvent::Finished { id, generation } => {
                    finished.insert(id, generation);
                }
            }
        }
    }
    let got = &finished[&bound];
    assert_eq!(got.finish_reason, FinishReason::Stop);
    assert_eq!(got.token_ids.len(), steps.len());
    for (t, allowed) in got.token_ids.iter().zip(&steps) {
        assert!(allowed.contains(t), "{t} not in {allowed:?}");
    }
    assert_eq!(
        finished[&free].token_ids.len(),
        8,
        "the unconstrained one runs as before"
    );
    assert_eq!(tokens[&bound], got.token_ids);
}

/// A `Steps` grammar of `len` steps, each allowing 6 tokens drawn from the vocabulary.
fn random_steps(rng: &mut metrale_testkit::Rng, len: usize) -> Steps {
    let steps = (0..len)
        .map(|_| (0..6).map(|_| rng.below(511) + 1).collect())
        .collect();
    Steps {
        steps,
        taken: Vec::new(),
    }
}

/// Run `requests` (each with its constraint, if any) submitted together; their generations in
/// submission order.
fn run_together(
    options: &ModelOptions,
    requests: Vec<(SeqRequest, Option<Steps>)>,
) -> Vec<Generation> {
    let mut s = scheduler(options.clone());
    let ids: Vec<SeqId> = (requests.into_iter())
        .map(|(r, c)| {
            let c = (c.into_iter())
                .map(|c| Box::new(c) as Box<dyn crate::constraint::TokenConstraint>)
                .collect();
            s.add_constrained(r, c).expect("valid")
        })
        .collect();
    let mut finished = std::collections::HashMap::new();
    while !s.is_idle() {
        for e in s.step().expect("step").events {
            if let SeqEvent::Finished { id, generation } = e {
                finished.insert(id, generation);
            }
        }
    }
    ids.iter()
        .map(|id| finished.remove(id).expect("ran"))
        .collect()
}

/// Greedy decoding under a constraint, as the host computes it: each token is the lowest-index
/// maximum of its logits with every disallowed token at `-inf`.
fn host_masked_argmax(logits: &[f32], allowed: &[u32]) -> u32 {
    let mut mask = vec![0u32; crate::constraint::mask_words(logits.len())];
    for &t in allowed {
        crate::constraint::allow(&mut mask, t);
    }
    let mut masked = logits.to_vec();
    crate::constraint::apply_mask(&mut masked, &mask);
    crate::sampling::argmax(&masked)
}

#[test]
fn constrained_rows_are_masked_on_the_device_and_leave_their_batch_mates_bitwise_unchanged() {
    let mut rng = metrale_testkit::Rng::new(29);
    let (greedy_steps, sampled_steps) = (random_steps(&mut rng, 9), random_steps(&mut rng, 7));
    let constrained = |steps: &Steps, sampling: SamplingParams| {
        let mut r = request(5, 40);
        r.prompt[1] = 77;
        r.params.sampling = sampling;
        r.params.return_logits = true;
        let c = Steps {
            steps: steps.steps.clone(),
            taken: Vec::new(),
        };
        (r, Some(c))
    };
    let free = |i: usize| {
        let mut r = request(4 + i, 12);
        r.prompt[0] = 300 + i as u32;
        r.params.sampling = match i {
            0 => SamplingParams::default(),
            1 => SamplingParams::default().temperature(0.8).seed(5),
            _ => SamplingParams::default()
                .temperature(1.0)
                .top_k(40)
                .repetition_penalty(1.3)
                .seed(9),
        };
        (r, None)
    };
    let sampled = SamplingParams::default().temperature(1.0).seed(17);
    for graphs in [true, false] {
        let options = ModelOptions::default().decode_graphs(graphs);
        let alone: Vec<Generation> = (0..3)
            .map(|i| run_together(&options, vec![free(i)]).remove(0))
            .collect();
        let batch = vec![
            constrained(&greedy_steps, SamplingParams::default()),
            free(0),
            free(1),
            constrained(&sampled_steps, sampled.clone()),
            free(2),
        ];
        let together = run_together(&options, batch);
        for (i, g) in [&together[1], &together[2], &together[4]]
            .into_iter()
            .enumerate()
        {
            assert_eq!(
                g.token_ids, alone[i].token_ids,
                "graphs {graphs}: unconstrained request {i} beside constrained ones is its solo run"
            );
        }
        // Greedy under the constraint: the host's masked argmax of every step's logits, which
        // is not the plain argmax.
        let g = &together[0];
        assert_eq!(g.finish_reason, FinishReason::Stop, "the grammar ended it");
        assert_eq!(g.token_ids.len(), greedy_steps.steps.len());
        let logits = g.logits.as_ref().expect("return_logits");
        let mut differs = false;
        for (t, (&token, row)) in g.token_ids.iter().zip(logits).enumerate() {
            let want = host_masked_argmax(row, &greedy_steps.steps[t]);
            assert_eq!(token, want, "graphs {graphs}: step {t}");
            differs |= crate::sampling::argmax(row) != want;
        }
        assert!(differs, "the mask changed some greedy pick");
        // Sampled under the constraint: only allowed tokens, the same as alone.
        let s = &together[3];
        for (t, token) in s.token_ids.iter().enumerate() {
            assert!(sampled_steps.steps[t].contains(token), "step {t}: {token}");
        }
        let solo = run_together(&options, vec![constrained(&sampled_steps, sampled.clone())]);
        assert_eq!(s.token_ids, solo[0].token_ids, "graphs {graphs}");
    }
}
