//! Decode steps shared by several sequences give each sequence bitwise the tokens and logits it
//! gets alone, at every padded width; graph-replayed decode is bitwise eager decode, and its
//! graphs run the decode GEMM that reads weights through tensor maps.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

use std::path::PathBuf;
use std::sync::Arc;

use metrale_gpu_runtime::cpu::KernelCtx;
use metrale_gpu_runtime::cpu::kernels::gemm;
use metrale_gpu_runtime::{CpuBackend, GpuResult};
use metrale_model_engine::generate::{GenerateParams, Generation, SeqRequest, generate};
use metrale_model_engine::runner::Fusions;
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::{ForwardSelect, ModelCircuit, ModelOptions, Scheduler, factory};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn load(name: &str, options: ModelOptions) -> Scheduler {
    let model = factory::load(&fixture(name), Arc::new(CpuBackend::default())).unwrap();
    Scheduler::new(model, options).unwrap()
}

fn request(prompt: &[u32], p: &GenerateParams) -> SeqRequest {
    SeqRequest {
        prompt: prompt.to_vec(),
        params: p.clone(),
        ignore_eos: true,
    }
}

fn batch(model: &mut Scheduler, reqs: &[(&[u32], &GenerateParams)]) -> Vec<Generation> {
    let reqs = reqs.iter().map(|(q, p)| request(q, p)).collect();
    model
        .run(reqs, &mut |_, _| std::ops::ControlFlow::Continue(()))
        .unwrap()
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

fn alone(model: &mut Scheduler, prompt: &[u32], p: &GenerateParams) -> Generation {
    generate(model, request(prompt, p), &mut |_| {
        std::ops::ControlFlow::Continue(())
    })
    .unwrap()
}

#[test]
fn batched_decode_is_bitwise_alone() {
    // Alternating steps: every ladder width then runs as a decode step (mixed steps hold the
    // decode rows of the steps where a sequence prefills; tests/mixed_steps.rs covers those).
    let options = ModelOptions::default()
        .max_decode_seqs(8)
        .mixed_steps(false);
    let mut model = load("qwen3-gqa4-hd128", options);
    // Five sequences of different lengths and lifetimes: widths 8, then 4, 2, 1 as they finish.
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|i| {
            (0..(3 + 7 * i))
                .map(|t| ((t * 31 + i * 17) % 300) as u32 + 1)
                .collect()
        })
        .collect();
    let ps: Vec<GenerateParams> = (0..5)
        .map(|i| params(4 + 3 * i, if i % 2 == 0 { 0.0 } else { 0.8 }, i as u64))
        .collect();
    let reqs: Vec<(&[u32], &GenerateParams)> = prompts.iter().map(Vec::as_slice).zip(&ps).collect();
    let batched = batch(&mut model, &reqs);
    assert_eq!(
        model.runner().graphs().decode_widths(),
        vec![1, 2, 4, 8],
        "every ladder width ran"
    );
    for (i, (prompt, p)) in reqs.iter().enumerate() {
        let solo = alone(&mut model, prompt, p);
        assert_eq!(batched[i].token_ids, solo.token_ids, "sequence {i} tokens");
        let (b, s) = (
            batched[i].logits.as_ref().unwrap(),
            solo.logits.as_ref().unwrap(),
        );
        for (step, (x, y)) in b.iter().zip(s).enumerate() {
            let same = x.iter().zip(y).all(|(a, c)| a.to_bits() == c.to_bits());
            assert!(
                same,
                "sequence {i} step {step}: batched logits differ from solo"
            );
        }
    }
}

#[test]
fn graphed_decode_is_bitwise_eager_decode() {
    let prompt: Vec<u32> = (1..40).collect();
    let p = params(10, 0.0, 0);
    let mut graphed = load("qwen3-tiny", ModelOptions::default());
    let mut eager = load("qwen3-tiny", ModelOptions::default().decode_graphs(false));
    let g = alone(&mut graphed, &prompt, &p);
    let e = alone(&mut eager, &prompt, &p);
    assert_eq!(graphed.runner().graphs().decode_widths(), vec![1]);
    assert!(eager.runner().graphs().decode_widths().is_empty());
    assert_eq!(g.token_ids, e.token_ids);
    for (x, y) in g.logits.unwrap().iter().zip(e.logits.as_ref().unwrap()) {
        assert!(
            x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()),
            "graph replay differs from eager"
        );
    }
}

static STREAM_TMA_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `gemm::linear_stream_tma`'s twin, counted.
fn counted_stream_tma(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    STREAM_TMA_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    gemm::linear_stream_tma(ctx)
}

