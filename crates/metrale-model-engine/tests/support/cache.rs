//! Shared by the prefix-cache tests: random prompts, a request run alone with its cache
//! figures, bitwise comparison with a cold run, and "nothing is held".

use metrale_model_engine::generate::Generation;
use metrale_model_engine::scheduler::{Scheduler, SeqEvent, SeqRequest};
use metrale_testkit::Rng;

/// `n` random token ids below `vocab`.
pub fn tokens(rng: &mut Rng, n: usize, vocab: u32) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab)).collect()
}

/// What one request alone did: its generation, the cached and prefilled prompt tokens, and the
/// tokens its re-prefill computed once it finished.
#[derive(Debug)]
pub struct Solo {
    pub generation: Generation,
    pub hit_tokens: u64,
    pub prefill_tokens: u64,
    pub reprefill_tokens: u64,
}

/// Run `req` alone on `s` until the scheduler is idle (its re-prefill included), counting its
/// cache hits and prefill rows.
pub fn solo(s: &mut Scheduler, req: &SeqRequest) -> Solo {
    let before = s.stats().steps;
    let id = s.add(req.clone()).unwrap();
    let mut out = None;
    while !s.is_idle() {
        for e in s.step().unwrap().events {
            if let SeqEvent::Finished { id: f, generation } = e {
                assert_eq!(f, id);
                out = Some(generation);
            }
        }
    }
    let after = s.stats().steps;
    Solo {
        generation: out.unwrap(),
        hit_tokens: after.prefix.hit_tokens - before.prefix.hit_tokens,
        prefill_tokens: after.prefill_tokens - before.prefill_tokens,
        reprefill_tokens: after.reprefill_tokens - before.reprefill_tokens,
    }
}

/// `got` has the cold run's tokens, finish reason and logits, bit for bit.
pub fn assert_bitwise(got: &Generation, cold: &Generation, what: &str) {
    assert_eq!(got.token_ids, cold.token_ids, "{what}: tokens");
    assert_eq!(
        got.finish_reason, cold.finish_reason,
        "{what}: finish reason"
    );
    let (g, c) = (got.logits.as_ref().unwrap(), cold.logits.as_ref().unwrap());
    assert_eq!(g.len(), c.len(), "{what}: logits rows");
    for (step, (x, y)) in g.iter().zip(c).enumerate() {
        assert!(
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: logits of step {step} differ from the cold run"
        );
    }
}

/// Nothing is held: every block can be handed out, every SSM slot is free; and once the cache
/// is cleared nothing is cached either.
pub fn assert_nothing_held(s: &mut Scheduler) {
    let a = s.cache().blocks();
    assert_eq!(a.num_free(), a.capacity(), "a KV block is still referenced");
    if let Some((total, free)) = s.cache().ssm_slots() {
        assert_eq!(free, total, "an SSM slot is held");
    }
    s.clear_prefix_cache();
    let a = s.cache().blocks();
    assert_eq!((a.num_cached(), a.num_evictable()), (0, 0));
    assert_eq!(a.num_free(), a.capacity());
    assert_eq!(s.cache().snapshot_usage().used, 0);
}
