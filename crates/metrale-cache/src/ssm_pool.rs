//! `SsmStatePool`: the state every Gated DeltaNet layer keeps per live sequence: its conv window
//! and its recurrent state, in slots at fixed addresses, and the bookkeeping of which slot each
//! sequence holds.
//!
//! Layout, f32, one allocation per array, two arrays per GDN layer:
//! - conv state `[slots, K - 1, conv_dim]`: a slot's last `K - 1` conv inputs, oldest first;
//! - recurrent state `[slots, Hv, Dk, Dv]`.
//!
//! Slot `s` of layer `i` starts at `layer(i).conv + s * conv_slot_bytes` and
//! `layer(i).recurrent + s * recurrent_slot_bytes`; the GDN kernels take those strides (in f32
//! elements) as their `slot_stride`.
//!
//! Invariants:
//! - Every address is fixed from `new` to drop, so a captured graph that reads a layer's pools
//!   stays valid whichever slots its sequences hold.
//! - A slot is free or held by exactly one sequence; free slots are handed out lowest first, so
//!   the assignment is deterministic.
//! - `alloc_slot` does not clear the slot: the caller zeroes it (`zero_slot`, on the stream of
//!   the sequence's first step) before a new sequence's first step reads it.
//! - The pool launches no kernel; zeroing is a memset.

use std::collections::BTreeSet;
use std::sync::Arc;

use metrale_gpu_runtime::{DevicePtr, GpuBackend, StreamHandle};

use crate::error::CacheError;

/// The shape of an SSM state pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsmLayout {
    /// GDN (linear-attention) layers; attention layers keep no SSM state.
    pub num_gdn_layers: usize,
    /// Slots: the most sequences that hold state at once (entries, for a snapshot pool).
    pub slots: usize,
    /// Conv channels, `2 * Hk * Dk + Hv * Dv`.
    pub conv_dim: usize,
    /// Conv taps `K` (`linear_conv_kernel_dim`); the window keeps `K - 1` inputs.
    pub conv_kernel: usize,
    /// Value heads `Hv`.
    pub num_v_heads: usize,
    /// Key head dimension `Dk`.
    pub k_head_dim: usize,
    /// Value head dimension `Dv`.
    pub v_head_dim: usize,
}

impl SsmLayout {
    /// f32 elements of one slot's conv window.
    pub fn conv_slot_elems(&self) -> usize {
        self.conv_kernel
            .saturating_sub(1)
            .saturating_mul(self.conv_dim)
    }

    /// f32 elements of one slot's recurrent state.
    pub fn recurrent_slot_elems(&self) -> usize {
        self.num_v_heads
            .saturating_mul(self.k_head_dim)
            .saturating_mul(self.v_head_dim)
    }

    /// Bytes from one slot's conv window to the next.
    pub fn conv_slot_bytes(&self) -> usize {
        self.conv_slot_elems().saturating_mul(4)
    }

    /// Bytes from one slot's recurrent state to the next.
    pub fn recurrent_slot_bytes(&self) -> usize {
        self.recurrent_slot_elems().saturating_mul(4)
    }

    /// Bytes of the whole pool, or `None` when the size overflows.
    pub fn total_bytes(&self) -> Option<usize> {
        let conv = self
            .conv_kernel
            .checked_sub(1)?
            .checked_mul(self.conv_dim)?;
        let rec = self
            .num_v_heads
            .checked_mul(self.k_head_dim)?
            .checked_mul(self.v_head_dim)?;
        let per_slot = conv.checked_add(rec)?.checked_mul(4)?;
        per_slot
            .checked_mul(self.slots)?
            .checked_mul(self.num_gdn_layers)
    }

    fn check(&self) -> Result<(), CacheError> {
        let bad = |what: &str| {
            Err(CacheError::Layout(format!(
                "SSM pool: {what} (layout {self:?})"
            )))
        };
        if self.slots == 0 || self.slots > u32::MAX as usize {
            return bad("slots must be in 1..=u32::MAX");
        }
        if self.conv_kernel < 2 || self.conv_dim == 0 {
            return bad("conv_kernel must be at least 2 and conv_dim positive");
        }
        if self.recurrent_slot_elems() == 0 {
            return bad("num_v_heads, k_head_dim and v_head_dim must be positive");
        }
        if self.total_bytes().is_none() {
            return bad("the pool size overflows");
        }
        Ok(())
    }
}

