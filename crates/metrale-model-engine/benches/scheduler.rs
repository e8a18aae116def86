//! The host work of an engine step, on the CPU: the scheduler's `add` and admission of a burst
//! of requests, decode steps at batch 1, 8 and 32, a prefill chunk step, and the step-input
//! preparation of `StepRunner` (checks, the metadata upload, the step's launch list).
//!
//! The model is `bench::tiny_for_cpu()` with random weights: Qwen3's dense layer at hidden 64,
//! 2 layers, 4 query and 2 KV heads of 16, FFN 128, vocabulary 256, so that the CPU kernels
//! cost little next to the host work. The engine runs with the default options but for
//! `max_decode_seqs` (32 where the batch reaches 32) and `max_seq_len` 4096 (block tables of
//! 256 columns, as a served 4K context has): 512-token chunks (`max_batch_tokens`), blocks of
//! 16, prefix caching on, decode steps replayed from captured graphs.
//!
//! Each step figure is taken twice, on two CPU backends:
//! - `kernels`: the CPU backend as the tests run it, every kernel computed;
//! - `host`: every kernel but the device argmax and the sampler replaced by one that does
//!   nothing, so the figure is the host's own work: the scheduler's bookkeeping, the prefix
//!   cache, the step's metadata written to its buffers, the launches handed to the backend (a
//!   captured graph replayed, launch by launch on the CPU backend, for decode), the tokens
//!   read back (the sampler stays: the scheduler feeds its tokens back as inputs).
//!   The logits are then meaningless (every sequence samples token 0, and ignores EOS), which
//!   changes no host work: no decision of the scheduler reads a token's value.
//!
//! The difference between the two is the kernels' share of a step on this backend. On CUDA the
//! kernels are others and a graph replay is one launch; the host work above is the same code.
//!
//! Sizes: prompts of 512 tokens (one chunk); decode contexts from 512 to 768 tokens (each
//! decode measurement restarts its sequences from their prompts, a prefix-cache hit, every 256
//! steps, outside the timing); bursts of 32 requests.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use metrale_cache::{BlockTable, CacheManager};
use metrale_gpu_runtime::cpu::KernelCtx;
use metrale_gpu_runtime::{CpuBackend, GpuBackend, GpuResult};
use metrale_model_engine::bench::tiny_for_cpu;
use metrale_model_engine::factory;
use metrale_model_engine::runner::{StepInput, StepRow};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::scheduler::{GenerateParams, SeqRequest, StepKind};
use metrale_model_engine::{ModelOptions, Scheduler, StepRunner};

/// Prompt tokens of every request: one prefill chunk.
const PROMPT: usize = 512;
/// Decode steps measured before the sequences restart from their prompts.
const DECODE_STEPS_PER_FILL: usize = 256;
/// The context of the decode-shaped step inputs: mid-way through the decode steps' contexts.
const DECODE_CONTEXT: usize = PROMPT + DECODE_STEPS_PER_FILL / 2;
const DECODE_BATCHES: [usize; 3] = [1, 8, 32];
const BURST: usize = 32;

/// Which CPU backend runs the steps (see the module header).
#[derive(Debug, Clone, Copy)]
enum Kernels {
    Computed,
    Skipped,
}

impl Kernels {
    fn label(self) -> &'static str {
        match self {
            Kernels::Computed => "kernels",
            Kernels::Skipped => "host",
        }
    }

    fn backend(self) -> Arc<dyn GpuBackend> {
        let mut cpu = CpuBackend::default();
        if let Kernels::Skipped = self {
            for (module, name) in cpu.kernel_names() {
                if module != "sampling" {
                    cpu.register(&module, &name, skip);
                }
            }
        }
        Arc::new(cpu)
    }
}

/// A kernel that does nothing.
fn skip(_: &KernelCtx<'_>) -> GpuResult<()> {
    Ok(())
}

fn options(max_decode_seqs: usize) -> ModelOptions {
    ModelOptions::default()
        .max_seq_len(Some(4096))
        .max_decode_seqs(max_decode_seqs)
}

fn scheduler(kernels: Kernels, max_decode_seqs: usize) -> Scheduler {
    let config = tiny_for_cpu().expect("the tiny shape parses");
    let model = factory::random(config, kernels.backend(), 7).expect("random weights");
    Scheduler::new(model, options(max_decode_seqs)).expect("the scheduler fits the CPU backend")
}

