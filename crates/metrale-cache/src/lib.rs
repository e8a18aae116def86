//! KV-cache memory: `PagedKvCache` (K and V pools per attention layer, in blocks of `block_size`
//! tokens), its refcounting `BlockAllocator` with the prefix index (full blocks keyed by a
//! `BlockHash` chain over their tokens, kept after release and evicted least recently used
//! first), `BlockTable`, a sequence's list of blocks, `SsmStatePool`, the per-sequence conv and
//! recurrent state slots of the GDN layers, and `SsmSnapshotPool`, copies of that state at
//! prefix positions so a prefix hit on a hybrid model restores it. `CacheManager` owns all of
//! them for one model; the scheduler owns the manager.
//!
//! Architecture invariant: metrale-cache launches no kernel; it owns memory and bookkeeping only.

mod allocator;
mod block_table;
mod error;
mod kv_cache;
mod lru;
mod manager;
mod prefix;
mod ssm_pool;
mod ssm_snapshot;

pub use allocator::BlockAllocator;
pub use block_table::BlockTable;
pub use error::CacheError;
pub use kv_cache::{KvCacheLayout, KvDtype, KvLayerPools, KvScales, PagedKvCache};
pub use manager::{CacheLayout, CacheManager, SnapshotUsage};
pub use prefix::{BlockHash, block_hashes};
pub use ssm_pool::{SsmLayerPools, SsmLayout, SsmStatePool};
pub use ssm_snapshot::SsmSnapshotPool;
