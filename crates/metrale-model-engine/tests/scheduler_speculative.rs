//! Speculative decoding through the scheduler on the CPU backend: greedy outputs (tokens and
//! logits, bitwise) equal the plain scheduler's for concurrent requests of different lengths,
//! with the MTP head drafting and with an oracle drafter that reaches full acceptance and every
//! rollback depth, stop tokens and `max_new_tokens` inside accepted runs included, and with
//! prefix-cache hits; the MTP head drafts for a request in a batch exactly what it drafts for
//! it alone, graphed or eager; every block and slot comes back; sampling with drafts is valid.
//! The speculation gate's tests are in `scheduler_speculative/gate.rs`.

#![allow(clippy::unwrap_used)]

#[path = "scheduler_speculative/gate.rs"]
mod gate;
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrale_model_engine::generate::{FinishReason, Generation};
use metrale_model_engine::options::{ModelOptions, Speculative};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::scheduler::{SeqEvent, SeqRequest, StepKind};
use metrale_model_engine::speculative::{
    CheckedDraft, DraftInput, Drafter, GateOptions, MtpDrafter, OracleDrafter,
};
use metrale_model_engine::{ModelError, Scheduler, StepRunner};
use support::*;

fn prompts() -> Vec<Vec<u32>> {
    (0..4)
        .map(|i| {
            (0..(3 + 11 * i))
                .map(|t| ((t * 37 + i * 11) % 200) as u32 + 3)
                .collect()
        })
        .collect()
}

fn request(prompt: &[u32], max_new_tokens: usize, stop: &[u32]) -> SeqRequest {
    SeqRequest {
        prompt: prompt.to_vec(),
        params: metrale_model_engine::generate::GenerateParams {
            stop_token_ids: stop.to_vec(),
            ..greedy(max_new_tokens)
        },
        ignore_eos: true,
    }
}

/// What a scheduler run produced: the generations in request order, and for each verify step
/// the tokens each sequence got.
struct Served {
    out: Vec<Generation>,
    per_verify: Vec<usize>,
    verify_steps: usize,
}

/// Submit every request at once and step until idle; `before_step` runs before each step.
fn serve(
    sched: &mut Scheduler,
    reqs: &[SeqRequest],
    before_step: impl FnMut(&mut Scheduler),
) -> Served {
    let at_once: Vec<(usize, SeqRequest)> = reqs.iter().map(|r| (0, r.clone())).collect();
    serve_arriving(sched, &at_once, before_step)
}

/// [`serve`] with each request submitted before the step of its number (generations in the
/// order given).
fn serve_arriving(
    sched: &mut Scheduler,
    arrivals: &[(usize, SeqRequest)],
    mut before_step: impl FnMut(&mut Scheduler),
) -> Served {
    let mut ids = vec![None; arrivals.len()];
    let mut done = HashMap::new();
    let (mut per_verify, mut verify_steps) = (Vec::new(), 0);
    let mut steps = 0;
    while !sched.is_idle() || ids.iter().any(Option::is_none) {
        for (id, (at, r)) in ids.iter_mut().zip(arrivals) {
            if id.is_none() && *at <= steps {
                *id = Some(sched.add(r.clone()).unwrap());
            }
        }
        before_step(sched);
        let report = sched.step().unwrap();
        let mut count: HashMap<_, usize> = HashMap::new();
        for e in report.events {
            match e {
                SeqEvent::Token { id, .. } => *count.entry(id).or_default() += 1,
                SeqEvent::Finished { id, generation } => {
                    done.insert(id, generation);
                }
            }
        }
        if let StepKind::Verify { .. } = report.kind {
            verify_steps += 1;
            per_verify.extend(count.values());
        }
        steps += 1;
        assert!(steps < 20_000, "the scheduler does not finish");
    }
    let stats = sched.stats();
    assert_eq!(stats.cache.kv_blocks_used, 0, "every KV block back");
    assert_eq!(stats.cache.ssm_slots_used, 0, "every SSM slot back");
    Served {
        out: (ids.iter().flatten())
            .map(|id| done.remove(id).unwrap())
            .collect(),
        per_verify,
        verify_steps,
    }
}

