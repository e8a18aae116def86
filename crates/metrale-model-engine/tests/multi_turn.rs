//! Multi-turn prefix caching: a follow-up turn whose prompt is the previous turn's prompt, its
//! answer and a new user message gets bitwise the tokens and logits of a model with prefix
//! caching off, after skipping exactly the cached tokens. On the dense fixture it shares every
//! block the previous turn filled, its answer's blocks included (published by the decode steps
//! that filled them), even while that turn still runs; a block the last sampled token would
//! complete, and a block partly filled at the end, are never published. On the hybrid fixtures
//! decode-filled blocks are not published (decode and a cold prefill round the delta rule
//! differently); instead the scheduler re-prefills each finished conversation
//! (`ModelOptions::reprefill_answers`), so a follow-up resumes at the conversation's last
//! multiple of the snapshot interval (64), and without it at the previous prompt's last
//! snapshot; a follow-up arriving while the re-prefill runs is bitwise cold too, and nothing is
//! held once idle. On the CPU backend (and, built with `--features cuda`, on the CUDA backend
//! too).

#![allow(clippy::unwrap_used)]

mod support;

use support::cache::{assert_bitwise, assert_nothing_held, solo, tokens};

use std::sync::Arc;

use metrale_cache::block_hashes;
use metrale_gpu_runtime::{CpuBackend, GpuBackend};
use metrale_model_engine::generate::GenerateParams;
use metrale_model_engine::runner::Fusions;
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::scheduler::{Scheduler, SeqEvent, SeqRequest, StepKind};
use metrale_model_engine::{ForwardSelect, KvCacheDtype, ModelCircuit, ModelOptions, factory};
use metrale_testkit::Rng;

/// Where the model runs.
type Backend = fn() -> Arc<dyn GpuBackend>;

fn cpu() -> Arc<dyn GpuBackend> {
    Arc::new(CpuBackend::default())
}

fn load_on(backend: Backend, name: &str, prefix_caching: bool) -> Scheduler {
    load_with(backend, name, 16, prefix_caching, true)
}

/// `name` on `backend`, prefill chunks of `chunk` tokens.
fn load_with(
    backend: Backend,
    name: &str,
    chunk: usize,
    prefix_caching: bool,
    reprefill: bool,
) -> Scheduler {
    load_kv(
        backend,
        name,
        chunk,
        (prefix_caching, reprefill),
        KvCacheDtype::Bf16,
    )
}

/// `load_with` with the KV cache in `kv`.
fn load_kv(
    backend: Backend,
    name: &str,
    chunk: usize,
    (prefix_caching, reprefill): (bool, bool),
    kv: KvCacheDtype,
) -> Scheduler {
    let options = ModelOptions::default()
        .max_batch_tokens(chunk)
        .max_decode_seqs(4)
        .prefix_caching(prefix_caching)
        .reprefill_answers(reprefill)
        .kv_cache_dtype(kv);
    let model =
        factory::load(&support::fixture(name), backend()).unwrap_or_else(|e| panic!("{name}: {e}"));
    Scheduler::new(model, options).unwrap()
}

