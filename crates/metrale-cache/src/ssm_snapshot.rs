//! `SsmSnapshotPool`: copies of a sequence's SSM state (every GDN layer's conv window and
//! recurrent state) taken at a prefix position, keyed by the [`BlockHash`] of the prefix's last
//! block, so a prefix-cache hit on a hybrid model restores the recurrent state along with the
//! KV blocks.
//!
//! An entry has the layout of one `SsmStatePool` slot (`SsmLayout` with `slots` = entries), in
//! arrays of its own. `save` copies a held slot into an entry and `restore` copies an entry into
//! a held slot, as device-to-device copies queued on the caller's stream; the pool launches no
//! kernel.
//!
//! Invariants:
//! - A key names at most one entry, and an entry holds the state after exactly the tokens its
//!   key hashes (the caller saves a slot right after the step that computed the prefix).
//! - Entries have no holders: `restore` only queues a copy, and every copy that may later
//!   overwrite the entry goes on the same stream, after it. When every entry is taken, `save`
//!   reuses the least recently saved or restored one.
//! - Every address is fixed from `new` to drop.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use metrale_gpu_runtime::{DevicePtr, GpuBackend, StreamHandle};

use crate::error::CacheError;
use crate::lru::Lru;
use crate::prefix::BlockHash;
use crate::ssm_pool::{SsmLayerPools, SsmLayout, SsmStatePool};

/// See the module header.
#[derive(Debug)]
pub struct SsmSnapshotPool {
    gpu: Arc<dyn GpuBackend>,
    layout: SsmLayout,
    layers: Vec<SsmLayerPools>,
    allocations: Vec<DevicePtr>,
    free: BTreeSet<u32>,
    /// Entries in use, least recently saved or restored first.
    used: Lru,
    key_of: Vec<Option<BlockHash>>,
    index: HashMap<BlockHash, u32>,
}

impl SsmSnapshotPool {
    /// Allocate `layout.slots` entries of `layout`'s shape. Their contents are unspecified
    /// until saved.
    pub fn new(gpu: Arc<dyn GpuBackend>, layout: SsmLayout) -> Result<SsmSnapshotPool, CacheError> {
        let state = SsmStatePool::new(gpu.clone(), layout)?;
        // Reuse the state pool's checks and allocation; keep its arrays as ours.
        let (layers, allocations) = state.into_parts();
        Ok(SsmSnapshotPool {
            gpu,
            layout,
            layers,
            allocations,
            free: (0..layout.slots as u32).collect(),
            used: Lru::new(layout.slots),
            key_of: vec![None; layout.slots],
            index: HashMap::new(),
        })
    }

    /// Entries in the pool.
    pub fn capacity(&self) -> usize {
        self.layout.slots
    }

    /// Entries holding a snapshot.
    pub fn num_used(&self) -> usize {
        self.index.len()
    }

    /// Whether a snapshot is stored under `key`.
    pub fn contains(&self, key: &BlockHash) -> bool {
        self.index.contains_key(key)
    }

    /// Queue on `stream` a copy of `pool`'s held `slot` into an entry under `key`, evicting the
    /// least recently used entry when none is free. Returns false, copying nothing, when `key`
    /// is stored already (the state after the same tokens is the same; the entry is refreshed).
    pub fn save(
        &mut self,
        key: BlockHash,
        pool: &SsmStatePool,
        slot: u32,
        stream: StreamHandle,
    ) -> Result<bool, CacheError> {
        self.check_shape(pool, slot)?;
        if let Some(&e) = self.index.get(&key) {
            self.used.touch(e);
            return Ok(false);
        }
        let entry = match self.free.pop_first() {
            Some(e) => e,
            None => {
                let e = self.used.pop_oldest().ok_or(CacheError::OutOfSsmSlots {
                    total: self.layout.slots,
                })?;
                if let Some(old) = self.key_of[e as usize].take() {
                    self.index.remove(&old);
                }
                e
            }
        };
        let copied = self.copy(pool, slot, entry, true, stream);
        if let Err(e) = copied {
            self.free.insert(entry);
            return Err(e);
        }
        self.key_of[entry as usize] = Some(key);
        self.index.insert(key, entry);
        self.used.touch(entry);
        Ok(true)
    }

