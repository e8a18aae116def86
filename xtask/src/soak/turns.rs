//! The multi-turn part of `cargo xtask soak`: conversations of three turns, each turn's prompt
//! the previous turn's prompt, its answer and a new message, run one turn at a time on the idle
//! engine (so each turn's cache hits are its own, read from the metrics).
//!
//! Asserts, per turn: its output equals its solo run without prefix caching; and a follow-up
//! turn hits the cache for exactly what the previous turn left: on a dense checkpoint every full
//! block of the tokens it fed (prompt and answer, all but the last answer token), on a hybrid
//! one its conversation (prompt and every answer token, re-prefilled once it finished) up to the
//! last multiple of the SSM snapshot interval (64).

use anyhow::{Context, Result, ensure};
use metrale::{Engine, GenerateRequest, Prompt, SamplingParams};
use metrale_testkit::Rng;

use super::{check_solo, wait_idle};

/// Turns per conversation.
const TURNS: usize = 3;

/// What the conversations did.
pub(super) struct TurnsSummary {
    pub conversations: usize,
    /// Follow-up turns (all but each conversation's first).
    pub follow_ups: usize,
    /// Prompt tokens of the follow-ups, and of those the ones the cache served.
    pub follow_up_tokens: u64,
    pub follow_up_hit_tokens: u64,
}

/// The tokens of the previous turn a follow-up can find cached: see the module header.
fn expected_hit(hybrid: bool, block_size: usize, prompt: usize, answer: usize) -> u64 {
    let unit = if hybrid { 64 } else { block_size };
    let reusable = if hybrid {
        prompt + answer
    } else {
        prompt + answer - 1
    };
    (reusable / unit * unit) as u64
}

/// Run `conversations` conversations on the idle `engine` (blocks of `block_size` tokens), each
/// turn checked on `cold`.
pub(super) fn run(
    engine: &Engine,
    cold: &Engine,
    seed: u64,
    conversations: usize,
    block_size: usize,
) -> Result<TurnsSummary> {
    let vocab = engine.config().tokens.vocab_size as u32;
    let hybrid = engine.metrics().cache.ssm_slots_total > 0;
    let mut summary = TurnsSummary {
        conversations,
        follow_ups: 0,
        follow_up_tokens: 0,
        follow_up_hit_tokens: 0,
    };
    let mut rng = Rng::new(seed ^ 0x7E2A);
    let (mut done, mut cold_done) = (
        engine.metrics().requests.finished,
        cold.metrics().requests.finished,
    );
    for c in 0..conversations {
        let mut prompt: Vec<u32> = (0..rng.usize_in(40..=80))
            .map(|_| rng.below(vocab))
            .collect();
        let mut previous: Option<(usize, usize)> = None;
        for turn in 0..TURNS {
            let sampling = if rng.chance(0.5) {
                SamplingParams::default()
            } else {
                SamplingParams::default()
                    .temperature(0.8)
                    .seed(rng.next_u64())
            };
            let req = GenerateRequest::new(Prompt::TokenIds(prompt.clone()))
                .max_new_tokens(rng.usize_in(8..=24))
                .sampling(sampling)
                .ignore_eos(true)
                .return_logits(rng.chance(0.5));
            let before = wait_idle(engine, done)?;
            let out = engine.generate(&req).context("a conversation's turn")?;
            done += 1;
            let after = wait_idle(engine, done)?;
            let hit = after.steps.prefix.hit_tokens - before.steps.prefix.hit_tokens;
            let what = format!("conversation {c}, turn {turn} ({} tokens)", prompt.len());
            check_solo(cold, &req, &out).with_context(|| what.clone())?;
            cold_done += 1;
            if let Some((p, a)) = previous {
                let want = expected_hit(hybrid, block_size, p, a);
                ensure!(
                    hit == want,
                    "{what}: {hit} tokens came from the prefix cache, {want} expected"
                );
                summary.follow_ups += 1;
                summary.follow_up_tokens += prompt.len() as u64;
                summary.follow_up_hit_tokens += hit;
            }
            previous = Some((prompt.len(), out.token_ids.len()));
            prompt.extend(&out.token_ids);
            prompt.extend((0..rng.usize_in(3..=12)).map(|_| rng.below(vocab)));
        }
    }
    wait_idle(cold, cold_done)?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::expected_hit;

    #[test]
    fn a_follow_up_expects_the_full_blocks_fed_or_the_last_snapshot() {
        // 30 prompt tokens and 18 answer tokens: 47 fed, two full blocks.
        assert_eq!(expected_hit(false, 16, 30, 18), 32);
        assert_eq!(expected_hit(false, 16, 30, 19), 48);
        assert_eq!(expected_hit(true, 16, 130, 40), 128);
        assert_eq!(expected_hit(true, 16, 60, 40), 64);
        assert_eq!(expected_hit(true, 16, 100, 27), 64);
        assert_eq!(expected_hit(true, 16, 100, 28), 128);
    }
}
