//! Multi-turn prefix caching: a follow-up turn whose prompt is the previous turn's prompt, its
//! answer and a new user message gets bitwise the tokens and logits of a model with prefix
//! caching off, after skipping exactly the cached tokens. On the dense fixture it shares every
//! block the previous turn filled, its answer's blocks included (published by the decode steps
//! that filled them), even while that turn still runs; a block the last sampled token would
//! complete, and a block partly filled at the end, are never published. On the hybrid fixture
//! decode-filled blocks are not published (decode and a cold prefill round the delta rule
//! differently), and a follow-up resumes at the last SSM snapshot of the previous prompt. On the
//! CPU backend (and, built with `--features cuda`, on the CUDA backend too).

#![allow(clippy::unwrap_used)]

mod support;

use support::cache::{assert_bitwise, assert_nothing_held, solo, tokens};

use std::sync::Arc;

use metrale_cache::block_hashes;
use metrale_gpu_runtime::{CpuBackend, GpuBackend};
use metrale_model_engine::generate::GenerateParams;
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::scheduler::{Scheduler, SeqEvent, SeqRequest};
use metrale_model_engine::{ModelOptions, factory};
use metrale_testkit::Rng;

/// Where the model runs.
type Backend = fn() -> Arc<dyn GpuBackend>;

fn cpu() -> Arc<dyn GpuBackend> {
    Arc::new(CpuBackend::default())
}

fn load_on(backend: Backend, name: &str, prefix_caching: bool) -> Scheduler {
    let options = ModelOptions::default()
        .max_batch_tokens(16)
        .max_decode_seqs(4)
        .prefix_caching(prefix_caching);
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

/// Three turns: a 70-token prompt answered with 60 tokens; then that conversation plus 11 new
/// tokens, answered (sampled) with 30; then all of it plus 5 more. Each turn on the warm model
/// is bitwise the turn on the cold one, and hits the cache for `want_hits` tokens.
fn conversation(backend: Backend, name: &str, want_hits: [u64; 3]) {
    let mut warm = load_on(backend, name, true);
    let mut cold = load_on(backend, name, false);
    let vocab = warm.runner().model().config().tokens.vocab_size as u32;
    let mut rng = Rng::new(11);
    let mut prompt = tokens(&mut rng, 70, vocab);
    let turns = [(60, None, 11), (30, Some(7), 5), (4, None, 0)];
    for (k, ((max_new, seed, next_user), want)) in turns.into_iter().zip(want_hits).enumerate() {
        let what = format!("{name}: turn {k} ({} prompt tokens)", prompt.len());
        let req = request(prompt.clone(), max_new, seed);
        let (w, c) = (solo(&mut warm, &req), solo(&mut cold, &req));
        assert_bitwise(&w.generation, &c.generation, &what);
        assert_eq!(w.hit_tokens, want, "{what}: cached tokens");
        assert_eq!(
            w.prefill_tokens,
            prompt.len() as u64 - want,
            "{what}: prefill skips exactly the hit"
        );
        assert_eq!(c.hit_tokens, 0, "{what}: the cold model never hits");
        prompt.extend(&w.generation.token_ids);
        prompt.extend(tokens(&mut rng, next_user, vocab));
    }
    assert_eq!(cold.cache().blocks().num_cached(), 0);
    assert_nothing_held(&mut warm);
}

// Dense: turn 0 computes 70 + 59 tokens (its last token is never fed): 8 full blocks, so turn
// 1 (141 tokens) hits 128 where the prompt's blocks alone give 64; turn 1 computes 141 + 29:
// 10 full blocks, so turn 2 (176 tokens) hits 160.
const DENSE_HITS: [u64; 3] = [0, 128, 160];
// Hybrid: turn 0's prompt leaves a snapshot at 64, turn 1's (prefilled from 64 in chunks of
// 16) one at 128; the answers' blocks are not published.
const HYBRID_HITS: [u64; 3] = [0, 64, 128];

#[test]
fn a_follow_up_turn_shares_the_whole_conversation_and_is_bitwise_cold() {
    conversation(cpu, "qwen3-tiny", DENSE_HITS);
}

#[test]
fn a_hybrid_follow_up_resumes_at_the_previous_prompts_snapshot_and_is_bitwise_cold() {
    conversation(cpu, "qwen3_5-tiny", HYBRID_HITS);
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
        conversation(gpu, "qwen3-tiny", DENSE_HITS);
        conversation(gpu, "qwen3_5-tiny", HYBRID_HITS);
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
