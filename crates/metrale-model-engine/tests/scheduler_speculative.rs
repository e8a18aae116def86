//! Speculative decoding through the scheduler on the CPU backend: greedy outputs (tokens and
//! logits, bitwise) equal the plain scheduler's for concurrent requests of different lengths,
//! with the MTP head drafting and with an oracle drafter that reaches full acceptance and every
//! rollback depth, stop tokens and `max_new_tokens` inside accepted runs included, and with
//! prefix-cache hits; the MTP head drafts for a request in a batch exactly what it drafts for
//! it alone, graphed or eager; every block
//! and slot comes back; the gate turns speculation off while an injected clock says it is
//! slower, and on again once it is faster past the margin; the head's checks score the first
//! drafts drafting makes, and a head that accepts nothing stops verifying once checked;
//! sampling with drafts is valid.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrale_model_engine::generate::{FinishReason, Generation};
use metrale_model_engine::options::{ModelOptions, Speculative};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::scheduler::{SeqEvent, SeqRequest, StepKind};
use metrale_model_engine::speculative::{
    CheckedDraft, Clock, DraftInput, Drafter, GateOptions, MtpDrafter, OracleDrafter,
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

/// Delegates to the MTP head, recording each request's drafts (by request id) in order and
/// counting the checks that scored drafts.
#[derive(Clone)]
struct PerRequest(
    Arc<Mutex<HashMap<usize, Vec<Vec<u32>>>>>,
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
                seen.entry(inp.request).or_default().push(d.clone());
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

/// A clock the test moves: every reading advances it by half the cost of the step to come, so
/// a step (two readings) lasts that cost.
#[derive(Debug, Clone, Default)]
struct TestClock(Arc<Mutex<(Duration, Duration)>>);

impl TestClock {
    fn set_step_cost(&self, cost: Duration) {
        self.0.lock().unwrap().1 = cost / 2;
    }
}

impl Clock for TestClock {
    fn now(&self) -> Duration {
        let mut g = self.0.lock().unwrap();
        let tick = g.1;
        g.0 += tick;
        g.0
    }
}

/// A gate that decides within a few steps (averages over 4 steps, probes of 4 steps every 16,
/// a margin of 5 %), reading time from the returned clock. It decides on step times alone (no
/// checks of the acceptance): these tests make a verify step cheaper than a plain one, which the
/// acceptance rule rightly takes for impossible.
fn quick_gate(s: &mut Scheduler) -> TestClock {
    let spec = s.speculation().unwrap();
    spec.set_gate(
        GateOptions::default()
            .enabled(true)
            .margin_percent(5)
            .ema_steps(4)
            .probe_every(16)
            .probe_every_max(16)
            .probe_steps(4)
            .check_before_probe(false),
    );
    let clock = TestClock::default();
    spec.set_clock(Box::new(clock.clone()));
    clock
}

#[test]
fn the_gate_turns_speculation_off_while_slower_and_back_on_past_the_margin() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let p = prompts();
    let reqs: Vec<SeqRequest> = p[..2].iter().map(|q| request(q, 90, &[])).collect();
    let want = plain(fx.path(), &reqs);
    let mut s = fx.load(
        ModelOptions::default()
            .speculative(Speculative::Mtp)
            .num_draft_tokens(2),
    );
    let clock = quick_gate(&mut s);
    // Phase 1: a verify step costs 3 plain steps, and yields at most K + 1 = 3 tokens per
    // sequence, so speculation never beats plain decode by the margin. Phase 2: it costs half a
    // plain step, and at least one token per sequence doubles the rate.
    let (mut phase, mut steps) = (1, 0);
    let mut timeline: Vec<(usize, bool)> = Vec::new();
    let got = serve(&mut s, &reqs, |s| {
        steps += 1;
        if steps == 40 {
            phase = 2;
        }
        let on = s.speculation().unwrap().gate().is_on(2);
        timeline.push((phase, on));
        let verify = s.next_decode_speculates();
        let cost = match (phase, verify) {
            (1, true) => 30,
            (2, true) => 5,
            _ => 10,
        };
        clock.set_step_cost(Duration::from_millis(cost));
    });
    assert_same(&got.out, &want, "gated");
    let on_in = |ph: usize| timeline.iter().filter(move |t| t.0 == ph).map(|t| t.1);
    // Off before phase 1 ends, and it stays off through its last steps.
    assert!(!on_in(1).next_back().unwrap(), "{timeline:?}");
    // Phase 2 begins off and does not switch at once (it waits for a probe), then turns on.
    let phase2: Vec<bool> = on_in(2).collect();
    assert!(!phase2[0] && !phase2[1], "{timeline:?}");
    assert!(*phase2.last().unwrap(), "{timeline:?}");
    let stats = s.stats().speculation.unwrap();
    assert_eq!(stats.switches, 2, "{timeline:?}");
    // The two sequences decoded together: batch width 2's class measured both modes.
    let (plain, speculative) = s.speculation().unwrap().gate().rates(2);
    assert!(plain.is_some() && speculative.is_some());
}

/// While the gate has speculation off, the MTP head's take-ins lag: rows are archived and taken
/// in before the next drafts. Through the gate turning speculation off and on again (probes
/// every 16 steps), the lagging head drafts exactly what a head taking in every step drafts,
/// request by request: an archived row lost, misplaced or taken in at the wrong position would
/// leave other head KV and give other drafts.
#[test]
fn a_lagging_take_in_drafts_what_taking_in_every_step_drafts() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let reqs: Vec<SeqRequest> = prompts()[..3].iter().map(|q| request(q, 90, &[])).collect();
    let want = plain(fx.path(), &reqs);
    let mut seen = Vec::new();
    for head in [MtpDrafter::without_lag(), MtpDrafter::default()] {
        let mut s = fx.load(
            ModelOptions::default()
                .speculative(Speculative::Mtp)
                .num_draft_tokens(2),
        );
        let rec = PerRequest::new(head);
        s.set_drafter(Some(Box::new(rec.clone()))).unwrap();
        let clock = quick_gate(&mut s);
        let mut steps = 0;
        let got = serve(&mut s, &reqs, |s| {
            // A verify step costs three plain steps for the first 60 steps (speculation turns
            // off), half of one after (a probe turns it on again).
            steps += 1;
            let cost = match (steps < 60, s.next_decode_speculates()) {
                (true, true) => 30,
                (false, true) => 5,
                _ => 10,
            };
            clock.set_step_cost(Duration::from_millis(cost));
        });
        assert_same(&got.out, &want, "lagging take-in");
        let stats = s.stats().speculation.unwrap();
        assert_eq!(stats.switches, 2);
        seen.push((
            rec.0.lock().unwrap().clone(),
            rec.1.lock().unwrap().archived_rows(),
        ));
    }
    let (every_step, lagging) = (&seen[0], &seen[1]);
    assert_eq!(every_step.1, 0);
    assert!(lagging.1 > 20, "rows archived: {}", lagging.1);
    assert!(every_step.0.values().map(Vec::len).sum::<usize>() > 10);
    assert_eq!(every_step.0, lagging.0);
}

