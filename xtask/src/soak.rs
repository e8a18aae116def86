//! `cargo xtask soak`: many concurrent requests against the library `Engine` (no HTTP), of
//! random lengths (seeded), with shared prefixes, random cancellation (explicit, and by dropping
//! the handle), stop strings, a few invalid requests and a short admission queue; on the tiny
//! checkpoints by default (dense `qwen3-tiny` and hybrid `qwen3_5-tiny`), with a KV cache small
//! enough that requests get preempted.
//!
//! At the end, per checkpoint, it asserts: every accepted request ended exactly once and none
//! failed; no client thread panicked and the engine still serves; no KV block or SSM slot is
//! leaked (`Engine::metrics` once idle: no block referenced, the prefix cache within the pool);
//! the shared prefixes hit the prefix cache; every completed output equals its solo run on a
//! second engine with prefix caching off (tokens, finish reason, text, logits where asked for),
//! and every cancelled output is a prefix of that run. Then, on the idle engine, multi-turn
//! conversations (`turns`): each follow-up turn hits the cache for what the previous turn left
//! and equals its solo run. Short by default (CI runs it); `--requests`, `--seconds` and
//! `--conversations` make it long.

mod turns;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, ValueEnum};
use metrale::{
    Backend, Engine, EngineError, EngineOptions, FinishReason, GenerateEvent, GenerateOutput,
    GenerateRequest, KvCacheDtype, ModelOptions, Prompt, SamplingParams,
};
use metrale_testkit::Rng;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum BackendArg {
    Cpu,
    Cuda,
}

#[derive(Debug, Args)]
pub struct SoakArgs {
    /// Requests per checkpoint.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Stop submitting after this many seconds per checkpoint (whichever of --requests and
    /// --seconds comes first).
    #[arg(long, default_value_t = 120.0)]
    seconds: f64,
    /// Where the model runs (`cuda` needs `cargo run -p xtask --features cuda -- soak`).
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// Checkpoint directory; repeat for several. Default: tests/fixtures/qwen3-tiny and
    /// tests/fixtures/qwen3_5-tiny.
    #[arg(long)]
    model: Vec<PathBuf>,
    /// Seed of the request generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Client threads submitting at once.
    #[arg(long, default_value_t = 12)]
    clients: usize,
    /// Compare this many of the outputs read to their end (spread over the run) with their solo
    /// runs; more than there are checks them all.
    #[arg(long, default_value_t = 48)]
    solo_checks: usize,
    /// Multi-turn conversations (three turns each) run after the concurrent requests.
    #[arg(long, default_value_t = 4)]
    conversations: usize,
    /// The KV cache's format (`fp8`: e4m3 keys and values; the solo runs use the same).
    #[arg(long, value_enum, default_value_t = KvArg::Bf16)]
    kv_cache_dtype: KvArg,
}

/// The KV cache's format.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum KvArg {
    Bf16,
    Fp8,
}

/// What a client does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Read it to the end.
    Complete,
    /// Cancel after this many tokens, then read the output.
    CancelAfter(usize),
    /// Drop the handle after this many tokens (0: at once).
    DropAfter(usize),
    /// An invalid request: `submit` must refuse it.
    Invalid,
}