    /// Queue on `stream` a copy of the snapshot under `key` into `pool`'s held `slot`. Returns
    /// false, copying nothing, when no snapshot is stored under `key`.
    pub fn restore(
        &mut self,
        key: &BlockHash,
        pool: &SsmStatePool,
        slot: u32,
        stream: StreamHandle,
    ) -> Result<bool, CacheError> {
        self.check_shape(pool, slot)?;
        let Some(&entry) = self.index.get(key) else {
            return Ok(false);
        };
        self.copy(pool, slot, entry, false, stream)?;
        self.used.touch(entry);
        Ok(true)
    }

    /// Drop every snapshot.
    pub fn clear(&mut self) {
        while let Some(e) = self.used.pop_oldest() {
            self.key_of[e as usize] = None;
            self.free.insert(e);
        }
        self.index.clear();
    }

    /// Copy every layer's conv window and recurrent state between slot `slot` of `pool` and
    /// entry `entry`: into the entry when `save`, out of it otherwise.
    fn copy(
        &self,
        pool: &SsmStatePool,
        slot: u32,
        entry: u32,
        save: bool,
        stream: StreamHandle,
    ) -> Result<(), CacheError> {
        let (s, e) = (slot as usize, entry as usize);
        for (i, snap) in self.layers.iter().enumerate() {
            let live = pool.layer(i).ok_or_else(|| self.mismatch(pool))?;
            for (base_live, base_snap, bytes) in [
                (live.conv, snap.conv, snap.conv_slot_bytes),
                (live.recurrent, snap.recurrent, snap.recurrent_slot_bytes),
            ] {
                let (at_live, at_snap) = (base_live.offset(s * bytes), base_snap.offset(e * bytes));
                let (dst, src) = if save {
                    (at_snap, at_live)
                } else {
                    (at_live, at_snap)
                };
                self.gpu.copy_d2d(dst, src, bytes, stream)?;
            }
        }
        Ok(())
    }

    fn check_shape(&self, pool: &SsmStatePool, slot: u32) -> Result<(), CacheError> {
        let (a, b) = (pool.layout(), &self.layout);
        let same = a.num_gdn_layers == b.num_gdn_layers
            && a.conv_slot_bytes() == b.conv_slot_bytes()
            && a.recurrent_slot_bytes() == b.recurrent_slot_bytes();
        if !same {
            return Err(self.mismatch(pool));
        }
        if !pool.is_held(slot) {
            return Err(CacheError::SsmSlotNotHeld {
                slot,
                total: pool.num_slots(),
            });
        }
        Ok(())
    }

    fn mismatch(&self, pool: &SsmStatePool) -> CacheError {
        CacheError::Layout(format!(
            "SSM snapshots of {:?} do not fit the state pool {:?}",
            self.layout,
            pool.layout()
        ))
    }
}

