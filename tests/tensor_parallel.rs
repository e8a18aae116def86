//! Tensor parallelism on the CPU backend: the dense, hybrid and MoE fixtures split over 2 and 4
//! ranks (threads sharing the CPU backend's communicator) match transformers by the project's
//! rule as the whole model does, a sharded model's run is bitwise the same every time, MTP
//! speculative decoding on a sharded model gives its plain greedy output, and sizes or settings
//! a model cannot be split with are refused with typed errors.

#![allow(clippy::unwrap_used)]

mod support;

#[path = "../crates/metrale-model-engine/tests/support/mod.rs"]
mod engine_support;

use metrale::{
    Backend, Engine, EngineError, EngineOptions, GateOptions, GenerateRequest, ModelOptions,
    Speculative,
};
use support::*;

fn options(tp: usize) -> EngineOptions {
    EngineOptions::default().model(ModelOptions::default().tensor_parallel_size(tp))
}

fn check(names: &[&str], sizes: &[usize]) {
    let dirs: Vec<_> = names.iter().map(|n| fixtures_dir().join(n)).collect();
    for &tp in sizes {
        let worst = check_fixture_dirs(&dirs, &options(tp), Rule::BF16);
        eprintln!("{names:?} at {tp} ranks: worst logits relative L2 error {worst:.3e}");
    }
}

#[test]
fn dense_fixtures_match_transformers_on_1_2_and_4_ranks() {
    // qwen3-tiny: 4 query heads over 2 KV heads (4 ranks share each KV head over 2), tied
    // embeddings (each rank's LM head is rows of the replicated embedding); llama-tiny: one KV
    // head on every rank, an FFN of 224 (56 columns a rank at 4).
    check(&["qwen3-tiny", "llama-tiny"], &[1, 2, 4]);
}

#[test]
fn hybrid_fixtures_match_transformers_on_2_and_4_ranks() {
    // 2 GDN key heads and 4 value heads: at 4 ranks each key head serves two ranks.
    // qwen3_next-tiny also has MoE layers and Qwen3-Next's per-key-head projection layout.
    check(&["qwen3_5-tiny", "qwen3_next-tiny"], &[2, 4]);
}

#[test]
fn moe_fixture_matches_transformers_on_2_and_4_ranks() {
    // 8 experts of width 32 (8 a rank at 4) and a gated shared expert of 48.
    check(&["qwen3_5_moe-tiny"], &[2, 4]);
}

/// Greedy tokens and the bits of every step's logits of a fresh engine with `options` on each
/// of `dir`'s reference prompts.
fn run_bits(dir: &std::path::Path, options: EngineOptions) -> Vec<(Vec<u32>, Vec<Vec<u32>>)> {
    let engine = Engine::load(dir, options).unwrap();
    greedy_bits(&engine, &read_reference(dir).unwrap())
}

#[test]
fn a_sharded_run_is_bitwise_the_same_every_time() {
    for (name, tp) in [("qwen3_5_moe-tiny", 4), ("qwen3-tiny", 2)] {
        let dir = fixtures_dir().join(name);
        let first = run_bits(&dir, options(tp));
        assert!(
            first
                .iter()
                .all(|(t, l)| !t.is_empty() && l.len() == t.len())
        );
        assert!(
            run_bits(&dir, options(tp)) == first,
            "{name} at {tp} ranks: a second run differs"
        );
        // Eager decode steps are the graphed ones (each rank captured its own, collectives
        // included).
        let eager = ModelOptions::default()
            .tensor_parallel_size(tp)
            .decode_graphs(false);
        assert!(
            run_bits(&dir, EngineOptions::default().model(eager)) == first,
            "{name} at {tp} ranks: eager decode differs from graphed"
        );
        // The sums run in another order than the whole model's: the check above compares
        // something that depends on the ranks.
        assert!(run_bits(&dir, options(1)) != first, "{name}");
    }
}

