//! Prefix caching in the scheduler: at admission, the longest prefix of a prompt the cache can
//! serve (`lookup`) and taking it (`acquire`); after each prefill chunk, publishing the prompt
//! blocks the chunk completed and, on a hybrid model at a snapshot position, keeping the SSM
//! state (`publish`).
//!
//! Policy:
//! - Only full blocks of the prompt are published, once the step that wrote their last token
//!   has run. Blocks holding generated tokens are not: their KV came from decode steps, and a
//!   cold run computes those positions in a prefill, which the engine does not promise to be
//!   bitwise the same on every backend.
//! - A hit leaves at least the prompt's last token to compute (its logits choose the first
//!   token), so it covers at most `(prompt_len - 1) / block_size` blocks.
//! - On a hybrid model a hit must end where an SSM snapshot of that prefix is kept: at a
//!   multiple of the snapshot interval, the longest such cached prefix.
//! - A shared block is never written: the sharer computes from the end of the hit, past every
//!   shared block.

use metrale_cache::block_hashes;

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
    if s.block_hashes.is_empty() {
        s.block_hashes = block_hashes(&s.tokens[..s.prompt_len], bs);
    }
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
    let full = (end / bs).min(s.block_hashes.len());
    for i in s.published..full {
        let block = s.table.blocks()[i];
        // A duplicate of a block published meanwhile stays private; the chain goes on.
        model
            .kv_cache()
            .allocator
            .publish(block, s.block_hashes[i])?;
    }
    s.published = s.published.max(full);
    if let (Some(interval), Some(slot)) = (model.ssm_snapshot_interval(), s.ssm_slot)
        && end > 0
        && end.is_multiple_of(interval)
        && end / bs <= s.block_hashes.len()
    {
        model.save_ssm_snapshot(s.block_hashes[end / bs - 1], slot)?;
    }
    Ok(())
}