impl Drop for SsmSnapshotPool {
    fn drop(&mut self) {
        for &p in &self.allocations {
            if let Err(e) = self.gpu.free(p) {
                tracing::warn!("SsmSnapshotPool: free failed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use metrale_gpu_runtime::{CpuBackend, GpuBackendExt};

    use super::*;

    fn layout(slots: usize) -> SsmLayout {
        SsmLayout {
            num_gdn_layers: 2,
            slots,
            conv_dim: 6,
            conv_kernel: 3,
            num_v_heads: 2,
            k_head_dim: 2,
            v_head_dim: 3,
        }
    }

    fn key(i: u32) -> BlockHash {
        BlockHash::chain(None, &[i])
    }

    /// Fill slot `slot` of every layer with values that name the layer, the array and `tag`.
    fn fill(cpu: &CpuBackend, pool: &SsmStatePool, slot: u32, tag: f32) {
        let l = *pool.layout();
        for i in 0..l.num_gdn_layers {
            let p = pool.layer(i).unwrap();
            for (base, n, bytes, what) in [
                (p.conv, l.conv_slot_elems(), p.conv_slot_bytes, 0.0),
                (
                    p.recurrent,
                    l.recurrent_slot_elems(),
                    p.recurrent_slot_bytes,
                    0.5,
                ),
            ] {
                let v: Vec<f32> = (0..n)
                    .map(|x| tag * 1000.0 + i as f32 * 100.0 + what + x as f32)
                    .collect();
                let at = base.offset(slot as usize * bytes);
                cpu.upload(at, &v, StreamHandle::DEFAULT).unwrap();
            }
        }
    }

    fn read(cpu: &CpuBackend, pool: &SsmStatePool, slot: u32) -> Vec<f32> {
        let l = *pool.layout();
        let mut out = Vec::new();
        for i in 0..l.num_gdn_layers {
            let p = pool.layer(i).unwrap();
            for (base, n, bytes) in [
                (p.conv, l.conv_slot_elems(), p.conv_slot_bytes),
                (
                    p.recurrent,
                    l.recurrent_slot_elems(),
                    p.recurrent_slot_bytes,
                ),
            ] {
                let at = base.offset(slot as usize * bytes);
                out.extend(cpu.download::<f32>(at, n, StreamHandle::DEFAULT).unwrap());
            }
        }
        out
    }

    #[test]
    fn a_restored_slot_holds_exactly_the_saved_state_of_every_layer() {
        let cpu = Arc::new(CpuBackend::default());
        let mut pool = SsmStatePool::new(cpu.clone(), layout(3)).unwrap();
        let mut snaps = SsmSnapshotPool::new(cpu.clone(), layout(2)).unwrap();
        let s = StreamHandle::DEFAULT;
        let (a, b) = (pool.alloc_slot().unwrap(), pool.alloc_slot().unwrap());
        fill(&cpu, &pool, a, 1.0);
        fill(&cpu, &pool, b, 2.0);
        let saved = read(&cpu, &pool, a);
        assert!(snaps.save(key(1), &pool, a, s).unwrap());
        assert!(
            !snaps.save(key(1), &pool, b, s).unwrap(),
            "a key is saved once"
        );
        fill(&cpu, &pool, a, 3.0);
        assert!(snaps.restore(&key(1), &pool, b, s).unwrap());
        assert_eq!(read(&cpu, &pool, b), saved);
        assert_ne!(read(&cpu, &pool, a), saved, "the source slot is untouched");
        assert!(!snaps.restore(&key(2), &pool, b, s).unwrap());
        assert!(matches!(
            snaps.restore(&key(1), &pool, 2, s),
            Err(CacheError::SsmSlotNotHeld { slot: 2, .. })
        ));
        assert_eq!(snaps.num_used(), 1);
    }

    #[test]
    fn the_least_recently_used_entry_is_reused_when_the_pool_is_full() {
        let cpu = Arc::new(CpuBackend::default());
        let mut pool = SsmStatePool::new(cpu.clone(), layout(1)).unwrap();
        let mut snaps = SsmSnapshotPool::new(cpu.clone(), layout(2)).unwrap();
        let s = StreamHandle::DEFAULT;
        let slot = pool.alloc_slot().unwrap();
        for k in 1..=2 {
            fill(&cpu, &pool, slot, k as f32);
            snaps.save(key(k), &pool, slot, s).unwrap();
        }
        // Restoring key 1 makes key 2 the least recently used.
        assert!(snaps.restore(&key(1), &pool, slot, s).unwrap());
        fill(&cpu, &pool, slot, 3.0);
        let three = read(&cpu, &pool, slot);
        assert!(snaps.save(key(3), &pool, slot, s).unwrap());
        assert!(snaps.contains(&key(1)) && snaps.contains(&key(3)) && !snaps.contains(&key(2)));
        fill(&cpu, &pool, slot, 9.0);
        snaps.restore(&key(3), &pool, slot, s).unwrap();
        assert_eq!(read(&cpu, &pool, slot), three);
        snaps.clear();
        assert_eq!((snaps.num_used(), snaps.capacity()), (0, 2));
        assert!(!snaps.contains(&key(1)));
    }

    #[test]
    fn a_pool_of_another_shape_is_refused() {
        let cpu = Arc::new(CpuBackend::default());
        let mut pool = SsmStatePool::new(
            cpu.clone(),
            SsmLayout {
                v_head_dim: 4,
                ..layout(1)
            },
        )
        .unwrap();
        let mut snaps = SsmSnapshotPool::new(cpu, layout(1)).unwrap();
        let slot = pool.alloc_slot().unwrap();
        assert!(matches!(
            snaps.save(key(1), &pool, slot, StreamHandle::DEFAULT),
            Err(CacheError::Layout(_))
        ));
    }
}
