//! Tensor parallelism below the facade: a sharded MTP head (its layer split like the model's,
//! `fc` and norms whole) computes the whole head's draft logits, on the CPU backend's ranks.

#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;
use std::sync::Arc;

use metrale_cache::BlockTable;
use metrale_gpu_runtime::{CpuBackend, GpuBackend};
use metrale_model_engine::options::Speculative;
use metrale_model_engine::runner::{MtpStep, StepInput, StepRow, StepRunner};
use metrale_model_engine::{ModelOptions, factory};
use support::MtpFixture;

/// Relative L2 error of `got` against `want`.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// The MTP head's logits at the last prompt position after a prefill of `prompt`, on `tp`
/// ranks.
fn head_logits(dir: &Path, prompt: &[u32], tp: usize) -> Vec<f32> {
    head_logits_via(dir, prompt, tp, false)
}

/// [`head_logits`], the head's rows taken in directly or (`archived`) copied to the archive
/// first (in reverse order, from row 3) and taken in from there.
fn head_logits_via(dir: &Path, prompt: &[u32], tp: usize, archived: bool) -> Vec<f32> {
    let gpus: Vec<Arc<dyn GpuBackend>> = if tp == 1 {
        vec![Arc::new(CpuBackend::default())]
    } else {
        CpuBackend::tensor_parallel_group(tp, Default::default())
            .into_iter()
            .map(|b| Arc::new(b) as _)
            .collect()
    };
    let models = factory::load_ranks(dir, &gpus, Default::default()).unwrap();
    let options = ModelOptions::default()
        .tensor_parallel_size(tp)
        .speculative(Speculative::Mtp);
    let (mut runner, mut cache) = StepRunner::new_ranks(models, options).unwrap();
    let n = prompt.len();
    let mut table = BlockTable::new();
    cache.ensure(&mut table, n + 1).unwrap();
    let slot = cache.alloc_ssm_slot(None).unwrap().unwrap();
    let rows: Vec<StepRow> = (0..n)
        .map(|p| StepRow {
            token: prompt[p],
            position: p as u32,
            seq: 0,
        })
        .collect();
    let input = StepInput {
        rows: &rows,
        tables: &[&table],
        logit_rows: &[n as u32 - 1],
        ssm_slots: &[slot],
        prompt_until: &[],
    };
    runner.forward(&cache, &input).unwrap();
    // The head at position p reads the token at p + 1 (the last one: the target's greedy
    // token) and the target's row p.
    let next = runner.greedy(1).unwrap()[0];
    let head_rows: Vec<StepRow> = (0..n)
        .map(|p| StepRow {
            token: if p + 1 < n { prompt[p + 1] } else { next },
            position: p as u32,
            seq: 0,
        })
        .collect();
    let hidden: Vec<u32> = (0..n as u32).collect();
    let step = MtpStep {
        rows: &head_rows,
        tables: &[&table],
        hidden_rows: &hidden,
        logit_rows: &[n as u32 - 1],
        depth: 0,
    };
    if archived {
        let reversed: Vec<u32> = hidden.iter().rev().copied().collect();
        runner.mtp_archive(&reversed, 3).unwrap();
        let at: Vec<u32> = (0..n as u32).map(|p| 3 + (n as u32 - 1 - p)).collect();
        let step = MtpStep {
            hidden_rows: &at,
            ..step
        };
        runner.mtp_step_archived(&step).unwrap();
    } else {
        runner.mtp_step(&step).unwrap();
    }
    runner.logits(1).unwrap().remove(0)
}

/// Rows copied to the take-in archive (on every rank) and taken in from there give bitwise the
/// head's logits of taking them in at once, whole or sharded.
#[test]
fn an_archived_take_in_is_bitwise_the_direct_one() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let prompt = &fx.prompts()[1];
    for tp in [1, 2] {
        let direct = head_logits_via(fx.path(), prompt, tp, false);
        let archived = head_logits_via(fx.path(), prompt, tp, true);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&direct) == bits(&archived), "{tp} ranks");
    }
}

#[test]
fn a_sharded_mtp_head_drafts_from_the_logits_of_the_whole_head() {
    let fx = MtpFixture::new("qwen3_5-tiny");
    let prompt = &fx.prompts()[1];
    let whole = head_logits(fx.path(), prompt, 1);
    for tp in [2, 4] {
        let sharded = head_logits(fx.path(), prompt, tp);
        let e = rel_l2(&sharded, &whole);
        assert!(e < 1e-2, "{tp} ranks: the head's logits differ by {e:.3e}");
    }
    // The comparison can fail: the head reading the previous position's token is another
    // function.
    let other = head_logits(fx.path(), &prompt[1..], 1);
    assert!(rel_l2(&other, &whole) > 1e-1);
}
