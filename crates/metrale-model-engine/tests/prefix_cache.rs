//! Prefix caching changes how much prefill runs, never what comes out: a prompt whose leading
//! blocks are cached (the same prompt again, or one sharing a prefix of a length around the
//! block and SSM-snapshot boundaries) gets bitwise the tokens and logits of a model with prefix
//! caching off, after skipping exactly the cached tokens; eviction under a small cache keeps
//! that true; and preemption, cancellation and shared blocks leave no block or slot held. On
//! the dense fixture and both hybrid (Gated DeltaNet) fixtures, on the CPU backend.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use metrale_cache::{BlockTable, block_hashes};
use metrale_gpu_runtime::CpuBackend;
use metrale_model_engine::generate::{FinishReason, GenerateParams, Generation};
use metrale_model_engine::runner::{StepInput, StepRow};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::scheduler::{SeqEvent, SeqId, SeqRequest};
use metrale_model_engine::{
    KvCacheDtype, ModelError, ModelOptions, Scheduler, StepRunner, factory,
};
use metrale_testkit::Rng;
use support::cache::{assert_bitwise, assert_nothing_held, solo, tokens};

const HYBRID: [&str; 2] = ["qwen3_5-tiny", "qwen3_next-tiny"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn load(name: &str, options: ModelOptions) -> Scheduler {
    let model = factory::load(&fixture(name), Arc::new(CpuBackend::default()))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    Scheduler::new(model, options).unwrap()
}

fn options(chunk: usize, prefix_caching: bool, num_kv_blocks: Option<usize>) -> ModelOptions {
    ModelOptions::default()
        .max_batch_tokens(chunk)
        .max_decode_seqs(4)
        .num_kv_blocks(num_kv_blocks)
        .prefix_caching(prefix_caching)
}

/// A request keeping its logits; odd `i` samples (seeded), even `i` is greedy.
fn request(prompt: Vec<u32>, max_new_tokens: usize, i: u64) -> SeqRequest {
    let sampling = if i % 2 == 1 {
        SamplingParams::default().temperature(0.8).seed(i)
    } else {
        SamplingParams::default()
    };
    SeqRequest {
        prompt,
        params: GenerateParams {
            max_new_tokens,
            sampling,
            stop_token_ids: Vec::new(),
            return_logits: true,
        },
        ignore_eos: true,
    }
}

/// A prompt of 200 tokens, then the same prompt, then prompts sharing its first `n` tokens
/// (then 10 of their own) for `n` around the block (16) and snapshot (64) boundaries.
fn shared_prefix_prompts(vocab: u32) -> Vec<Vec<u32>> {
    let mut rng = Rng::new(42);
    let a = tokens(&mut rng, 200, vocab);
    let mut out = vec![a.clone(), a.clone()];
    for n in [15, 16, 17, 63, 64, 65, 127, 128, 129] {
        let mut p = a[..n].to_vec();
        // The first token of the tail differs from `a`'s, so `n` is the shared length.
        p.push((a[n] + 1) % vocab);
        p.extend(tokens(&mut rng, 9, vocab));
        out.push(p);
    }
    out
}

/// The first token's logits of `prompt` prefilled in one step (no cut at all), on a fresh
/// model of the fixture `name`.
fn unsplit_first_logits(name: &str, options: ModelOptions, prompt: &[u32]) -> Vec<f32> {
    let model = factory::load(&fixture(name), Arc::new(CpuBackend::default())).unwrap();
    let (mut runner, mut cache) = StepRunner::new(model, options).unwrap();
    let slot = cache.alloc_ssm_slot(None).unwrap();
    let mut table = BlockTable::new();
    cache.ensure(&mut table, prompt.len()).unwrap();
    let rows: Vec<StepRow> = prompt
        .iter()
        .enumerate()
        .map(|(p, &token)| StepRow {
            token,
            position: p as u32,
            seq: 0,
        })
        .collect();
    let slots: Vec<u32> = slot.into_iter().collect();
    runner
        .forward(
            &cache,
            &StepInput {
                rows: &rows,
                tables: &[&table],
                logit_rows: &[(rows.len() - 1) as u32],
                ssm_slots: &slots,
                prompt_until: &[],
            },
        )
        .unwrap();
    runner.logits(1).unwrap().pop().unwrap()
}

fn cached_runs_are_cold_runs(name: &str, chunk: usize, stride: Option<usize>, want_hits: &[u64]) {
    cached_runs_are_cold_runs_in(name, chunk, stride, KvCacheDtype::Bf16, want_hits);
}

/// `cached_runs_are_cold_runs` with the KV cache in `kv` (FP8: e4m3 blocks shared as bf16
/// ones are).
fn cached_runs_are_cold_runs_in(
    name: &str,
    chunk: usize,
    stride: Option<usize>,
    kv: KvCacheDtype,
    want_hits: &[u64],
) {
    let opts = |prefix_caching| {
        options(chunk, prefix_caching, None)
            .ssm_snapshot_stride(stride)
            .kv_cache_dtype(kv)
    };
    let mut warm = load(name, opts(true));
    let mut cold = load(name, opts(false));
    let vocab = warm.runner().model().config().tokens.vocab_size as u32;
    let prompts = shared_prefix_prompts(vocab);
    assert_eq!(prompts.len(), want_hits.len());
    for (i, (prompt, &want)) in prompts.iter().zip(want_hits).enumerate() {
        let what = format!(
            "{name}, chunk {chunk}, stride {stride:?}, {kv:?} KV, prompt {i} ({} tokens)",
            prompt.len()
        );
        let req = request(prompt.clone(), 5, i as u64);
        let (w, c) = (solo(&mut warm, &req), solo(&mut cold, &req));
        assert_bitwise(&w.generation, &c.generation, &what);
        assert_eq!(w.hit_tokens, want, "{what}: cached tokens");
        assert_eq!(c.hit_tokens, 0, "{what}: the cold model never hits");
        let len = prompt.len() as u64;
        assert_eq!(
            w.prefill_tokens,
            len - want,
            "{what}: prefill skips the hit"
        );
        assert_eq!(c.prefill_tokens, len, "{what}");
    }
    let stats = warm.stats();
    assert_eq!(stats.steps.prefix.queries, prompts.len() as u64);
    assert_eq!(
        stats.steps.prefix.hits,
        want_hits.iter().filter(|&&h| h > 0).count() as u64
    );
    assert_eq!(cold.cache().blocks().num_cached(), 0);
    assert_nothing_held(&mut warm);
    // The aligned cut of a hybrid prefill changes nothing: with chunks of 512 the 200-token
    // prompt is cut at 192 only, and its first logits equal those of one unsplit step. (Cuts
    // inside a GDN chunk of 64 do change the rounding on the CPU; the alignment exists to
    // make every cut a multiple of 64 or the same in every run.)
    if chunk < prompts[0].len() {
        return;
    }
    let first = solo(&mut cold, &request(prompts[0].clone(), 1, 0));
    let unsplit = unsplit_first_logits(name, opts(false), &prompts[0]);
    assert_bitwise(
        &first.generation,
        &Generation {
            logits: Some(vec![unsplit]),
            ..first.generation.clone()
        },
        &format!("{name}, chunk {chunk}: unsplit prefill"),
    );
}

// Hits, by prompt: 200 tokens, the same again (all but the last partial block, 192), then the
// prefixes of 15, 16, 17, 63, 64, 65, 127, 128 and 129 shared tokens.
#[test]
fn dense_cached_runs_are_bitwise_cold_runs() {
    let hits = [0, 192, 0, 16, 16, 48, 64, 64, 112, 128, 128];
    for chunk in [16, 512] {
        cached_runs_are_cold_runs("qwen3-tiny", chunk, None, &hits);
        cached_runs_are_cold_runs_in("qwen3-tiny", chunk, None, KvCacheDtype::Fp8, &hits);
    }
}

#[test]
fn hybrid_cached_runs_are_bitwise_cold_runs() {
    // Hybrid hits end at a multiple of 64 where an SSM snapshot of that prefix was kept. With
    // chunks of 16 (or 37) the 200-token prompt leaves snapshots at 64, 128 and 192.
    let small = [0, 192, 0, 0, 0, 0, 64, 64, 64, 128, 128];
    // With chunks of 512 it leaves one at 192 (its only cut); the prompts sharing 63 and 64
    // tokens leave one at 64 (for their own prefixes: 63 shared + 1 own, and 64 shared), the
    // 128-token one at 128, so the prompts after them hit there.
    let large = [0, 192, 0, 0, 0, 0, 0, 64, 64, 64, 128];
    for name in HYBRID {
        cached_runs_are_cold_runs(name, 16, None, &small);
        cached_runs_are_cold_runs(name, 37, None, &small);
        cached_runs_are_cold_runs(name, 512, None, &large);
        cached_runs_are_cold_runs_in(name, 37, None, KvCacheDtype::Fp8, &small);
    }
}

#[test]
fn a_snapshot_stride_gives_hybrid_prompts_the_resume_points_of_small_chunks() {
    // With chunks of 512 and a stride of 64, the 200-token prompt is cut at 64, 128 and 192 and
    // leaves a snapshot at each, as chunks of 16 do: the same hits. Its first logits still equal
    // those of one unsplit step (checked in `cached_runs_are_cold_runs`).
    let small = [0, 192, 0, 0, 0, 0, 64, 64, 64, 128, 128];
    for name in HYBRID {
        cached_runs_are_cold_runs(name, 512, Some(64), &small);
    }
    // A stride that is not a multiple of the snapshot interval (64) is refused at load.
    for stride in [0, 100] {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5-tiny");
        let opts = options(512, true, None).ssm_snapshot_stride(Some(stride));
        let model = factory::load(&dir, Arc::new(CpuBackend::default())).unwrap();
        let err = Scheduler::new(model, opts).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::Options {
                    option: "ssm_snapshot_stride",
                    ..
                }
            ),
            "stride {stride}: {err}"
        );
    }
}

