//! The CUDA backend end to end (GPU machine only): every fixture reproduces transformers by the
//! same rule as on the CPU (and by the FP8 rule with an FP8 KV cache); graph-replayed decode is bitwise eager decode; a sequence decoded
//! beside others is bitwise the same sequence decoded alone; speculative decoding (MTP head, and
//! an oracle drafter reaching every rollback depth) gives plain greedy decoding's tokens and
//! logits bitwise, through `generate` and through the scheduler. The tests named
//! `*_on_two_gpus` shard the fixtures over 2 GPUs through NCCL (transformers' rule; bitwise
//! repeatable, graphed and batch-invariant at 2 ranks); they fail, saying so, on a machine with
//! fewer GPUs, and run.sh runs them apart, in its tensor-parallel section.

#![allow(clippy::unwrap_used, clippy::type_complexity)]
#![cfg(feature = "cuda")]

#[path = "../crates/metrale-model-engine/tests/support/mod.rs"]
mod engine_support;
mod support;

use std::ops::ControlFlow;
use std::sync::Arc;

use metrale::{Backend, EngineOptions, ModelOptions};
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cuda::CudaBackend;
use metrale_model_engine::generate::{GenerateParams, Generation, generate, generate_speculative};
use metrale_model_engine::options::Speculative;
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::scheduler::{SeqEvent, SeqRequest};
use metrale_model_engine::speculative::{GateOptions, OracleDrafter};
use metrale_model_engine::{Scheduler, factory};
use support::*;

fn cuda_options(model: ModelOptions) -> EngineOptions {
    EngineOptions::default()
        .backend(Backend::cuda(0))
        .model(model)
}

#[test]
fn every_fixture_matches_transformers_on_cuda() {
    let types = [
        "qwen3",
        "llama",
        "qwen3_5_text",
        "qwen3_next",
        "qwen3_5_moe_text",
        "qwen3_5",
        "qwen3_5_moe",
    ];
    let worst = check_fixtures(&types, 11, &cuda_options(ModelOptions::default()));
    eprintln!("worst logits relative L2 error on CUDA: {worst:.3e}");
}

/// With an FP8 KV cache, every fixture passes the FP8 rule on CUDA as on the CPU (a prompt
/// compares at least its first step: some hybrid prompts reach a near tie at their second).
#[test]
fn every_fixture_matches_transformers_with_an_fp8_kv_cache_on_cuda() {
    let types = [
        "qwen3",
        "llama",
        "qwen3_5_text",
        "qwen3_next",
        "qwen3_5_moe_text",
        "qwen3_5",
        "qwen3_5_moe",
    ];
    let fp8 = ModelOptions::default().kv_cache_dtype(metrale::KvCacheDtype::Fp8);
    let rule = Rule {
        min_steps: 1,
        ..Rule::FP8_KV
    };
    let worst = check_fixtures_by(&types, 13, &cuda_options(fp8), rule);
    eprintln!("worst logits relative L2 error on CUDA, FP8 KV: {worst:.3e}");
}

fn params(n: usize, temperature: f32, seed: u64) -> GenerateParams {
    GenerateParams {
        max_new_tokens: n,
        sampling: SamplingParams::default()
            .temperature(temperature)
            .seed(seed),
        stop_token_ids: Vec::new(),
        return_logits: true,
    }
}

fn gpu() -> Arc<dyn GpuBackend> {
    Arc::new(CudaBackend::new(0).expect("a CUDA device"))
}

/// The checkpoint in `dir` on the GPU, sized by `options`.
fn load(dir: &std::path::Path, options: ModelOptions) -> Scheduler {
    Scheduler::new(factory::load(dir, gpu()).unwrap(), options).unwrap()
}

fn request(prompt: &[u32], p: &GenerateParams) -> SeqRequest {
    SeqRequest {
        prompt: prompt.to_vec(),
        params: p.clone(),
        ignore_eos: true,
    }
}

/// One request alone, to its end.
fn alone(s: &mut Scheduler, prompt: &[u32], p: &GenerateParams) -> Generation {
    generate(s, request(prompt, p), &mut |_| ControlFlow::Continue(())).unwrap()
}

