//! The scheduling policy on the tiny dense fixture: chunk boundaries, the alternation of prefill
//! and decode under the token budget, admission by free blocks, and the checks on requests.

use std::path::PathBuf;
use std::sync::Arc;

use metrale_gpu_runtime::CpuBackend;

use super::*;
use crate::options::ModelOptions;
use crate::sampling::SamplingParams;

fn scheduler(options: ModelOptions) -> Scheduler {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-tiny");
    let model = crate::factory::load(&dir, Arc::new(CpuBackend::default()))
        .expect("the qwen3-tiny fixture loads");
    Scheduler::new(model, options).expect("the options fit")
}

fn request(prompt_len: usize, max_new_tokens: usize) -> SeqRequest {
    SeqRequest {
        prompt: (0..prompt_len).map(|t| (t * 7 % 500) as u32 + 1).collect(),
        params: GenerateParams {
            max_new_tokens,
            sampling: SamplingParams::default(),
            stop_token_ids: Vec::new(),
            return_logits: false,
        },
        ignore_eos: true,
    }
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
    let mut s = scheduler(ModelOptions::default().max_batch_tokens(8));
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
    let mut s = scheduler(ModelOptions::default().max_batch_tokens(8));
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