#[test]
fn least_recently_used_blocks_are_evicted_and_hits_stay_bitwise_cold() {
    // 12 usable blocks; each 33-token prompt holds 3 while it runs and leaves 2 cached.
    let mut warm = load("qwen3-tiny", options(16, true, Some(13)));
    let mut cold = load("qwen3-tiny", options(16, false, Some(13)));
    let vocab = warm.runner().model().config().tokens.vocab_size as u32;
    let mut rng = Rng::new(7);
    let prompts: Vec<Vec<u32>> = (0..6).map(|_| tokens(&mut rng, 33, vocab)).collect();
    // Six distinct prompts (12 blocks to cache, 10 fit), then the first, fifth and second again.
    let order = [0, 1, 2, 3, 4, 5, 0, 4, 1];
    // The sixth prompt evicts the least recently released block: the first prompt's second
    // (a sequence's blocks are released last first), so the first prompt hits one block. Its
    // rerun evicts the second prompt's second block; the fifth prompt is still whole.
    let want = [0, 0, 0, 0, 0, 0, 16, 32, 16];
    for (k, (&p, &hit)) in order.iter().zip(&want).enumerate() {
        let req = request(prompts[p].clone(), 3, k as u64);
        let (w, c) = (solo(&mut warm, &req), solo(&mut cold, &req));
        assert_bitwise(
            &w.generation,
            &c.generation,
            &format!("run {k} (prompt {p})"),
        );
        assert_eq!(w.hit_tokens, hit, "run {k} (prompt {p}): cached tokens");
        let a = warm.cache().blocks();
        assert!(a.num_cached() <= a.capacity());
    }
    assert_eq!(warm.cache().blocks().evictions(), 3);
    assert_nothing_held(&mut warm);
}