/// A request keeping its logits, sampled (seeded) when `seed` is given, greedy otherwise.
fn request(prompt: Vec<u32>, max_new_tokens: usize, seed: Option<u64>) -> SeqRequest {
    let sampling = match seed {
        Some(seed) => SamplingParams::default().temperature(0.9).seed(seed),
        None => SamplingParams::default(),
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

/// What a conversation's turns should find: per turn, the tokens served from the cache, and
/// the tokens its re-prefill computes once it has finished.
struct Want {
    hits: [u64; 3],
    reprefills: [u64; 3],
}

/// Three turns: a 70-token prompt answered with 60 tokens; then that conversation plus 11 new
/// tokens, answered (sampled) with 80; then all of it plus 5 more. Each turn on the warm model
/// (prefill chunks of `chunk` tokens, `reprefill_answers` as given) is bitwise the turn on the
/// cold one, and hits the cache and re-prefills as `want` says. With chunks longer than the
/// snapshot interval a cold prefill runs through the block boundaries between its multiples,
/// so a hybrid follow-up resumed at one of those would not be bitwise cold.
fn conversation(backend: Backend, name: &str, chunk: usize, reprefill: bool, want: Want) {
    conversation_in(backend, name, chunk, reprefill, KvCacheDtype::Bf16, want);
}

/// `conversation` with the KV cache in `kv`: with FP8, decode rows store and read the e4m3
/// blocks a prefill would, so the decoded blocks are shared as bf16 ones are.
fn conversation_in(
    backend: Backend,
    name: &str,
    chunk: usize,
    reprefill: bool,
    kv: KvCacheDtype,
    want: Want,
) {
    conversation_under(
        ForwardSelect::Legacy,
        (backend, name, chunk, reprefill, kv),
        want,
    );
}

/// `conversation_in` with the warm model's decode steps under `forward` (the cold model's
/// under the legacy forward).
fn conversation_under(
    forward: ForwardSelect,
    (backend, name, chunk, reprefill, kv): (Backend, &str, usize, bool, KvCacheDtype),
    want: Want,
) {
    let mut warm = load_kv(backend, name, chunk, (true, reprefill), kv);
    warm.runner_mut().set_forward(forward).unwrap();
    let cold = load_kv(backend, name, chunk, (false, false), kv);
    let label = format!("{name}, {kv:?} KV, {}", forward.name());
    conversation_on((warm, cold), &label, want);
}

/// The three turns of [`conversation`] on a `warm` model (prefix caching on) and a `cold` one
/// (off): each turn bitwise cold, hitting and re-prefilling as `want` says.
fn conversation_on((mut warm, mut cold): (Scheduler, Scheduler), label: &str, want: Want) {
    let vocab = warm.runner().model().config().tokens.vocab_size as u32;
    let mut rng = Rng::new(11);
    let mut prompt = tokens(&mut rng, 70, vocab);
    let turns = [(60, None, 11), (80, Some(7), 5), (4, None, 0)];
    let wants = want.hits.into_iter().zip(want.reprefills);
    for (k, ((max_new, seed, next_user), (hit, reprefilled))) in
        turns.into_iter().zip(wants).enumerate()
    {
        let what = format!("{label}: turn {k} ({} prompt tokens)", prompt.len());
        let req = request(prompt.clone(), max_new, seed);
        let (w, c) = (solo(&mut warm, &req), solo(&mut cold, &req));
        assert_bitwise(&w.generation, &c.generation, &what);
        assert_eq!(w.hit_tokens, hit, "{what}: cached tokens");
        assert_eq!(
            w.reprefill_tokens, reprefilled,
            "{what}: re-prefilled tokens"
        );
        assert_eq!(
            w.prefill_tokens,
            prompt.len() as u64 - hit,
            "{what}: prefill skips exactly the hit"
        );
        assert_eq!(
            (c.hit_tokens, c.reprefill_tokens),
            (0, 0),
            "{what}: the cold model never hits nor re-prefills"
        );
        prompt.extend(&w.generation.token_ids);
        prompt.extend(tokens(&mut rng, next_user, vocab));
    }
    assert_eq!(cold.cache().blocks().num_cached(), 0);
    assert_nothing_held(&mut warm);
}

// Dense: turn 0 computes 70 + 59 tokens (its last token is never fed): 8 full blocks, so turn
// 1 (141 tokens) hits 128 where the prompt's blocks alone give 64; turn 1 computes 141 + 79:
// 13 full blocks, so turn 2 (226 tokens) hits 208. Decode fills what prefill would: no
// re-prefill.
const DENSE: Want = Want {
    hits: [0, 128, 208],
    reprefills: [0, 0, 0],
};
// Hybrid (chunks of 16 or 512 alike): turn 0's prompt leaves a snapshot at 64; its
// conversation (130 tokens) is re-prefilled from there to 128, the last multiple of the
// snapshot interval, so turn 1 (141 tokens) hits 128 where the prompt alone gives 64. Turn 1's
// conversation (221 tokens) is re-prefilled from 128 to 192, so turn 2 (226 tokens) hits 192
// where the prompts alone give 128; its own conversation (230 tokens) has nothing past 192.
const HYBRID: Want = Want {
    hits: [0, 128, 192],
    reprefills: [64, 64, 0],
};
// Hybrid without re-prefills: turn 0's prompt leaves a snapshot at 64, turn 1's (prefilled from
// 64) one at 128; the answers' blocks are not published.
const HYBRID_PROMPTS_ONLY: Want = Want {
    hits: [0, 64, 128],
    reprefills: [0, 0, 0],
};

#[test]
fn a_follow_up_turn_shares_the_whole_conversation_and_is_bitwise_cold() {
    conversation(cpu, "qwen3-tiny", 16, false, DENSE);
    conversation(cpu, "qwen3-tiny", 16, true, DENSE);
    conversation_in(cpu, "qwen3-tiny", 16, true, KvCacheDtype::Fp8, DENSE);
    // Whole-prompt prefill chunks past the decode sizes store through the fused rotation
    // kernel, the decode steps through `kv_store`: the same e4m3 bytes.
    conversation_in(cpu, "qwen3-tiny", 512, true, KvCacheDtype::Fp8, DENSE);
}

/// With prompt rows in their own arithmetic (`ModelOptions::prompt_attention`, a dense shape of
/// head_dim 128 with random weights), decode-filled blocks hold other bits than a cold prefill
/// of the same tokens as prompt, so they are not published: each finished conversation is
/// re-prefilled as a prompt instead (turn 0's from its prompt's 64 cached tokens to 128, the end
/// of its last full block; turn 1's from 128 to 208; turn 2's 230 tokens end no block past its
/// own prompt's 224), and every follow-up hits those blocks, bitwise the cold turn.
#[test]
fn with_prompt_arithmetic_a_follow_up_shares_the_reprefilled_answer_and_is_bitwise_cold() {
    let [config, _] = metrale_model_engine::bench::decode_staging_shapes_for_cpu().unwrap();
    let load = |caching: bool| {
        let options = ModelOptions::default()
            .max_batch_tokens(16)
            .max_decode_seqs(4)
            .prefix_caching(caching)
            .reprefill_answers(caching)
            .prompt_attention(true);
        let model = factory::random(config.clone(), cpu(), 7).unwrap();
        Scheduler::new(model, options).unwrap()
    };
    let (warm, cold) = (load(true), load(false));
    assert!(warm.runner().prompt_attention() && !warm.runner().decode_matches_prefill());
    let want = Want {
        hits: [0, 128, 208],
        reprefills: [64, 80, 0],
    };
    conversation_on((warm, cold), "prompt attention", want);
}

/// Under the circuit forward's fused programs, whose every fusion is byte-identical to the
/// legacy launches, decode steps still fill the blocks a cold prefill writes: a follow-up
/// shares the answer's blocks (no re-prefill) and is bitwise the legacy forward's cold turn.
#[test]
fn fused_circuit_decode_steps_publish_their_blocks_and_are_bitwise_cold() {
    let fused = ForwardSelect::Circuit {
        fusions: Fusions::All,
    };
    conversation_under(
        fused,
        (cpu, "qwen3-tiny", 16, true, KvCacheDtype::Bf16),
        DENSE,
    );
}

#[test]
fn a_hybrid_follow_up_shares_the_reprefilled_answer_and_is_bitwise_cold() {
    conversation(cpu, "qwen3_5-tiny", 512, true, HYBRID);
    conversation(cpu, "qwen3_5-tiny", 16, true, HYBRID);
    conversation(cpu, "qwen3_next-tiny", 512, true, HYBRID);
    conversation_in(cpu, "qwen3_5-tiny", 16, true, KvCacheDtype::Fp8, HYBRID);
}

#[test]
fn without_reprefill_a_hybrid_follow_up_resumes_at_the_previous_prompts_snapshot() {
    conversation(cpu, "qwen3_5-tiny", 512, false, HYBRID_PROMPTS_ONLY);
}

/// A hybrid follow-up submitted while the previous turn's conversation is being re-prefilled:
/// the re-prefill gives way at once (the follow-up's prefill is the next step), the follow-up
/// resumes at the previous prompt's snapshot (the re-prefill kept none yet) and is bitwise
/// cold; the re-prefill, resumed after it, finds its conversation cached by the follow-up's
/// prefill and ends; nothing is held once idle.
fn a_follow_up_during_the_reprefill(backend: Backend) {
    let mut warm = load_on(backend, "qwen3_5-tiny", true);
    let mut cold = load_on(backend, "qwen3_5-tiny", false);
    let vocab = warm.runner().model().config().tokens.vocab_size as u32;
    let mut rng = Rng::new(41);
    let first = request(tokens(&mut rng, 70, vocab), 60, None);
    let id = warm.add(first.clone()).unwrap();
    let mut answer = None;
    while answer.is_none() {
        for e in warm.step().unwrap().events {
            if let SeqEvent::Finished { id: f, generation } = e {
                assert_eq!(f, id);
                answer = Some(generation);
            }
        }
    }
    let answer = answer.unwrap();
    assert_eq!(
        warm.stats().reprefills,
        1,
        "the conversation's re-prefill is queued"
    );
    // Two chunks of 16 from the prompt's snapshot at 64: blocks to 96, no snapshot past 64.
    for start in [64, 80] {
        let report = warm.step().unwrap();
        assert_eq!(report.kind, StepKind::Reprefill { start, rows: 16 });
        assert!(report.events.is_empty(), "a re-prefill emits nothing");
    }
    let stats = warm.stats();
    assert_eq!((stats.running, stats.reprefills), (0, 1));
    assert!(stats.cache.kv_blocks_used > 0 && stats.cache.ssm_slots_used == 1);
    let mut prompt = first.prompt.clone();
    prompt.extend(&answer.token_ids);
    prompt.extend(tokens(&mut rng, 11, vocab));
    let second = request(prompt, 8, Some(5));
    let before = warm.stats().steps;
    let id2 = warm.add(second.clone()).unwrap();
    let mut out = None;
    let mut kinds = Vec::new();
    while !warm.is_idle() {
        let report = warm.step().unwrap();
        kinds.push(report.kind);
        for e in report.events {
            if let SeqEvent::Finished { id: f, generation } = e {
                assert_eq!(f, id2);
                out = Some(generation);
            }
        }
    }
    assert!(
        matches!(kinds[0], StepKind::Prefill { seq, start: 64, .. } if seq == id2),
        "the follow-up's prefill runs first, from the prompt's snapshot: {kinds:?}"
    );
    let after = warm.stats().steps;
    assert_eq!(after.prefix.hit_tokens - before.prefix.hit_tokens, 64);
    assert_eq!(
        after.reprefill_tokens - before.reprefill_tokens,
        0,
        "the rest of the re-prefill is the follow-up's own prefill"
    );
    assert_bitwise(
        &answer,
        &solo(&mut cold, &first).generation,
        "the first turn",
    );
    let c = solo(&mut cold, &second);
    assert_bitwise(&out.unwrap(), &c.generation, "the follow-up");
    assert_nothing_held(&mut warm);
}

#[test]
fn a_follow_up_arriving_during_the_reprefill_is_bitwise_cold() {
    a_follow_up_during_the_reprefill(cpu);
}

/// A 30-token prompt answered with 18 tokens holds 48 tokens, three blocks' worth, but its last
/// token is never fed: blocks 0 (prompt) and 1 (prompt and answer, filled by decode) are
/// published, block 2 is not. Another 30-token prompt answered with 10 leaves its block 2 with
/// 7 computed tokens: not published either. A follow-up on the first hits 32 tokens, bitwise
/// cold.
fn unfinished_blocks_are_not_published(backend: Backend) {
    let mut warm = load_on(backend, "qwen3-tiny", true);
    let mut cold = load_on(backend, "qwen3-tiny", false);
    let vocab = warm.runner().model().config().tokens.vocab_size as u32;
    let mut rng = Rng::new(23);
    let first = tokens(&mut rng, 30, vocab);
    let a = solo(&mut warm, &request(first.clone(), 18, None));
    let b = solo(
        &mut warm,
        &request(tokens(&mut rng, 30, vocab), 10, Some(3)),
    );
    assert_eq!(
        (a.generation.token_ids.len(), b.generation.token_ids.len()),
        (18, 10)
    );
    assert_eq!(
        warm.cache().blocks().num_cached(),
        4,
        "two full blocks each"
    );
    // The first conversation's 48 tokens hash to three blocks; the third is not cached.
    let mut prompt = first;
    prompt.extend(&a.generation.token_ids);
    let hashes = block_hashes(&prompt, 16);
    let alloc = warm.cache().blocks();
    assert!(alloc.lookup(&hashes[0]).is_some() && alloc.lookup(&hashes[1]).is_some());
    assert_eq!(
        alloc.lookup(&hashes[2]),
        None,
        "a block whose last token was never fed"
    );
    prompt.extend(tokens(&mut rng, 5, vocab));
    let req = request(prompt, 6, None);
    let w = solo(&mut warm, &req);
    let c = solo(&mut cold, &req);
    assert_bitwise(&w.generation, &c.generation, "the follow-up");
    assert_eq!(w.hit_tokens, 32);
    assert_nothing_held(&mut warm);
}

#[test]
fn a_block_not_filled_by_fed_tokens_is_not_published() {
    unfinished_blocks_are_not_published(cpu);
}

/// A follow-up submitted while the first request still decodes shares the blocks its decode
/// steps filled so far (held by both), and both complete bitwise cold.
fn a_running_answer_is_shared(backend: Backend) {
    let mut warm = load_on(backend, "qwen3-tiny", true);
    let mut cold = load_on(backend, "qwen3-tiny", false);
    let vocab = warm.runner().model().config().tokens.vocab_size as u32;
    let mut rng = Rng::new(31);
    let first = request(tokens(&mut rng, 20, vocab), 60, None);
    let id = warm.add(first.clone()).unwrap();
    let mut answer = Vec::new();
    while answer.len() < 40 {
        for e in warm.step().unwrap().events {
            if let SeqEvent::Token { id: t, token, .. } = e {
                assert_eq!(t, id);
                answer.push(token);
            }
        }
    }
    // 20 + 40 tokens, 59 of them fed: three full blocks, the last two filled by decode.
    let mut prompt = first.prompt.clone();
    prompt.extend(&answer);
    let hashes = block_hashes(&prompt, 16);
    let shared = warm.cache().blocks().lookup(&hashes[2]).unwrap();
    prompt.extend(tokens(&mut rng, 3, vocab));
    let second = request(prompt, 8, Some(5));
    let id2 = warm.add(second.clone()).unwrap();
    let mut out = std::collections::HashMap::new();
    let mut steps = 0;
    while !warm.is_idle() {
        for e in warm.step().unwrap().events {
            if let SeqEvent::Finished { id, generation } = e {
                out.insert(id, generation);
            }
        }
        if steps == 0 {
            assert_eq!(
                warm.cache().blocks().refcount(shared),
                2,
                "both hold block 2"
            );
        }
        steps += 1;
    }
    assert_eq!(warm.stats().steps.prefix.hit_tokens, 48);
    for (id, req) in [(id, first), (id2, second)] {
        let c = solo(&mut cold, &req);
        assert_bitwise(&out[&id], &c.generation, &format!("{id}"));
    }
    assert_nothing_held(&mut warm);
}

#[test]
fn a_follow_up_shares_the_blocks_of_an_answer_still_running() {
    a_running_answer_is_shared(cpu);
}

/// The same conversations on the GPU: decode rows there must compute what prefill rows do.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use metrale_gpu_runtime::cuda::CudaBackend;

    fn gpu() -> Arc<dyn GpuBackend> {
        Arc::new(CudaBackend::new(0).expect("a CUDA device"))
    }

    #[test]
    fn a_follow_up_turn_shares_the_whole_conversation_and_is_bitwise_cold_on_cuda() {
        conversation(gpu, "qwen3-tiny", 16, true, DENSE);
        conversation(gpu, "qwen3_5-tiny", 512, true, HYBRID);
        conversation(gpu, "qwen3_5-tiny", 16, true, HYBRID);
        conversation(gpu, "qwen3_next-tiny", 512, true, HYBRID);
        conversation(gpu, "qwen3_5-tiny", 512, false, HYBRID_PROMPTS_ONLY);
        conversation_in(gpu, "qwen3-tiny", 16, true, KvCacheDtype::Fp8, DENSE);
        conversation_in(gpu, "qwen3_5-tiny", 16, true, KvCacheDtype::Fp8, HYBRID);
    }

    #[test]
    fn a_follow_up_arriving_during_the_reprefill_is_bitwise_cold_on_cuda() {
        a_follow_up_during_the_reprefill(gpu);
    }

    #[test]
    fn a_block_not_filled_by_fed_tokens_is_not_published_on_cuda() {
        unfinished_blocks_are_not_published(gpu);
    }

    #[test]
    fn a_follow_up_shares_the_blocks_of_an_answer_still_running_on_cuda() {
        a_running_answer_is_shared(gpu);
    }
}