fn plain(model_dir: &std::path::Path, reqs: &[SeqRequest]) -> Vec<Generation> {
    let mut s = factory_load(model_dir, ModelOptions::default());
    serve(&mut s, reqs, |_| {}).out
}

fn factory_load(dir: &std::path::Path, o: ModelOptions) -> Scheduler {
    let gpu = Arc::new(metrale_gpu_runtime::CpuBackend::default());
    Scheduler::new(metrale_model_engine::factory::load(dir, gpu).unwrap(), o).unwrap()
}

/// Speculate at every decode step, with `drafter` when given (else the MTP head).
fn always(s: &mut Scheduler, drafter: Option<Box<dyn Drafter + Send>>) {
    if drafter.is_some() {
        s.set_drafter(drafter).unwrap();
    }
    s.speculation()
        .unwrap()
        .set_gate(GateOptions::default().enabled(false));
}

fn assert_same(got: &[Generation], want: &[Generation], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.token_ids, w.token_ids, "{what}: request {i} tokens");
        assert_eq!(
            g.finish_reason, w.finish_reason,
            "{what}: request {i} finish"
        );
        assert_eq!(
            g.logits.is_some(),
            w.logits.is_some(),
            "{what}: request {i}"
        );
        if g.logits.is_some() {
            assert!(logit_bits(g) == logit_bits(w), "{what}: request {i} logits");
        }
    }
}

#[test]
fn mtp_through_the_scheduler_gives_the_plain_schedulers_greedy_output() {
    for name in ["qwen3_5-tiny", "qwen3_next-tiny"] {
        let fx = MtpFixture::new(name);
        let p = prompts();
        // Lengths around K + 1 = 4 and across a KV block; two without logits (the device's
        // argmax picks their tokens when no row of the step needs host logits).
        let mut reqs = vec![
            request(&p[0], 1, &[]),
            request(&p[1], 4, &[]),
            request(&p[2], 23, &[]),
            request(&p[3], 9, &[]),
        ];
        reqs[2].params.return_logits = false;
        reqs[3].params.return_logits = false;
        let want = plain(fx.path(), &reqs);
        let mut s = fx.load(
            ModelOptions::default()
                .speculative(Speculative::Mtp)
                .num_draft_tokens(3),
        );
        always(&mut s, None);
        let got = serve(&mut s, &reqs, |_| {});
        assert_same(&got.out, &want, name);
        assert!(got.verify_steps > 0, "{name}: no verify step ran");
        let stats = s.stats().speculation.unwrap();
        assert!(stats.drafted() > 0 && stats.accepted() <= stats.drafted());
        assert!(stats.on);
    }
}

/// Each request's drafts (by request id) in order, each with the position its first draft
/// proposes a token for.
type DraftsSeen = HashMap<usize, Vec<(usize, Vec<u32>)>>;

/// Delegates to the MTP head, recording each request's drafts and counting the checks that
/// scored drafts.
#[derive(Clone)]
struct PerRequest(
    Arc<Mutex<DraftsSeen>>,
    Arc<Mutex<MtpDrafter>>,
    Arc<Mutex<usize>>,
);

impl Default for PerRequest {
    fn default() -> Self {
        PerRequest::new(MtpDrafter::default())
    }
}

impl PerRequest {
    fn new(head: MtpDrafter) -> Self {
        PerRequest(Arc::default(), Arc::new(Mutex::new(head)), Arc::default())
    }
}