#[test]
fn the_least_recently_used_ssm_snapshot_is_dropped_when_the_pool_is_full() {
    for name in HYBRID {
        let mut warm = load(name, options(16, true, None).ssm_snapshot_slots(Some(1)));
        let mut cold = load(name, options(16, false, None));
        let usage = warm.cache().snapshot_usage();
        assert_eq!((usage.used, usage.total), (0, 1));
        let vocab = warm.runner().model().config().tokens.vocab_size as u32;
        let mut rng = Rng::new(3);
        let prompts: Vec<Vec<u32>> = (0..2).map(|_| tokens(&mut rng, 70, vocab)).collect();
        // The second prompt's snapshot at 64 replaces the first's: the first prompt's blocks
        // are still cached, but without the SSM state there it cannot resume.
        for (k, (p, hit)) in [(0, 0), (1, 0), (0, 0), (0, 64), (1, 0)]
            .into_iter()
            .enumerate()
        {
            let req = request(prompts[p].clone(), 3, k as u64);
            let (w, c) = (solo(&mut warm, &req), solo(&mut cold, &req));
            assert_bitwise(&w.generation, &c.generation, &format!("{name}: run {k}"));
            assert_eq!(w.hit_tokens, hit, "{name}: run {k} (prompt {p})");
        }
        assert_nothing_held(&mut warm);
    }
}

/// Requests sharing three prefixes (20, 64 and 100 tokens) with tails of their own, arriving
/// over the first steps, a fifth of them cancelled, on a cache small enough to preempt.
fn shared_traffic(vocab: u32) -> Vec<(SeqRequest, usize, Option<usize>)> {
    let mut rng = Rng::new(99);
    let prefixes: Vec<Vec<u32>> = [20, 64, 100]
        .iter()
        .map(|&n| tokens(&mut rng, n, vocab))
        .collect();
    let mut at = 0;
    (0..16)
        .map(|i| {
            let mut prompt = prefixes[rng.below(3) as usize].clone();
            let tail = rng.below(30) as usize + usize::from(i % 4 == 0);
            prompt.extend(tokens(&mut rng, tail, vocab));
            at += rng.below(4) as usize;
            let cancel = rng.chance(0.2).then(|| rng.below(20) as usize);
            let max_new = 20 + rng.below(40) as usize;
            (request(prompt, max_new, i), at, cancel)
        })
        .collect()
}

