//! `TokenConstraint`: what a structured-output grammar tells the scheduler at each step of one
//! sequence: which tokens may come next (an allowed-token bitmask), the token that came, and
//! whether the grammar is done. The scheduler holds one per constrained sequence
//! ([`Scheduler::add_constrained`](crate::Scheduler::add_constrained)); what implements it (the
//! facade's llguidance matcher, a test's fixed automaton) lives above this crate.
//!
//! The bitmask layout is the one every consumer shares, host or device: `mask_words(vocab)`
//! `u32` words, bit `t % 32` of word `t / 32` set when token `t` is allowed; bits past the
//! vocabulary are clear.
//!
//! Invariants:
//! - A constrained row's mask goes into the device sampler's mask input, which sets every
//!   disallowed logit to `-inf` before any pick ([`apply_mask`] is the same rule on the host, the
//!   tests' reference), so greedy and sampled picking never choose one; a sequence without a
//!   constraint pays nothing.
//! - A sequence whose constraint fails (its grammar errs, or allows no token) may only end:
//!   its mask falls back to its stop tokens.

use std::fmt::Debug;

/// Why a constraint could not go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the output constraint failed: {reason}")]
pub struct ConstraintError {
    /// What failed, in the constraint's words (a token the grammar refused, an internal error).
    pub reason: String,
}

/// A sequence's structured-output state; see the module header.
pub trait TokenConstraint: Send + Debug {
    /// Set `mask` (of [`mask_words`]`(vocab)` words, cleared by the caller) to the tokens that
    /// may come next.
    fn fill_mask(&mut self, mask: &mut [u32]) -> Result<(), ConstraintError>;
    /// The sequence took `token`.
    fn accept(&mut self, token: u32) -> Result<(), ConstraintError>;
    /// The grammar is complete and allows nothing but the end of the sequence.
    fn is_finished(&self) -> bool;
}

/// Words of a bitmask over `vocab` tokens.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Whether `mask` allows token `t`.
pub fn allows(mask: &[u32], t: u32) -> bool {
    mask.get(t as usize / 32)
        .is_some_and(|w| (w >> (t % 32)) & 1 == 1)
}

/// Allow token `t` in `mask` (a token past the mask is ignored).
pub fn allow(mask: &mut [u32], t: u32) {
    if let Some(w) = mask.get_mut(t as usize / 32) {
        *w |= 1 << (t % 32);
    }
}

/// Set every logit whose token `mask` does not allow to `-inf`.
pub fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = mask.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if (bits >> b) & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_testkit::Rng;

    #[test]
    fn the_mask_keeps_exactly_the_allowed_tokens_and_the_layout_is_bit_t_of_word_t_over_32() {
        let vocab = 77;
        let mut rng = Rng::new(5);
        let mut mask = vec![0u32; mask_words(vocab)];
        assert_eq!(mask.len(), 3);
        let allowed: Vec<u32> = (0..vocab as u32).filter(|_| rng.below(3) == 0).collect();
        for &t in &allowed {
            allow(&mut mask, t);
        }
        allow(&mut mask, 40);
        assert_eq!(mask[1] >> 8 & 1, 1, "token 40 is bit 8 of word 1");
        let mut logits = rng.f32s(vocab, -2.0, 2.0);
        let before = logits.clone();
        apply_mask(&mut logits, &mask);
        for t in 0..vocab as u32 {
            let kept = allowed.contains(&t) || t == 40;
            assert_eq!(allows(&mask, t), kept);
            let l = logits[t as usize];
            if kept {
                assert_eq!(l, before[t as usize]);
            } else {
                assert_eq!(l, f32::NEG_INFINITY);
            }
        }
    }
}
