//! `CacheManager`: every piece of per-sequence cache state a model's steps read and write, under
//! one owner — the paged KV cache and its block allocator with the prefix index, the SSM state
//! pool of hybrid models, and the SSM snapshots kept for prefix hits. The scheduler owns it and
//! is the only code that hands out or takes back blocks and slots; a step only reads the fixed
//! addresses of the pools (`kv_layer`, `ssm_layer`) and the slots its sequences hold.
//!
//! A tensor-parallel model (`new_ranks`) keeps one set of bookkeeping (rank 0's block
//! allocator, prefix index, slot and snapshot choices) and one set of pools per rank, each on
//! that rank's backend and holding that rank's heads: block ids, SSM slots and snapshot entries
//! are the same on every rank, and every copy the cache queues (zeroing a slot, saving or
//! restoring a snapshot, a fork) is queued on every rank.
//!
//! Invariants:
//! - Every pool address is fixed from `new` to drop, so graphs and compiled programs that read
//!   them stay valid whichever blocks and slots the sequences hold.
//! - A slot handed out by `alloc_ssm_slot` holds either zeros or the snapshot it was restored
//!   from, queued on the cache's stream before the sequence's first step.
//! - Snapshot copies go on the cache's stream (the model's), between the steps that produce and
//!   consume them.

use std::sync::Arc;

use metrale_gpu_runtime::{GpuBackend, GpuBackendExt, StreamHandle};

use crate::allocator::BlockAllocator;
use crate::block_table::BlockTable;
use crate::error::CacheError;
use crate::kv_cache::{KvCacheLayout, KvLayerPools, PagedKvCache};
use crate::prefix::BlockHash;
use crate::ssm_pool::{SsmLayerPools, SsmLayout, SsmStatePool};
use crate::ssm_snapshot::SsmSnapshotPool;

/// What a [`CacheManager`] allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLayout {
    /// The KV pools (the model's attention layers, then any draft head's).
    pub kv: KvCacheLayout,
    /// The SSM state pool of a model with GDN layers (`slots`: what the running sequences hold
    /// at most).
    pub ssm: Option<SsmLayout>,
    /// SSM snapshot entries for prefix hits on a hybrid model (0: none).
    pub snapshot_slots: usize,
}

/// SSM snapshots in use and in the pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotUsage {
    /// Entries holding a snapshot.
    pub used: usize,
    /// Entries in the pool.
    pub total: usize,
}

/// See the module header.
#[derive(Debug)]
pub struct CacheManager {
    gpu: Arc<dyn GpuBackend>,
    stream: StreamHandle,
    kv: PagedKvCache,
    ssm: Option<SsmStatePool>,
    snapshots: Option<SsmSnapshotPool>,
    /// Tensor-parallel ranks `1..N`: their pools, whose slot and snapshot bookkeeping follows
    /// rank 0's call for call (their block allocators are unused).
    peers: Vec<RankPools>,
}

/// One tensor-parallel rank's pools.
#[derive(Debug)]
struct RankPools {
    gpu: Arc<dyn GpuBackend>,
    stream: StreamHandle,
    kv: PagedKvCache,
    ssm: Option<SsmStatePool>,
    snapshots: Option<SsmSnapshotPool>,
}

impl RankPools {
    fn new(
        gpu: Arc<dyn GpuBackend>,
        layout: CacheLayout,
        stream: StreamHandle,
    ) -> Result<RankPools, CacheError> {
        let kv = PagedKvCache::new(gpu.clone(), layout.kv)?;
        let ssm = layout
            .ssm
            .map(|l| SsmStatePool::new(gpu.clone(), l))
            .transpose()?;
        let snapshots = match layout.ssm {
            Some(l) if layout.snapshot_slots > 0 => Some(SsmSnapshotPool::new(
                gpu.clone(),
                SsmLayout {
                    slots: layout.snapshot_slots,
                    ..l
                },
            )?),
            _ => None,
        };
        Ok(RankPools {
            gpu,
            stream,
            kv,
            ssm,
            snapshots,
        })
    }
}

/// Copy KV block `from` into block `to` in every layer of `kv`.
fn copy_kv_block(
    gpu: &dyn GpuBackend,
    kv: &PagedKvCache,
    (to, from): (u32, u32),
    stream: StreamHandle,
) -> Result<(), CacheError> {
    let l = *kv.layout();
    let bytes = l.block_bytes();
    for i in 0..l.num_layers {
        let p = kv.layer(i);
        for pool in [p.k, p.v] {
            let (dst, src) = (
                pool.offset(to as usize * bytes),
                pool.offset(from as usize * bytes),
            );
            gpu.copy_d2d(dst, src, bytes, stream)?;
        }
    }
    Ok(())
}