fn traffic_leaks_nothing(name: &str) {
    // 17 usable blocks for up to 4 sequences of up to 190 tokens (12 blocks): preemption
    // happens, and cached blocks are evicted under the pressure, yet many admissions hit.
    let mut warm = load(name, options(16, true, Some(18)));
    let mut cold = load(name, options(16, false, None));
    let vocab = warm.runner().model().config().tokens.vocab_size as u32;
    let traffic = shared_traffic(vocab);
    let mut ids: Vec<Option<SeqId>> = vec![None; traffic.len()];
    let mut out: HashMap<SeqId, Generation> = HashMap::new();
    let mut step = 0;
    while ids.iter().any(Option::is_none) || !warm.is_idle() {
        for (i, (req, at, cancel)) in traffic.iter().enumerate() {
            if *at == step {
                ids[i] = Some(warm.add(req.clone()).unwrap());
            }
            if let (Some(id), Some(after)) = (ids[i], cancel)
                && at + after == step
                && let Some(g) = warm.finish(id, FinishReason::Cancelled).unwrap()
            {
                out.insert(id, g);
            }
        }
        for e in warm.step().unwrap().events {
            if let SeqEvent::Finished { id, generation } = e {
                out.insert(id, generation);
            }
        }
        step += 1;
        assert!(step < 100_000, "{name}: the scheduler does not finish");
    }
    let stats = warm.stats();
    eprintln!(
        "{name}: {} preemptions, {} of {} admissions hit ({} of {} prompt tokens)",
        stats.steps.preemptions,
        stats.steps.prefix.hits,
        stats.steps.prefix.queries,
        stats.steps.prefix.hit_tokens,
        stats.steps.prefix.query_tokens
    );
    assert!(
        stats.steps.preemptions >= 2,
        "{name}: the cache hardly ran out"
    );
    assert!(
        stats.steps.prefix.hits >= 6,
        "{name}: only {} hits",
        stats.steps.prefix.hits
    );
    assert_eq!(
        (stats.cache.kv_blocks_used, stats.cache.ssm_slots_used),
        (0, 0)
    );
    assert_nothing_held(&mut warm);
    let mut cancelled = 0;
    for (i, (req, _, _)) in traffic.iter().enumerate() {
        let got = &out[&ids[i].unwrap()];
        let c = solo(&mut cold, req).generation;
        if got.finish_reason == FinishReason::Cancelled {
            cancelled += 1;
            assert!(
                c.token_ids.starts_with(&got.token_ids),
                "{name}: request {i}"
            );
        } else {
            assert_bitwise(got, &c, &format!("{name}: request {i}"));
        }
    }
    assert!(cancelled >= 1, "{name}: nothing was cancelled");
}

#[test]
fn preemption_and_cancellation_with_shared_prefixes_leak_nothing() {
    traffic_leaks_nothing("qwen3-tiny");
    traffic_leaks_nothing("qwen3_5-tiny");
}

#[test]
fn a_request_sharing_blocks_with_a_cancelled_one_completes_bitwise_cold() {
    for name in ["qwen3-tiny", "qwen3_5-tiny"] {
        let mut warm = load(name, options(16, true, None));
        let mut cold = load(name, options(16, false, None));
        let vocab = warm.runner().model().config().tokens.vocab_size as u32;
        let mut rng = Rng::new(5);
        let a = tokens(&mut rng, 100, vocab);
        let mut b = a[..80].to_vec();
        b.extend(tokens(&mut rng, 12, vocab));
        let hashes = block_hashes(&a, 16);
        let ida = warm.add(request(a, 40, 1)).unwrap();
        // A's prefill (7 chunks of 16) and a few decode steps.
        for _ in 0..10 {
            warm.step().unwrap();
        }
        let idb = warm.add(request(b.clone(), 12, 2)).unwrap();
        warm.step().unwrap();
        let stats = warm.stats();
        // Dense: 5 blocks (80 tokens); hybrid: up to the snapshot at 64.
        let shared = if warm.cache().ssm_slots().is_some() {
            4
        } else {
            5
        };
        assert_eq!(stats.steps.prefix.hit_tokens, 16 * shared as u64, "{name}");
        let first = warm.cache().blocks().lookup(&hashes[0]).unwrap();
        assert_eq!(
            warm.cache().blocks().refcount(first),
            2,
            "{name}: A and B share"
        );
        let ga = warm.finish(ida, FinishReason::Cancelled).unwrap();
        assert!(ga.is_some(), "{name}: A was running");
        assert_eq!(
            warm.cache().blocks().refcount(first),
            1,
            "{name}: B holds on"
        );
        let mut gb = None;
        while !warm.is_idle() {
            for e in warm.step().unwrap().events {
                if let SeqEvent::Finished { id, generation } = e {
                    assert_eq!(id, idb);
                    gb = Some(generation);
                }
            }
        }
        let c = solo(&mut cold, &request(b, 12, 2));
        assert_bitwise(&gb.unwrap(), &c.generation, name);
        assert_nothing_held(&mut warm);
    }
}
