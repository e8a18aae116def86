//! `CacheManager`: every piece of per-sequence cache state a model's steps read and write, under
//! one owner — the paged KV cache and its block allocator with the prefix index, the SSM state
//! pool of hybrid models, and the SSM snapshots kept for prefix hits. The scheduler owns it and
//! is the only code that hands out or takes back blocks and slots; a step only reads the fixed
//! addresses of the pools (`kv_layer`, `ssm_layer`) and the slots its sequences hold.
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
}

impl CacheManager {
    /// Allocate every pool of `layout` on `gpu`; snapshot and zeroing copies go on `stream`.
    pub fn new(
        gpu: Arc<dyn GpuBackend>,
        layout: CacheLayout,
        stream: StreamHandle,
    ) -> Result<CacheManager, CacheError> {
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
        Ok(CacheManager {
            gpu,
            stream,
            kv,
            ssm,
            snapshots,
        })
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
            Ok(true) => Ok(Some(slot)),
            other => {
                pool.free_slot(slot)?;
                other?;
                Err(CacheError::NoSnapshot)
            }
        }
    }

    /// Return a sequence's SSM slot.
    pub fn free_ssm_slot(&mut self, slot: u32) -> Result<(), CacheError> {
        match self.ssm.as_mut() {
            Some(pool) => pool.free_slot(slot),
            None => Ok(()),
        }
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
        match (&mut self.snapshots, &self.ssm) {
            (Some(snaps), Some(pool)) => snaps.save(key, pool, slot, self.stream),
            _ => Ok(false),
        }
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
            let l = *self.kv.layout();
            let bytes = l.block_bytes();
            let from = blocks[shared] as usize * bytes;
            for i in 0..l.num_layers {
                let p = self.kv.layer(i);
                for pool in [p.k, p.v] {
                    let (dst, src) = (pool.offset(new as usize * bytes), pool.offset(from));
                    self.gpu.copy_d2d(dst, src, bytes, self.stream)?;
                }
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
        for l in (0..).map_while(|i| pool.layer(i)) {
            for (base, bytes) in [
                (l.conv, l.conv_slot_bytes),
                (l.recurrent, l.recurrent_slot_bytes),
            ] {
                let (to, from) = (
                    base.offset(dst as usize * bytes),
                    base.offset(src as usize * bytes),
                );
                if let Err(e) = self.gpu.copy_d2d(to, from, bytes, self.stream) {
                    pool.free_slot(dst)?;
                    return Err(e.into());
                }
            }
        }
        Ok(Some(dst))
    }

    /// Drop every cached prefix nobody holds: evictable KV blocks become free and every SSM
    /// snapshot is dropped. Returns the KV blocks evicted.
    pub fn clear_prefix_cache(&mut self) -> usize {
        if let Some(p) = self.snapshots.as_mut() {
            p.clear();
        }
        self.kv.allocator.evict_all()
    }
}

#[cfg(test)]
mod tests {
    use metrale_gpu_runtime::CpuBackend;

    use super::*;
    use crate::kv_cache::KvDtype;

    #[test]
    fn a_fork_shares_full_blocks_and_copies_the_partial_one_and_the_ssm_state() {
        // FP8 pools are half the bytes a block: the copy moves that block's bytes.
        for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
            fork_copies(dtype);
        }
    }

    fn fork_copies(dtype: KvDtype) {
        let cpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let kv = KvCacheLayout {
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 4,
            block_size: 4,
            num_blocks: 8,
            dtype,
        };
        let ssm = SsmLayout {
            num_gdn_layers: 1,
            slots: 3,
            conv_dim: 4,
            conv_kernel: 2,
            num_v_heads: 1,
            k_head_dim: 2,
            v_head_dim: 2,
        };
        let layout = CacheLayout {
            kv,
            ssm: Some(ssm),
            snapshot_slots: 0,
        };
        let s = StreamHandle::DEFAULT;
        let mut c = CacheManager::new(cpu.clone(), layout, s).unwrap();
        // A sequence of 10 tokens: blocks of 4, 4 and 2 tokens; its pools and slot filled.
        let mut table = BlockTable::new();
        c.ensure(&mut table, 10).unwrap();
        let pool_elems = kv.pool_bytes() / 2;
        assert_eq!(kv.pool_bytes(), 8 * 4 * 4 * dtype.bytes());
        for i in 0..2 {
            let p = c.kv_layer(i);
            let k: Vec<u16> = (0..pool_elems).map(|x| (x * 7 + i) as u16).collect();
            let v: Vec<u16> = (0..pool_elems).map(|x| (x * 5 + 3 * i) as u16).collect();
            cpu.upload(p.k, &k, s).unwrap();
            cpu.upload(p.v, &v, s).unwrap();
        }
        let slot = c.alloc_ssm_slot(None).unwrap().unwrap();
        let l = c.ssm_layer(0).unwrap();
        let state: Vec<f32> = (0..l.recurrent_slot_bytes / 4)
            .map(|x| x as f32 + 0.5)
            .collect();
        cpu.upload(
            l.recurrent.offset(slot as usize * l.recurrent_slot_bytes),
            &state,
            s,
        )
        .unwrap();
        let free = c.blocks().num_free();
        let (child, child_slot) = c.fork(&table, 10, Some(slot)).unwrap();
        let (b, cb) = (table.blocks(), child.blocks());
        assert_eq!(&cb[..2], &b[..2], "full blocks shared");
        assert_ne!(cb[2], b[2], "the partial block is the child's own");
        assert_eq!(
            (c.blocks().refcount(b[0]), c.blocks().refcount(b[2])),
            (2, 1)
        );
        assert_eq!(c.blocks().num_free(), free - 1);
        let block_bytes = 4 * 4 * dtype.bytes();
        for i in 0..2 {
            let p = c.kv_layer(i);
            for pool in [p.k, p.v] {
                let read = |blk: u32| -> Vec<u8> {
                    cpu.download(pool.offset(blk as usize * block_bytes), block_bytes, s)
                        .unwrap()
                };
                assert_eq!(
                    read(cb[2]),
                    read(b[2]),
                    "layer {i}: the partial block copied"
                );
                assert_ne!(read(cb[2]), read(b[1]));
            }
        }
        let child_slot = child_slot.unwrap();
        assert_ne!(child_slot, slot);
        assert_eq!(
            c.ssm_slot_bytes(child_slot).unwrap(),
            c.ssm_slot_bytes(slot).unwrap()
        );
        // Both release independently; everything comes back.
        let mut child = child;
        c.release(&mut child).unwrap();
        c.free_ssm_slot(child_slot).unwrap();
        assert_eq!(c.blocks().refcount(b[0]), 1);
        c.release(&mut table).unwrap();
        c.free_ssm_slot(slot).unwrap();
        assert_eq!(c.blocks().num_free(), free + 3);
        // A fork past the table is refused and holds nothing.
        let mut short = BlockTable::new();
        c.ensure(&mut short, 4).unwrap();
        assert!(c.fork(&short, 6, None).is_err());
        assert_eq!(c.blocks().refcount(short.blocks()[0]), 1);
    }
}
