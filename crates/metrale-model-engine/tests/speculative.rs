//! Speculative decoding on the CPU backend: greedy output with the MTP head drafting equals
//! plain greedy output token for token (and logit for logit, bitwise) on every hybrid fixture,
//! for K = 1..4, alone and batched; an oracle drafter reaches multi-token acceptance and every
//! rollback depth with the same output; blocks of rejected tokens go back to the allocator; bad
//! speculative options are named.

#![allow(clippy::unwrap_used)]

mod support;

use std::ops::ControlFlow;

use metrale_model_engine::generate::generate_speculative;
use metrale_model_engine::options::{ModelOptions, Speculative};
use metrale_model_engine::speculative::{DraftInput, Drafter, OracleDrafter, SpeculativeStats};
use metrale_model_engine::{ModelError, Scheduler, StepRunner, factory};
use support::*;

/// Tokens generated per prompt: several verify rounds, crossing a KV block boundary.
const NEW_TOKENS: usize = 24;

fn spec_options(speculative: Speculative, k: usize) -> ModelOptions {
    ModelOptions::default()
        .speculative(speculative)
        .num_draft_tokens(k)
}

#[test]
fn mtp_greedy_equals_plain_greedy_on_every_hybrid_fixture_for_k_1_to_4() {
    for name in HYBRID {
        let fx = MtpFixture::new(name);
        let prompts = fx.prompts();
        let mut plain_model = fx.load(ModelOptions::default());
        let plain: Vec<_> = prompts
            .iter()
            .map(|p| run(&mut plain_model, p, &greedy(NEW_TOKENS)))
            .collect();
        for k in 1..=4 {
            let mut model = fx.load(spec_options(Speculative::Mtp, k));
            assert!(model.runner().has_mtp());
            for (p, want) in prompts.iter().zip(&plain) {
                let got = run(&mut model, p, &greedy(NEW_TOKENS));
                assert_eq!(got.token_ids, want.token_ids, "{name} K={k}: tokens");
                assert!(
                    logit_bits(&got) == logit_bits(want),
                    "{name} K={k}: the logits differ from plain decode's"
                );
            }
            // All prompts at once: verify steps over several sequences.
            let gp = greedy(NEW_TOKENS);
            let reqs = prompts.iter().map(|p| request(p, &gp)).collect();
            let batched = model
                .run(reqs, &mut |_, _| ControlFlow::Continue(()))
                .unwrap();
            for (got, want) in batched.iter().zip(&plain) {
                assert_eq!(got.token_ids, want.token_ids, "{name} K={k} batched");
                assert!(logit_bits(got) == logit_bits(want), "{name} K={k} batched");
            }
            let all = 8 * (1 + k);
            assert_eq!(
                model.cache().ssm_slots(),
                Some((all, all)),
                "every slot back"
            );
        }
    }
}

/// Delegates to a drafter, checking at every call that each sequence's block table holds no
/// block past what the next verify step needs (rejected tokens' blocks were released).
struct Checked<D> {
    inner: D,
    block_size: usize,
    calls: usize,
}

impl<D: Drafter> Drafter for Checked<D> {
    fn draft(
        &mut self,
        runner: &mut StepRunner,
        inputs: &[DraftInput<'_>],
    ) -> Result<Vec<Vec<u32>>, ModelError> {
        for inp in inputs {
            // KV holds `len - 1` tokens (the last is fed next), then `num_drafts + 1` rows come.
            let need = (inp.len() + inp.num_drafts).div_ceil(self.block_size);
            assert!(
                inp.table.blocks().len() <= need,
                "request {}: {} blocks held, {need} needed",
                inp.request,
                inp.table.blocks().len()
            );
        }
        self.calls += 1;
        self.inner.draft(runner, inputs)
    }
}

/// Greedy output with an oracle drafter whose drafts go wrong at depth `round % (K + 1)` (depth
/// K: none wrong) equals plain greedy output, and every outcome 0..=K of a K-draft verify
/// occurs.
fn oracle_case(name: &str, with_mtp_file: bool, k: usize) {
    let fx;
    let dir = if with_mtp_file {
        fx = MtpFixture::new(name);
        fx.path().to_path_buf()
    } else {
        fixture(name)
    };
    let load = |o: ModelOptions| {
        let gpu = std::sync::Arc::new(metrale_gpu_runtime::CpuBackend::default());
        Scheduler::new(factory::load(&dir, gpu).unwrap(), o).unwrap()
    };
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            (0..(5 + 13 * i))
                .map(|t| ((t * 37 + i * 11) % 200) as u32 + 3)
                .collect()
        })
        .collect();
    let n = 40;
    let mut plain_model = load(ModelOptions::default());
    let plain: Vec<_> = prompts
        .iter()
        .map(|p| run(&mut plain_model, p, &greedy(n)))
        .collect();
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&plain)
        .map(|(p, g)| p.iter().chain(&g.token_ids).copied().collect())
        .collect();
    let mut model = load(spec_options(Speculative::External, k));
    let block_size = model.cache().block_size();
    let free_before = model.cache().blocks().num_free();
    let kk = k;
    let oracle = OracleDrafter::wrong_at(
        expected.clone(),
        Box::new(move |req, round| Some((round + req) % (kk + 1))),
    );
    let drafter = Checked {
        inner: oracle,
        block_size,
        calls: 0,
    };
    let gp = greedy(n);
    let reqs: Vec<_> = prompts.iter().map(|p| request(p, &gp)).collect();
    let (out, stats) =
        generate_speculative(&mut model, reqs.clone(), Box::new(drafter), &mut |_, _| {
            ControlFlow::Continue(())
        })
        .unwrap();
    for (got, want) in out.iter().zip(&plain) {
        assert_eq!(got.token_ids, want.token_ids, "{name} K={k}: tokens");
        assert!(logit_bits(got) == logit_bits(want), "{name} K={k}: logits");
    }
    for j in 0..=k {
        assert!(
            stats.outcomes.get(&(k, j)).copied().unwrap_or(0) > 0,
            "{name} K={k}: no verify kept exactly {j} of {k} drafts: {:?}",
            stats.outcomes
        );
    }
    assert_eq!(
        model.cache().blocks().num_free(),
        free_before,
        "every block back"
    );

    // All drafts right: K + 1 tokens per verify while drafts last.
    let exact = OracleDrafter::new(expected);
    let (out, stats): (_, SpeculativeStats) =
        generate_speculative(&mut model, reqs, Box::new(exact), &mut |_, _| {
            ControlFlow::Continue(())
        })
        .unwrap();
    for (got, want) in out.iter().zip(&plain) {
        assert_eq!(got.token_ids, want.token_ids, "{name} K={k} exact: tokens");
    }
    assert_eq!(stats.accepted(), stats.drafted(), "{name} K={k}: all kept");
    assert!(
        stats.verifies() <= prompts.len() * (n - 1).div_ceil(k + 1) + prompts.len(),
        "{name} K={k}: {} verifies for {} tokens",
        stats.verifies(),
        prompts.len() * n
    );
}