impl Drafter for PerRequest {
    fn draft(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError> {
        let drafts = self.1.lock().unwrap().draft(runner, inputs)?;
        let mut seen = self.0.lock().unwrap();
        for (inp, d) in inputs.iter().zip(&drafts) {
            if !d.is_empty() {
                // Draft 1 comes from the last row (position p) and proposes the token at p + 2.
                let at = inp.first_position + inp.step_rows.len() + 1;
                seen.entry(inp.request).or_default().push((at, d.clone()));
            }
        }
        Ok(drafts)
    }

    fn check_next(&mut self, held: bool) -> bool {
        self.1.lock().unwrap().check_next(held)
    }

    fn take_checks(&mut self) -> (usize, usize) {
        let checks = self.1.lock().unwrap().take_checks();
        *self.2.lock().unwrap() += usize::from(checks.0 > 0);
        checks
    }
}

/// The scheduler feeds the MTP head each sequence's own rows, positions and hidden states: a
/// request batched with others gets the drafts it gets alone, verify after verify, from graphed
/// head steps as from eager ones. An off-by-one in the batched take-in would still give plain
/// output, but other drafts.
#[test]
fn a_batched_request_drafts_what_it_drafts_alone() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let options = |decode_graphs| {
        ModelOptions::default()
            .speculative(Speculative::Mtp)
            .num_draft_tokens(3)
            .decode_graphs(decode_graphs)
    };
    let mut prompts = fx.prompts();
    prompts.push((0..40).map(|t| (t * 17 + 3) % 250 + 1).collect());
    let reqs: Vec<SeqRequest> = prompts.iter().map(|p| request(p, 30, &[])).collect();
    let mut alone = Vec::new();
    for r in &reqs {
        let mut s = fx.load(options(false));
        let rec = PerRequest::default();
        always(&mut s, Some(Box::new(rec.clone())));
        serve(&mut s, std::slice::from_ref(r), |_| {});
        let mut seen = rec.0.lock().unwrap();
        alone.push(seen.remove(&0).unwrap_or_default());
    }
    for graphs in [false, true] {
        let mut s = fx.load(options(graphs));
        let rec = PerRequest::default();
        always(&mut s, Some(Box::new(rec.clone())));
        serve(&mut s, &reqs, |_| {});
        let seen = rec.0.lock().unwrap();
        for (i, want) in alone.iter().enumerate() {
            assert!(want.len() > 5, "{want:?}");
            assert_eq!(seen.get(&i), Some(want), "graphs {graphs}: request {i}");
        }
    }
}

/// Prefix caching with speculation: requests that share a 70-token prefix hit the first one's
/// blocks and SSM snapshot, and every output is still the plain scheduler's (whose cache holds
/// the same prompts); generated tokens, accepted or rejected, never reach the cache.
#[test]
fn speculation_with_prefix_hits_gives_the_plain_output() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let shared: Vec<u32> = (0..70).map(|t| (t * 13 + 5) % 250 + 1).collect();
    let reqs: Vec<SeqRequest> = (0..3)
        .map(|i| {
            let mut p = shared.clone();
            p.extend((0..(2 + 3 * i)).map(|t| (t * 7 + i * 31) as u32 % 250 + 1));
            request(&p, 12 + 5 * i, &[])
        })
        .collect();
    let want = plain(fx.path(), &reqs);
    let mut s = fx.load(
        ModelOptions::default()
            .speculative(Speculative::Mtp)
            .num_draft_tokens(2),
    );
    always(&mut s, None);
    let got = serve(&mut s, &reqs, |_| {});
    assert_same(&got.out, &want, "prefix hits");
    let stats = s.stats();
    assert!(
        stats.steps.prefix.hits >= 2 && stats.steps.verify_steps > 0,
        "{stats:?}"
    );
    // Only the prompts' full blocks are cached: the 4 of the shared prefix (the prompts' fifth
    // blocks are partial), none holding generated tokens.
    assert_eq!(stats.cache.kv_blocks_cached, 4, "{stats:?}");
}

