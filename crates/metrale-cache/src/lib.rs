//! KV-cache memory: `PagedKvCache` (K and V pools per attention layer, in blocks of `block_size`
//! tokens), its refcounting `BlockAllocator`, and `BlockTable`, a sequence's list of blocks.
//!
//! Architecture invariant: metrale-cache launches no kernel; it owns memory and bookkeeping only.

mod allocator;
mod block_table;
mod error;
mod kv_cache;

pub use allocator::BlockAllocator;
pub use block_table::BlockTable;
pub use error::CacheError;
pub use kv_cache::{KvCacheLayout, KvLayerPools, PagedKvCache};
