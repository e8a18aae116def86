//! `PagedKvCache`: the K and V pools of every attention layer, at fixed addresses for the life of
//! the cache, and the allocator of their blocks.
//!
//! Invariants:
//! - Pool layout per layer: `[num_blocks * block_size, num_kv_heads, head_dim]` elements of the
//!   layout's [`KvDtype`] (bf16, or e4m3 bytes: half the bytes a token); slot
//!   `block * block_size + offset` holds one token.
//! - Block 0 of every pool is the dummy block: zeroed at creation and never allocated, so padding
//!   rows that point at it read zeros.

use std::sync::Arc;

use metrale_gpu_runtime::{DevicePtr, GpuBackend};

use crate::allocator::BlockAllocator;
use crate::error::CacheError;

/// How a KV cache stores its keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KvDtype {
    /// bf16, two bytes an element. The default.
    #[default]
    Bf16,
    /// e4m3 bytes, one an element: each stands for `bf16(e4m3 · scale')` with its pool's
    /// scale ([`KvScales`]); the stores write `e4m3(value / scale)`
    /// (`metrale_gpu_runtime::fp8::kv_quantize`).
    Fp8,
}

impl KvDtype {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::Fp8 => 1,
        }
    }

    /// `bf16` or `fp8`, as the options and the CLI spell them.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8",
        }
    }
}

/// One attention layer's FP8 KV scales: a stored key element `e` stands for
/// `bf16(e · bf16(k))`, a value element for `bf16(e · bf16(v))`. 1.0 each unless the checkpoint
/// gives them; unused by bf16 caches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvScales {
    /// The K pool's scale.
    pub k: f32,
    /// The V pool's scale.
    pub v: f32,
}

impl Default for KvScales {
    fn default() -> Self {
        KvScales { k: 1.0, v: 1.0 }
    }
}

/// The shape of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheLayout {
    /// Attention layers (GDN layers have no KV cache).
    pub num_layers: usize,
    /// KV heads per layer.
    pub num_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Tokens per block (default 16).
    pub block_size: usize,
    /// Blocks per pool, the dummy block included.
    pub num_blocks: usize,
    /// The element format of every pool.
    pub dtype: KvDtype,
}

impl KvCacheLayout {
    /// Bytes of one block of one layer's K (or V) pool.
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_dim * self.dtype.bytes()
    }

    /// Bytes of one layer's K (or V) pool.
    pub fn pool_bytes(&self) -> usize {
        self.num_blocks * self.block_bytes()
    }

    /// Tokens the cache holds: every block but the dummy, full.
    pub fn token_capacity(&self) -> usize {
        self.num_blocks.saturating_sub(1) * self.block_size
    }

    /// Blocks (the dummy included) whose pools fit in `bytes` over every layer, K and V.
    pub fn blocks_in(&self, bytes: usize) -> usize {
        let per_block = self.block_bytes() * 2 * self.num_layers;
        bytes.checked_div(per_block).unwrap_or(0)
    }

    /// Bytes of the whole cache.
    pub fn total_bytes(&self) -> usize {
        self.pool_bytes() * 2 * self.num_layers
    }
}

/// One attention layer's pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayerPools {
    /// The K pool.
    pub k: DevicePtr,
    /// The V pool.
    pub v: DevicePtr,
}

/// See the module header.
#[derive(Debug)]
pub struct PagedKvCache {
    gpu: Arc<dyn GpuBackend>,
    layout: KvCacheLayout,
    layers: Vec<KvLayerPools>,
    /// Block bookkeeping; `CacheManager` allocates and releases through it.
    pub(crate) allocator: BlockAllocator,
}

impl PagedKvCache {
    /// Allocate every pool and zero the dummy block.
    pub fn new(
        gpu: Arc<dyn GpuBackend>,
        layout: KvCacheLayout,
    ) -> Result<PagedKvCache, CacheError> {
        if layout.block_size == 0 || layout.num_blocks < 2 {
            return Err(CacheError::Layout(format!(
                "block_size {} and num_blocks {} (need at least the dummy and one block)",
                layout.block_size, layout.num_blocks
            )));
        }
        // Block ids are u32 on the device; a pool's bytes must be addressable.
        let pool_fits = layout
            .num_blocks
            .checked_mul(layout.block_bytes())
            .is_some();
        if u32::try_from(layout.num_blocks).is_err() || !pool_fits {
            return Err(CacheError::Layout(format!(
                "num_blocks {} of {} bytes each: more blocks than 32-bit ids name, or a pool \
                 past the address space",
                layout.num_blocks,
                layout.block_bytes()
            )));
        }
        // The pools first: a cache too large for the device fails there, as an allocation
        // error, before the host bookkeeping of its blocks is sized by it.
        let mut cache = PagedKvCache {
            gpu: gpu.clone(),
            layout,
            layers: Vec::with_capacity(layout.num_layers),
            allocator: BlockAllocator::new(0),
        };
        let dummy_bytes = layout.block_bytes();
        let stream = gpu.default_stream();
        for _ in 0..layout.num_layers {
            let k = gpu.alloc(layout.pool_bytes())?;
            cache.layers.push(KvLayerPools {
                k,
                v: DevicePtr::NULL,
            });
            let v = gpu.alloc(layout.pool_bytes())?;
            if let Some(last) = cache.layers.last_mut() {
                last.v = v;
            }
            gpu.memset(k, 0, dummy_bytes, stream)?;
            gpu.memset(v, 0, dummy_bytes, stream)?;
        }
        gpu.synchronize(stream)?;
        cache.allocator = BlockAllocator::new(layout.num_blocks);
        Ok(cache)
    }

    /// The layout.
    pub fn layout(&self) -> &KvCacheLayout {
        &self.layout
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.layout.block_size
    }

    /// Slots per pool.
    pub fn num_slots(&self) -> usize {
        self.layout.num_blocks * self.layout.block_size
    }

    /// Pools of attention layer `i`.
    pub fn layer(&self, i: usize) -> KvLayerPools {
        self.layers[i]
    }

    /// The always-zero block.
    pub fn dummy_block(&self) -> u32 {
        0
    }
}

impl Drop for PagedKvCache {
    fn drop(&mut self) {
        for l in &self.layers {
            for p in [l.k, l.v] {
                if !p.is_null()
                    && let Err(e) = self.gpu.free(p)
                {
                    tracing::warn!("PagedKvCache: free failed: {e}");
                }
            }
        }
    }
}
