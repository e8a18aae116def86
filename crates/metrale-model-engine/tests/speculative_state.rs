//! The state speculative decoding leaves, on the CPU backend: after a verify step that keeps
//! `j` of `K` drafts, the sequence's SSM slot holds bitwise the bytes of a sequence that decoded
//! only the kept tokens, the verify rows' logits are the decode steps' bitwise, and the next
//! step's logits too (the rejected rows' KV entries and states are never read). The MTP
//! drafter feeds its head as `runner::mtp` documents: the row at position `p` reads the token at
//! `p + 1` and the target's final-norm output of row `p`. A verify step refuses row slots that
//! would overwrite a state another sequence reads.

#![allow(clippy::unwrap_used)]

mod support;

use metrale_cache::BlockTable;
use metrale_model_engine::StepRunner;
use metrale_model_engine::options::{ModelOptions, Speculative};
use metrale_model_engine::runner::{MtpStep, StepInput, StepRow};
use metrale_model_engine::sampling::{Sampler, SamplingParams, argmax};
use metrale_model_engine::speculative::{DraftInput, Drafter, MtpDrafter, verify_drafts};
use support::*;

/// A sequence driven by hand: its table, its SSM slot and spare slots.
struct Seq {
    table: BlockTable,
    slot: u32,
    spares: Vec<u32>,
}

impl Seq {
    fn new(rig: &mut Rig, spares: usize) -> Seq {
        let slot = rig.cache.alloc_ssm_slot(None).unwrap().unwrap();
        let spares = (0..spares)
            .map(|_| rig.cache.alloc_ssm_slot(None).unwrap().unwrap())
            .collect();
        Seq {
            table: BlockTable::new(),
            slot,
            spares,
        }
    }

    fn ensure(&mut self, rig: &mut Rig, tokens: usize) {
        rig.cache.ensure(&mut self.table, tokens).unwrap();
    }

    /// Prefill `prompt`; returns the last row's logits.
    fn prefill(&mut self, rig: &mut Rig, prompt: &[u32]) -> Vec<f32> {
        self.ensure(rig, prompt.len());
        let rows: Vec<StepRow> = prompt
            .iter()
            .enumerate()
            .map(|(p, &token)| StepRow {
                token,
                position: p as u32,
                seq: 0,
            })
            .collect();
        let input = StepInput {
            rows: &rows,
            tables: &[&self.table],
            logit_rows: &[prompt.len() as u32 - 1],
            ssm_slots: &[self.slot],
            prompt_until: &[],
        };
        rig.runner.forward(&rig.cache, &input).unwrap();
        rig.runner.logits(1).unwrap().pop().unwrap()
    }