/// Records, for each first draft, the request, the position it proposes a token for and the
/// token.
#[derive(Clone, Default)]
struct FirstDrafts(
    Arc<Mutex<Vec<(usize, usize, u32)>>>,
    Arc<Mutex<Option<MtpDrafter>>>,
);

impl Drafter for FirstDrafts {
    fn draft(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError> {
        let mut head = self.1.lock().unwrap();
        let drafts = head
            .get_or_insert_with(MtpDrafter::without_lag)
            .draft(runner, inputs)?;
        for (inp, d) in inputs.iter().zip(&drafts) {
            if let Some(&t) = d.first() {
                // Draft 1 comes from the last row (position p) and proposes the token at p + 2.
                let last = inp.first_position + inp.step_rows.len() - 1;
                self.0.lock().unwrap().push((inp.request, last + 2, t));
            }
        }
        Ok(drafts)
    }
}

/// [`PerRequest`] asking for a check of the prompt rows at every take-in.
#[derive(Clone, Default)]
struct CheckingPrompts(PerRequest);

impl Drafter for CheckingPrompts {
    fn draft(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError> {
        assert!(self.0.check_next(false));
        let drafts = self.0.draft(runner, inputs)?;
        self.0.take_checks();
        Ok(drafts)
    }
}

/// Checks of prompt rows ride on the take-ins that draft (their logits after the drafts'): a
/// head checking every prompt drafts exactly what it drafts unchecked, graphed or eager.
#[test]
fn checking_prompt_rows_leaves_the_drafts_as_they_are() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let reqs: Vec<SeqRequest> = prompts()[1..].iter().map(|q| request(q, 30, &[])).collect();
    let want = plain(fx.path(), &reqs);
    for graphs in [false, true] {
        let options = ModelOptions::default()
            .speculative(Speculative::Mtp)
            .num_draft_tokens(3)
            .decode_graphs(graphs);
        let mut seen = Vec::new();
        for check in [false, true] {
            let mut s = fx.load(options.clone());
            let rec = PerRequest::default();
            let drafter: Box<dyn Drafter + Send> = match check {
                false => Box::new(rec.clone()),
                true => Box::new(CheckingPrompts(rec.clone())),
            };
            always(&mut s, Some(drafter));
            assert_same(&serve(&mut s, &reqs, |_| {}).out, &want, "checking prompts");
            let checks = *rec.2.lock().unwrap();
            seen.push((rec.0.lock().unwrap().clone(), checks));
        }
        assert_eq!(seen[0].1, 0);
        assert!(seen[1].1 >= reqs.len(), "{} checks", seen[1].1);
        assert!(seen[0].0.values().map(Vec::len).sum::<usize>() > 10);
        assert_eq!(seen[0].0, seen[1].0, "graphs {graphs}");
    }
}

/// Drafts nothing and asks the MTP head for a check at every take-in, keeping what each scored.
#[derive(Clone, Default)]
struct CheckEvery(Arc<Mutex<Vec<CheckedDraft>>>, Arc<Mutex<MtpDrafter>>);

impl Drafter for CheckEvery {
    fn draft(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError> {
        let plain: Vec<DraftInput<'_>> = (inputs.iter())
            .map(|i| DraftInput {
                num_drafts: 0,
                ..i.clone()
            })
            .collect();
        let mut head = self.1.lock().unwrap();
        assert!(head.check_next(true));
        let drafts = head.draft(runner, &plain)?;
        let (scored, accepted) = head.take_checks();
        let last = head.last_check();
        if scored > 0 {
            assert_eq!(scored, last.len());
            assert_eq!(accepted, last.iter().filter(|c| c.accepted).count());
            self.0.lock().unwrap().extend_from_slice(last);
        }
        Ok(drafts)
    }
}

/// A check scores a held-back row, or a prompt row taken in, as drafting there would have: each
/// first draft a check scores equals the first draft a head taking in every step made for the
/// same request and position, and it counts as accepted exactly when the model chose (or the
/// prompt holds) that token. A check off by a position, or reading another row's logits, scores
/// other tokens.
#[test]
fn a_check_scores_the_first_drafts_drafting_makes() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let reqs: Vec<SeqRequest> = prompts()[1..4]
        .iter()
        .map(|q| request(q, 40, &[]))
        .collect();
    let want = plain(fx.path(), &reqs);
    let options = ModelOptions::default()
        .speculative(Speculative::Mtp)
        .num_draft_tokens(1);
    let mut s = fx.load(options.clone());
    let drafting = FirstDrafts::default();
    always(&mut s, Some(Box::new(drafting.clone())));
    assert_same(&serve(&mut s, &reqs, |_| {}).out, &want, "drafting");
    let drafted: HashMap<(usize, usize), u32> = (drafting.0.lock().unwrap().iter())
        .map(|&(r, p, t)| ((r, p), t))
        .collect();