/// One GDN layer's pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsmLayerPools {
    /// Conv windows, f32 `[slots, K - 1, conv_dim]`.
    pub conv: DevicePtr,
    /// Recurrent states, f32 `[slots, Hv, Dk, Dv]`.
    pub recurrent: DevicePtr,
    /// Bytes from one slot's conv window to the next.
    pub conv_slot_bytes: usize,
    /// Bytes from one slot's recurrent state to the next.
    pub recurrent_slot_bytes: usize,
}

/// See the module header.
#[derive(Debug)]
pub struct SsmStatePool {
    gpu: Arc<dyn GpuBackend>,
    layout: SsmLayout,
    layers: Vec<SsmLayerPools>,
    allocations: Vec<DevicePtr>,
    free: BTreeSet<u32>,
}

impl SsmStatePool {
    /// Allocate every layer's pools. Their contents are unspecified until `zero_slot`.
    pub fn new(gpu: Arc<dyn GpuBackend>, layout: SsmLayout) -> Result<SsmStatePool, CacheError> {
        layout.check()?;
        let mut pool = SsmStatePool {
            gpu: gpu.clone(),
            layout,
            layers: Vec::with_capacity(layout.num_gdn_layers),
            allocations: Vec::with_capacity(2 * layout.num_gdn_layers),
            free: (0..layout.slots as u32).collect(),
        };
        let (conv_bytes, rec_bytes) = (layout.conv_slot_bytes(), layout.recurrent_slot_bytes());
        for _ in 0..layout.num_gdn_layers {
            // `total_bytes` was checked, so neither product overflows.
            let conv = gpu.alloc(conv_bytes * layout.slots)?;
            pool.allocations.push(conv);
            let recurrent = gpu.alloc(rec_bytes * layout.slots)?;
            pool.allocations.push(recurrent);
            pool.layers.push(SsmLayerPools {
                conv,
                recurrent,
                conv_slot_bytes: conv_bytes,
                recurrent_slot_bytes: rec_bytes,
            });
        }
        Ok(pool)
    }

    /// The layout.
    pub fn layout(&self) -> &SsmLayout {
        &self.layout
    }

    /// Slots in the pool.
    pub fn num_slots(&self) -> usize {
        self.layout.slots
    }

    /// Free slots now.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// The pools of GDN layer `i` (counting GDN layers only); `None` past the last.
    pub fn layer(&self, i: usize) -> Option<SsmLayerPools> {
        self.layers.get(i).copied()
    }

    /// Take the lowest free slot. Its state is left as it was: zero it before use.
    pub fn alloc_slot(&mut self) -> Result<u32, CacheError> {
        self.free.pop_first().ok_or(CacheError::OutOfSsmSlots {
            total: self.layout.slots,
        })
    }

    /// Give a held slot back.
    pub fn free_slot(&mut self, slot: u32) -> Result<(), CacheError> {
        self.check_held(slot)?;
        self.free.insert(slot);
        Ok(())
    }

    /// Whether `slot` is held by a sequence.
    pub fn is_held(&self, slot: u32) -> bool {
        (slot as usize) < self.layout.slots && !self.free.contains(&slot)
    }

    /// Queue on `stream` the zeroing of both states of every layer for a held slot: the state
    /// of a sequence before its first token.
    pub fn zero_slot(&self, slot: u32, stream: StreamHandle) -> Result<(), CacheError> {
        self.check_held(slot)?;
        let s = slot as usize;
        for l in &self.layers {
            self.gpu.memset(
                l.conv.offset(s * l.conv_slot_bytes),
                0,
                l.conv_slot_bytes,
                stream,
            )?;
            self.gpu.memset(
                l.recurrent.offset(s * l.recurrent_slot_bytes),
                0,
                l.recurrent_slot_bytes,
                stream,
            )?;
        }
        Ok(())
    }

    /// The per-layer pools and the allocations behind them, which the caller now owns (the
    /// snapshot pool keeps its entries in arrays of this shape).
    pub(crate) fn into_parts(mut self) -> (Vec<SsmLayerPools>, Vec<DevicePtr>) {
        (
            std::mem::take(&mut self.layers),
            std::mem::take(&mut self.allocations),
        )
    }

    fn check_held(&self, slot: u32) -> Result<(), CacheError> {
        if self.is_held(slot) {
            Ok(())
        } else {
            Err(CacheError::SsmSlotNotHeld {
                slot,
                total: self.layout.slots,
            })
        }
    }
}

