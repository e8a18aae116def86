//! Continuous batching is batch-invariant: requests of different lengths arriving at different
//! steps, some cancelled at random, some preempted by a tiny KV cache, each get bitwise the
//! tokens and logits of their solo run; and when everything has finished every KV block and SSM
//! slot is free again; and prefix-cache hits give bitwise what a model without the cache gives.
//! On a dense and on a hybrid (Gated DeltaNet) fixture, on the CPU backend (and, built with
//! `--features cuda`, on the CUDA backend too).

#![allow(clippy::unwrap_used, clippy::type_complexity)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use metrale_gpu_runtime::{CpuBackend, GpuBackend};
use metrale_model_engine::generate::{FinishReason, GenerateParams, Generation, generate};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::scheduler::{
    Scheduler, SchedulerStats, SeqEvent, SeqId, SeqRequest, StepKind,
};
use metrale_model_engine::{ModelOptions, factory};
use metrale_testkit::Rng;

/// Where the model runs.
type Backend = fn() -> Arc<dyn GpuBackend>;

fn cpu() -> Arc<dyn GpuBackend> {
    Arc::new(CpuBackend::default())
}

fn load_on(backend: Backend, name: &str, options: ModelOptions) -> Scheduler {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    let model = factory::load(&dir, backend()).unwrap_or_else(|e| panic!("{name}: {e}"));
    Scheduler::new(model, options).unwrap()
}

fn load(name: &str, options: ModelOptions) -> Scheduler {
    load_on(cpu, name, options)
}

/// A request of the mixed run: what to generate, when it arrives and when (if ever) the caller
/// cancels it.
#[derive(Debug, Clone)]
struct Arrival {
    req: SeqRequest,
    /// The step before which it is added.
    at_step: usize,
    /// Cancel it this many steps after it arrives.
    cancel_after: Option<usize>,
}

/// `n` requests with prompts of 1 to 70 tokens (several prefill chunks of 16), 4 to 30 new
/// tokens, greedy or sampled, arriving over the first steps; about one in five is cancelled.
fn arrivals(n: usize, vocab: u32, seed: u64, cancel: bool) -> Vec<Arrival> {
    let mut rng = Rng::new(seed);
    let mut at_step = 0;
    (0..n)
        .map(|i| {
            let len = 1 + rng.below(70) as usize;
            let prompt = (0..len).map(|_| rng.below(vocab)).collect();
            let sampling = match i % 3 {
                0 => SamplingParams::default(),
                1 => SamplingParams::default()
                    .temperature(0.9)
                    .seed(rng.next_u64()),
                _ => SamplingParams::default()
                    .temperature(1.3)
                    .top_k(20)
                    .top_p(0.9)
                    .seed(rng.next_u64()),
            };
            let params = GenerateParams {
                max_new_tokens: 4 + rng.below(27) as usize,
                sampling,
                stop_token_ids: if i % 4 == 3 {
                    vec![rng.below(vocab)]
                } else {
                    Vec::new()
                },
                return_logits: true,
            };
            at_step += rng.below(6) as usize;
            let cancel_after = (cancel && rng.chance(0.2)).then(|| rng.below(25) as usize);
            Arrival {
                req: SeqRequest {
                    prompt,
                    params,
                    ignore_eos: i % 2 == 0,
                },
                at_step,
                cancel_after,
            }
        })
        .collect()
}

/// Step the scheduler until it is idle; collect every finished generation by id, and check that
/// each token event matches the generation it ends in.
fn run_until_idle(
    s: &mut Scheduler,
    out: &mut HashMap<SeqId, Generation>,
    tokens: &mut HashMap<SeqId, Vec<u32>>,
) {
    let mut steps = 0;
    while !s.is_idle() {
        collect(s.step().expect("step").events, out, tokens);
        steps += 1;
        assert!(steps < 100_000, "the scheduler does not finish");
    }
}

