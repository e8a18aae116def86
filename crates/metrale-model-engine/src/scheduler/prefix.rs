//! Prefix caching in the scheduler: at admission, the longest prefix of a prompt the cache can
//! serve (`lookup`) and taking it (`acquire`); after each prefill chunk, publishing the prompt
//! blocks the chunk completed and, on a hybrid model at a snapshot position, keeping the SSM
//! state (`publish`); after each decode step, publishing the block it filled, where decode
//! computes what prefill computes (`publish_decoded`).
//!
//! Policy:
//! - A block is published once the step that wrote its last token has run: a full prompt
//!   block after its prefill chunk; a block that decode steps filled (a multi-turn follow-up
//!   repeats the prompt and the answer) after the decode step of its last token, on models
//!   where `StepRunner::decode_matches_prefill` holds, so that the block holds what a
//!   cold prefill of its tokens writes. A sequence's last sampled token is never fed, so a
//!   block it would complete, like a block partly filled at the end, is not published.
//! - On hybrid models blocks filled by decode steps are not published, nor is the SSM state
//!   after them kept: decode runs the delta rule token by token, a cold prefill in chunks of
//!   64, and the two round differently. Instead, once a sequence finishes, its conversation is
//!   prefilled again (`reprefill`, with `ModelOptions::reprefill_answers`) through the same
//!   lookup, chunks and `publish` as a prompt, up to its last multiple of the snapshot
//!   interval, so a follow-up turn resumes there (fewer than an interval of the previous
//!   conversation to recompute). Without it, or before it has run, a follow-up resumes at the
//!   last snapshot of the previous turn's prompt and prefills the answer, as a cold run does;
//!   its own prefill keeps snapshots for the turn after it.
//! - A hit leaves at least the prompt's last token to compute (its logits choose the first
//!   token), so it covers at most `(prompt_len - 1) / block_size` blocks.
//! - On a hybrid model a hit must end where an SSM snapshot of that prefix is kept: at a
//!   multiple of the snapshot interval, the longest such cached prefix.
//! - A shared block is never written: the sharer computes from the end of the hit, past every
//!   shared block; the sequence that filled a published block only writes past it.

use metrale_cache::CacheManager;

use super::sequence::Seq;
use crate::error::ModelError;
use crate::runner::StepRunner;

/// What the cache can serve of a prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Hit {
    /// Leading prompt blocks found cached (all of them usable).
    pub blocks: usize,
    /// Of those, the blocks nobody holds now: taking them makes them unavailable to others.
    pub unreferenced: usize,
}

/// The longest usable cached prefix of `s`'s prompt (nothing with prefix caching off).
pub(super) fn lookup(cache: &CacheManager, caching: bool, s: &mut Seq) -> Hit {
    if !caching {
        return Hit::default();
    }
    let bs = cache.block_size();
    s.hash_blocks(s.prompt_len, bs);
    let hashes = &s.cache.block_hashes;
    let most = (s.prompt_len.saturating_sub(1) / bs).min(hashes.len());
    let alloc = cache.blocks();
    let found: Vec<u32> = hashes[..most]
        .iter()
        .map_while(|h| alloc.lookup(h))
        .collect();
    let blocks = if cache.ssm_slots().is_none() {
        found.len()
    } else {
        // A hybrid hit ends where a snapshot of its prefix is kept (at a multiple of the
        // snapshot interval, where every snapshot is taken).
        (1..=found.len())
            .rev()
            .find(|&k| cache.has_snapshot(&hashes[k - 1]))
            .unwrap_or(0)
    };
    Hit {
        blocks,
        unreferenced: found[..blocks]
            .iter()
            .filter(|&&b| alloc.refcount(b) == 0)
            .count(),
    }
}

/// Take the hit for `s`, which holds nothing yet: share its blocks and take an SSM slot (the
/// snapshot restored into it on a hybrid hit, zeroed otherwise); `s` resumes after the hit.
pub(super) fn acquire(cache: &mut CacheManager, s: &mut Seq, hit: Hit) -> Result<(), ModelError> {
    let c = &mut s.cache;
    for h in &c.block_hashes[..hit.blocks] {
        cache
            .acquire_cached(&mut c.table, h)
            .ok_or_else(|| ModelError::Step(format!("cached block {h:?} vanished")))?;
    }
    c.published = hit.blocks;
    let snapshot = (hit.blocks.checked_sub(1))
        .filter(|_| cache.ssm_slots().is_some())
        .map(|last| c.block_hashes[last]);
    c.ssm_slot = cache.alloc_ssm_slot(snapshot.as_ref())?;
    s.computed = hit.blocks * cache.block_size();
    Ok(())
}

/// After a prefill chunk of `s` that ended at prompt position `end`: publish the prompt blocks
/// it completed, and keep the SSM state when `end` is a multiple of the snapshot `interval`.
pub(super) fn publish(
    cache: &mut CacheManager,
    caching: bool,
    interval: Option<usize>,
    s: &mut Seq,
    end: usize,
) -> Result<(), ModelError> {
    if !caching {
        return Ok(());
    }
    let bs = cache.block_size();
    publish_blocks(cache, s, end / bs)?;
    let c = &s.cache;
    if let (Some(interval), Some(slot)) = (interval, c.ssm_slot)
        && end > 0
        && end.is_multiple_of(interval)
        && end / bs <= c.block_hashes.len()
    {
        cache.save_snapshot(c.block_hashes[end / bs - 1], slot)?;
    }
    Ok(())
}

/// After a decode or verify step of the sequences `idx` of `running` (their `computed` counts
/// the rows just run): publish the blocks those rows filled, where `runner`'s decode steps
/// compute what prefill steps do. Any number of rows per step (a verify step accepting several
/// tokens): every block wholly within `computed` is final.
pub(super) fn publish_decoded(
    runner: &StepRunner,
    cache: &mut CacheManager,
    running: &mut [Seq],
    idx: &[usize],
) -> Result<(), ModelError> {
    if !runner.options().prefix_caching || !runner.decode_matches_prefill() {
        return Ok(());
    }
    let bs = cache.block_size();
    for &i in idx {
        let s = &mut running[i];
        let full = s.computed / bs.max(1);
        if full > s.cache.published {
            s.hash_blocks(s.computed, bs);
            publish_blocks(cache, s, full)?;
        }
    }
    Ok(())
}

/// Publish `s`'s blocks from `published` up to `full` (at most the blocks it has keys for).
fn publish_blocks(cache: &mut CacheManager, s: &mut Seq, full: usize) -> Result<(), ModelError> {
    let c = &mut s.cache;
    let full = full.min(c.block_hashes.len()).min(c.table.blocks().len());
    for i in c.published..full {
        // A duplicate of a block published meanwhile stays private; the chain goes on.
        cache.publish(c.table.blocks()[i], c.block_hashes[i])?;
    }
    c.published = c.published.max(full);
    Ok(())
}