/// Every request at once, to their ends.
fn batch(s: &mut Scheduler, reqs: Vec<SeqRequest>) -> Vec<Generation> {
    s.run(reqs, &mut |_, _| ControlFlow::Continue(())).unwrap()
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn a_prompt_prefilled_whole_is_the_prompt_prefilled_in_chunks_on_cuda() {
    for name in ["qwen3-tiny", "qwen3-gqa4-hd128"] {
        check_staged_prefill(&fixtures_dir().join(name), gpu);
    }
}

#[test]
fn graphed_decode_is_bitwise_eager_decode_on_cuda() {
    for name in [
        "qwen3-gqa4-hd128",
        "qwen3_5-tiny",
        "qwen3_next-tiny",
        "qwen3_5-vl-tiny",
        "qwen3_5_moe-vl-tiny",
        "qwen3_next-b-tiny",
    ] {
        let dir = fixtures_dir().join(name);
        let prompt: Vec<u32> = (1..40).collect();
        let p = params(16, 0.0, 0);
        let mut graphed = load(&dir, ModelOptions::default());
        let mut eager = load(&dir, ModelOptions::default().decode_graphs(false));
        let g = alone(&mut graphed, &prompt, &p);
        let e = alone(&mut eager, &prompt, &p);
        assert_eq!(
            graphed.runner().graphs().decode_widths(),
            vec![1],
            "{name}: decode ran from a graph"
        );
        assert_eq!(g.token_ids, e.token_ids, "{name}");
        assert_eq!(
            bits(g.logits.as_ref().unwrap()),
            bits(e.logits.as_ref().unwrap()),
            "{name}: graph replay differs from eager"
        );
    }
}

#[test]
fn batched_decode_is_bitwise_alone_on_cuda() {
    // MoE fixtures too: a row's experts and their weights must not depend on which other rows
    // the step groups by expert.
    for name in [
        "qwen3-gqa4-hd128",
        "qwen3_5-tiny",
        "qwen3_5_moe-vl-tiny",
        "qwen3_next-b-tiny",
    ] {
        let dir = fixtures_dir().join(name);
        // Token ids stay below every fixture's vocabulary (200 for qwen3_next-b-tiny).
        let vocab = metrale_config::ModelConfig::from_dir(&dir)
            .unwrap()
            .tokens
            .vocab_size
            .min(256);
        let mut model = load(&dir, ModelOptions::default().max_decode_seqs(8));
        let prompts: Vec<Vec<u32>> = (0..6)
            .map(|i| {
                (0..(2 + 9 * i))
                    .map(|t| ((t * 37 + i * 11) % (vocab - 6)) as u32 + 1)
                    .collect()
            })
            .collect();
        let ps: Vec<GenerateParams> = (0..6)
            .map(|i| params(3 + 2 * i, if i % 2 == 0 { 0.0 } else { 0.7 }, i as u64))
            .collect();
        let reqs: Vec<SeqRequest> = prompts
            .iter()
            .zip(&ps)
            .map(|(q, p)| request(q, p))
            .collect();
        let batched = batch(&mut model, reqs);
        for (i, (prompt, p)) in prompts.iter().zip(&ps).enumerate() {
            let solo = alone(&mut model, prompt, p);
            assert_eq!(batched[i].token_ids, solo.token_ids, "{name} sequence {i}");
            assert_eq!(
                bits(batched[i].logits.as_ref().unwrap()),
                bits(solo.logits.as_ref().unwrap()),
                "{name} sequence {i}: batched logits differ from solo"
            );
        }
    }
}

#[test]
fn speculative_greedy_is_bitwise_plain_greedy_on_cuda() {
    for name in engine_support::HYBRID {
        let fx = engine_support::MtpFixture::new(name);
        let prompts = fx.prompts();
        let p = params(24, 0.0, 0);
        let mut plain = load(fx.path(), ModelOptions::default());
        let want: Vec<_> = prompts.iter().map(|q| alone(&mut plain, q, &p)).collect();
        let reqs: Vec<SeqRequest> = prompts.iter().map(|q| request(q, &p)).collect();
        for k in 1..=4 {
            let spec = |speculative| {
                ModelOptions::default()
                    .speculative(speculative)
                    .num_draft_tokens(k)
            };
            // The MTP head drafting, all prompts in shared verify steps.
            let mut model = load(fx.path(), spec(Speculative::Mtp));
            let got = batch(&mut model, reqs.clone());
            // The model's own continuation, wrong at depth (round % (k + 1)).
            let expected: Vec<Vec<u32>> = prompts
                .iter()
                .zip(&want)
                .map(|(q, g)| q.iter().chain(&g.token_ids).copied().collect())
                .collect();
            let oracle =
                OracleDrafter::wrong_at(expected, Box::new(move |_, round| Some(round % (k + 1))));
            let mut ext = load(fx.path(), spec(Speculative::External));
            let (by_oracle, stats) =
                generate_speculative(&mut ext, reqs.clone(), Box::new(oracle), &mut |_, _| {
                    ControlFlow::Continue(())
                })
                .unwrap();
            assert!(
                stats.accepted() > 0,
                "{name} K={k}: the oracle's drafts were kept"
            );
            for (i, w) in want.iter().enumerate() {
                for (g, how) in [(&got[i], "mtp"), (&by_oracle[i], "oracle")] {
                    assert_eq!(g.token_ids, w.token_ids, "{name} K={k} {how} prompt {i}");
                    assert_eq!(
                        bits(g.logits.as_ref().unwrap()),
                        bits(w.logits.as_ref().unwrap()),
                        "{name} K={k} {how} prompt {i}: verify logits differ from decode's"
                    );
                }
            }
        }
    }
}

/// Every request of `reqs` through the scheduler stepped by hand, in request order.
fn scheduled(sched: &mut Scheduler, reqs: &[SeqRequest]) -> Vec<Generation> {
    let ids: Vec<_> = reqs.iter().map(|r| sched.add(r.clone()).unwrap()).collect();
    let mut done = std::collections::HashMap::new();
    while !sched.is_idle() {
        for e in sched.step().unwrap().events {
            if let SeqEvent::Finished { id, generation } = e {
                done.insert(id, generation);
            }
        }
    }
    ids.iter().map(|id| done.remove(id).unwrap()).collect()
}

#[test]
fn the_scheduler_speculating_is_bitwise_the_plain_scheduler_on_cuda() {
    let always = GateOptions::default().enabled(false);
    for name in engine_support::HYBRID {
        let fx = engine_support::MtpFixture::new(name);
        let reqs: Vec<SeqRequest> = fx
            .prompts()
            .into_iter()
            .zip([5, 24, 13, 2])
            .map(|(prompt, n)| SeqRequest {
                prompt,
                params: params(n, 0.0, 0),
                ignore_eos: true,
            })
            .collect();
        let mut plain = load(fx.path(), ModelOptions::default());
        let want = scheduled(&mut plain, &reqs);
        let expected: Vec<Vec<u32>> = reqs
            .iter()
            .zip(&want)
            .map(|(r, g)| r.prompt.iter().chain(&g.token_ids).copied().collect())
            .collect();
        let spec = |speculative| {
            ModelOptions::default()
                .speculative(speculative)
                .num_draft_tokens(3)
        };
        let mut mtp = load(fx.path(), spec(Speculative::Mtp));
        mtp.speculation().unwrap().set_gate(always);
        let by_mtp = scheduled(&mut mtp, &reqs);
        let mut ext = load(fx.path(), spec(Speculative::External));
        let oracle =
            OracleDrafter::wrong_at(expected, Box::new(|req, round| Some((req + round) % 4)));
        ext.set_drafter(Some(Box::new(oracle))).unwrap();
        ext.speculation().unwrap().set_gate(always);
        let by_oracle = scheduled(&mut ext, &reqs);
        assert!(
            ext.stats().speculation.unwrap().accepted() > 0,
            "{name}: the oracle's drafts were kept"
        );
        for (i, w) in want.iter().enumerate() {
            for (g, how) in [(&by_mtp[i], "mtp"), (&by_oracle[i], "oracle")] {
                assert_eq!(g.token_ids, w.token_ids, "{name} {how} request {i}");
                assert_eq!(
                    bits(g.logits.as_ref().unwrap()),
                    bits(w.logits.as_ref().unwrap()),
                    "{name} {how} request {i}: logits differ from the plain scheduler's"
                );
            }
        }
    }
}

/// Panics, naming the machine the test needs, when the driver sees fewer than `n` GPUs: a test
/// of tensor parallelism must not pass on a machine that cannot run it.
fn require_gpus(n: usize) {
    let seen = CudaBackend::device_count().expect("the CUDA driver");
    assert!(
        seen >= n,
        "this test needs {n} GPUs and the driver sees {seen}: run it on a machine with {n} \
         (run.sh's tensor-parallel section, not the single-GPU run)"
    );
}

fn tp_options(tp: usize, model: ModelOptions) -> EngineOptions {
    cuda_options(model.tensor_parallel_size(tp))
}

/// The dense, hybrid and MoE fixtures split over 2 GPUs (NCCL's all-reduce and all-gather
/// between the ranks) match transformers by the same rule as the whole model.
#[test]
fn tensor_parallel_fixtures_match_transformers_on_two_gpus() {
    require_gpus(2);
    let names = [
        "qwen3-tiny",
        "llama-tiny",
        "qwen3_5-tiny",
        "qwen3_next-tiny",
        "qwen3_5_moe-tiny",
    ];
    let dirs: Vec<_> = names.iter().map(|n| fixtures_dir().join(n)).collect();
    let worst = check_fixture_dirs(&dirs, &tp_options(2, ModelOptions::default()), Rule::BF16);
    eprintln!("2 GPUs: worst logits relative L2 error {worst:.3e}");
}

/// At 2 ranks an all-reduce adds two addends, one commutative f32 addition, so NCCL's order
/// cannot change a bit: a sharded run repeats bit for bit, graphed decode is eager decode, and
/// sequences decoded together are each their solo run.
#[test]
fn a_tensor_parallel_run_is_bitwise_repeatable_graphed_and_batch_invariant_on_two_gpus() {
    require_gpus(2);
    for name in ["qwen3-tiny", "qwen3_5_moe-tiny", "qwen3_next-tiny"] {
        let dir = fixtures_dir().join(name);
        let prompts = read_reference(&dir).unwrap();
        let run = |model: ModelOptions| {
            let engine = metrale::Engine::load(&dir, tp_options(2, model)).unwrap();
            greedy_bits(&engine, &prompts)
        };
        let first = run(ModelOptions::default());
        assert!(
            first
                .iter()
                .all(|(t, l)| !t.is_empty() && l.len() == t.len())
        );
        assert!(
            run(ModelOptions::default()) == first,
            "{name}: a second run differs"
        );
        assert!(
            run(ModelOptions::default().decode_graphs(false)) == first,
            "{name}: eager decode differs from graphed"
        );
        // Every prompt submitted at once: decode steps of several rows.
        let engine = metrale::Engine::load(&dir, tp_options(2, ModelOptions::default())).unwrap();
        let handles: Vec<_> = (prompts.iter())
            .map(|p| {
                let req =
                    metrale::GenerateRequest::new(metrale::Prompt::TokenIds(p.prompt_ids.clone()))
                        .max_new_tokens(p.greedy_ids.len())
                        .ignore_eos(true)
                        .return_logits(true);
                engine.submit(req).unwrap()
            })
            .collect();
        for (h, (tokens, logits)) in handles.into_iter().zip(&first) {
            let out = h.wait().unwrap();
            assert_eq!(&out.token_ids, tokens, "{name}: batched tokens");
            assert!(
                bits(&out.logits.unwrap_or_default()) == *logits,
                "{name}: batched logits differ from the solo run's"
            );
        }
    }
}

/// More ranks than GPUs from the device on: refused at load with a typed error naming the GPU
/// that is missing (rank 1 on the GPU past the last, whatever the machine).
#[test]
fn a_tensor_parallel_engine_past_the_last_gpu_is_refused_naming_it() {
    let n = CudaBackend::device_count().expect("the CUDA driver");
    let options = EngineOptions::default()
        .backend(Backend::cuda(n - 1))
        .model(ModelOptions::default().tensor_parallel_size(2));
    match metrale::Engine::load(fixtures_dir().join("qwen3-tiny"), options) {
        Ok(_) => panic!("2 ranks from GPU {} of {n} loaded", n - 1),
        Err(e) => {
            let text = e.to_string();
            assert!(
                matches!(e, metrale::EngineError::BackendUnavailable { .. })
                    && text.contains(&format!("needs GPU {n}"))
                    && text.contains(&format!("the driver sees {n} GPU(s)")),
                "{text}"
            );
        }
    }
}