/// Copy SSM slot `src` into slot `dst` in every layer of `pool`.
fn copy_ssm_slot(
    gpu: &dyn GpuBackend,
    pool: &SsmStatePool,
    (dst, src): (u32, u32),
    stream: StreamHandle,
) -> Result<(), CacheError> {
    for l in (0..).map_while(|i| pool.layer(i)) {
        for (base, bytes) in [
            (l.conv, l.conv_slot_bytes),
            (l.recurrent, l.recurrent_slot_bytes),
        ] {
            let (to, from) = (
                base.offset(dst as usize * bytes),
                base.offset(src as usize * bytes),
            );
            gpu.copy_d2d(to, from, bytes, stream)?;
        }
    }
    Ok(())
}

fn diverged(rank: usize, problem: String) -> CacheError {
    CacheError::RankDiverged { rank, problem }
}

impl CacheManager {
    /// Allocate every pool of `layout` on `gpu`; snapshot and zeroing copies go on `stream`.
    pub fn new(
        gpu: Arc<dyn GpuBackend>,
        layout: CacheLayout,
        stream: StreamHandle,
    ) -> Result<CacheManager, CacheError> {
        let RankPools {
            gpu,
            stream,
            kv,
            ssm,
            snapshots,
        } = RankPools::new(gpu, layout, stream)?;
        Ok(CacheManager {
            gpu,
            stream,
            kv,
            ssm,
            snapshots,
            peers: Vec::new(),
        })
    }

    /// The caches of a tensor-parallel model: `layout` (one rank's heads) allocated on every
    /// rank's backend, `ranks[r]` for rank `r`, its copies queued on that rank's stream; the
    /// bookkeeping is rank 0's (see the module header).
    pub fn new_ranks(
        ranks: &[(Arc<dyn GpuBackend>, StreamHandle)],
        layout: CacheLayout,
    ) -> Result<CacheManager, CacheError> {
        let Some(((gpu, stream), rest)) = ranks.split_first() else {
            return Err(CacheError::Layout("a cache of no ranks".into()));
        };
        let mut cache = CacheManager::new(gpu.clone(), layout, *stream)?;
        for (gpu, stream) in rest {
            cache
                .peers
                .push(RankPools::new(gpu.clone(), layout, *stream)?);
        }
        Ok(cache)
    }

    /// Tensor-parallel ranks whose pools this cache holds (1: a model that is not sharded).
    pub fn num_ranks(&self) -> usize {
        1 + self.peers.len()
    }

    /// Rank `rank`'s pools of KV layer `i` (rank 0: [`CacheManager::kv_layer`]); `None` past
    /// the ranks.
    pub fn rank_kv_layer(&self, rank: usize, i: usize) -> Option<KvLayerPools> {
        match rank {
            0 => Some(self.kv.layer(i)),
            r => self.peers.get(r - 1).map(|p| p.kv.layer(i)),
        }
    }

    /// Rank `rank`'s SSM pool arrays of GDN layer `i` (rank 0: [`CacheManager::ssm_layer`]).
    pub fn rank_ssm_layer(&self, rank: usize, i: usize) -> Option<SsmLayerPools> {
        match rank {
            0 => self.ssm_layer(i),
            r => self.peers.get(r - 1)?.ssm.as_ref()?.layer(i),
        }
    }

    /// The KV cache's shape.
    pub fn kv_layout(&self) -> &KvCacheLayout {
        self.kv.layout()
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.kv.block_size()
    }

    /// The pools of KV layer `i` (the model's attention layers in order, then a draft head's).
    pub fn kv_layer(&self, i: usize) -> KvLayerPools {
        self.kv.layer(i)
    }

    /// The block allocator and its prefix index, to read.
    pub fn blocks(&self) -> &BlockAllocator {
        &self.kv.allocator
    }

    /// Grow `table` so `tokens` tokens fit; on failure nothing is allocated.
    pub fn ensure(&mut self, table: &mut BlockTable, tokens: usize) -> Result<(), CacheError> {
        table.ensure(tokens, self.kv.block_size(), &mut self.kv.allocator)
    }

    /// Release the blocks of `table` wholly past its first `tokens` tokens.
    pub fn truncate(&mut self, table: &mut BlockTable, tokens: usize) -> Result<(), CacheError> {
        table.truncate(tokens, self.kv.block_size(), &mut self.kv.allocator)
    }

    /// Release every block of `table` (see [`BlockTable::release_all`]).
    pub fn release(&mut self, table: &mut BlockTable) -> Result<(), CacheError> {
        table.release_all(&mut self.kv.allocator)
    }

    /// Append to `table` the cached block published under `hash`, taking a reference on it;
    /// `None` (and nothing taken) when no block is published under it.
    pub fn acquire_cached(&mut self, table: &mut BlockTable, hash: &BlockHash) -> Option<u32> {
        let block = self.kv.allocator.acquire(hash)?;
        table.push(block);
        Some(block)
    }

