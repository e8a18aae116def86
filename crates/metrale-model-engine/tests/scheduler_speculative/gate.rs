//! The speculation gate through the scheduler (`scheduler_speculative.rs`): it turns
//! speculation off while an injected clock says it is slower and on again past the margin; the
//! MTP head's lagging take-in drafts what taking in every step drafts; its checks score the
//! first drafts drafting makes and leave the drafts as they are; a head that accepts nothing
//! stops verifying once checked, or before its first verify step given long enough prompts.

use super::*;

/// A gate of `opts`, reading time from the returned clock.
fn gated(s: &mut Scheduler, opts: GateOptions) -> StepClock {
    let spec = s.speculation().unwrap();
    spec.set_gate(opts);
    let clock = StepClock::default();
    spec.set_clock(Box::new(clock.clone()));
    clock
}

/// A gate that decides within a few steps (averages over 4 steps, probes of 4 steps every 16,
/// a margin of 5 %), reading time from the returned clock. It decides on step times alone (no
/// checks of the acceptance): these tests make a verify step cheaper than a plain one, which the
/// acceptance rule rightly takes for impossible.
fn quick_gate(s: &mut Scheduler) -> StepClock {
    gated(
        s,
        GateOptions::default()
            .enabled(true)
            .margin_percent(5)
            .ema_steps(4)
            .probe_every(16)
            .probe_every_max(16)
            .probe_steps(4)
            .check_before_probe(false),
    )
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

/// [`PerRequest`] asking the MTP head for a check at every take-in (of the held rows too with
/// `held`), drafting nothing with `plain`, and keeping what each check scored.
#[derive(Clone, Default)]
struct Checking {
    rec: PerRequest,
    held: bool,
    plain: bool,
    scored: Arc<Mutex<Vec<CheckedDraft>>>,
}

impl Drafter for Checking {
    fn draft(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError> {
        let without_drafts: Vec<DraftInput<'_>> = (inputs.iter())
            .map(|i| DraftInput {
                num_drafts: 0,
                ..i.clone()
            })
            .collect();
        let inputs = if self.plain { &without_drafts } else { inputs };
        assert!(self.rec.check_next(self.held));
        let drafts = self.rec.draft(runner, inputs)?;
        let (scored, accepted) = self.rec.take_checks();
        let head = self.rec.1.lock().unwrap();
        let last = head.last_check();
        assert_eq!(scored, last.len());
        assert_eq!(accepted, last.iter().filter(|c| c.accepted).count());
        self.scored.lock().unwrap().extend_from_slice(last);
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
                true => Box::new(Checking {
                    rec: rec.clone(),
                    ..Checking::default()
                }),
            };
            always(&mut s, Some(drafter));
            assert_same(&serve(&mut s, &reqs, |_| {}).out, &want, "checking prompts");
            let checks = *rec.2.lock().unwrap();
            seen.push((rec.0.lock().unwrap().clone(), checks));
        }
        assert!(seen[1].1 >= reqs.len(), "{} checks", seen[1].1);
        assert!(seen[0].0.values().map(Vec::len).sum::<usize>() > 10);
        assert_eq!(seen[0].0, seen[1].0, "graphs {graphs}");
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
    let drafting = PerRequest::new(MtpDrafter::without_lag());
    always(&mut s, Some(Box::new(drafting.clone())));
    assert_same(&serve(&mut s, &reqs, |_| {}).out, &want, "drafting");
    let drafted: HashMap<(usize, usize), u32> = (drafting.0.lock().unwrap().iter())
        .flat_map(|(&r, seen)| seen.iter().map(move |(p, d)| ((r, *p), d[0])))
        .collect();

    let mut s = fx.load(options);
    let checking = Checking {
        held: true,
        plain: true,
        ..Checking::default()
    };
    s.set_drafter(Some(Box::new(checking.clone()))).unwrap();
    let got = serve(&mut s, &reqs, |_| {});
    assert_same(&got.out, &want, "checking");
    assert_eq!(got.verify_steps, 0);
    let checked = checking.scored.lock().unwrap();
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
        let clock = gated(
            &mut s,
            GateOptions::default()
                .ema_steps(4)
                .probe_every(16)
                .probe_every_max(64)
                .probe_steps(4)
                .check_before_probe(check),
        );
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