/// A decode graph is captured on its width's first step, when a weight's tensor map cannot be
/// uploaded; prompts too short for the prefill kernel that maps weights leave none made. The
/// model records the step first, so the graph of 16 rows still runs the decode GEMM that reads
/// the weights through their maps, the faster decode GEMM. So does a model whose steps never
/// reach the prefill kernel's size (`max_batch_tokens` 64), which has map slots without staging
/// images.
#[test]
fn graphed_decode_of_9_rows_and_more_reads_the_weights_through_their_maps() {
    for max_batch_tokens in [ModelOptions::default().max_batch_tokens, 64] {
        let mut backend = CpuBackend::default();
        backend.register("gemm", "linear_stream_tma", counted_stream_tma);
        let options = ModelOptions::default()
            .max_decode_seqs(16)
            .max_batch_tokens(max_batch_tokens)
            .mixed_steps(false);
        let model = factory::load(&fixture("qwen3-tiny"), Arc::new(backend)).unwrap();
        let mut model = Scheduler::new(model, options).unwrap();
        let prompts: Vec<Vec<u32>> = (0..16u32).map(|i| vec![i + 1, 2 * i + 3, 7]).collect();
        let p = params(3, 0.0, 0);
        let reqs: Vec<(&[u32], &GenerateParams)> =
            prompts.iter().map(|q| (q.as_slice(), &p)).collect();
        let before = STREAM_TMA_RUNS.load(std::sync::atomic::Ordering::SeqCst);
        batch(&mut model, &reqs);
        assert!(model.runner().graphs().decode_widths().contains(&16));
        let runs = STREAM_TMA_RUNS.load(std::sync::atomic::Ordering::SeqCst) - before;
        assert!(
            runs > 0,
            "max_batch_tokens {max_batch_tokens}: the graphed 16-row decode never ran \
             linear_stream_tma"
        );
    }
}

#[test]
fn kv_blocks_are_returned_after_every_generation() {
    let mut model = load("llama-tiny", ModelOptions::default());
    let free = model.cache().blocks().num_free();
    let prompt: Vec<u32> = (1..50).collect();
    alone(&mut model, &prompt, &params(20, 0.0, 0));
    assert_eq!(model.cache().blocks().num_free(), free);
}

static STAGED_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `activation::silu_mul_staged`'s twin, counted.
fn counted_silu_staged(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    STAGED_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    metrale_gpu_runtime::cpu::kernels::activation::silu_mul_staged(ctx)
}

/// Decode steps of 17..128 rows give the qkv (or GDN input), gate/up and down projections their
/// x as stage images written by the kernel ahead (`add_rms_norm_staged`, `silu_mul_staged`)
/// wherever every k segment is whole stages, which the tiny checkpoints' widths never are. On
/// random Qwen3 and Qwen3.5 models of 512 and 1024 inputs (`decode_staging_shapes_for_cpu`),
/// twenty sequences batched (steps of 32 rows, which stage) give bitwise what each gives alone
/// (one row: no staging), under the legacy, reference and fused forwards.
#[test]
fn decode_steps_staging_x_as_images_are_bitwise_alone() {
    for config in metrale_model_engine::bench::decode_staging_shapes_for_cpu().unwrap() {
        staged_decode_is_bitwise_alone(&config);
    }
}

fn staged_decode_is_bitwise_alone(config: &metrale_config::ModelConfig) {
    let forwards = [
        ForwardSelect::Legacy,
        ForwardSelect::Circuit {
            fusions: Fusions::ReferenceOnly,
        },
        ForwardSelect::Circuit {
            fusions: Fusions::All,
        },
    ];
    for forward in forwards {
        let mut backend = CpuBackend::default();
        backend.register("activation", "silu_mul_staged", counted_silu_staged);
        // Alternating steps, so the wide steps are graphed decode steps.
        let options = ModelOptions::default()
            .max_decode_seqs(32)
            .mixed_steps(false);
        let model = factory::random(config.clone(), Arc::new(backend), 7).unwrap();
        let mut model = Scheduler::new(model, options).unwrap();
        model.runner_mut().set_forward(forward).unwrap();
        let prompts: Vec<Vec<u32>> = (0..20u32)
            .map(|i| {
                (0..3 + i % 5)
                    .map(|t| (t * 37 + i * 11) % 250 + 1)
                    .collect()
            })
            .collect();
        let p = params(3, 0.0, 0);
        let reqs: Vec<(&[u32], &GenerateParams)> =
            prompts.iter().map(|q| (q.as_slice(), &p)).collect();
        let before = STAGED_RUNS.load(std::sync::atomic::Ordering::SeqCst);
        let batched = batch(&mut model, &reqs);
        let staged = STAGED_RUNS.load(std::sync::atomic::Ordering::SeqCst) - before;
        assert!(
            staged > 0,
            "{forward:?}: no decode step staged the down projection's x"
        );
        for (i, (prompt, p)) in reqs.iter().enumerate() {
            let solo = alone(&mut model, prompt, p);
            assert_eq!(
                batched[i].token_ids, solo.token_ids,
                "{forward:?} sequence {i}"
            );
            let (b, s) = (
                batched[i].logits.as_ref().unwrap(),
                solo.logits.as_ref().unwrap(),
            );
            for (step, (x, y)) in b.iter().zip(s).enumerate() {
                assert!(
                    x.iter().zip(y).all(|(a, c)| a.to_bits() == c.to_bits()),
                    "{forward:?} sequence {i} step {step}: batched logits differ from solo"
                );
            }
        }
    }
}