fn collect(
    events: Vec<SeqEvent>,
    out: &mut HashMap<SeqId, Generation>,
    tokens: &mut HashMap<SeqId, Vec<u32>>,
) {
    for e in events {
        match e {
            SeqEvent::Token { id, token, .. } => tokens.entry(id).or_default().push(token),
            SeqEvent::Finished { id, generation } => {
                assert!(out.insert(id, generation).is_none(), "{id} finished twice");
            }
        }
    }
}

/// The request alone on an idle scheduler.
fn solo(s: &mut Scheduler, req: &SeqRequest) -> Generation {
    let id = s.add(req.clone()).expect("a valid request");
    let (mut out, mut tokens) = (HashMap::new(), HashMap::new());
    run_until_idle(s, &mut out, &mut tokens);
    out.remove(&id).expect("the solo run finished")
}

/// Run `arrivals` together; returns each one's generation (by index) and the final stats.
fn mixed(s: &mut Scheduler, arrivals: &[Arrival]) -> (Vec<Generation>, SchedulerStats, usize) {
    let (mut out, mut tokens) = (HashMap::new(), HashMap::new());
    let mut ids: Vec<Option<SeqId>> = vec![None; arrivals.len()];
    let mut widest = 0;
    let mut step = 0;
    while ids.iter().any(Option::is_none) || !s.is_idle() {
        for (i, a) in arrivals.iter().enumerate() {
            if a.at_step == step {
                ids[i] = Some(s.add(a.req.clone()).expect("a valid request"));
            }
            if let (Some(id), Some(after)) = (ids[i], a.cancel_after)
                && a.at_step + after == step
                && let Some(g) = s.finish(id, FinishReason::Cancelled).expect("release")
            {
                assert!(out.insert(id, g).is_none());
            }
        }
        let report = s.step().expect("step");
        if let StepKind::Decode { seqs } = report.kind {
            widest = widest.max(seqs);
        }
        collect(report.events, &mut out, &mut tokens);
        step += 1;
        assert!(step < 100_000, "the scheduler does not finish");
    }
    let gens = ids
        .iter()
        .map(|id| {
            let id = id.expect("added");
            let g = out
                .remove(&id)
                .unwrap_or_else(|| panic!("{id} never finished"));
            assert_eq!(
                tokens.remove(&id).unwrap_or_default(),
                g.token_ids,
                "{id}: token events and the generation disagree"
            );
            g
        })
        .collect();
    (gens, s.stats(), widest)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Every completed request equals its solo run bitwise; a cancelled one is a prefix of it.
fn assert_solo_equivalent(
    model: &mut Scheduler,
    arrivals: &[Arrival],
    got: &[Generation],
) -> usize {
    let mut cancelled = 0;
    for (i, (a, g)) in arrivals.iter().zip(got).enumerate() {
        let alone = solo(model, &a.req);
        let (gl, al) = (
            g.logits.as_ref().expect("logits"),
            alone.logits.as_ref().expect("logits"),
        );
        assert_eq!(
            gl.len(),
            g.token_ids.len(),
            "request {i}: one logits row per token"
        );
        if g.finish_reason == FinishReason::Cancelled {
            cancelled += 1;
            assert!(
                alone.token_ids.starts_with(&g.token_ids),
                "request {i}: cancelled tokens are not a prefix of the solo run"
            );
        } else {
            assert_eq!(
                g.token_ids,
                alone.token_ids,
                "request {i} ({} prompt tokens): tokens differ from its solo run",
                a.req.prompt.len()
            );
            assert_eq!(
                g.finish_reason, alone.finish_reason,
                "request {i}: finish reason"
            );
        }
        for (step, (x, y)) in gl.iter().zip(al).enumerate() {
            assert!(
                same_bits(x, y),
                "request {i} step {step}: logits differ from its solo run"
            );
        }
    }
    cancelled
}

fn assert_all_free(model: &mut Scheduler, stats: &SchedulerStats) {
    let kv = model.cache().blocks();
    assert_eq!(kv.num_free(), kv.capacity(), "every KV block is free again");
    assert_eq!(stats.cache.kv_blocks_used, 0);
    if let Some((total, free)) = model.cache().ssm_slots() {
        assert_eq!(free, total, "every SSM slot is free again");
        assert_eq!(stats.cache.ssm_slots_used, 0);
    }
    assert_eq!((stats.running, stats.waiting), (0, 0));
}

fn options(num_kv_blocks: Option<usize>) -> ModelOptions {
    ModelOptions::default()
        .max_batch_tokens(16)
        .max_decode_seqs(8)
        .num_kv_blocks(num_kv_blocks)
}

fn traffic_with_cancellations_is_bitwise_solo(backend: Backend, name: &str) {
    let mut model = load_on(backend, name, options(None));
    let vocab = model.runner().model().config().tokens.vocab_size as u32;
    let arrivals = arrivals(20, vocab, 11, true);
    let (got, stats, widest) = mixed(&mut model, &arrivals);
    assert_all_free(&mut model, &stats);
    assert!(
        widest >= 5,
        "{name}: at most {widest} sequences decoded together; the test needs real batches"
    );
    assert_eq!(
        stats.steps.preemptions, 0,
        "{name}: the default cache holds every sequence"
    );
    let cancelled = assert_solo_equivalent(&mut model, &arrivals, &got);
    assert!(
        cancelled >= 2,
        "{name}: only {cancelled} requests were cancelled"
    );
    assert_all_free(&mut model, &stats);
}

fn preemption_is_bitwise_solo(backend: Backend, name: &str) {
    // 11 usable blocks of 16 tokens for up to 8 sequences of up to 100 tokens.
    let mut model = load_on(backend, name, options(Some(12)));
    let vocab = model.runner().model().config().tokens.vocab_size as u32;
    let mut arrivals = arrivals(12, vocab, 5, false);
    for a in &mut arrivals {
        a.at_step /= 4;
        a.req.params.max_new_tokens += 36;
    }
    let (got, stats, _) = mixed(&mut model, &arrivals);
    assert_all_free(&mut model, &stats);
    assert!(
        stats.steps.preemptions >= 3,
        "{name}: only {} preemptions; the test needs a cache under pressure",
        stats.steps.preemptions
    );
    assert_solo_equivalent(&mut model, &arrivals, &got);
}

/// Prefix caching on `backend`: a 150-token prompt run twice, then one sharing its first 128
/// tokens, give bitwise the tokens and logits of a model with prefix caching off, and the last
/// two hit the cache (on a hybrid model through an SSM snapshot copied device to device). With
/// chunks of 512 the cold and cached prefills also cut the prompt into steps of other sizes.
fn prefix_hits_are_bitwise_cold(backend: Backend, name: &str) {
    let opts = |prefix_caching| {
        options(None)
            .max_batch_tokens(512)
            .prefix_caching(prefix_caching)
    };
    let mut warm = load_on(backend, name, opts(true));
    let mut cold = load_on(backend, name, opts(false));
    let vocab = warm.runner().model().config().tokens.vocab_size as u32;
    let mut rng = Rng::new(17);
    let a: Vec<u32> = (0..150).map(|_| rng.below(vocab)).collect();
    let mut b = a[..128].to_vec();
    b.extend([(a[128] + 1) % vocab, 3, 1, 4]);
    for (i, prompt) in [a.clone(), a, b].into_iter().enumerate() {
        let req = SeqRequest {
            prompt,
            params: GenerateParams {
                max_new_tokens: 6,
                sampling: SamplingParams::default().temperature(0.9).seed(i as u64),
                stop_token_ids: Vec::new(),
                return_logits: true,
            },
            ignore_eos: true,
        };
        let id = warm.add(req.clone()).unwrap();
        let (mut out, mut tokens) = (HashMap::new(), HashMap::new());
        run_until_idle(&mut warm, &mut out, &mut tokens);
        let got = out.remove(&id).unwrap();
        let want = solo(&mut cold, &req);
        assert_eq!(got.token_ids, want.token_ids, "{name}: prompt {i}");
        for (x, y) in got
            .logits
            .iter()
            .flatten()
            .zip(want.logits.iter().flatten())
        {
            assert!(same_bits(x, y), "{name}: prompt {i}: logits differ");
        }
    }
    let stats = warm.stats();
    // Dense: 144 (9 blocks), then 128; hybrid: 128 (the snapshot at its cut), then 128.
    let want = if warm.cache().ssm_slots().is_some() {
        128 + 128
    } else {
        144 + 128
    };
    assert_eq!(
        (stats.steps.prefix.hits, stats.steps.prefix.hit_tokens),
        (2, want),
        "{name}"
    );
    assert_eq!(stats.cache.kv_blocks_used, 0, "{name}");
}

#[test]
fn prefix_hits_are_bitwise_cold_runs() {
    prefix_hits_are_bitwise_cold(cpu, "qwen3-tiny");
    prefix_hits_are_bitwise_cold(cpu, "qwen3_5-tiny");
}

#[test]
fn dense_traffic_with_cancellations_is_bitwise_solo() {
    traffic_with_cancellations_is_bitwise_solo(cpu, "qwen3-tiny");
}

#[test]
fn hybrid_traffic_with_cancellations_is_bitwise_solo() {
    traffic_with_cancellations_is_bitwise_solo(cpu, "qwen3_5-tiny");
}

#[test]
fn dense_preemption_is_bitwise_solo() {
    preemption_is_bitwise_solo(cpu, "qwen3-tiny");
}

#[test]
fn hybrid_preemption_is_bitwise_solo() {
    preemption_is_bitwise_solo(cpu, "qwen3_5-tiny");
}

/// `generate` (the scheduler driven on the caller's thread, with a token callback) gives
/// bitwise what stepping the scheduler by hand gives.
#[test]
fn generate_on_the_callers_thread_is_bitwise_the_stepped_scheduler() {
    for name in [
        "qwen3-tiny",
        "qwen3_5-tiny",
        "qwen3_next-tiny",
        "qwen3_5_moe-tiny",
    ] {
        let mut model = load(name, options(None));
        let vocab = model.runner().model().config().tokens.vocab_size as u32;
        for a in arrivals(4, vocab, 3, false) {
            let scheduled = solo(&mut model, &a.req);
            let mut streamed = Vec::new();
            let looped = generate(&mut model, a.req.clone(), &mut |t| {
                streamed.push(t);
                std::ops::ControlFlow::Continue(())
            })
            .expect("generate");
            assert_eq!(
                streamed, looped.token_ids,
                "{name}: the callback saw every token"
            );
            assert_eq!(scheduled.token_ids, looped.token_ids, "{name}");
            assert_eq!(scheduled.finish_reason, looped.finish_reason, "{name}");
            for (x, y) in scheduled
                .logits
                .iter()
                .flatten()
                .zip(looped.logits.iter().flatten())
            {
                assert!(same_bits(x, y), "{name}: logits differ");
            }
        }
    }
}

/// The same traffic on the GPU: batch invariance must hold for the CUDA kernels too.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use metrale_gpu_runtime::cuda::CudaBackend;

    fn gpu() -> Arc<dyn GpuBackend> {
        Arc::new(CudaBackend::new(0).expect("a CUDA device"))
    }

    #[test]
    fn dense_traffic_with_cancellations_is_bitwise_solo_on_cuda() {
        traffic_with_cancellations_is_bitwise_solo(gpu, "qwen3-tiny");
    }

    #[test]
    fn hybrid_traffic_with_cancellations_is_bitwise_solo_on_cuda() {
        traffic_with_cancellations_is_bitwise_solo(gpu, "qwen3_5-tiny");
    }

    #[test]
    fn dense_preemption_is_bitwise_solo_on_cuda() {
        preemption_is_bitwise_solo(gpu, "qwen3-tiny");
    }

    #[test]
    fn hybrid_preemption_is_bitwise_solo_on_cuda() {
        preemption_is_bitwise_solo(gpu, "qwen3_5-tiny");
    }

    #[test]
    fn prefix_hits_are_bitwise_cold_runs_on_cuda() {
        prefix_hits_are_bitwise_cold(gpu, "qwen3-tiny");
        prefix_hits_are_bitwise_cold(gpu, "qwen3_5-tiny");
    }
}