    let mut s = fx.load(options);
    let checking = CheckEvery::default();
    s.set_drafter(Some(Box::new(checking.clone()))).unwrap();
    let got = serve(&mut s, &reqs, |_| {});
    assert_same(&got.out, &want, "checking");
    assert_eq!(got.verify_steps, 0);
    let checked = checking.0.lock().unwrap();
    let (mut both, mut prompt_rows) = (0, 0);
    // (Checks of answers re-prefilled after they finished come under other ids: left out.)
    for c in checked.iter().filter(|c| c.request < reqs.len()) {
        let (prompt, out) = (&reqs[c.request].prompt, &want[c.request].token_ids);
        prompt_rows += usize::from(c.position < prompt.len());
        let chosen = prompt.iter().chain(out).nth(c.position).copied();
        assert_eq!(c.accepted, chosen == Some(c.token), "{c:?}");
        if let Some(&t) = drafted.get(&(c.request, c.position)) {
            assert_eq!(c.token, t, "{c:?}");
            both += 1;
        }
    }
    assert!(
        checked.len() > 60 && both > 40,
        "{} checked, {both} drafted too",
        checked.len()
    );
    assert!(prompt_rows > 20, "{prompt_rows} prompt rows checked");
}

/// With checks before probes (the default), a head that accepts next to nothing stops costing
/// verify steps: once the gate has enough first drafts checked it calls the acceptance hopeless,
/// and from then on no step verifies (the probes of speculation are skipped at their checks, and
/// the wider batches of requests that arrive later start plain), with a check a probe period,
/// not one a step; without checks the probes keep verifying. Both give the plain output.
#[test]
fn a_head_that_accepts_nothing_stops_verifying_once_checked() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let reqs: Vec<SeqRequest> = prompts().iter().map(|q| request(q, 120, &[])).collect();
    let want = plain(fx.path(), &reqs);
    // One request alone, three more from step 100.
    let arrivals: Vec<(usize, SeqRequest)> = (reqs.iter().enumerate())
        .map(|(i, r)| (if i == 0 { 0 } else { 100 }, r.clone()))
        .collect();
    let mut verifies = Vec::new();
    for check in [false, true] {
        let mut s = fx.load(
            ModelOptions::default()
                .speculative(Speculative::Mtp)
                .num_draft_tokens(2),
        );
        let rec = PerRequest::default();
        s.set_drafter(Some(Box::new(rec.clone()))).unwrap();
        let clock = quick_gate(&mut s);
        let spec = s.speculation().unwrap();
        let opts = GateOptions::default()
            .ema_steps(4)
            .probe_every(16)
            .probe_every_max(64)
            .probe_steps(4)
            .check_before_probe(check);
        spec.set_gate(opts);
        // A verify step costs twice a plain one.
        let mut timeline = Vec::new();
        let got = serve_arriving(&mut s, &arrivals, |s| {
            let verify = s.next_decode_speculates();
            let hopeless = s.speculation().unwrap().gate().hopeless();
            timeline.push((verify, hopeless));
            clock.set_step_cost(Duration::from_millis(if verify { 20 } else { 10 }));
        });
        assert_same(&got.out, &want, "gated");
        let gate = s.speculation().unwrap().gate();
        assert_eq!(gate.hopeless(), check, "{:?}", gate.acceptance());
        if check {
            assert!(gate.acceptance().unwrap() < 0.05);
            assert!(
                !timeline.iter().any(|&(v, h)| v && h),
                "a verify step once hopeless: {timeline:?}"
            );
            assert!(timeline[99].1, "hopeless before the others arrive");
            // A check for each probe period of each width class, not one a step.
            let checks = *rec.2.lock().unwrap();
            assert!((1..=8).contains(&checks), "{checks} checks");
        }
        verifies.push(got.verify_steps);
    }
    assert!(verifies[1] * 2 < verifies[0], "verify steps: {verifies:?}");
}

/// Under the default gate, prompts long enough to give the gate its first-draft checks decide
/// before any verify step: with a head that accepts next to nothing no step verifies (the drafts
/// made at the take-in whose check found it hopeless are dropped), and the output is plain.
#[test]
fn long_first_prompts_turn_a_head_that_accepts_nothing_off_before_any_verify() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let reqs: Vec<SeqRequest> = (0..3)
        .map(|i| {
            let p: Vec<u32> = (0..40).map(|t| (t * 29 + i * 7) % 230 + 3).collect();
            request(&p, 24, &[])
        })
        .collect();
    let want = plain(fx.path(), &reqs);
    // Room for the first prompt's 39 checks beside its draft row: 16 x (1 + 3) logit rows.
    let mut s = fx.load(
        ModelOptions::default()
            .speculative(Speculative::Mtp)
            .num_draft_tokens(3)
            .max_decode_seqs(16),
    );
    let got = serve(&mut s, &reqs, |_| {});
    assert_same(&got.out, &want, "default gate");
    let gate = s.speculation().unwrap().gate();
    assert!(gate.hopeless(), "{:?}", gate.acceptance());
    assert_eq!(got.verify_steps, 0);
    assert_eq!(s.stats().speculation.unwrap().switches, 0);
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
