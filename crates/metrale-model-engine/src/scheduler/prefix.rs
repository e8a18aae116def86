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
//!   where `TransformerModel::decode_matches_prefill` holds, so that the block holds what a
//!   cold prefill of its tokens writes. A sequence's last sampled token is never fed, so a
//!   block it would complete, like a block partly filled at the end, is not published.
//! - On hybrid models blocks filled by decode steps are not published, nor is the SSM state
//!   after them kept: decode runs the delta rule token by token, a cold prefill in chunks of
//!   64, and the two round differently. A follow-up turn resumes at the last snapshot of the
//!   previous turn's prompt (at most an interval before its end) and prefills the answer, as a
//!   cold run does; its own prefill keeps snapshots for the turn after it.
//! - A hit leaves at least the prompt's last token to compute (its logits choose the first
//!   token), so it covers at most `(prompt_len - 1) / block_size` blocks.
//! - On a hybrid model a hit must end where an SSM snapshot of that prefix is kept: at a
//!   multiple of the snapshot interval, the longest such cached prefix.
//! - A shared block is never written: the sharer computes from the end of the hit, past every
//!   shared block; the sequence that filled a published block only writes past it.

use crate::error::ModelError;
use crate::model::TransformerModel;

use super::sequence::Seq;

/// What the cache can serve of a prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Hit {
    /// Leading prompt blocks found cached (all of them usable).
    pub blocks: usize,
    /// Of those, the blocks nobody holds now: taking them makes them unavailable to others.
    pub unreferenced: usize,
}

/// The longest usable cached prefix of `s`'s prompt (nothing with prefix caching off).
pub(super) fn lookup(model: &TransformerModel, s: &mut Seq) -> Hit {
    if !model.options().prefix_caching {
        return Hit::default();
    }
    let bs = model.options().block_size;
    s.hash_blocks(s.prompt_len, bs);
    let most = (s.prompt_len.saturating_sub(1) / bs).min(s.block_hashes.len());
    let alloc = model.kv_allocator();
    let found: Vec<u32> = s.block_hashes[..most]
        .iter()
        .map_while(|h| alloc.lookup(h))
        .collect();
    let blocks = match model.ssm_snapshot_interval() {
        None => found.len(),
        Some(_) if !model.keeps_ssm_snapshots() => 0,
        Some(interval) => (1..=found.len())
            .rev()
            .find(|&k| {
                (k * bs).is_multiple_of(interval) && model.has_ssm_snapshot(&s.block_hashes[k - 1])
            })
            .unwrap_or(0),
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
pub(super) fn acquire(
    model: &mut TransformerModel,
    s: &mut Seq,
    hit: Hit,
) -> Result<(), ModelError> {
    let bs = model.options().block_size;
    for h in &s.block_hashes[..hit.blocks] {
        let block = model
            .kv_cache()
            .allocator
            .acquire(h)
            .ok_or_else(|| ModelError::Step(format!("cached block {h:?} vanished")))?;
        s.table.push(block);
    }
    s.published = hit.blocks;
    let snapshot = hit
        .blocks
        .checked_sub(1)
        .filter(|_| model.has_ssm_state())
        .map(|last| s.block_hashes[last]);
    s.ssm_slot = model.alloc_ssm_slot_from(snapshot.as_ref())?;
    s.computed = hit.blocks * bs;
    Ok(())
}

/// After a prefill chunk of `s` that ended at prompt position `end`: publish the prompt blocks
/// it completed, and keep the SSM state when `end` is a snapshot position.
pub(super) fn publish(
    model: &mut TransformerModel,
    s: &mut Seq,
    end: usize,
) -> Result<(), ModelError> {
    if !model.options().prefix_caching {
        return Ok(());
    }
    let bs = model.options().block_size;
    publish_blocks(model, s, end / bs)?;
    if let (Some(interval), Some(slot)) = (model.ssm_snapshot_interval(), s.ssm_slot)
        && end > 0
        && end.is_multiple_of(interval)
        && end / bs <= s.block_hashes.len()
    {
        model.save_ssm_snapshot(s.block_hashes[end / bs - 1], slot)?;
    }
    Ok(())
}

/// After a decode step of `s` (its `computed` counts the rows just run): publish the blocks
/// those rows filled, if decode steps compute what prefill steps do. Any number of rows per
/// step (a verify step accepting several tokens): every block wholly within `computed` is
/// final.
pub(super) fn publish_decoded(model: &mut TransformerModel, s: &mut Seq) -> Result<(), ModelError> {
    let bs = model.options().block_size;
    let full = s.computed / bs.max(1);
    if !model.options().prefix_caching || full <= s.published || !model.decode_matches_prefill() {
        return Ok(());
    }
    s.hash_blocks(s.computed, bs);
    publish_blocks(model, s, full)
}

/// Publish `s`'s blocks from `s.published` up to `full` (at most the blocks it has keys for).
fn publish_blocks(
    model: &mut TransformerModel,
    s: &mut Seq,
    full: usize,
) -> Result<(), ModelError> {
    let full = full.min(s.block_hashes.len()).min(s.table.blocks().len());
    for i in s.published..full {
        let block = s.table.blocks()[i];
        // A duplicate of a block published meanwhile stays private; the chain goes on.
        model
            .kv_cache()
            .allocator
            .publish(block, s.block_hashes[i])?;
    }
    s.published = s.published.max(full);
    Ok(())
}
