//! `CacheError`: what cache bookkeeping can fail with.

use metrale_gpu_runtime::GpuError;

/// An error of the cache: its KV blocks, SSM state slots, layouts or device operations.
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
    /// Every SSM state slot is held by a sequence.
    #[error("the SSM state pool is full: all {total} slots are in use")]
    OutOfSsmSlots {
        /// Slots in the pool.
        total: usize,
    },
    /// An SSM slot that no sequence holds (a double free, a stale or out-of-range id).
    #[error("SSM slot {slot} is not held (the pool has {total} slots)")]
    SsmSlotNotHeld {
        /// The slot.
        slot: u32,
        /// Slots in the pool.
        total: usize,
    },
    /// A prefix hit asked for an SSM snapshot that is not kept.
    #[error("no SSM snapshot is kept for the prefix")]
    NoSnapshot,
    /// A tensor-parallel rank's pools, which follow rank 0's bookkeeping, do not agree with it.
    #[error("tensor-parallel rank {rank}'s cache disagrees with rank 0's: {problem}")]
    RankDiverged {
        /// The rank.
        rank: usize,
        /// What differs.
        problem: String,
    },
    /// A layout the cache cannot hold.
    #[error("invalid KV cache layout: {0}")]
    Layout(String),
    /// The device failed.
    #[error("KV cache device operation failed: {0}")]
    Device(#[from] GpuError),
}
