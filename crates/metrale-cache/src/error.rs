//! `CacheError`: what cache bookkeeping can fail with.

use metrale_gpu_runtime::GpuError;

/// An error of the KV cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// Every block is in use.
    #[error("the KV cache is full: all {total} blocks are in use")]
    OutOfBlocks {
        /// Blocks in the pool (the dummy block excluded).
        total: usize,
    },
    /// A block id that is not allocated (a double free, or a stale id).
    #[error("block {block} is not allocated")]
    NotAllocated {
        /// The block id.
        block: u32,
    },
    /// A layout the cache cannot hold.
    #[error("invalid KV cache layout: {0}")]
    Layout(String),
    /// The device failed.
    #[error("KV cache device operation failed: {0}")]
    Device(#[from] GpuError),
}