    /// Publish `block` under `hash` in the prefix index (see [`BlockAllocator::publish`]).
    pub fn publish(&mut self, block: u32, hash: BlockHash) -> Result<bool, CacheError> {
        self.kv.allocator.publish(block, hash)
    }

    /// The SSM state pool's per-layer arrays and sizes, `None` for a model without GDN layers.
    pub fn ssm_layer(&self, i: usize) -> Option<SsmLayerPools> {
        self.ssm.as_ref()?.layer(i)
    }

    /// SSM state slots in the pool and free now (`None` for a model without GDN layers).
    pub fn ssm_slots(&self) -> Option<(usize, usize)> {
        self.ssm.as_ref().map(|p| (p.num_slots(), p.num_free()))
    }

    /// Whether `slot` is held by a sequence (false for a model without GDN layers).
    pub fn ssm_slot_held(&self, slot: u32) -> bool {
        self.ssm.as_ref().is_some_and(|p| p.is_held(slot))
    }

    /// A slot for a new sequence: holding the snapshot kept under `snapshot` when given (a
    /// prefix hit), zeroed otherwise. `None` for a model without GDN layers.
    pub fn alloc_ssm_slot(
        &mut self,
        snapshot: Option<&BlockHash>,
    ) -> Result<Option<u32>, CacheError> {
        let Some(pool) = self.ssm.as_mut() else {
            return Ok(None);
        };
        let slot = pool.alloc_slot()?;
        let filled = match (snapshot, self.snapshots.as_mut()) {
            (None, _) => pool.zero_slot(slot, self.stream).map(|()| true),
            (Some(key), Some(snaps)) => snaps.restore(key, pool, slot, self.stream),
            (Some(_), None) => Ok(false),
        };
        match filled {
            Ok(true) => {}
            other => {
                pool.free_slot(slot)?;
                other?;
                return Err(CacheError::NoSnapshot);
            }
        }
        for (r, peer) in self.peers.iter_mut().enumerate() {
            let Some(pool) = peer.ssm.as_mut() else {
                continue;
            };
            let got = pool.alloc_slot()?;
            if got != slot {
                return Err(diverged(
                    r + 1,
                    format!("SSM slot {got}, rank 0 took {slot}"),
                ));
            }
            let filled = match (snapshot, peer.snapshots.as_mut()) {
                (Some(key), Some(snaps)) => snaps.restore(key, pool, slot, peer.stream)?,
                _ => pool.zero_slot(slot, peer.stream).map(|()| true)?,
            };
            if !filled {
                return Err(diverged(r + 1, "no snapshot where rank 0 has one".into()));
            }
        }
        Ok(Some(slot))
    }

    /// Return a sequence's SSM slot.
    pub fn free_ssm_slot(&mut self, slot: u32) -> Result<(), CacheError> {
        if let Some(pool) = self.ssm.as_mut() {
            pool.free_slot(slot)?;
        }
        for peer in &mut self.peers {
            if let Some(pool) = peer.ssm.as_mut() {
                pool.free_slot(slot)?;
            }
        }
        Ok(())
    }

    /// The bytes of SSM slot `slot`: each GDN layer's conv window, then its recurrent state, in
    /// layer order (empty for a model without GDN layers). For checks: a rollback must leave
    /// exactly the bytes of a run that never saw the rejected tokens.
    pub fn ssm_slot_bytes(&self, slot: u32) -> Result<Vec<u8>, CacheError> {
        let Some(pool) = &self.ssm else {
            return Ok(Vec::new());
        };
        if slot as usize >= pool.num_slots() {
            return Err(CacheError::SsmSlotNotHeld {
                slot,
                total: pool.num_slots(),
            });
        }
        let s = slot as usize;
        let mut out = Vec::new();
        for l in (0..).map_while(|i| pool.layer(i)) {
            for (base, bytes) in [
                (l.conv, l.conv_slot_bytes),
                (l.recurrent, l.recurrent_slot_bytes),
            ] {
                let part: Vec<u8> =
                    self.gpu
                        .download(base.offset(s * bytes), bytes, self.stream)?;
                out.extend(part);
            }
        }
        Ok(out)
    }

    /// Whether prefixes of a hybrid model can hit: it keeps SSM state and snapshots of it.
    pub fn keeps_snapshots(&self) -> bool {
        self.snapshots.is_some()
    }

    /// Whether a snapshot of the state after the prefix whose last block is `key` is kept.
    pub fn has_snapshot(&self, key: &BlockHash) -> bool {
        self.snapshots.as_ref().is_some_and(|p| p.contains(key))
    }