/// The oracle drafts the plain continuation, wrong at depth `(round + request) % (K + 1)`
/// (depth K: all right): every verify outcome 0..=K occurs, through the scheduler's batched
/// verify, preemption-free.
#[test]
fn oracle_drafts_reach_full_acceptance_and_every_rollback_depth_through_the_scheduler() {
    let dir = fixture("qwen3_5-tiny");
    let p = prompts();
    let long: Vec<SeqRequest> = p.iter().map(|q| request(q, 30, &[])).collect();
    let plain_long = plain(&dir, &long);
    let expected: Vec<Vec<u32>> = p
        .iter()
        .zip(&plain_long)
        .map(|(q, g)| q.iter().chain(&g.token_ids).copied().collect())
        .collect();
    for k in [1, 3] {
        let mut s = factory_load(
            &dir,
            ModelOptions::default()
                .speculative(Speculative::External)
                .num_draft_tokens(k),
        );
        let oracle = OracleDrafter::wrong_at(
            expected.clone(),
            Box::new(move |req, round| Some((round + req) % (k + 1))),
        );
        always(&mut s, Some(Box::new(oracle)));
        let got = serve(&mut s, &long, |_| {});
        assert_same(&got.out, &plain_long, &format!("K={k} rollbacks"));
        for n in 1..=k + 1 {
            assert!(
                got.per_verify.contains(&n),
                "K={k}: no sequence verify kept exactly {} drafts: {:?}",
                n - 1,
                got.per_verify
            );
        }

        // All drafts right; a stop token and max_new_tokens fall inside accepted runs.
        let stop = plain_long[0].token_ids[6];
        let cut = plain_long[0]
            .token_ids
            .iter()
            .position(|&t| t == stop)
            .unwrap();
        let reqs = vec![
            request(&p[0], 30, &[stop]),
            request(&p[1], 2, &[]),
            request(&p[2], k + 3, &[]),
            request(&p[3], 30, &[]),
        ];
        let want = plain(&dir, &reqs);
        assert_eq!(want[0].token_ids.len(), cut + 1);
        assert_eq!(want[0].finish_reason, FinishReason::Stop);
        always(&mut s, Some(Box::new(OracleDrafter::new(expected.clone()))));
        let got = serve(&mut s, &reqs, |_| {});
        assert_same(&got.out, &want, &format!("K={k} exact"));
        let stats = s.stats().speculation.unwrap();
        assert_eq!(stats.accepted(), stats.drafted(), "K={k}: every draft kept");
        assert!(
            got.per_verify.contains(&(k + 1)),
            "K={k}: {:?}",
            got.per_verify
        );
    }
}

/// Sampling with drafts through the scheduler: valid tokens, the requested lengths, logits for
/// each token, reproducible per seed, and drafts both kept and rejected.
#[test]
fn sampling_through_the_scheduler_with_drafts_gives_valid_reproducible_output() {
    let dir = fixture("qwen3_5-tiny");
    let p = prompts();
    let long: Vec<SeqRequest> = p.iter().map(|q| request(q, 20, &[])).collect();
    let expected: Vec<Vec<u32>> = p
        .iter()
        .zip(plain(&dir, &long))
        .map(|(q, g)| q.iter().chain(&g.token_ids).copied().collect())
        .collect();
    let sampled: Vec<SeqRequest> = long
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut r = r.clone();
            r.params.sampling = SamplingParams::default()
                .temperature(0.7)
                .top_k(8)
                .seed(100 + i as u64);
            r
        })
        .collect();
    let load = || {
        factory_load(
            &dir,
            ModelOptions::default()
                .speculative(Speculative::External)
                .num_draft_tokens(3),
        )
    };
    let run = |mut s: Scheduler| {
        always(&mut s, Some(Box::new(OracleDrafter::new(expected.clone()))));
        let got = serve(&mut s, &sampled, |_| {});
        (got.out, s.stats().speculation.unwrap())
    };
    let vocab = load().runner().model().config().tokens.vocab_size as u32;
    let (a, stats) = run(load());
    let (b, _) = run(load());
    for (g, h) in a.iter().zip(&b) {
        assert_eq!(g.token_ids.len(), 20);
        assert!(g.token_ids.iter().all(|&t| t < vocab));
        assert_eq!(g.logits.as_ref().unwrap().len(), 20);
        assert_eq!(g.token_ids, h.token_ids, "same seed, same tokens");
    }
    assert!(
        stats.accepted() > 0 && stats.accepted() < stats.drafted(),
        "{stats:?}"
    );
}