    /// One decode step of `token` at `pos`; returns its logits.
    fn decode(&mut self, rig: &mut Rig, token: u32, pos: usize) -> Vec<f32> {
        self.ensure(rig, pos + 1);
        let row = StepRow {
            token,
            position: pos as u32,
            seq: 0,
        };
        (rig.runner)
            .decode(&rig.cache, &[row], &[&self.table], &[self.slot])
            .unwrap();
        rig.runner.logits(1).unwrap().pop().unwrap()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Keep `j` of `k` drafts on fixture `name` and compare against plain decode.
fn rollback_case(name: &str, k: usize, j: usize) {
    let mut model = Rig::load(
        &fixture(name),
        ModelOptions::default()
            .speculative(Speculative::External)
            .num_draft_tokens(k),
    );
    // 14 prompt tokens: the verify rows cross the 16-token KV block boundary.
    let prompt: Vec<u32> = (0..14).map(|t| (t * 29 + 7) % 250 + 1).collect();
    let n = prompt.len();

    // The plain sequence: greedy tokens g[0..], the state and logits after feeding each.
    let mut plain = Seq::new(&mut model, 0);
    let mut g = vec![argmax(&plain.prefill(&mut model, &prompt))];
    let (mut states, mut logits) = (Vec::new(), Vec::new());
    for t in 0..k + 2 {
        let l = plain.decode(&mut model, g[t], n + t);
        g.push(argmax(&l));
        logits.push(l);
        states.push(model.cache.ssm_slot_bytes(plain.slot).unwrap());
    }

    // The speculative one: drafts right up to depth j, wrong from there.
    let mut spec = Seq::new(&mut model, k);
    assert_eq!(argmax(&spec.prefill(&mut model, &prompt)), g[0]);
    let drafts: Vec<u32> = (1..=k)
        .map(|t| if t <= j { g[t] } else { (g[t] + 1) % 250 })
        .collect();
    spec.ensure(&mut model, n + k + 1);
    let rows: Vec<StepRow> = std::iter::once(g[0])
        .chain(drafts.iter().copied())
        .enumerate()
        .map(|(t, token)| StepRow {
            token,
            position: (n + t) as u32,
            seq: 0,
        })
        .collect();
    let row_slots: Vec<u32> = spec.spares.iter().copied().chain([spec.slot]).collect();
    (model.runner)
        .verify(
            &model.cache,
            &rows,
            &[&spec.table],
            &[spec.slot],
            &row_slots,
        )
        .unwrap();
    let vlogits = model.runner.logits(k + 1).unwrap();
    let verdict = verify_drafts(
        &mut Sampler::new(SamplingParams::default()),
        &vlogits,
        &drafts,
    );
    let case = format!("{name} K={k}, {j} kept");
    assert_eq!(verdict.accepted, j, "{case}");
    assert_eq!(verdict.tokens, g[1..=j + 1].to_vec(), "{case}");
    for t in 0..=j {
        assert!(
            bits(&vlogits[t]) == bits(&logits[t]),
            "{case}: verify row {t}'s logits are not the decode step's"
        );
    }
    // Roll back: row j's slot becomes the sequence's; blocks past the kept tokens go back.
    if j < k {
        std::mem::swap(&mut spec.slot, &mut spec.spares[j]);
    }
    let kept = n + j + 1;
    model.cache.truncate(&mut spec.table, kept).unwrap();
    assert!(
        model.cache.ssm_slot_bytes(spec.slot).unwrap() == states[j],
        "{case}: the kept slot is not the state of a run that decoded only the kept tokens"
    );
    // The next step: the token the verify chose, at the first free position.
    let next = spec.decode(&mut model, g[j + 1], kept);
    assert!(
        bits(&next) == bits(&logits[j + 1]),
        "{case}: the step after the rollback sees the rejected tokens"
    );
    assert!(
        model.cache.ssm_slot_bytes(spec.slot).unwrap() == states[j + 1],
        "{case}: the state after the next step"
    );
}

#[test]
fn a_rollback_leaves_bitwise_the_state_of_a_run_that_never_saw_the_rejected_tokens() {
    for k in [1, 3] {
        for j in 0..=k {
            rollback_case("qwen3_5-tiny", k, j);
        }
    }
    for j in [0, 2, 4] {
        rollback_case("qwen3_5_moe-tiny", 4, j);
        rollback_case("qwen3_next-tiny", 4, j);
    }
}

/// Records what the MTP drafter was asked, then drafts with it.
struct Spy {
    inner: MtpDrafter,
    first_logits: Option<Vec<f32>>,
}

impl Drafter for Spy {
    fn draft(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, metrale_model_engine::ModelError> {
        let d = self.inner.draft(runner, inputs)?;
        // With one draft the head's last step is the one that takes in the rows.
        self.first_logits = Some(runner.logits(1)?.pop().unwrap_or_default());
        Ok(d)
    }
}

#[test]
fn the_mtp_head_reads_the_next_token_and_the_target_row_at_each_position() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let mut model = Rig::load(
        fx.path(),
        ModelOptions::default()
            .speculative(Speculative::Mtp)
            .num_draft_tokens(1),
    );
    let prompt = fx.prompts()[1].clone();
    let n = prompt.len();
    let mut seq = Seq::new(&mut model, 0);
    let x_n = argmax(&seq.prefill(&mut model, &prompt));
    seq.ensure(&mut model, n + 2);
    let generated = [x_n];
    let mut spy = Spy {
        inner: MtpDrafter::default(),
        first_logits: None,
    };
    let input = DraftInput {
        request: 0,
        prompt: &prompt,
        generated: &generated,
        table: &seq.table,
        step_rows: 0..n as u32,
        first_position: 0,
        num_drafts: 1,
        leaving: false,
    };
    spy.draft(&mut model.runner, &[input]).unwrap();
    let drafted = spy.first_logits.unwrap();

    // The same head step by hand: at position p, the token at p + 1 and the target's row p.
    // Each variant runs after a prefill of a fresh sequence, so `normed` holds the prompt's
    // rows again.
    let mut by_hand = |token_shift: usize, pos_shift: usize, hidden_shift: usize| {
        let mut seq = Seq::new(&mut model, 0);
        seq.prefill(&mut model, &prompt);
        seq.ensure(&mut model, n + 2);
        let next = |p: usize| if p + 1 < n { prompt[p + 1] } else { x_n };
        let rows: Vec<StepRow> = (0..n)
            .map(|p| StepRow {
                token: if token_shift == 0 { next(p) } else { prompt[p] },
                position: (p + pos_shift) as u32,
                seq: 0,
            })
            .collect();
        let hidden: Vec<u32> = (0..n as u32)
            .map(|p| p.saturating_sub(hidden_shift as u32))
            .collect();
        (model.runner)
            .mtp_step(&MtpStep {
                rows: &rows,
                tables: &[&seq.table],
                hidden_rows: &hidden,
                logit_rows: &[n as u32 - 1],
                depth: 0,
            })
            .unwrap();
        model.runner.logits(1).unwrap().pop().unwrap()
    };
    assert!(
        bits(&by_hand(0, 0, 0)) == bits(&drafted),
        "the documented alignment"
    );
    for (shift, what) in [
        ((1, 0, 0), "token"),
        ((0, 1, 0), "position"),
        ((0, 0, 1), "hidden row"),
    ] {
        assert!(
            bits(&by_hand(shift.0, shift.1, shift.2)) != bits(&drafted),
            "shifting the {what} by one must change the draft's logits"
        );
    }
}

#[test]
fn a_verify_step_refuses_row_slots_that_would_corrupt_a_state() {
    let mut model = Rig::load(
        &fixture("qwen3_5-tiny"),
        ModelOptions::default()
            .speculative(Speculative::External)
            .num_draft_tokens(2),
    );
    let (mut a, mut b) = (Seq::new(&mut model, 2), Seq::new(&mut model, 0));
    a.ensure(&mut model, 8);
    b.ensure(&mut model, 8);
    let rows: Vec<StepRow> = (0..4)
        .map(|t| StepRow {
            token: 5 + t,
            position: t % 3,
            seq: u32::from(t == 3),
        })
        .collect();
    let free = model.cache.alloc_ssm_slot(None).unwrap().unwrap();
    model.cache.free_ssm_slot(free).unwrap();
    let (s0, s1) = (a.spares[0], a.spares[1]);
    for (slots, why) in [
        (
            vec![s0, s0, a.slot, u32::MAX],
            "two rows keep their state in one slot",
        ),
        (
            vec![s0, s1, b.slot, u32::MAX],
            "a row writes the slot another sequence reads",
        ),
        (
            vec![s0, free, a.slot, u32::MAX],
            "a row slot no sequence holds",
        ),
        (vec![s0, s1, a.slot], "fewer row slots than rows"),
    ] {
        let tables = [&a.table, &b.table];
        let r = (model.runner).verify(&model.cache, &rows, &tables, &[a.slot, b.slot], &slots);
        assert!(r.is_err(), "{why}");
    }
    let ok = model.runner.verify(
        &model.cache,
        &rows,
        &[&a.table, &b.table],
        &[a.slot, b.slot],
        &[s0, s1, a.slot, b.slot],
    );
    assert!(ok.is_ok(), "{ok:?}");
}