/// A prompt of `len` tokens that no prompt of another `salt` shares a block with: the salt's
/// bytes first, then tokens spread over the vocabulary of 256.
fn prompt(salt: u32, len: usize) -> Vec<u32> {
    let head = salt.to_le_bytes().map(u32::from);
    (head.into_iter())
        .chain((4..len as u32).map(|i| salt.wrapping_mul(7919).wrapping_add(i * 31) % 256))
        .take(len)
        .collect()
}

/// A greedy request that only the context's end stops.
fn request(salt: u32) -> SeqRequest {
    SeqRequest {
        prompt: prompt(salt, PROMPT),
        params: GenerateParams {
            max_new_tokens: 1 << 20,
            sampling: SamplingParams::default(),
            stop_token_ids: Vec::new(),
            return_logits: false,
        },
        ignore_eos: true,
    }
}

/// The time of `f`, and its result.
fn timed<T>(f: impl FnOnce() -> T) -> (Duration, T) {
    let t = Instant::now();
    let out = f();
    (t.elapsed(), out)
}

/// `batch` sequences decoding together.
struct Decoding {
    sched: Scheduler,
    batch: usize,
    /// Steps left before the sequences restart from their prompts.
    left: usize,
}

impl Decoding {
    /// The sequences' first fill (their prompts prefilled cold) runs here, before any
    /// measurement, so that criterion's warm-up sees decode steps only.
    fn new(kernels: Kernels, batch: usize) -> Decoding {
        let mut d = Decoding {
            sched: scheduler(kernels, batch),
            batch,
            left: 0,
        };
        d.refill();
        d
    }

    /// Restart every sequence from its prompt (after the first fill, a prefix-cache hit of all
    /// but the prompt's last block) and step until all of them decode.
    fn refill(&mut self) {
        self.sched.abort_all();
        for i in 0..self.batch {
            self.sched.add(request(i as u32)).expect("a valid request");
        }
        let all = StepKind::Decode { seqs: self.batch };
        while self.sched.step().expect("a step").kind != all {}
        self.left = DECODE_STEPS_PER_FILL;
    }

    /// One decode step of every sequence, timed.
    fn step(&mut self) -> Duration {
        if self.left == 0 {
            self.refill();
        }
        self.left -= 1;
        let (t, report) = timed(|| self.sched.step());
        let report = report.expect("a decode step");
        assert_eq!(report.kind, StepKind::Decode { seqs: self.batch });
        t
    }
}

fn decode_steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_step");
    // Every sample the same number of steps: a computed step at batch 32 takes milliseconds.
    g.sampling_mode(SamplingMode::Flat);
    for kernels in [Kernels::Computed, Kernels::Skipped] {
        for batch in DECODE_BATCHES {
            let mut d = Decoding::new(kernels, batch);
            g.throughput(Throughput::Elements(batch as u64));
            g.bench_function(BenchmarkId::new(kernels.label(), batch), |b| {
                b.iter_custom(|iters| (0..iters).map(|_| d.step()).sum());
            });
        }
    }
    g.finish();
}

fn prefill_chunk(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefill_chunk");
    // A computed chunk takes tens of milliseconds: few samples, each of the same count.
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);
    g.throughput(Throughput::Elements(PROMPT as u64));
    for kernels in [Kernels::Computed, Kernels::Skipped] {
        let mut sched = scheduler(kernels, 1);
        let mut salt = 0;
        // A new prompt each time (a prefix-cache miss): admitted and prefilled in one step.
        g.bench_function(BenchmarkId::new(kernels.label(), PROMPT), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    salt += 1;
                    sched.add(request(salt)).expect("a valid request");
                    let (t, report) = timed(|| sched.step());
                    let kind = report.expect("a prefill step").kind;
                    assert!(matches!(kind, StepKind::Prefill { rows: PROMPT, .. }));
                    total += t;
                    sched.abort_all();
                }
                total
            });
        });
    }
    g.finish();
}