/// The error of loading `name` with `options`, which must fail.
fn load_error(name: &str, options: EngineOptions) -> String {
    match Engine::load(fixtures_dir().join(name), options) {
        Ok(_) => panic!("{name}: loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn sizes_and_settings_a_model_cannot_be_split_with_are_refused() {
    for (tp, name, needles) in [
        (3, "qwen3-tiny", &["tensor_parallel_size", "3 ranks"][..]),
        (0, "qwen3-tiny", &["tensor_parallel_size", "0 ranks"]),
        // 4 query heads over 8 ranks.
        (
            8,
            "qwen3-tiny",
            &["tensor_parallel_size", "num_attention_heads"],
        ),
        (2, "qwen3-fp8-tiny", &["tensor_parallel_size", "FP8"]),
    ] {
        let e = load_error(name, options(tp));
        for n in needles {
            assert!(e.contains(n), "{name} at {tp}: `{n}` not in: {e}");
        }
    }
    let e = load_error(
        "qwen3-tiny",
        options(2).backend(Backend::Cuda { device: 0 }),
    );
    assert!(e.contains("cuda"), "{e}");
    let circuit = options(2).forward(metrale::ForwardSelect::Circuit {
        fusions: metrale::circuit::Fusions::All,
    });
    let e = load_error("qwen3-tiny", circuit);
    assert!(e.contains("tensor parallelism over 2 ranks"), "{e}");
    // The error types are typed: the options error is the model's.
    assert!(matches!(
        Engine::load(fixtures_dir().join("qwen3-tiny"), options(3)),
        Err(EngineError::Model(_))
    ));
}

#[test]
fn a_sharded_hybrid_model_serves_a_repeated_prompt_from_the_prefix_cache_bitwise() {
    // A 100-token prompt: its first 64 tokens' KV blocks and SSM snapshot are published on
    // every rank, the second request restores them on every rank and prefills the rest.
    let dir = fixtures_dir().join("qwen3_5-tiny");
    let engine = Engine::load(&dir, options(2)).unwrap();
    let cold = Engine::load(
        &dir,
        options(2).model(
            ModelOptions::default()
                .tensor_parallel_size(2)
                .prefix_caching(false),
        ),
    )
    .unwrap();
    let prompt: Vec<u32> = (0..100u32).map(|t| (t * 53 + 11) % 256).collect();
    let req = metrale::GenerateRequest::new(metrale::Prompt::TokenIds(prompt))
        .max_new_tokens(6)
        .ignore_eos(true)
        .return_logits(true);
    let want = cold.generate(&req).unwrap();
    for run in 0..2 {
        let got = engine.generate(&req).unwrap();
        assert_eq!(got.token_ids, want.token_ids, "run {run}");
        assert!(got.logits == want.logits, "run {run}: logits differ");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let hits = loop {
        let m = engine.metrics();
        if m.steps.prefix.hits > 0 || std::time::Instant::now() > deadline {
            break m.steps.prefix.hit_tokens;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert_eq!(hits, 64, "the second request's cached tokens");
}

#[test]
fn a_scheduler_refuses_a_rank_count_its_options_do_not_name() {
    let dir = fixtures_dir().join("qwen3-tiny");
    let gpu = std::sync::Arc::new(metrale_gpu_runtime::CpuBackend::default());
    let model = metrale_model_engine::factory::load(&dir, gpu).unwrap();
    let options = ModelOptions::default().tensor_parallel_size(2);
    let e = metrale_model_engine::Scheduler::new(model, options).unwrap_err();
    assert!(e.to_string().contains("tensor_parallel_size"), "{e}");
    // A shard needs a backend of its group: one alone is refused at load.
    let gpus: Vec<std::sync::Arc<dyn metrale_gpu_runtime::GpuBackend>> = (0..2)
        .map(|_| std::sync::Arc::new(metrale_gpu_runtime::CpuBackend::default()) as _)
        .collect();
    let e = metrale_model_engine::factory::load_ranks(&dir, &gpus, Default::default()).unwrap_err();
    assert!(
        e.to_string().contains("drives rank 0 of a group of 1"),
        "{e}"
    );
}

#[test]
fn sharded_models_prefilled_in_chunks_of_5_tokens_match_transformers() {
    // Chunks cut every prompt, block and GDN chunk in odd places, and mixed steps hold decode
    // rows beside prefill rows: every rank runs the same rows.
    let dirs = [
        fixtures_dir().join("qwen3-tiny"),
        fixtures_dir().join("qwen3_5-tiny"),
    ];
    let model = ModelOptions::default()
        .tensor_parallel_size(2)
        .max_batch_tokens(5);
    check_fixture_dirs(&dirs, &EngineOptions::default().model(model), Rule::BF16);
}

#[test]
fn the_choices_of_a_sharded_request_are_each_their_solo_run() {
    // Three choices prefill once and fork the cache: the partial KV block and the SSM state
    // are copied on every rank.
    let engine = Engine::load(fixtures_dir().join("qwen3_5-tiny"), options(2)).unwrap();
    let prompt: Vec<u32> = (0..21u32).map(|t| (t * 37 + 5) % 256).collect();
    let request = |seed: u64, n: usize| {
        metrale::GenerateRequest::new(metrale::Prompt::TokenIds(prompt.clone()))
            .max_new_tokens(6)
            .ignore_eos(true)
            .sampling(
                metrale::SamplingParams::default()
                    .temperature(1.0)
                    .seed(seed)
                    .n(n),
            )
    };
    let choices = engine.generate(&request(7, 3)).unwrap().into_choices();
    assert_eq!(choices.len(), 3);
    for (c, choice) in choices.iter().enumerate() {
        let seed = metrale_model_engine::sampling::choice_seed(7, c);
        let solo = engine.generate(&request(seed, 1)).unwrap();
        assert_eq!(choice.token_ids, solo.token_ids, "choice {c}");
    }
    assert!(
        choices[0].token_ids != choices[1].token_ids
            || choices[1].token_ids != choices[2].token_ids
    );
}

#[test]
fn mtp_speculation_on_a_sharded_model_gives_its_plain_greedy_output() {
    for tp in [2, 4] {
        mtp_run(tp);
    }
}

fn mtp_run(tp: usize) {
    // A synthetic MTP head (one layer) on qwen3_5-tiny, sharded like the model's layers; every
    // decode step verifies (the gate off), each rank running verify and MTP steps with its
    // own graphs.
    let fx = engine_support::MtpFixture::new("qwen3_5-tiny");
    let plain = Engine::load(fx.path(), options(tp)).unwrap();
    let spec = Engine::load(
        fx.path(),
        EngineOptions::default()
            .model(
                ModelOptions::default()
                    .tensor_parallel_size(tp)
                    .speculative(Speculative::Mtp)
                    .num_draft_tokens(2),
            )
            .speculation_gate(GateOptions::default().enabled(false)),
    )
    .unwrap();
    let reqs: Vec<GenerateRequest> = (fx.prompts().iter().zip([3, 16, 9, 1]))
        .map(|(p, n)| {
            GenerateRequest::new(metrale::Prompt::TokenIds(p.clone()))
                .max_new_tokens(n)
                .ignore_eos(true)
                .return_logits(true)
        })
        .collect();
    let handles: Vec<_> = (reqs.iter())
        .map(|r| spec.submit(r.clone()).unwrap())
        .collect();
    for (r, h) in reqs.iter().zip(handles) {
        let got = h.wait().unwrap();
        let want = plain.generate(r).unwrap();
        assert_eq!(got.token_ids, want.token_ids);
        assert!(got.logits == want.logits, "logits differ");
    }
    let m = spec.metrics();
    let sp = m.speculation.unwrap();
    assert!(m.steps.verify_steps > 0 && sp.drafted > 0, "{m:?}");
}

#[test]
fn an_fp8_kv_cache_shards_with_its_model() {
    // Each rank's pools hold its KV heads in e4m3 with the layers' scales: at 2 ranks the dense
    // and hybrid fixtures pass the FP8 cache's rule, as the whole model does.
    let dirs: Vec<_> = ["qwen3-tiny", "qwen3_5-tiny"]
        .iter()
        .map(|n| fixtures_dir().join(n))
        .collect();
    let model = ModelOptions::default()
        .tensor_parallel_size(2)
        .kv_cache_dtype(metrale::KvCacheDtype::Fp8);
    let rule = Rule {
        min_steps: 1,
        ..Rule::FP8_KV
    };
    let worst = check_fixture_dirs(&dirs, &EngineOptions::default().model(model), rule);
    eprintln!("FP8 KV cache at 2 ranks: worst logits relative L2 error {worst:.3e}");
}