/// Request `index` of the run: a function of the seed and the index alone.
fn make_request(
    seed: u64,
    index: usize,
    prefixes: &[Vec<u32>],
    vocab: usize,
    max_context: usize,
    has_tokenizer: bool,
) -> (GenerateRequest, Plan) {
    let mut rng = Rng::new(seed ^ (index as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    let token = |rng: &mut Rng| rng.below(vocab as u32);
    if rng.chance(0.03) {
        let prompt = match rng.usize_in(0..=2) {
            0 => vec![1, vocab as u32 + 3],
            1 => Vec::new(),
            _ => (0..max_context + 1).map(|_| token(&mut rng)).collect(),
        };
        return (
            GenerateRequest::new(Prompt::TokenIds(prompt)),
            Plan::Invalid,
        );
    }
    let mut prompt = if rng.chance(0.6) {
        prefixes[rng.below(prefixes.len() as u32) as usize].clone()
    } else {
        Vec::new()
    };
    let extra = rng.usize_in(usize::from(prompt.is_empty())..=40);
    prompt.extend((0..extra).map(|_| token(&mut rng)));
    prompt.truncate(max_context - 1);
    // A few long outputs grow past what admission reserved, so the cache runs out (preemption).
    let max_new_tokens = if rng.chance(0.08) {
        rng.usize_in(48..=96)
    } else {
        rng.usize_in(1..=24)
    };
    let sampling = match rng.usize_in(0..=9) {
        0..=4 => SamplingParams::default(),
        5..=7 => SamplingParams::default()
            .temperature(0.7 + 0.1 * rng.usize_in(0..=6) as f32)
            .seed(rng.next_u64()),
        _ => SamplingParams::default()
            .temperature(1.0)
            .top_k(rng.usize_in(1..=50))
            .top_p(0.8 + 0.05 * rng.usize_in(0..=4) as f32)
            .seed(rng.next_u64()),
    };
    let mut req = GenerateRequest::new(Prompt::TokenIds(prompt))
        .max_new_tokens(max_new_tokens)
        .sampling(sampling)
        .ignore_eos(rng.chance(0.5))
        .return_logits(rng.chance(0.25));
    if rng.chance(0.2) {
        req = req.stop_token_ids(vec![token(&mut rng), token(&mut rng)]);
    }
    if has_tokenizer && rng.chance(0.15) {
        let stops = ["e", " t", "in", "\n", "."];
        req = req.stop_strings(vec![stops[rng.below(stops.len() as u32) as usize].into()]);
    }
    let plan = match rng.usize_in(0..=99) {
        0..=64 => Plan::Complete,
        65..=84 => Plan::CancelAfter(rng.usize_in(0..=max_new_tokens)),
        85..=92 => Plan::DropAfter(rng.usize_in(1..=max_new_tokens)),
        _ => Plan::DropAfter(0),
    };
    (req, plan)
}

/// What the clients saw.
#[derive(Debug, Default)]
struct Tally {
    accepted: usize,
    refused_invalid: usize,
    queue_full_retries: usize,
    dropped: usize,
    /// (request, output) of every request read to its end: completed or cancelled.
    outputs: Vec<(GenerateRequest, GenerateOutput)>,
    errors: Vec<String>,
}

/// One client's part of the run.
fn client(
    engine: &Engine,
    args: &SoakArgs,
    next: &AtomicUsize,
    started: Instant,
    prefixes: &[Vec<u32>],
    tally: &Mutex<Tally>,
) {
    let vocab = engine.config().tokens.vocab_size;
    let deadline = started + Duration::from_secs_f64(args.seconds);
    loop {
        let index = next.fetch_add(1, Ordering::Relaxed);
        if index >= args.requests || Instant::now() >= deadline {
            return;
        }
        let (req, plan) = make_request(
            args.seed,
            index,
            prefixes,
            vocab,
            engine.max_context(),
            engine.has_tokenizer(),
        );
        let mut retries = 0;
        let handle = loop {
            match engine.submit(req.clone()) {
                Err(EngineError::QueueFull { .. }) => {
                    retries += 1;
                    std::thread::sleep(Duration::from_millis(5));
                }
                other => break other,
            }
        };
        let mut t = lock(tally);
        t.queue_full_retries += retries;
        let mut handle = match (handle, plan) {
            (Err(EngineError::Request(_)), Plan::Invalid) => {
                t.refused_invalid += 1;
                continue;
            }
            (Ok(h), Plan::Invalid) => {
                t.errors
                    .push(format!("request {index}: invalid, yet accepted"));
                drop(h);
                continue;
            }
            (Err(e), _) => {
                t.errors.push(format!("request {index}: refused: {e}"));
                continue;
            }
            (Ok(h), _) => {
                t.accepted += 1;
                h
            }
        };
        drop(t);
        let mut seen = 0;
        match plan {
            Plan::DropAfter(0) => {
                drop(handle);
                lock(tally).dropped += 1;
                continue;
            }
            Plan::CancelAfter(0) => handle.cancel(),
            _ => {}
        }
        let mut output = None;
        while let Some(event) = handle.next() {
            match event {
                Ok(GenerateEvent::Token(_)) => {
                    seen += 1;
                    if plan == Plan::CancelAfter(seen) {
                        handle.cancel();
                    }
                    if plan == Plan::DropAfter(seen) {
                        break;
                    }
                }
                Ok(GenerateEvent::Finished { output: o }) => output = Some(o),
                // Events this soak does not know yet say nothing about the output.
                Ok(_) => {}
                Err(e) => lock(tally).errors.push(format!("request {index}: {e}")),
            }
        }
        drop(handle);
        let mut t = lock(tally);
        match output {
            Some(o) => t.outputs.push((req, o)),
            None if matches!(plan, Plan::DropAfter(_)) => t.dropped += 1,
            None => t.errors.push(format!("request {index}: no output")),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A client that panicked fails the run at its join; the tally itself stays usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Wait (bounded) until `done` requests have ended and nothing runs or waits.
fn wait_idle(engine: &Engine, done: u64) -> Result<metrale::EngineMetrics> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = engine.metrics();
        if m.requests.finished + m.requests.failed >= done
            && m.requests.running == 0
            && m.requests.queued == 0
            && m.reprefills == 0
        {
            return Ok(m);
        }
        ensure!(
            Instant::now() < deadline,
            "the engine did not go idle after {done} requests: {m:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Compare an output with its solo run on `cold` (prefix caching off): equal when it completed,
/// a prefix when cancelled.
fn check_solo(cold: &Engine, req: &GenerateRequest, got: &GenerateOutput) -> Result<()> {
    let solo = cold.generate(req).context("solo run")?;
    let n = got.token_ids.len();
    if got.finish_reason == FinishReason::Cancelled {
        ensure!(
            solo.token_ids.starts_with(&got.token_ids),
            "cancelled output {:?} is not a prefix of the solo run {:?}",
            got.token_ids,
            solo.token_ids
        );
    } else {
        ensure!(
            solo.token_ids == got.token_ids
                && solo.finish_reason == got.finish_reason
                && solo.text == got.text,
            "output ({:?}, {:?}, {:?}) differs from the solo run ({:?}, {:?}, {:?})",
            got.token_ids,
            got.finish_reason,
            got.text,
            solo.token_ids,
            solo.finish_reason,
            solo.text
        );
    }
    if let (Some(g), Some(s)) = (&got.logits, &solo.logits) {
        for (step, (a, b)) in g.iter().zip(&s[..n.min(s.len())]).enumerate() {
            let same =
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            ensure!(same, "logits of step {step} differ from the solo run");
        }
    }
    Ok(())
}

/// Once the run's requests have ended: every accepted one finished and none failed, no KV block
/// or SSM slot is leaked, the prefix cache stays within its pools and the shared prefixes hit
/// it. Returns the engine's metrics then.
fn check_idle_after_run(engine: &Engine, tally: &Tally) -> Result<metrale::EngineMetrics> {
    let m = wait_idle(engine, tally.accepted as u64)?;
    ensure!(
        m.requests.finished == tally.accepted as u64 && m.requests.failed == 0,
        "{} requests accepted, but the engine counts {} finished and {} failed",
        tally.accepted,
        m.requests.finished,
        m.requests.failed
    );
    ensure!(
        m.cache.kv_blocks_used == 0 && m.cache.ssm_slots_used == 0,
        "leaked after the run: {} KV block(s), {} SSM slot(s)",
        m.cache.kv_blocks_used,
        m.cache.ssm_slots_used
    );
    ensure!(
        m.cache.kv_blocks_cached <= m.cache.kv_blocks_total
            && m.cache.snapshots.used <= m.cache.snapshots.total,
        "the prefix cache outgrew its pools: {m:?}"
    );
    ensure!(
        m.steps.prefix.hits > 0 && m.steps.prefix.hit_tokens > 0,
        "requests sharing prefixes never hit the prefix cache: {m:?}"
    );
    Ok(m)
}

/// Soak one checkpoint; returns its summary line.
fn soak_one(dir: &Path, args: &SoakArgs) -> Result<String> {
    let backend = match args.backend {
        BackendArg::Cpu => Backend::Cpu,
        BackendArg::Cuda => Backend::cuda(0),
    };
    let model = ModelOptions::default()
        .max_batch_tokens(16)
        .max_decode_seqs(8)
        .max_seq_len(256)
        // 17 blocks of 16 tokens: fewer than 8 long requests need, so some get preempted.
        .num_kv_blocks(17)
        .kv_cache_dtype(match args.kv_cache_dtype {
            KvArg::Bf16 => KvCacheDtype::Bf16,
            KvArg::Fp8 => KvCacheDtype::Fp8,
        });
    let mut options = EngineOptions::default()
        .backend(backend)
        .model(model)
        // Fewer than the clients, so `submit` sometimes finds the queue full.
        .max_queued_requests(6);
    let block_size = options.model.block_size;
    let engine =
        Engine::load(dir, options.clone()).with_context(|| format!("loading {}", dir.display()))?;
    // The reference for every output: the same engine without prefix caching.
    options.model.prefix_caching = false;
    let cold = Engine::load(dir, options).with_context(|| format!("loading {}", dir.display()))?;
    let vocab = engine.config().tokens.vocab_size;
    let mut rng = Rng::new(args.seed ^ 0x5EED);
    let prefixes: Vec<Vec<u32>> = [8usize, 16, 33, 64]
        .iter()
        .map(|&len| (0..len).map(|_| rng.below(vocab as u32)).collect())
        .collect();
    let next = AtomicUsize::new(0);
    let tally = Mutex::new(Tally::default());
    let started = Instant::now();
    let panics = std::thread::scope(|s| {
        let threads: Vec<_> = (0..args.clients.max(1))
            .map(|_| s.spawn(|| client(&engine, args, &next, started, &prefixes, &tally)))
            .collect();
        threads
            .into_iter()
            .map(|t| t.join())
            .filter(Result::is_err)
            .count()
    });
    let tally = tally
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    ensure!(panics == 0, "{panics} client thread(s) panicked");
    if let Some(first) = tally.errors.first() {
        bail!(
            "{} request error(s); the first: {first}",
            tally.errors.len()
        );
    }
    let m = check_idle_after_run(&engine, &tally)?;
    let seconds = started.elapsed().as_secs_f64();
    let cancelled = tally
        .outputs
        .iter()
        .filter(|(_, o)| o.finish_reason == FinishReason::Cancelled)
        .count();
    let completed = tally.outputs.len() - cancelled;
    let checks = args.solo_checks.min(tally.outputs.len());
    // An even spread over the run when checking a sample.
    let step = (tally.outputs.len() / checks.max(1)).max(1);
    let solo_started = Instant::now();
    let mut checked = 0;
    for (i, (req, out)) in tally.outputs.iter().enumerate().step_by(step).take(checks) {
        check_solo(&cold, req, out).with_context(|| format!("output {i}: {req:?}"))?;
        checked += 1;
    }
    let after = wait_idle(&cold, checked as u64)?;
    ensure!(
        after.cache.kv_blocks_used == 0 && after.cache.ssm_slots_used == 0,
        "leaked after the solo runs: {} KV block(s), {} SSM slot(s)",
        after.cache.kv_blocks_used,
        after.cache.ssm_slots_used
    );
    let turns = turns::run(&engine, &cold, args.seed, args.conversations, block_size)
        .context("multi-turn conversations")?;
    let end = engine.metrics();
    ensure!(
        end.cache.kv_blocks_used == 0 && end.cache.ssm_slots_used == 0,
        "leaked after the conversations: {} KV block(s), {} SSM slot(s)",
        end.cache.kv_blocks_used,
        end.cache.ssm_slots_used
    );
    let name = dir.file_name().map_or_else(
        || dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok(format!(
        "soak {name}: {submitted} requests in {seconds:.1} s ({accepted} accepted: {completed} completed, {cancelled} cancelled and read, {dropped} dropped; {invalid} invalid refused; {retries} queue-full retries); {tokens} tokens ({tps:.0}/s), {steps} steps, {preempt} preemptions; prefix cache: {hits} of {lookups} admissions hit, {hit_tokens} of {query_tokens} prompt tokens ({rate:.0}%); leaked 0 of {kv} KV blocks and 0 of {ssm} SSM slots; {checked} of {outputs} outputs checked against their solo runs without prefix caching, all equal ({solo_s:.1} s); {conversations} conversations: {follow_ups} follow-up turns hit {turn_hits} of {turn_tokens} prompt tokens, as expected, all equal to their solo runs",
        submitted = tally.accepted + tally.refused_invalid,
        accepted = tally.accepted,
        dropped = tally.dropped,
        invalid = tally.refused_invalid,
        retries = tally.queue_full_retries,
        tokens = m.steps.tokens_generated,
        tps = m.steps.tokens_generated as f64 / seconds,
        steps = m.steps.steps,
        preempt = m.steps.preemptions,
        hits = m.steps.prefix.hits,
        lookups = m.steps.prefix.queries,
        hit_tokens = m.steps.prefix.hit_tokens,
        query_tokens = m.steps.prefix.query_tokens,
        rate = 100.0 * m.prefix_hit_rate,
        kv = m.cache.kv_blocks_total,
        ssm = m.cache.ssm_slots_total,
        outputs = tally.outputs.len(),
        solo_s = solo_started.elapsed().as_secs_f64(),
        conversations = turns.conversations,
        follow_ups = turns.follow_ups,
        turn_hits = turns.follow_up_hit_tokens,
        turn_tokens = turns.follow_up_tokens,
    ))
}

/// Run the soak on every checkpoint asked for. A watchdog ends the process if a checkpoint
/// takes far longer than `--seconds` (a hung engine), so the run always stops by itself.
pub fn run(root: &Path, args: SoakArgs) -> Result<()> {
    let dirs = if args.model.is_empty() {
        ["qwen3-tiny", "qwen3_5-tiny"]
            .iter()
            .map(|f| root.join("tests/fixtures").join(f))
            .collect()
    } else {
        args.model.clone()
    };
    let limit = Duration::from_secs_f64(args.seconds * 3.0 + 300.0);
    for dir in &dirs {
        let watched = dir.display().to_string();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = done.clone();
        std::thread::spawn(move || {
            std::thread::sleep(limit);
            if !flag.load(Ordering::Relaxed) {
                eprintln!("soak of {watched}: still running after {limit:?}; giving up");
                std::process::exit(2);
            }
        });
        let line = soak_one(dir, &args).with_context(|| format!("soak of {}", dir.display()))?;
        done.store(true, Ordering::Relaxed);
        println!("{line}");
    }
    Ok(())
}