fn admission(c: &mut Criterion) {
    let mut g = c.benchmark_group("admission");
    g.sample_size(20);
    g.throughput(Throughput::Elements(BURST as u64));
    let mut sched = scheduler(Kernels::Skipped, BURST);
    let mut salt = 1000;
    // `add` alone: the checks and the queue.
    g.bench_function(BenchmarkId::new("add", BURST), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let burst: Vec<SeqRequest> = (0..BURST as u32).map(request).collect();
                total += timed(|| {
                    for r in burst {
                        sched.add(r).expect("a valid request");
                    }
                })
                .0;
                sched.abort_all();
            }
            total
        });
    });
    // The burst added, admitted one by one and prefilled (the running ones decoding between
    // chunks) until all decode: the host work only. New prompts miss the prefix cache; the
    // same prompts again hit it for all but their last block.
    for (name, fresh) in [("burst_miss", true), ("burst_hit", false)] {
        g.bench_function(BenchmarkId::new(name, BURST), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let burst: Vec<SeqRequest> = (0..BURST as u32)
                        .map(|i| {
                            salt += u32::from(fresh);
                            request(if fresh { salt } else { i })
                        })
                        .collect();
                    total += timed(|| {
                        for r in burst {
                            sched.add(r).expect("a valid request");
                        }
                        let all = StepKind::Decode { seqs: BURST };
                        while sched.step().expect("a step").kind != all {}
                    })
                    .0;
                    sched.abort_all();
                }
                total
            });
        });
    }
    g.finish();
}

/// A runner over the kernel-skipping backend, its cache, and `n` sequences' block tables
/// covering `tokens` tokens each.
fn runner_with_tables(n: usize, tokens: usize) -> (StepRunner, CacheManager, Vec<BlockTable>) {
    let config = tiny_for_cpu().expect("the tiny shape parses");
    let model = factory::random(config, Kernels::Skipped.backend(), 7).expect("random weights");
    let (runner, mut cache) = StepRunner::new(model, options(32)).expect("the runner fits");
    let tables = (0..n)
        .map(|_| {
            let mut t = BlockTable::new();
            cache.ensure(&mut t, tokens).expect("room");
            t
        })
        .collect();
    (runner, cache, tables)
}

fn step_input(c: &mut Criterion) {
    let mut g = c.benchmark_group("step_input");
    // A decode step's rows (one per sequence) through `forward_launches`: the checks, the
    // upload of token ids, positions, sequences, slots, block tables and logit rows, and the
    // launch list of the step, recorded but not run.
    for batch in DECODE_BATCHES {
        let (mut runner, cache, tables) = runner_with_tables(batch, DECODE_CONTEXT + 1);
        let rows: Vec<StepRow> = (0..batch as u32)
            .map(|i| StepRow {
                token: (i * 37) % 256,
                position: DECODE_CONTEXT as u32,
                seq: i,
            })
            .collect();
        let logit_rows: Vec<u32> = (0..batch as u32).collect();
        let table_refs: Vec<&BlockTable> = tables.iter().collect();
        let input = StepInput {
            rows: &rows,
            tables: &table_refs,
            logit_rows: &logit_rows,
            ssm_slots: &[],
            prompt_until: &[],
        };
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_function(BenchmarkId::new("decode_launches", batch), |b| {
            b.iter(|| {
                runner
                    .forward_launches(&cache, black_box(&input))
                    .expect("a step")
            });
        });
        // The runner's whole decode step on the same input, and its greedy tokens read back:
        // the checks, the upload padded to the ladder width, the captured graph replayed (its
        // kernels doing nothing). What a scheduler's decode step adds to it is its own work.
        g.bench_function(BenchmarkId::new("runner_decode", batch), |b| {
            b.iter(|| {
                runner
                    .decode(&cache, black_box(&rows), &table_refs, &[])
                    .expect("a decode step");
                runner.greedy(batch).expect("greedy tokens")
            });
        });
    }
    // A prefill chunk's rows: as above, with the attention row groups of the chunk.
    let (mut runner, cache, tables) = runner_with_tables(1, PROMPT);
    let rows: Vec<StepRow> = (0..PROMPT as u32)
        .map(|p| StepRow {
            token: (p * 37) % 256,
            position: p,
            seq: 0,
        })
        .collect();
    let input = StepInput {
        rows: &rows,
        tables: &[&tables[0]],
        logit_rows: &[PROMPT as u32 - 1],
        ssm_slots: &[],
        prompt_until: &[],
    };
    g.throughput(Throughput::Elements(PROMPT as u64));
    g.bench_function(BenchmarkId::new("prefill_launches", PROMPT), |b| {
        b.iter(|| {
            runner
                .forward_launches(&cache, black_box(&input))
                .expect("a step")
        });
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = step_input, decode_steps, prefill_chunk, admission
}
criterion_main!(benches);
