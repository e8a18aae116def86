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

    /// Drop every cached prefix nobody holds: evictable KV blocks become free and every SSM
    /// snapshot is dropped. Returns the KV blocks evicted.
    pub fn clear_prefix_cache(&mut self) -> usize {
        if let Some(p) = self.snapshots.as_mut() {
            p.clear();
        }
        self.kv.allocator.evict_all()
    }
}