#[test]
fn oracle_drafts_reach_every_rollback_depth_with_plain_greedy_output() {
    for k in [1, 3, 4] {
        oracle_case("qwen3_5-tiny", false, k);
    }
    oracle_case("qwen3_5_moe-tiny", false, 2);
    oracle_case("qwen3_next-tiny", false, 3);
    // A dense model: no SSM state to roll back, only KV.
    oracle_case("qwen3-tiny", false, 3);
    // The MTP head's KV pools beside the model's change nothing.
    oracle_case("qwen3_5-tiny", true, 2);
}

#[test]
fn stop_tokens_and_cancellation_end_a_speculative_sequence_where_plain_decode_does() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let prompt = &fx.prompts()[1];
    let mut plain_model = fx.load(ModelOptions::default());
    let full = run(&mut plain_model, prompt, &greedy(NEW_TOKENS));
    let stop = full.token_ids[9];
    let first_stop = full.token_ids.iter().position(|&t| t == stop).unwrap();
    let mut model = fx.load(spec_options(Speculative::Mtp, 3));
    let mut p = greedy(NEW_TOKENS);
    p.stop_token_ids = vec![stop];
    let got = run(&mut model, prompt, &p);
    assert_eq!(got.token_ids, full.token_ids[..=first_stop].to_vec());
    let mut seen = 0;
    let got = metrale_model_engine::generate::generate(
        &mut model,
        request(prompt, &greedy(NEW_TOKENS)),
        &mut |_| {
            seen += 1;
            if seen == 5 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        },
    )
    .unwrap();
    assert_eq!(
        got.token_ids,
        full.token_ids[..5].to_vec(),
        "cancelled after 5"
    );
    // A sequence near max_seq_len drafts only what fits.
    let mut short = fx.load(spec_options(Speculative::Mtp, 4).max_seq_len(Some(prompt.len() + 6)));
    let got = run(&mut short, prompt, &greedy(NEW_TOKENS));
    let mut plain_short = fx.load(ModelOptions::default().max_seq_len(Some(prompt.len() + 6)));
    assert_eq!(
        got.token_ids,
        run(&mut plain_short, prompt, &greedy(NEW_TOKENS)).token_ids
    );
}

#[test]
fn bad_speculative_options_are_named() {
    let cpu = || std::sync::Arc::new(metrale_gpu_runtime::CpuBackend::default());
    let model = factory::load(&fixture("qwen3_5-tiny"), cpu()).unwrap();
    let no_head = Scheduler::new(model, spec_options(Speculative::Mtp, 2))
        .unwrap_err()
        .to_string();
    assert!(
        no_head.contains("speculative") && no_head.contains("mtp"),
        "{no_head}"
    );
    let fx = MtpFixture::new("qwen3_5-tiny");
    for k in [0, 9] {
        let model = factory::load(fx.path(), cpu()).unwrap();
        let e = Scheduler::new(model, spec_options(Speculative::Mtp, k))
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_draft_tokens"), "{e}");
    }
    let mut plain = fx.load(ModelOptions::default());
    let oracle = OracleDrafter::new(vec![]);
    let e = generate_speculative(
        &mut plain,
        vec![request(&[1, 2], &greedy(3))],
        Box::new(oracle),
        &mut |_, _| ControlFlow::Continue(()),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("speculative"), "{e}");
}