    /// Keep a copy of held slot `slot`'s state as the state after the prefix whose last block
    /// is `key`. Returns whether a copy was made (not when one is kept already, or no
    /// snapshots are kept).
    pub fn save_snapshot(&mut self, key: BlockHash, slot: u32) -> Result<bool, CacheError> {
        let saved = match (&mut self.snapshots, &self.ssm) {
            (Some(snaps), Some(pool)) => snaps.save(key, pool, slot, self.stream)?,
            _ => false,
        };
        for (r, peer) in self.peers.iter_mut().enumerate() {
            if let (Some(snaps), Some(pool)) = (&mut peer.snapshots, &peer.ssm)
                && snaps.save(key, pool, slot, peer.stream)? != saved
            {
                return Err(diverged(r + 1, "a snapshot saved on one rank only".into()));
            }
        }
        Ok(saved)
    }

    /// SSM snapshots kept now, and the entries there are.
    pub fn snapshot_usage(&self) -> SnapshotUsage {
        self.snapshots
            .as_ref()
            .map_or(SnapshotUsage::default(), |p| SnapshotUsage {
                used: p.num_used(),
                total: p.capacity(),
            })
    }

    /// A copy of a sequence's cache after its first `tokens` tokens, for another sequence that
    /// continues from the same context (the choices of one prompt): the full blocks of `src`
    /// shared by reference, the block holding its last tokens, when partial, copied into a fresh
    /// block (each sequence writes its own next tokens there), and, on a hybrid model, the
    /// state of SSM slot `src_slot` copied into a fresh slot. Copies go on the cache's stream.
    /// On failure nothing is held.
    pub fn fork(
        &mut self,
        src: &BlockTable,
        tokens: usize,
        src_slot: Option<u32>,
    ) -> Result<(BlockTable, Option<u32>), CacheError> {
        let bs = self.kv.block_size();
        let blocks = src.blocks();
        let (full, partial) = (tokens / bs, !tokens.is_multiple_of(bs));
        if blocks.len() < full + usize::from(partial) {
            return Err(CacheError::Layout(format!(
                "fork of {tokens} tokens from a table of {} blocks",
                blocks.len()
            )));
        }
        let mut table = BlockTable::new();
        let forked = self.fork_blocks(&mut table, &blocks[..full + usize::from(partial)], partial);
        let slot = forked.and_then(|()| self.fork_slot(src_slot));
        match slot {
            Ok(slot) => Ok((table, slot)),
            Err(e) => {
                self.release(&mut table)?;
                Err(e)
            }
        }
    }

    /// Share `blocks` into `table`, the last one copied when `copy_last`.
    fn fork_blocks(
        &mut self,
        table: &mut BlockTable,
        blocks: &[u32],
        copy_last: bool,
    ) -> Result<(), CacheError> {
        let shared = blocks.len() - usize::from(copy_last);
        for &b in &blocks[..shared] {
            self.kv.allocator.retain(b)?;
            table.push(b);
        }
        if copy_last {
            let new = self.kv.allocator.alloc()?;
            table.push(new);
            let blocks = (new, blocks[shared]);
            copy_kv_block(self.gpu.as_ref(), &self.kv, blocks, self.stream)?;
            for peer in &self.peers {
                copy_kv_block(peer.gpu.as_ref(), &peer.kv, blocks, peer.stream)?;
            }
        }
        Ok(())
    }

    /// A fresh SSM slot holding `src`'s state (`None` without one).
    fn fork_slot(&mut self, src: Option<u32>) -> Result<Option<u32>, CacheError> {
        let (Some(src), Some(pool)) = (src, self.ssm.as_mut()) else {
            return Ok(None);
        };
        if !pool.is_held(src) {
            return Err(CacheError::SsmSlotNotHeld {
                slot: src,
                total: pool.num_slots(),
            });
        }
        let dst = pool.alloc_slot()?;
        if let Err(e) = copy_ssm_slot(self.gpu.as_ref(), pool, (dst, src), self.stream) {
            pool.free_slot(dst)?;
            return Err(e);
        }
        for (r, peer) in self.peers.iter_mut().enumerate() {
            let Some(pool) = peer.ssm.as_mut() else {
                continue;
            };
            let got = pool.alloc_slot()?;
            if got != dst {
                return Err(diverged(
                    r + 1,
                    format!("SSM slot {got}, rank 0 took {dst}"),
                ));
            }
            copy_ssm_slot(peer.gpu.as_ref(), pool, (dst, src), peer.stream)?;
        }
        Ok(Some(dst))
    }

    /// Drop every cached prefix nobody holds: evictable KV blocks become free and every SSM
    /// snapshot is dropped. Returns the KV blocks evicted.
    pub fn clear_prefix_cache(&mut self) -> usize {
        if let Some(p) = self.snapshots.as_mut() {
            p.clear();
        }
        for p in self.peers.iter_mut().filter_map(|p| p.snapshots.as_mut()) {
            p.clear();
        }
        self.kv.allocator.evict_all()
    }
}

#[cfg(test)]
mod tests;