impl Drop for SsmStatePool {
    fn drop(&mut self) {
        for &p in &self.allocations {
            if let Err(e) = self.gpu.free(p) {
                tracing::warn!("SsmStatePool: free failed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use metrale_gpu_runtime::{CpuBackend, GpuBackendExt};

    use super::*;

    fn layout() -> SsmLayout {
        SsmLayout {
            num_gdn_layers: 3,
            slots: 4,
            conv_dim: 20,
            conv_kernel: 4,
            num_v_heads: 2,
            k_head_dim: 3,
            v_head_dim: 5,
        }
    }

    #[test]
    fn every_layer_gets_fixed_pools_of_the_layout_size_freed_on_drop() {
        let cpu = Arc::new(CpuBackend::default());
        let l = layout();
        let pool = SsmStatePool::new(cpu.clone(), l).unwrap();
        assert_eq!(l.conv_slot_bytes(), 3 * 20 * 4);
        assert_eq!(l.recurrent_slot_bytes(), 2 * 3 * 5 * 4);
        assert_eq!(cpu.used_bytes(), l.total_bytes().unwrap());
        let mut ranges = Vec::new();
        for i in 0..3 {
            let p = pool.layer(i).unwrap();
            assert_eq!(p.conv_slot_bytes, l.conv_slot_bytes());
            assert_eq!(p.recurrent_slot_bytes, l.recurrent_slot_bytes());
            ranges.push((p.conv.0, p.conv.0 + (l.slots * p.conv_slot_bytes) as u64));
            ranges.push((
                p.recurrent.0,
                p.recurrent.0 + (l.slots * p.recurrent_slot_bytes) as u64,
            ));
        }
        ranges.sort();
        assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "pools overlap");
        assert_eq!(pool.layer(3), None);
        drop(pool);
        assert_eq!(cpu.used_bytes(), 0, "drop frees every pool");
    }

    #[test]
    fn slots_are_handed_out_lowest_first_and_refused_when_exhausted() {
        let mut pool = SsmStatePool::new(Arc::new(CpuBackend::default()), layout()).unwrap();
        let got: Vec<u32> = (0..4).map(|_| pool.alloc_slot().unwrap()).collect();
        assert_eq!(got, [0, 1, 2, 3]);
        assert!(matches!(
            pool.alloc_slot(),
            Err(CacheError::OutOfSsmSlots { total: 4 })
        ));
        pool.free_slot(2).unwrap();
        pool.free_slot(1).unwrap();
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.alloc_slot().unwrap(), 1);
        assert!(matches!(
            pool.free_slot(2),
            Err(CacheError::SsmSlotNotHeld { slot: 2, .. })
        ));
        assert!(pool.free_slot(9).is_err(), "a slot past the pool");
        assert!(
            pool.zero_slot(2, StreamHandle::DEFAULT).is_err(),
            "a free slot"
        );
    }

    #[test]
    fn zero_slot_clears_exactly_that_slot_in_every_layer() {
        let cpu = Arc::new(CpuBackend::default());
        let l = layout();
        let mut pool = SsmStatePool::new(cpu.clone(), l).unwrap();
        let s = StreamHandle::DEFAULT;
        let (nc, nr) = (
            l.slots * l.conv_slot_elems(),
            l.slots * l.recurrent_slot_elems(),
        );
        for i in 0..3 {
            let p = pool.layer(i).unwrap();
            let fill = |n: usize| (0..n).map(|x| x as f32 + 1.0).collect::<Vec<f32>>();
            cpu.upload(p.conv, &fill(nc), s).unwrap();
            cpu.upload(p.recurrent, &fill(nr), s).unwrap();
        }
        let (a, b) = (pool.alloc_slot().unwrap(), pool.alloc_slot().unwrap());
        pool.zero_slot(b, s).unwrap();
        for i in 0..3 {
            let p = pool.layer(i).unwrap();
            for (ptr, n, per) in [
                (p.conv, nc, l.conv_slot_elems()),
                (p.recurrent, nr, l.recurrent_slot_elems()),
            ] {
                let got = cpu.download::<f32>(ptr, n, s).unwrap();
                for (x, v) in got.iter().enumerate() {
                    let in_b = x / per == b as usize;
                    let want = if in_b { 0.0 } else { x as f32 + 1.0 };
                    assert_eq!(
                        *v, want,
                        "layer {i}, element {x} (slot {a} must keep its state)"
                    );
                }
            }
        }
    }

    #[test]
    fn bad_layouts_are_refused() {
        let cpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        for bad in [
            SsmLayout {
                slots: 0,
                ..layout()
            },
            SsmLayout {
                conv_kernel: 1,
                ..layout()
            },
            SsmLayout {
                v_head_dim: 0,
                ..layout()
            },
            SsmLayout {
                conv_dim: usize::MAX / 2,
                ..layout()
            },
        ] {
            assert!(matches!(
                SsmStatePool::new(cpu.clone(), bad),
                Err(CacheError::Layout(_))
            ));
        }
    }
}
